"""A retriever that is deliberately wrong, for RAPID's robustness to bad retrieval (the
paper's section 4.5): the `off-topic` variant of `rapid bench` reads it instead of the
document's own passages.
"""

from __future__ import annotations

import random

from .texts import TEXTS


class OffTopicRetriever:
    """The same `count` generated story paragraphs whatever the query (a `ContextRetriever`).

    They hold none of a task's planted facts: the suites' subjects, people and numbers come
    from word lists the generated texts never use (docs/benchmarks.md), so the draft reads
    C^S with nothing of the answer in it.
    """

    def __init__(self, count: int = 8, seed: int = 0) -> None:
        make = TEXTS["story"].paragraph
        assert make is not None  # story paragraphs are generated, not drawn from a pool
        rng = random.Random(seed)
        self.passages = tuple(make(rng) for _ in range(count))

    def retrieve(self, query: str) -> list[str]:
        """The fixed paragraphs, most "relevant" first (none is)."""
        return list(self.passages)
