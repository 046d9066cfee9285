"""Fitting retrieved passages into the draft's token budget without altering their text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .base import TokenizerLike, count_text_tokens, count_tokens
from .chunking import chunk_text

SEPARATOR = "\n\n"
"""Joins passages that were not adjacent in their source: a paragraph break, no invented text."""
MIN_PREFIX_TOKENS = 32
"""A passage too long for the room left is cut to a prefix only if that prefix gets this much."""


@dataclass(frozen=True)
class Passage:
    """A piece of C^S. text: verbatim source text; doc: index of the document (or chat turn)
    of the prompt it came from, None for an external retriever; score: cosine similarity to
    the query where known."""

    text: str
    doc: int | None = None
    score: float | None = None


def join_passages(passages: Sequence[Passage]) -> str:
    """C^S as one text: the passages separated by `SEPARATOR`."""
    return SEPARATOR.join(p.text for p in passages)


def trim_to_budget(
    passages: Sequence[Passage], tokenizer: TokenizerLike, budget: int
) -> list[Passage]:
    """Drop passages from the end until the joined text has at most `budget` tokens.

    Counts are exact (the joined text is tokenized), so token merges across separators can
    never push C^S over its budget.
    """
    kept = list(passages)
    while kept and count_text_tokens(tokenizer, join_passages(kept)) > budget:
        kept.pop()
    return kept


def pack_passages(texts: Sequence[str], tokenizer: TokenizerLike, budget: int) -> list[Passage]:
    """Passages from an external retriever, in its order, packed into `budget` tokens.

    Blank and duplicate passages are dropped; a passage too long for the room left is cut at
    a sentence (or word) boundary when at least `MIN_PREFIX_TOKENS` fit, else skipped for a
    shorter later one.
    """
    unique = [text for text in dict.fromkeys(t.strip() for t in texts) if text]
    separator = count_text_tokens(tokenizer, SEPARATOR)
    packed: list[Passage] = []
    used = 0
    for text, n in zip(unique, count_tokens(tokenizer, unique), strict=True):
        room = budget - used - (separator if packed else 0)
        if n > room and room >= MIN_PREFIX_TOKENS:
            prefix = chunk_text(text, tokenizer, room)[0]
            text, n = prefix.text, prefix.n_tokens
        if n <= room:
            packed.append(Passage(text))
            used += n + (separator if len(packed) > 1 else 0)
    return trim_to_budget(packed, tokenizer, budget)
