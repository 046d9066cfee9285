"""C^S that follows the answer (`retriever="following"`, docs/algorithm.md section 2.13).

The call starts as `retriever="attention"` does: C^S is the chunks the question's last tokens
attend to in the target's cache. Then, every `FOLLOW_TOKENS` committed tokens, the answer's
own last tokens (already in the target's cache) are the queries: their attention mass on each
chunk, from the probe's heads (`attention.question_attention`), is the chunk's answer share.
A chunk scores its question share plus its answer share, each normalized to sum 1 over the
chunks, so a chunk the answer turns to can overtake one only the question wanted. When the
best chunk outside C^S scores over `FOLLOW_MARGIN` times the weakest inside, C^S is chosen
again by the new scores (same budget and packing as the first) and the engine rebuilds the
draft's short context with it (`RapidEngine._follow`). The target's cache is read, never
written: a new C^S changes only the draft's q, as any C^S does, so eta = 0 greedy output stays
the target's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .attention import AttentionRetriever

FOLLOW_TOKENS = 16
"""Committed tokens between two scorings, and the answer tokens each scoring reads."""

FOLLOW_MARGIN = 1.5
"""How far the best chunk outside C^S must outscore the weakest inside to enter (a ratio):
below it C^S stays and the draft keeps its cache."""


class Following:
    """A call's C^S under `retriever="following"`: its chunks, scores and updates.

    retriever: the `AttentionRetriever` that chose the first C^S (its chunks, spans, heads and
    question scores); redraft: the draft's prompt ids for the retriever's current scores
    (None: the retriever gave up, C^S stays). `updates` counts the times C^S changed and
    `seconds` the wall time of the scorings and of the draft's rebuilds (`RapidEngine._follow`
    adds those).
    """

    every = FOLLOW_TOKENS
    margin = FOLLOW_MARGIN

    def __init__(
        self, retriever: AttentionRetriever, redraft: Callable[[], list[int] | None]
    ) -> None:
        self.retriever = retriever
        self.redraft = redraft
        self.question = _shares(retriever.attention_scores)  # (n_chunks,)
        self.chosen = frozenset(retriever.chosen(retriever.attention_scores))
        self.updates = 0
        self.seconds = 0.0
        self._next = self.every  # committed tokens at the next scoring

    def due(self, committed: int) -> bool:
        """Whether a call that has committed `committed` tokens scores the chunks again."""
        return committed >= self._next

    def rescore(self, model: Any, cache: Any, ids: Sequence[int], answered: int) -> bool:
        """Score the chunks by the answer's last tokens; returns whether C^S changed.

        model, cache: the target and its cache, holding `ids` (the prompt, then the committed
        tokens but the pending last); answered: how many of the cached tokens are the answer's.
        On a change the retriever's scores become the new ones (question share + answer
        share, shape (n_chunks,)) and `chosen` what they choose."""
        start = time.perf_counter()
        self._next = answered + 1 + self.every
        queries = min(self.every, answered)
        changed = False
        if queries > 0 and self.chosen:
            answer = chunk_shares(model, cache, ids, self.retriever, queries)
            changed = self.overtaken(self.question + answer)
        self.seconds += time.perf_counter() - start
        return changed

    def overtaken(self, scores: np.ndarray) -> bool:
        """Take `scores` (n_chunks,) if the best chunk outside C^S beats the weakest inside
        by the margin and they choose another C^S; returns whether they did."""
        inside = np.zeros(len(scores), dtype=bool)
        inside[list(self.chosen)] = True
        if inside.all() or scores[~inside].max() <= self.margin * scores[inside].min():
            return False
        chosen = frozenset(self.retriever.chosen(scores))
        if chosen == self.chosen:
            return False
        self.retriever.attention_scores = scores
        self.chosen = chosen
        self.updates += 1
        return True


def chunk_shares(
    model: Any, cache: Any, ids: Sequence[int], retriever: AttentionRetriever, queries: int
) -> np.ndarray:
    """Each chunk's share of the attention mass that the last `queries` cached tokens put on
    the chunks, from `retriever`'s heads over its spans: shape (n_chunks,), summing to 1 (all
    0 if none). model, cache, ids: as `attention.question_attention`."""
    return _shares(retriever.chunk_mass(model, cache, ids, queries))


def _shares(scores: np.ndarray) -> np.ndarray:
    """`scores` (n_chunks,) over their sum (all 0 for no mass), float64."""
    total = float(np.sum(scores))
    return np.asarray(scores, dtype=np.float64) / total if total > 0 else np.zeros(len(scores))


__all__ = ["FOLLOW_MARGIN", "FOLLOW_TOKENS", "Following", "chunk_shares"]
