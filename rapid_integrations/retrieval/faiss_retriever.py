"""`FaissContextRetriever`: the built-in dense retriever over a prompt's own long context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .base import TokenizerLike, chunk_tokens_for, count_text_tokens, count_tokens, default_budget
from .chunking import Chunk, chunk_documents, chunk_text
from .embedding import EmbedderSpec, get_embedder
from .packing import SEPARATOR, Passage, trim_to_budget

if TYPE_CHECKING:
    from rapid_integrations.config import RapidConfig

WINDOW_TOKENS = 64
"""Chunks longer than this are embedded as several windows and scored by their best window.

One vector per 512-token chunk would miss facts: MiniLM truncates at 256 word pieces, and a
one-sentence fact inside 128 tokens of other text already scores under the 0.3 threshold
(measured with `bench.recall`: 0.90 recall at 128-token windows, 1.00 at 64). Embedding cost
is about the same, since the same tokens are encoded either way."""


@dataclass(frozen=True)
class ScoredChunk:
    """A chunk and its cosine similarity to the query (best window)."""

    chunk: Chunk
    score: float


class FaissContextRetriever:
    """Dense top-k retrieval over documents, filling a token budget, in document order.

    documents: one text or several (e.g. chat turns); tokenizer: the target's tokenizer, in
    whose tokens `budget` and chunk sizes count; embedder: an `Embedder`, a sentence-transformers
    name or path, or None for the bundled all-MiniLM-L6-v2; budget: tokens of C^S (None:
    `default_budget` of the documents' total length); chunk_tokens: chunk size (None:
    `chunk_tokens_for(budget, max_chunk_tokens)`); threshold: chunks whose cosine similarity
    is below it are never returned; top_k: at most this many chunks (None: as many as fit).

    Indexing (chunking, embedding, a FAISS inner-product index over unit vectors) happens on
    construction; embeddings are cached by content, so indexing the same text again is cheap.
    """

    def __init__(
        self,
        documents: str | Sequence[str],
        tokenizer: TokenizerLike,
        *,
        embedder: EmbedderSpec = None,
        budget: int | None = None,
        chunk_tokens: int | None = None,
        max_chunk_tokens: int = 512,
        threshold: float = 0.3,
        top_k: int | None = None,
        window_tokens: int = WINDOW_TOKENS,
    ) -> None:
        self.documents = [documents] if isinstance(documents, str) else list(documents)
        self.tokenizer = tokenizer
        self.budget = budget or default_budget(sum(count_tokens(tokenizer, self.documents)))
        self.chunk_tokens = chunk_tokens or chunk_tokens_for(self.budget, max_chunk_tokens)
        self.threshold = threshold
        self.top_k = top_k
        self.embedder = get_embedder(embedder)
        self.chunks = chunk_documents(self.documents, tokenizer, self.chunk_tokens)
        self._separator_tokens = count_text_tokens(tokenizer, SEPARATOR)
        self._index, self._window_owner = self._build_index(window_tokens)

    @classmethod
    def from_config(
        cls,
        documents: str | Sequence[str],
        tokenizer: TokenizerLike,
        config: RapidConfig,
        budget: int | None = None,
    ) -> FaissContextRetriever:
        """A retriever with the retrieval settings of `config` (budget overridable)."""
        return cls(
            documents,
            tokenizer,
            embedder=config.retrieval_embedder,
            budget=budget or config.retrieval_budget,
            max_chunk_tokens=config.retrieval_chunk_tokens,
            threshold=config.retrieval_threshold,
            top_k=config.retrieval_top_k,
        )

    def retrieve(self, query: str) -> list[str]:
        """C^S for `query` as passages of document text, in document order, within budget."""
        return [passage.text for passage in self.select(query)]

    def select(self, query: str) -> list[Passage]:
        """Selected chunks merged into passages (neighbours joined by their original
        whitespace), in document order, whose `SEPARATOR`-joined text fits the budget."""
        return trim_to_budget(self._merge(self.search(query)), self.tokenizer, self.budget)

    def search(self, query: str) -> list[ScoredChunk]:
        """The chunks chosen for `query`, in document order (`chosen`)."""
        scores = self.scores(query)
        return [ScoredChunk(self.chunks[i], float(scores[i])) for i in self.chosen(scores)]

    def chosen(self, scores: np.ndarray) -> list[int]:
        """Indices of the chunks chosen by `scores` (shape (n_chunks,)), ascending.

        Chunks are taken by decreasing score, skipping those under `threshold`, up to
        `top_k`, while their tokens (plus a separator each) fit the budget.
        """
        limit = self.top_k or len(self.chunks)
        chosen: list[int] = []
        used = 0
        for i in np.argsort(-scores, kind="stable"):
            if scores[i] < self.threshold or len(chosen) == limit:
                break
            cost = self.chunks[i].n_tokens + (self._separator_tokens if chosen else 0)
            if used + cost <= self.budget:
                chosen.append(int(i))
                used += cost
        return sorted(chosen)

    def scores(self, query: str) -> np.ndarray:
        """Cosine similarity of `query` to each chunk (its best window), shape (n_chunks,)."""
        per_chunk = np.full(len(self.chunks), -np.inf, dtype=np.float32)
        if self._index.ntotal:
            sims, ids = self._index.search(self.embedder.embed([query]), self._index.ntotal)
            np.maximum.at(per_chunk, self._window_owner[ids[0]], sims[0])
        return per_chunk

    def _build_index(self, window_tokens: int) -> tuple[Any, np.ndarray]:
        import faiss

        texts: list[str] = []
        owners: list[int] = []
        for i, chunk in enumerate(self.chunks):
            windows = (
                [chunk.text]
                if chunk.n_tokens <= window_tokens
                else [w.text for w in chunk_text(chunk.text, self.tokenizer, window_tokens)]
            )
            texts.extend(windows)
            owners.extend([i] * len(windows))
        vectors = self.embedder.embed(texts)
        index = faiss.IndexFlatIP(vectors.shape[1])
        index.add(np.ascontiguousarray(vectors, dtype=np.float32))
        return index, np.asarray(owners, dtype=np.int64)

    def _merge(self, selected: Sequence[ScoredChunk]) -> list[Passage]:
        """Join runs of neighbouring chunks into one passage of the original text."""
        passages: list[Passage] = []
        run: list[ScoredChunk] = []
        for item in selected:
            if run and not self._adjacent(run[-1].chunk, item.chunk):
                passages.append(self._passage(run))
                run = []
            run.append(item)
        if run:
            passages.append(self._passage(run))
        return passages

    def _adjacent(self, left: Chunk, right: Chunk) -> bool:
        if left.doc != right.doc:
            return False
        return not self.documents[left.doc][left.end : right.start].strip()

    def _passage(self, run: Sequence[ScoredChunk]) -> Passage:
        first, last = run[0].chunk, run[-1].chunk
        text = self.documents[first.doc][first.start : last.end]
        return Passage(text, first.doc, max(item.score for item in run))
