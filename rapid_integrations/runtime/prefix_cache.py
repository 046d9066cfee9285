"""Prefix KV reuse across calls: the next question on the same document prefills only its tail.

A key/value pair at position i depends only on the model's weights and tokens 0..i (causal
attention), so the stored KV of any earlier prompt is exact for the longest common prefix with a
new one, as long as the weights are the same: entries are keyed by the model object and a
fingerprint of its parameters and buffers (`weights_version`), so weights changed in place, a
`load_state_dict` or a `.to(dtype / device)` never serve KV computed with the old ones.
Entries hold views of the per-call buffers (no copy at store time), in consecutive parts. A call
that reuses a prefix reads the first part in place, one copy for every call on the same document
(`kv.SharedPrefixLayer`, docs/algorithm.md section 14.1), and copies the rest (or everything,
where it cannot share) into its own buffer, so entries are never written after they are stored.
Its own entry then holds the shared part again (a view, not a copy) and its own tokens: at most
two parts. A buffer is counted once in the byte budget however many entries view it.
Entries stored by deterministic sequences (`RapidConfig.deterministic`, runtime/invariant.py)
serve only those, and the others only the others: the same tokens' KV is computed otherwise on
each path, and a prefix must be the one a fresh call of that kind would compute.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, heads, tokens, dim]
Parts = list[KV]  # consecutive parts of one prefix's KV, in order


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
    parts: Parts  # covering exactly `tokens`
    deterministic: bool = False  # computed by a deterministic sequence (runtime/invariant.py)

    def serves(self, model: torch.nn.Module, weights: Fingerprint, deterministic: bool) -> bool:
        return (
            self.model() is model
            and self.weights == weights
            and self.deterministic == deterministic
        )


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the buffers `tensors` view, each counted whole (not just the viewed tokens) and
    once, however many of them view it (a shared prefix's)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _nbytes(entries: Iterable[_Entry]) -> int:
    return storage_bytes(t for e in entries for part in e.parts for pair in part for t in pair)


def _first(parts: Parts, n: int) -> Parts:
    """The first `n` tokens of consecutive `parts` (views)."""
    kept = []
    for part in parts:
        if n <= 0:
            break
        kept.append([(k[..., :n, :], v[..., :n, :]) for k, v in part])
        n -= part[0][0].shape[-2]
    return kept


class PrefixCache:
    """Thread-safe LRU store of prompt KV caches, bounded in bytes."""

    def __init__(self) -> None:
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._next = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers the entries keep alive, each counted once."""
        with self._lock:
            return _nbytes(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, model: torch.nn.Module, tokens: Sequence[int], deterministic: bool = False
    ) -> tuple[int, Parts]:
        """Longest stored prefix of `tokens` for `model` with its current weights: (length,
        views of its KV in consecutive parts). `deterministic`: among the entries stored by
        deterministic sequences only, whose KV the default path computes otherwise (and the
        other way round)."""
        query = np.asarray(tokens, dtype=np.int64)
        weights = weights_version(model)
        with self._lock:
            best, best_key = 0, None
            for key, entry in self._entries.items():
                if (
                    entry.serves(model, weights, deterministic)
                    and (n := _common_prefix(entry.tokens, query)) > best
                ):
                    best, best_key = n, key
            if best_key is None:
                return 0, []
            self._entries.move_to_end(best_key)
            parts = self._entries[best_key].parts
        return best, _first(parts, best)

    def store(
        self,
        model: torch.nn.Module,
        tokens: Sequence[int],
        parts: Parts,
        max_bytes: int,
        deterministic: bool = False,
    ) -> None:
        """Remember `parts` (views covering exactly `tokens`, in order; `deterministic`: a
        deterministic sequence's, see `lookup`) and evict down to `max_bytes`.

        Entries of a model whose weights have changed since are dropped: they can never serve.
        """
        new = np.asarray(tokens, dtype=np.int64)
        weights = weights_version(model)
        entry = _Entry(weakref.ref(model), weights, new, parts, deterministic)
        with self._lock:
            for key, old in list(self._entries.items()):
                if not old.serves(model, weights, old.deterministic):
                    if old.model() is None or old.model() is model:
                        del self._entries[key]  # its model is gone, or its weights changed
                    continue
                if old.deterministic != deterministic:
                    continue  # the other kind: neither covers nor replaces this one
                shared = _common_prefix(old.tokens, new)
                if shared == len(new):
                    self._entries.move_to_end(key)
                    return  # an entry already covers these tokens
                if shared == len(old.tokens):
                    del self._entries[key]  # the new entry covers the old one
            self._entries[self._next] = entry
            self._next += 1
            while self._entries and _nbytes(self._entries.values()) > max_bytes:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def forget(self, model: torch.nn.Module) -> None:
        """Drop the entries of `model`, keeping the other models'."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.model() is model]:
                del self._entries[key]
