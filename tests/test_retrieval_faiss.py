"""The built-in FAISS retriever with real MiniLM embeddings: needles, order, budget, threshold,
caching, and end-to-end draft prompts for the LangChain / LlamaIndex / chat shapes."""

from __future__ import annotations

import numpy as np
import pytest

from rapid_integrations.bench.recall import haystack, make_needles, plant, question_prompt
from rapid_integrations.config import RapidConfig
from rapid_integrations.engine.prompts import prepare_draft_prompt
from rapid_integrations.models.loading import default_embedder_path
from rapid_integrations.retrieval import FaissContextRetriever, default_budget, split_prompt
from rapid_integrations.retrieval.base import count_text_tokens
from tests.retrieval_fixtures import minilm, smol_tokenizer

TOPICS = [
    "Volcanoes erupt when magma rises through the crust and lava flows down the slopes.",
    "A sourdough loaf needs flour, water, salt and a lively starter kept at room temperature.",
    "The Krakatoa volcano erupted in 1883 and its ash cooled the global climate for a year.",
    "Chess openings such as the Sicilian Defence aim to control the centre of the board.",
    "Mount Etna is an active volcano in Sicily whose eruptions are frequent but mild.",
    "Knitting a scarf takes two needles, soft wool and a simple garter stitch pattern.",
]
COOKING = [
    f"Recipe {i}: whisk the eggs with sugar, fold in the flour, and bake the sponge for "
    f"{20 + i} minutes until golden. Let it cool before adding the cream."
    for i in range(30)
]


@pytest.mark.slow  # embeds 50K tokens: ~15 s on 2 idle cores
def test_planted_fact_in_50k_token_document_lands_in_draft_context():
    tok = smol_tokenizer()
    needle = make_needles(1, seed=7)[0]
    prompt = question_prompt(plant(haystack(50_000, tok), [needle]), needle.question)
    n_tokens = count_text_tokens(tok, prompt)
    assert n_tokens > 50_000
    result = prepare_draft_prompt(prompt, tok)
    parts = split_prompt(prompt, tok)
    assert needle.fact in result.prompt and result.fallback is None
    assert result.budget == default_budget(n_tokens) > 2000  # about 1/24 of the input
    limit = count_text_tokens(tok, parts.head) + result.budget + count_text_tokens(tok, parts.tail)
    assert count_text_tokens(tok, result.prompt) <= limit
    assert result.prompt.startswith(parts.head) and result.prompt.endswith(parts.tail)


def test_second_question_on_the_same_document_is_not_re_embedded(monkeypatch):
    tok = smol_tokenizer()
    needles = make_needles(2, seed=3)
    document = plant(haystack(8_000, tok), needles)
    prepare_draft_prompt(question_prompt(document, needles[0].question), tok)
    encoded: list[int] = []
    model = minilm().model
    original = model.encode
    monkeypatch.setattr(
        model, "encode", lambda texts, **kw: encoded.append(len(texts)) or original(texts, **kw)
    )
    result = prepare_draft_prompt(question_prompt(document, needles[1].question), tok)
    assert encoded == [1]  # only the new question
    assert needles[1].fact in result.prompt


def test_passages_keep_document_order_and_budget():
    tok = smol_tokenizer()
    document = "\n\n".join(TOPICS * 3)
    for budget in (40, 80, 200):
        retriever = FaissContextRetriever(
            document,
            tok,
            embedder=minilm(),
            budget=budget,
            chunk_tokens=24,  # one topic each
        )
        chosen = retriever.search("volcano eruptions")
        starts = [item.chunk.start for item in chosen]
        assert starts == sorted(starts) and chosen
        assert all(item.score >= 0.3 for item in chosen)
        passages = retriever.retrieve("volcano eruptions")
        assert count_text_tokens(tok, "\n\n".join(passages)) <= budget
        position = -1
        for passage in passages:  # each found after the previous one: document order
            position = document.index(passage, position + 1)
    assert any("volcano" in p.lower() for p in passages)
    assert not any("sourdough" in p or "Knitting" in p for p in passages)


def test_adjacent_chunks_merge_into_one_passage_of_original_text():
    tok = smol_tokenizer()
    document = "\n\n".join(TOPICS)
    retriever = FaissContextRetriever(
        document, tok, embedder=minilm(), budget=400, chunk_tokens=24, threshold=-1.0
    )
    assert len(retriever.chunks) > 3
    assert retriever.retrieve("anything") == [document]  # everything fits: one passage


