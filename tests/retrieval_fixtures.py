"""Shared objects for the retrieval tests (imported by tests/test_retrieval_*.py).

Plain cached loaders rather than conftest fixtures (conftest.py belongs to the engine tests):
every test module shares one tokenizer and one MiniLM per process.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rapid_integrations.retrieval import Embedder

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@functools.lru_cache(maxsize=1)
def smol_tokenizer() -> PreTrainedTokenizerBase:
    """The target's tokenizer (SmolLM2-135M-Instruct, from the converted default model)."""
    from transformers import AutoTokenizer

    from rapid_integrations.models.loading import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model(progress=False)))


class HashingEmbedder:
    """A model-free bag-of-words embedder: unit vectors from hashed lower-case words.

    Texts sharing words get positive cosine similarity, texts sharing none get 0, so tests of
    the plumbing (fallbacks, packing, splitting) run in milliseconds.
    """

    def __init__(self, dim: int = 256) -> None:
        self.dim = dim
        self.calls: list[int] = []

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.calls.append(len(texts))
        out = np.zeros((len(texts), self.dim), np.float32)
        for row, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                out[row, int(hashlib.md5(word.encode()).hexdigest(), 16) % self.dim] += 1.0
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.where(norms == 0, 1.0, norms)


def minilm() -> Embedder:
    """The shared bundled all-MiniLM-L6-v2 embedder (its content cache persists across tests)."""
    from rapid_integrations.retrieval import get_embedder

    return get_embedder(None)
