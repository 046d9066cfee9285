"""Needle recall of the built-in retriever: how often a planted fact lands in C^S.

    python -m rapid_integrations.bench.recall [--needles 20] [--distractors 4] [--seed 0]

The haystack is made of Python standard-library docstrings (deterministic for a given Python);
each needle is a seeded synthetic fact ("The access code of the amber otter vault is 4721.")
planted as its own paragraph at a random depth, together with distractors: the facts of other
needles, which share the sentence pattern and often words of the subject. The needle is asked
about in a LangChain-style "Question: ..." tail. For each document length and C^S budget the
table gives the fraction of needles whose fact is inside the draft prompt, then the time to
index (chunk + embed + FAISS) a 32K-token document from a cold embedding cache.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rapid_integrations.config import RapidConfig
from rapid_integrations.engine.prompts import prepare_draft_prompt
from rapid_integrations.retrieval.base import TokenizerLike, count_text_tokens, count_tokens
from rapid_integrations.retrieval.embedding import SentenceTransformerEmbedder
from rapid_integrations.retrieval.faiss_retriever import FaissContextRetriever

from .haystack import stdlib_paragraphs

BUDGETS = (256, 512, 1024, 2048)
DOC_TOKENS = (8192, 32768)
INSTRUCTION = "Read the Python documentation below and answer the question at the end."
_COLORS = ("amber", "cobalt", "crimson", "emerald", "indigo", "ivory", "scarlet", "violet")
_ANIMALS = ("badger", "falcon", "heron", "lynx", "marmot", "otter", "walrus", "wombat")
_THINGS = ("vault", "archive", "lighthouse", "observatory", "greenhouse", "workshop")


@dataclass(frozen=True)
class Needle:
    """A planted fact, the question that asks for it, and where it goes (0..1 of the doc)."""

    fact: str
    question: str
    depth: float


def haystack(n_tokens: int, tokenizer: TokenizerLike) -> list[str]:
    """Paragraphs (docstrings) totalling about `n_tokens` tokens."""
    paragraphs: list[str] = []
    total = 0
    for paragraph in stdlib_paragraphs():
        if total >= n_tokens:
            return paragraphs
        paragraphs.append(paragraph)
        total += count_text_tokens(tokenizer, paragraph) + 1
    raise ValueError(f"the standard-library haystack has fewer than {n_tokens} tokens")


def make_needles(count: int, seed: int = 0) -> list[Needle]:
    """`count` distinct seeded facts such as "The access code of the amber otter vault is 4721"."""
    rng = random.Random(seed)
    needles: dict[str, Needle] = {}
    while len(needles) < count:
        subject = f"the {rng.choice(_COLORS)} {rng.choice(_ANIMALS)} {rng.choice(_THINGS)}"
        fact = f"The access code of {subject} is {rng.randrange(1000, 10000)}."
        question = f"What is the access code of {subject}?"
        needles.setdefault(subject, Needle(fact, question, rng.uniform(0.05, 0.95)))
    return list(needles.values())


def plant(paragraphs: Sequence[str], needles: Sequence[Needle]) -> str:
    """The document with each needle's fact inserted as a paragraph at its depth."""
    planted = list(paragraphs)
    for needle in sorted(needles, key=lambda n: n.depth, reverse=True):  # later indices first
        planted.insert(round(needle.depth * len(paragraphs)), needle.fact)
    return "\n\n".join(planted)


def question_prompt(document: str, question: str) -> str:
    return f"{INSTRUCTION}\n\n{document}\n\nQuestion: {question}\nAnswer:"


def recall(
    paragraphs: Sequence[str],
    needles: Sequence[Needle],
    distractors: int,
    budget: int,
    tokenizer: TokenizerLike,
) -> float:
    """Fraction of `needles` whose fact is in the draft prompt at this C^S budget, each planted
    with the facts of the `distractors` needles after it (cyclically) as hard negatives."""
    config = RapidConfig(retrieval_budget=budget)
    hits = 0
    for i, needle in enumerate(needles):
        others = [needles[(i + k) % len(needles)] for k in range(1, distractors + 1)]
        prompt = question_prompt(plant(paragraphs, [needle, *others]), needle.question)
        hits += needle.fact in prepare_draft_prompt(prompt, tokenizer, config=config).prompt
    return hits / len(needles)


def index_seconds(document: str, tokenizer: TokenizerLike) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, chunks) to index `document` at the default budget with a
    cold embedding cache. CPU time (all threads) is the figure that survives a busy machine."""
    embedder = SentenceTransformerEmbedder(show_progress=False)
    embedder.embed(["warm up: load the model outside the timing"])
    wall, cpu = time.perf_counter(), time.process_time()
    retriever = FaissContextRetriever(document, tokenizer, embedder=embedder)
    return time.perf_counter() - wall, time.process_time() - cpu, len(retriever.chunks)


def print_recall_table(
    tokenizer: TokenizerLike, needles: Sequence[Needle], distractors: int
) -> None:
    print("| document | " + " | ".join(f"budget {b}" for b in BUDGETS) + " |")
    print("|---" * (len(BUDGETS) + 1) + "|")
    for n_tokens in DOC_TOKENS:
        paragraphs = haystack(n_tokens, tokenizer)
        cells = [f"{recall(paragraphs, needles, distractors, b, tokenizer):.2f}" for b in BUDGETS]
        size = sum(count_tokens(tokenizer, paragraphs)) + len(paragraphs)
        print(f"| {size // 1024}K tokens | " + " | ".join(cells) + " |", flush=True)


def print_index_time(tokenizer: TokenizerLike) -> None:
    import torch

    document = "\n\n".join(haystack(DOC_TOKENS[-1], tokenizer))
    wall, cpu, chunks = index_seconds(document, tokenizer)
    print(
        f"\nindexing a {DOC_TOKENS[-1] // 1024}K-token document ({chunks} chunks): "
        f"{wall:.1f} s wall, {cpu:.1f} s CPU on {torch.get_num_threads()} threads"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--needles", type=int, default=20, help="needles per document length")
    parser.add_argument("--distractors", type=int, default=4, help="other facts per document")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from rapid_integrations.models.loading import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    print(
        f"needle recall: fraction of {args.needles} needles inside C^S "
        f"({args.distractors} distractor facts per document, seed {args.seed})\n"
    )
    print_recall_table(tokenizer, make_needles(args.needles, args.seed), args.distractors)
    print_index_time(tokenizer)


if __name__ == "__main__":
    main()