def test_threshold_drops_unrelated_chunks():
    tok = smol_tokenizer()
    document = "\n\n".join(COOKING)
    question = "What is the spin of an electron in quantum mechanics?"
    retriever = FaissContextRetriever(document, tok, embedder=minilm(), budget=256)
    assert float(np.max(retriever.scores(question))) < 0.3
    assert retriever.retrieve(question) == []
    assert retriever.retrieve("How long do I bake the sponge?")  # related text still found
    permissive = FaissContextRetriever(document, tok, embedder=minilm(), budget=256, threshold=-1)
    assert permissive.retrieve(question)
    fact = (
        "Electrons are fermions: in quantum mechanics the spin of an electron is an intrinsic "
        "angular momentum of one half."
    )
    mixed = "\n\n".join([*COOKING[:10], fact, *COOKING[10:]])
    result = prepare_draft_prompt(
        f"Notes:\n\n{mixed}\n\nQuestion: {question}", tok, config=RapidConfig(retrieval_budget=256)
    )
    assert fact in result.prompt
    assert result.retrieved_tokens <= 64  # only the fact's chunk, though 256 were allowed


def test_top_k_limits_chunks():
    tok = smol_tokenizer()
    document = "\n\n".join(TOPICS * 3)
    retriever = FaissContextRetriever(document, tok, embedder=minilm(), budget=400, top_k=2)
    assert len(retriever.search("volcano eruptions")) == 2


def test_embedder_by_path_shares_the_default_instance():
    tok = smol_tokenizer()
    by_path = FaissContextRetriever(TOPICS, tok, embedder=str(default_embedder_path()))
    assert by_path.embedder is FaissContextRetriever(TOPICS, tok).embedder or by_path.retrieve(
        "volcano"
    )
    assert [c.doc for c in by_path.chunks] == list(range(len(TOPICS)))


def test_an_embedder_loaded_here_runs_in_the_engines_dtype_and_a_given_one_as_given():
    """The bundled MiniLM runs in the dtype the engine picks for the CPU (bf16 where native:
    2.3x faster indexing here, the same recall); a SentenceTransformer the caller loaded is
    used as it is."""
    import torch
    from sentence_transformers import SentenceTransformer

    from rapid_integrations.models.loading import resolve_dtype
    from rapid_integrations.retrieval import get_embedder

    loaded_here = next(minilm().model.parameters()).dtype
    assert loaded_here == resolve_dtype("auto", "cpu")
    given = SentenceTransformer(str(default_embedder_path()), device="cpu")
    wrapped = get_embedder(given)
    assert wrapped.model is given and next(given.parameters()).dtype == torch.float32
    vectors = wrapped.embed(["a volcano erupts", "the bakery opens early"])
    assert vectors.dtype == np.float32 and np.allclose(np.linalg.norm(vectors, axis=1), 1.0)
    bundled = minilm().embed(["a volcano erupts", "the bakery opens early"])
    assert bundled.dtype == np.float32 and (bundled * vectors).sum(1).min() > 0.99


@pytest.mark.parametrize(
    ("head", "tail"),
    [
        (
            "Use the following pieces of context to answer the question at the end.\n\n",
            "\n\nQuestion: {q}\nHelpful Answer:",
        ),
        (
            "Context information is below.\n---------------------\n",
            "\n---------------------\nGiven the context information and not prior knowledge, "
            "answer the query.\nQuery: {q}\nAnswer: ",
        ),
    ],
    ids=["langchain-stuff", "llamaindex-text-qa"],
)
def test_framework_templates_end_to_end(head: str, tail: str):
    tok = smol_tokenizer()
    needle = make_needles(3, seed=11)[2]
    document = plant(haystack(8_000, tok), [needle])
    prompt = head + document + tail.format(q=needle.question)
    result = prepare_draft_prompt(prompt, tok)
    assert result.prompt.startswith(head) and result.prompt.endswith(tail.format(q=needle.question))
    assert needle.fact in result.prompt and result.query == needle.question
    assert count_text_tokens(tok, result.prompt) < count_text_tokens(tok, prompt) // 8


def test_multi_turn_fact_is_retrieved_from_an_early_turn():
    tok = smol_tokenizer()
    paragraphs = haystack(6_000, tok)
    chat = [{"role": "system", "content": "You are a concise assistant."}]
    chat += [{"role": "user", "content": "My locker code is 5521. Please remember it."}]
    chat += [{"role": "assistant", "content": "Noted: your locker code is 5521."}]
    for paragraph in paragraphs:
        chat += [{"role": "user", "content": f"Summarise:\n{paragraph}"}]
        chat += [{"role": "assistant", "content": "Done."}]
    chat += [{"role": "user", "content": "What is my locker code?"}]
    result = prepare_draft_prompt(chat, tok)
    draft = result.prompt
    assert draft[0] == chat[0] and draft[-1] == chat[-1] and len(draft) < 12
    assert any("5521" in m["content"] for m in draft[1:-1])
    assert result.retrieved_tokens <= result.budget == 512
