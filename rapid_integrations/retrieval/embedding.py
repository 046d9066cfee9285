"""Dense text embeddings for retrieval, cached by content so a document is embedded once.

The default model is the bundled sentence-transformers all-MiniLM-L6-v2; any
sentence-transformers model works by hub name or local path (BGE-M3 included, the paper's
choice). Vectors are float32 rows of unit length, so inner product is cosine similarity.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from os import PathLike
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

DEFAULT_BATCH_SIZE = 32
DEFAULT_CACHE_SIZE = 65_536
"""Cached vectors per embedder: 65,536 x 384 float32 (MiniLM) is about 100 MB."""


@runtime_checkable
class Embedder(Protocol):
    """Maps texts to unit-length vectors: `embed(texts) -> float32 array of shape (n, dim)`."""

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


EmbedderSpec = Any
"""What callers may pass for an embedder: an `Embedder`, a loaded `SentenceTransformer`, a
model name or path, or None (the bundled MiniLM)."""


class SentenceTransformerEmbedder:
    """A sentence-transformers model behind an LRU cache keyed by each text's hash.

    model: a loaded `SentenceTransformer`, a hub name or local path, or None for the bundled
    all-MiniLM-L6-v2. Texts longer than the model's `max_seq_length` (256 word pieces for
    MiniLM) are truncated by the model; `FaissContextRetriever` therefore embeds chunks in
    windows that fit. Encoding is batched (`batch_size` texts per forward pass), without a
    progress bar unless `show_progress=True` (a server encodes on every request: no bars).
    """

    def __init__(
        self,
        model: SentenceTransformer | str | PathLike[str] | None = None,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        device: str = "cpu",
        cache_size: int = DEFAULT_CACHE_SIZE,
        show_progress: bool = False,
    ) -> None:
        self._model_spec = model
        self._device = device
        self._loaded: SentenceTransformer | None = None
        self.batch_size = batch_size
        self.cache_size = cache_size
        self.show_progress = show_progress
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        # The engine may be driven from several threads (async frameworks, servers).
        self._lock = threading.Lock()

    @property
    def model(self) -> SentenceTransformer:
        """The sentence-transformers model, loaded on first use."""
        if self._loaded is None:
            self._loaded = _load_model(self._model_spec, self._device)
        return self._loaded

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors of `texts`, shape (len(texts), dim), float32; cached texts are reused."""
        keys = [_digest(text) for text in texts]
        with self._lock:
            found = {key: self._cache[key] for key in keys if key in self._cache}
            for key in found:
                self._cache.move_to_end(key)
        missing = {key: text for key, text in zip(keys, texts, strict=True) if key not in found}
        if missing:
            found.update(self._encode(missing))
        if not keys:
            return np.zeros((0, self.model.get_sentence_embedding_dimension() or 0), np.float32)
        return np.stack([found[key] for key in keys])

    def _encode(self, texts: dict[bytes, str]) -> dict[bytes, np.ndarray]:
        vectors = self.model.encode(
            list(texts.values()),
            batch_size=self.batch_size,
            show_progress_bar=self.show_progress,
            convert_to_numpy=True,
            normalize_embeddings=True,
        ).astype(np.float32, copy=False)
        fresh = dict(zip(texts, vectors, strict=True))
        with self._lock:
            self._cache.update(fresh)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return fresh


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _load_model(spec: Any, device: str) -> SentenceTransformer:
    from sentence_transformers import SentenceTransformer

    from rapid_integrations.quiet import loading_bars

    if isinstance(spec, SentenceTransformer):
        return spec
    from rapid_integrations.models.loading import default_embedder_path, resolve_dtype

    if spec is None:
        spec = default_embedder_path()
    with loading_bars():
        model = SentenceTransformer(str(spec), device=device)
    # Loaded here, it runs in the dtype the engine would pick for this device: bf16 where the
    # CPU has it natively (indexing a 32K-token document 3.0 s against 7.0 s in float32, the
    # same recall and broad-suite answers; docs/retrieval.md, "Recall"), float32 where bf16
    # is emulated.
    return model.to(resolve_dtype("auto", device))


def get_embedder(spec: EmbedderSpec = None) -> Embedder:
    """An embedder for `spec`; names and paths share one instance (and cache) per process.

    Sharing matters: the cache is what lets a second question on the same long document skip
    re-embedding it.
    """
    if isinstance(spec, Embedder):
        return spec
    if spec is None or isinstance(spec, str | PathLike):
        return _shared_embedder(None if spec is None else str(spec))
    return SentenceTransformerEmbedder(spec)  # a loaded model: wrap it once to share its cache


@functools.lru_cache(maxsize=8)
def _shared_embedder(name: str | None) -> SentenceTransformerEmbedder:
    return SentenceTransformerEmbedder(name)
