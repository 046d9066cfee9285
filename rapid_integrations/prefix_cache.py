"""Prefix KV reuse across calls: the next question on the same document prefills only its tail.

A key/value pair at position i depends only on the model's weights and tokens 0..i (causal
attention), so the stored KV of any earlier prompt is exact for the longest common prefix with a
new one, as long as the weights are the same: entries are keyed by the model object and a
fingerprint of its parameters and buffers (`weights_version`), so weights changed in place, a
`load_state_dict` or a `.to(dtype / device)` never serve KV computed with the old ones.
Entries hold views of the per-call buffers (no copy at store time); a call that reuses a prefix
copies it into its own buffer, so entries are never written after they are stored.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, heads, tokens, dim]


Fingerprint = tuple[tuple[int, torch.dtype, torch.device, int], ...]


def weights_version(model: torch.nn.Module) -> Fingerprint:
    """A cheap fingerprint of what a model computes with, per parameter and buffer: where its
    data lives (data_ptr), its dtype and device, and its in-place version counter (bumped by
    every in-place write, `load_state_dict` included). Any change to the weights changes it."""
    return tuple(
        (t.data_ptr(), t.dtype, t.device, _version(t))
        for t in itertools.chain(model.parameters(), model.buffers())
    )


def _version(t: torch.Tensor) -> int:
    # Tensors created under torch.inference_mode keep no counter (and cannot be written outside
    # it); their data_ptr, dtype and device still tell replaced weights apart.
    return -1 if t.is_inference() else t._version


@dataclass
class _Entry:
    model: weakref.ref
    weights: Fingerprint
    tokens: np.ndarray  # int64 [n]
    kv: KV
    nbytes: int

    def serves(self, model: torch.nn.Module, weights: Fingerprint) -> bool:
        return self.model() is model and self.weights == weights


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _nbytes(kv: KV) -> int:
    # Count the whole buffers the views keep alive, not just the viewed tokens.
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for pair in kv for t in pair
    }
    return sum(storages.values())


class PrefixCache:
    """Thread-safe LRU store of prompt KV caches, bounded in bytes."""

    def __init__(self) -> None:
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._next = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, model: torch.nn.Module, tokens: Sequence[int]) -> tuple[int, KV]:
        """Longest stored prefix of `tokens` for `model` with its current weights: (length,
        per-layer KV views of it)."""
        query = np.asarray(tokens, dtype=np.int64)
        weights = weights_version(model)
        with self._lock:
            best, best_key = 0, None
            for key, entry in self._entries.items():
                if (
                    entry.serves(model, weights)
                    and (n := _common_prefix(entry.tokens, query)) > best
                ):
                    best, best_key = n, key
            if best_key is None:
                return 0, []
            self._entries.move_to_end(best_key)
            kv = self._entries[best_key].kv
        return best, [(k[..., :best, :], v[..., :best, :]) for k, v in kv]

    def store(self, model: torch.nn.Module, tokens: Sequence[int], kv: KV, max_bytes: int) -> None:
        """Remember `kv` (views covering exactly `tokens`) and evict down to `max_bytes`.

        Entries of a model whose weights have changed since are dropped: they can never serve.
        """
        new = np.asarray(tokens, dtype=np.int64)
        weights = weights_version(model)
        entry = _Entry(weakref.ref(model), weights, new, kv, _nbytes(kv))
        with self._lock:
            for key, old in list(self._entries.items()):
                if not old.serves(model, weights):
                    if old.model() is None or old.model() is model:
                        del self._entries[key]  # its model is gone, or its weights changed
                    continue
                shared = _common_prefix(old.tokens, new)
                if shared == len(new):
                    self._entries.move_to_end(key)
                    return  # an entry already covers these tokens
                if shared == len(old.tokens):
                    del self._entries[key]  # the new entry covers the old one
            self._entries[self._next] = entry
            self._next += 1
            while self._entries and sum(e.nbytes for e in self._entries.values()) > max_bytes:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
