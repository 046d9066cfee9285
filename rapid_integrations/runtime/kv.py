"""One model's KV cache for one call: chunked prefill, prefix reuse, feeding tokens, rollback."""

from __future__ import annotations

import functools
import inspect
import itertools
import statistics
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from rapid_integrations.errors import RapidConfigError
from rapid_integrations.runtime import invariant
from rapid_integrations.runtime.attention import LAYOUT, NAME
from rapid_integrations.runtime.prefix_cache import KV, PrefixCache, storage_bytes

_R = TypeVar("_R")


class BufferedLayer(DynamicLayer):
    """A DynamicLayer that appends into a buffer allocated once for the whole call.

    transformers' DynamicLayer appends with torch.cat, copying the entire cache on every forward
    pass: at 8K tokens that is hundreds of MB per step. Here an append writes only the new
    tokens, and a rollback just moves the length back. `keys` / `values` are views [.., :len, :].
    """

    # Tensors once the first update has run (the base class types them as optional).
    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, capacity: int, zeroed: bool = False) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.zeroed = zeroed  # buffers start as zeros: read past `length` (`padded`)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the buffers [batch, kv_heads, capacity, head_dim] from the first states
        [batch, kv_heads, new, head_dim] (their dtype, device and head widths)."""
        super().lazy_initialization(key_states, value_states)
        shape = (*key_states.shape[:-2], self.capacity, key_states.shape[-1])
        keys, values = (
            (key_states.new_zeros, value_states.new_zeros)
            if self.zeroed
            else (key_states.new_empty, value_states.new_empty)
        )
        self._k = keys(shape)
        self._v = values((*shape[:-1], value_states.shape[-1]))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key/value states [batch, kv_heads, new, head_dim]; return the whole cache
        [batch, kv_heads, length, head_dim] (views of the buffers)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV buffer overflow: {end} > {self.capacity} tokens")
        self._k[..., self.length : end, :].copy_(key_states)
        self._v[..., self.length : end, :].copy_(value_states)
        self._set_length(end)
        return self.keys, self.values

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys = self._k[..., :length, :]
        self.values = self._v[..., :length, :]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove and self.is_initialized:
            self._set_length(self.length - abs(tokens_to_remove))

    def parts(self) -> KV:
        """The layer's KV as consecutive parts, (keys, values) [1, kv_heads, tokens, head_dim]
        each: here one, the buffer's tokens (none before the first append)."""
        return [(self.keys, self.values)] if self.length else []

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values [1, kv_heads, padded_keys(length), head_dim], views of a zeroed
        buffer allocated that long (a deterministic sequence's: `invariant.attention`); past
        `length` they hold zeros or rolled-back tokens, finite either way."""
        end = invariant.padded_keys(self.length)
        if not self.zeroed or end > self.capacity:
            raise RuntimeError(f"no zeroed KV buffer of {end} tokens to pad into")
        return self._k[..., :end, :], self._v[..., :end, :]


class SharedPrefixLayer(BufferedLayer):
    """A full-attention layer whose first tokens are a shared prefix it reads but does not hold.

    `prefix` (keys, values [1, kv_heads, P, head_dim]) is a stored prefix's KV (views of the
    prefix cache's entry, `prefix_cache.py`), read in place by every sequence that reuses it
    and never written; the buffer, `capacity - P` tokens, holds only this sequence's own
    tokens after it (`keys` / `values` are those). Positions count from the prefix's start
    (`get_seq_length` is P + own tokens). Attention reads the two parts through
    `PackedCache.kv` and merges them (docs/algorithm.md section 14.1), so a sequence with a
    shared prefix always runs packed passes (`KVState.feed`). A rollback crops own tokens only.
    """

    def __init__(self, capacity: int, prefix: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__(capacity - prefix[0].shape[-2])
        self.prefix = prefix

    def get_seq_length(self) -> int:
        return self.prefix[0].shape[-2] + self.length

    def crop(self, tokens_to_remove: int) -> None:
        # Only tokens read after the prompt are ever rolled back; the prefix is the prompt's.
        if abs(tokens_to_remove) > self.length:
            raise RuntimeError(
                f"rollback of {abs(tokens_to_remove)} tokens into a shared prefix "
                f"({self.length} own tokens)"
            )
        super().crop(tokens_to_remove)

    def parts(self) -> KV:
        """The shared prefix, then the own tokens (if any): [1, kv_heads, tokens, head_dim]."""
        return [self.prefix, *super().parts()]


class BufferedSlidingLayer(BufferedLayer):
    """A sliding-window (or chunked) attention layer that keeps every token, like `BufferedLayer`.

    transformers' DynamicSlidingWindowLayer drops tokens older than the window, so it cannot
    be rolled back once the window is reached, and its KV cannot be reused as a prefix. Here
    the buffer holds the whole sequence; each forward pass sees only the last
    `sliding_window - 1` cached tokens plus the new ones (views, no copy), and `get_mask_sizes`
    reports that span with its offset, so the model's own sliding-window mask masks by absolute
    position exactly as with transformers' layer. Memory is that of a full layer.
    """

    is_sliding = True

    def __init__(self, capacity: int, sliding_window: int) -> None:
        super().__init__(capacity)
        self.sliding_window = sliding_window

    def _first_visible(self) -> int:
        """Index of the oldest cached token the next query block may attend to."""
        return max(self.length - self.sliding_window + 1, 0)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append states [batch, kv_heads, new, head_dim]; return the visible span
        [batch, kv_heads, kv_length, head_dim] of `get_mask_sizes` (taken before the append)."""
        start = self._first_visible()
        super().update(key_states, value_states)
        return self.keys[..., start:, :], self.values[..., start:, :]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        offset = self._first_visible()
        return self.length - offset + query_length, offset

    def get_max_length(self) -> int:
        return self.sliding_window


def _buffered(layer: object, capacity: int, zeroed: bool = False) -> CacheLayerMixin | None:
    """The buffered replacement of one of transformers' cache layers; None if there is none."""
    if type(layer) is DynamicLayer:
        return BufferedLayer(capacity, zeroed)
    if type(layer) is DynamicSlidingWindowLayer:  # sliding-window and chunked attention
        return BufferedSlidingLayer(capacity, layer.sliding_window)
    # A layer that reads another layer's KV stores nothing. By name: transformers 5.17, for
    # one, has no such class, and the package supports every 5.x.
    if type(layer).__name__ == "DummyLayer":
        return cast(CacheLayerMixin, layer)  # kept as it is, among the layers around it
    return None


def new_cache(
    model: PreTrainedModel, capacity: int, role: str = "model", zeroed: bool = False
) -> DynamicCache:
    """A DynamicCache whose attention layers are buffered layers of `capacity` tokens
    (`zeroed`: full-attention buffers start as zeros, for `BufferedLayer.padded`).

    Raises `RapidConfigError` (field `role`) naming the layer kind when a layer's cache cannot
    be rolled back to the accepted drafts (recurrent, convolutional, compressed attention).
    """
    cache = DynamicCache(config=model.config)
    layers = [_buffered(layer, capacity, zeroed) for layer in cache.layers]
    if None in layers:
        kinds = sorted(
            {
                type(old).__name__
                for old, new in zip(cache.layers, layers, strict=True)
                if new is None
            }
        )
        raise RapidConfigError(
            role,
            f"the {model.config.model_type} model has cache layers of kind {', '.join(kinds)} "
            "(recurrent, convolutional or compressed attention), which cannot be rolled back "
            "to the accepted drafts; supported: full, sliding-window and chunked attention",
        )
    cache.layers = [layer for layer in layers if layer is not None]  # all: None raised above
    return cache


def check_cache_layout(model: PreTrainedModel, role: str) -> None:
    """Raise `RapidConfigError` now, at engine construction, if `model`'s cache is unsupported."""
    new_cache(model, 1, role)


def packing_refusal(model: PreTrainedModel, layers: list[Any]) -> str | None:
    """Why a packed pass (`feed_packed`), and so a shared prefix, cannot run on `model` with
    cache `layers`; None when it can. Attention must be the registered one (another kernel
    would ignore the layout and attend across sequences), and every layer a full-attention
    `BufferedLayer` (a sliding window would need its mask per segment)."""
    if getattr(model.config, "_attn_implementation", None) != NAME:
        return (
            f"batching needs the model on {NAME!r} attention (SDPA models are switched to it); "
            f"this one uses {model.config._attn_implementation!r}"
        )
    if not all(type(layer) is BufferedLayer for layer in layers):
        return "batching supports full-attention layers only (no sliding window yet)"
    return None


@dataclass
class KVState:
    """A sequence being decoded by one model.

    Invariant: `cache` holds every token of the sequence except `pending`, the committed tokens
    the model has not read yet (the last prompt token at first, then the last emitted token).
    `vocab` is the shared vocabulary width; logits are cut to it so padded heads agree.
    """

    model: PreTrainedModel
    cache: DynamicCache
    pending: torch.Tensor  # [k] int64 on the model's device
    vocab: int
    # The forward pass decode feeds run, once the prefill is done: a compiled one
    # (`compiled.compile_decode`), or None for the model itself.
    decode: Callable[..., Any] | None = None
    forward_passes: int = 0
    forward_seconds: float = 0.0  # decode-phase model time (on CUDA: until the next sync)

    reused_tokens: int = 0
    shared_tokens: int = 0  # of `reused_tokens`, those read in place from a shared prefix
    # Every pass runs packed, of one kind (`invariant.py`): a prefill pass while `prefilling`.
    deterministic: bool = False
    prefilling: bool = False

    @classmethod
    def start(
        cls,
        model: PreTrainedModel,
        prompt: list[int],
        vocab: int,
        chunk: int,
        capacity: int,
        prefixes: PrefixCache | None = None,
        max_prefix_bytes: int = 0,
        decode: Callable[..., Any] | None = None,
    ) -> KVState:
        """`starting`, its chunks run alone."""
        return direct(
            cls.starting(
                model, prompt, vocab, chunk, capacity, prefixes, max_prefix_bytes, decode=decode
            )
        )

    @classmethod
    def starting(
        cls,
        model: PreTrainedModel,
        prompt: list[int],
        vocab: int,
        chunk: int,
        capacity: int,
        prefixes: PrefixCache | None = None,
        max_prefix_bytes: int = 0,
        draft: bool = False,
        decode: Callable[..., Any] | None = None,
        deterministic: bool = False,
    ) -> Forwards[KVState]:
        """Prefill all but the last prompt token, reusing a stored prefix when one matches
        (read in place where it can be shared, else copied: `_load`, section 14.1).

        The rest is read in chunks of `chunk` tokens, each a `Feed` (`draft`: its flag) that
        keeps one logit row, so the prompt's full-vocabulary logits are never materialized
        and a batch runs a newcomer's prefill one chunk a step. `capacity` bounds the tokens
        the sequence will ever hold (prompt, generated, and drafts in flight). `decode`: the
        forward its decode passes run (`KVState.decode`); such a sequence copies a stored
        prefix into its own buffers, so that its passes stay on the plain path it compiled.
        `deterministic` (`RapidConfig.deterministic`, checked here: `invariant.prepare`):
        buffers padded for `invariant.attention` and zeroed, every pass packed (no compiled
        one), and only prefixes stored by deterministic sequences reused, copied.
        """
        if deterministic:
            role = "draft" if draft else "target"
            refusal = packing_refusal(model, new_cache(model, 1, role).layers)
            invariant.prepare(model, role, refusal)
            capacity, decode = invariant.padded_keys(capacity), None
        ids = torch.tensor(prompt, dtype=torch.long, device=model.device)
        cache = new_cache(model, capacity, zeroed=deterministic)
        state = cls(model, cache, ids[:0], vocab, deterministic=deterministic)
        head = prompt[:-1]
        reuse = prefixes if max_prefix_bytes > 0 and state._plain_layers() else None
        if reuse is not None:
            state.reused_tokens, parts = reuse.lookup(model, head, deterministic)
            state._load(parts, share=decode is None and not deterministic)
        state.prefilling = True
        for start in range(state.reused_tokens, len(head), chunk):
            yield Feed(state, ids[start : min(start + chunk, len(head))], draft, keep=1)
        state.prefilling = False
        state.forward_passes, state.forward_seconds = 0, 0.0  # counted: decode passes only
        state.pending, state.decode = ids[-1:], decode
        if reuse is not None and head:
            reuse.store(model, head, state._parts(), max_prefix_bytes, deterministic)
        return state

    def _plain_layers(self) -> bool:
        # Every layer must hold every token's KV (buffered full or sliding layers) to be reused.
        return all(isinstance(layer, BufferedLayer) for layer in self.cache.layers)

    def _load(self, parts: list[KV], share: bool) -> None:
        """Read a stored prefix, consecutive parts of per layer (keys, values) [1, kv_heads,
        tokens, head_dim]: with `share`, its first part shared in place where packed passes can
        read it (docs/algorithm.md section 14.1; `packing_refusal`); the rest copied into the
        buffers."""
        if parts and share and packing_refusal(self.model, self.cache.layers) is None:
            self.cache.layers = [
                SharedPrefixLayer(layer.capacity, prefix)
                for layer, prefix in zip(self._buffers(), parts[0], strict=True)
            ]
            self.shared_tokens = parts[0][0][0].shape[-2]
            parts = parts[1:]
        for part in parts:
            for layer, (k, v) in zip(self._buffers(), part, strict=True):
                layer.update(k, v)

    def _parts(self) -> list[KV]:
        """The sequence's KV as the prefix cache stores it: consecutive parts of per layer
        (keys, values) views [1, kv_heads, tokens, head_dim], the shared prefix it read (views
        of an earlier entry's buffer: stored again, never copied) then its own buffer's tokens."""
        layers = [layer.parts() for layer in self._buffers()]
        return [list(part) for part in zip(*layers, strict=True)]

    def _buffers(self) -> list[BufferedLayer]:
        # Called only where `_plain_layers` holds (prefix reuse checks it first).
        return cast(list[BufferedLayer], self.cache.layers)

    def feed(self, tokens: torch.Tensor | None = None, keep: int = 0) -> torch.Tensor:
        """Read `pending` then `tokens` ([k] int64 ids); return their logits [len, vocab]
        (len = pending + k rows, or the last `keep` when keep > 0; in the model's dtype).
        A sequence on a shared prefix runs as a packed pass of one, whose attention reads the
        prefix in place (section 14.1); so does a deterministic one (`invariant.attention`)."""
        if self.shared_tokens or self.deterministic:
            return feed_packed([Feed(self, tokens, keep=keep)])[0]
        ids = self.take(tokens)
        start = time.perf_counter()
        out = self._forward()(
            input_ids=ids[None], **_cache_arg(self.model, self.cache), logits_to_keep=keep
        )
        self.counted(time.perf_counter() - start)
        return out.logits[0, :, : self.vocab]

    def _forward(self) -> Callable[..., Any]:
        # The compiled graphs read allocated buffers: the first pass of a sequence that had
        # nothing to prefill allocates them, and runs on the model itself.
        if self.decode is not None and self.cache.get_seq_length() > 0:
            return self.decode
        return self.model

    def take(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The ids [pending + k] the next forward pass reads: `pending`, then `tokens` ([k]);
        none are pending afterwards."""
        ids = (
            self.pending
            if tokens is None
            else torch.cat([self.pending, tokens.to(self.pending.device)])
        )
        self.pending = ids[:0]
        return ids

    def counted(self, seconds: float) -> None:
        """A forward pass read this sequence's ids in `seconds` (wall time: a packed pass's
        seconds count for each sequence it read)."""
        self.forward_seconds += seconds
        self.forward_passes += 1

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens read (rejected drafts)."""
        if n > 0:
            self.cache.crop(-n)  # transformers 5: a negative count removes tokens

    def append(self, tokens: torch.Tensor) -> None:
        """Commit `tokens` ([k] int64 ids) as pending: they are read on the next `feed`."""
        self.pending = torch.cat([self.pending, tokens.to(self.pending.device)])

    def adopt(self, other: KVState) -> None:
        """Hold `other`'s sequence from now on (its cache and pending tokens, a sequence of
        the same model prefilled afresh: a rebuilt short context), keeping this one's counts
        of decode passes, so whoever holds this state reads the new sequence."""
        if other.model is not self.model:
            raise ValueError("a sequence adopts only a sequence of its own model")
        self.cache, self.pending, self.decode = other.cache, other.pending, other.decode
        self.reused_tokens, self.shared_tokens = other.reused_tokens, other.shared_tokens


def held_bytes(states: Iterable[KVState]) -> int:
    """Bytes of the KV buffers `states` keep alive, each counted once however many of them
    read it (a shared prefix: section 14.1)."""
    return storage_bytes(
        t for s in states for layer in s._buffers() for pair in layer.parts() for t in pair
    )


PASS_REPEATS = 3
"""Passes timed per size by `pass_seconds`; the median is kept (robust to a burst of load)."""


@torch.inference_mode()
def pass_seconds(
    model: PreTrainedModel,
    ids: list[int],
    vocab: int,
    sizes: Sequence[int],
    *,
    chunk: int,
    prefixes: PrefixCache | None = None,
    max_prefix_bytes: int = 0,
    repeats: int = PASS_REPEATS,
    warmup: int = 0,
    decode: Callable[..., Any] | None = None,
) -> dict[int, float]:
    """Median seconds of `repeats` forward passes reading k tokens after `ids`, each size's
    first `warmup` passes untimed, for each k in `sizes` (run by `decode`, the draft's compiled
    passes, where the engine has them).

    The prompt's KV comes from `prefixes` when a previous call stored it (the bench runs the
    methods first), else it is prefilled here. Each pass is rolled back before the next.
    """
    state = KVState.start(
        model,
        ids,
        vocab,
        chunk,
        capacity=len(ids) + max(sizes),
        prefixes=prefixes,
        max_prefix_bytes=max_prefix_bytes,
        decode=decode,
    )
    last = state.pending
    filler = last.repeat(max(sizes))  # which tokens does not change a pass's cost
    seconds: dict[int, float] = {}
    for k in sizes:
        times = []
        for _ in range(warmup + repeats):
            start = time.perf_counter()
            state.feed(filler[: k - 1])
            if last.device.type == "cuda":
                torch.cuda.synchronize(last.device)
            times.append(time.perf_counter() - start)
            state.rollback(k)
            state.pending = last
        seconds[k] = statistics.median(times[warmup:])
    return seconds


@functools.cache
def cache_param(model_type: type[torch.nn.Module]) -> str:
    """The name a `model_type`'s forward takes its cache by: transformers renamed
    `past_key_values` to `cache` during 5.x."""
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_arg(model: PreTrainedModel, cache: DynamicCache | PackedCache) -> dict[str, Any]:
    # mypy takes a class for unhashable here (python/mypy#20409); classes hash by identity.
    return {cache_param(type(model)): cache, "use_cache": True}  # type: ignore[arg-type]


@dataclass(frozen=True)
class Feed:
    """A forward pass one sequence's loop asks for: `state` reads its pending tokens, then
    `tokens` ([k] int64 ids; None: none). The loop is a generator that yields a `Feed` and is
    sent back the logits [pending + k, vocab] (`KVState.feed`'s); whoever drives it decides
    how the pass runs: alone (`direct`) or packed with other sequences' (`feed_packed`).
    `draft`: a draft model's pass (a batch runs them all before any verify pass)."""

    state: KVState
    tokens: torch.Tensor | None = None
    draft: bool = False
    keep: int = 0  # logit rows sent back: the last `keep` (0: all; `logits_to_keep`)

    def run(self) -> torch.Tensor:
        """This pass alone: the logits [pending + k, vocab] (or the last `keep` rows)."""
        return self.state.feed(self.tokens, self.keep)


Forwards = Generator[Feed, torch.Tensor, _R]
"""A computation of one sequence that needs forward passes: yields `Feed`s, is sent their
logits, returns its result."""


def direct(steps: Forwards[_R]) -> _R:
    """Run `steps` alone: each `Feed` is one forward pass of its own (`KVState.feed`)."""
    try:
        feed = next(steps)
        while True:
            feed = steps.send(feed.run())
    except StopIteration as done:
        return cast(_R, done.value)


class PackedCache:
    """The cache and the attention layout of one packed forward pass (the varlen layout).

    Several sequences' new tokens are read in one row, `input_ids [1, T_total]`, segment i
    at `bounds[i] = (start, end)` of the row, each at its own positions (`position_ids`
    [1, T_total]), no padding. The projections and the MLP, where the weights are read (the
    memory-bound part of a decode step), run once over the whole row; attention runs per
    segment: `update` appends segment i's key/value states into sequence i's own cache, and
    the registered attention (`attention.rapid_attention`, which gets this object as the
    `rapid_layout` keyword the model passes down) computes segment i's queries against
    sequence i's whole KV with a causal mask over its new tokens. That is the layout of
    flash-attn's varlen kernel (`cu_seqlens_q` = the bounds, `cu_seqlens_k` = each
    sequence's KV length), which a GPU port would call instead of the loop over segments.
    Full-attention layers only (`BufferedLayer`, `SharedPrefixLayer`): a sliding window would
    need its mask per segment.
    """

    def __init__(
        self,
        caches: list[DynamicCache],
        bounds: list[tuple[int, int]],
        deterministic: Sequence[bool] = (),
    ) -> None:
        self.caches = caches
        self.bounds = bounds
        self.deterministic = list(deterministic) or [False] * len(caches)  # per segment
        self._masks: dict[tuple[int, int, int], torch.Tensor] = {}

    @property
    def masks(self) -> dict[tuple[int, int, int], torch.Tensor]:
        """Deterministic segments' masks, kept from the pass's first layer for the others."""
        return self._masks

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each segment's slice of key/value states [1, kv_heads, T_total, head_dim]
        to its own sequence's layer `layer_idx`; the states come back unchanged (attention
        reads each sequence's KV through `kv`)."""
        for cache, (start, end) in zip(self.caches, self.bounds, strict=True):
            layer = cast(BufferedLayer, cache.layers[layer_idx])
            layer.update(key_states[..., start:end, :], value_states[..., start:end, :])
        return key_states, value_states

    def kv(self, layer_idx: int, segment: int) -> KV:
        """Sequence `segment`'s keys and values at layer `layer_idx` as consecutive parts
        (`BufferedLayer.parts`), [1, kv_heads, tokens, head_dim] each: a shared prefix where
        it reads one, then its own tokens, the new ones included."""
        return cast(BufferedLayer, self.caches[segment].layers[layer_idx]).parts()

    def padded(self, layer_idx: int, segment: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A deterministic segment's keys and values at layer `layer_idx`, padded
        (`BufferedLayer.padded`, the new tokens included); None for any other segment."""
        if not self.deterministic[segment]:
            return None
        return cast(BufferedLayer, self.caches[segment].layers[layer_idx]).padded()


def feed_packed(feeds: list[Feed]) -> list[torch.Tensor]:
    """Run `feeds`, all on one model, as one forward pass over a packed row (`PackedCache`);
    returns each feed's logits [pending + k_i, vocab]. A deterministic sequence's pass is of
    one kind (`invariant.py`): its prefill chunk runs alone, its decode passes with the other
    deterministic sequences' only."""
    kinds = [_kind(f.state) for f in feeds]
    if len(set(kinds)) > 1 or kinds.count("prefill") > 1:
        passes: dict[object, list[int]] = {}
        for i, kind in enumerate(kinds):
            passes.setdefault(i if kind == "prefill" else kind, []).append(i)
        logits: list[torch.Tensor] = [torch.empty(0)] * len(feeds)
        for members in passes.values():
            for i, rows in zip(members, _feed_packed([feeds[i] for i in members]), strict=True):
                logits[i] = rows
        return logits
    return _feed_packed(feeds)


def _kind(state: KVState) -> invariant.Kind | None:
    """The kind of pass a sequence's next feed is (None: not a deterministic sequence)."""
    if not state.deterministic:
        return None
    return "prefill" if state.prefilling else "decode"


def _feed_packed(feeds: list[Feed]) -> list[torch.Tensor]:
    """`feed_packed` of feeds whose passes are of one kind (`_kind`)."""
    states = [f.state for f in feeds]
    model = states[0].model
    ids = [s.take(f.tokens) for s, f in zip(states, feeds, strict=True)]
    ends = list(itertools.accumulate(len(i) for i in ids))
    bounds = list(zip([0, *ends[:-1]], ends, strict=True))
    positions = torch.cat(
        [
            torch.arange(len(i), device=i.device) + s.cache.get_seq_length()
            for s, i in zip(states, ids, strict=True)
        ]
    )  # [T_total]: each segment continues its own sequence
    kept = [f.keep or len(i) for f, i in zip(feeds, ids, strict=True)]  # rows sent back
    rows = torch.cat(
        [
            torch.arange(end - k, end, device=positions.device)
            for end, k in zip(ends, kept, strict=True)
        ]
    )  # [sum(kept)]: the rows the output head reads
    layout = PackedCache([s.cache for s in states], bounds, [s.deterministic for s in states])
    start = time.perf_counter()
    with invariant.pass_of(_kind(states[0])):
        out = model(
            input_ids=torch.cat(ids)[None],
            position_ids=positions[None],
            # A 4-D mask is taken as prepared: transformers' `create_causal_mask` returns it
            # as it is and builds no [T_total, kv] mask, which no single cache length could
            # size; the attention masks each segment itself. This one is empty.
            attention_mask=torch.zeros(1, 1, 0, 0, dtype=torch.bool, device=positions.device),
            **_cache_arg(model, layout),
            **{LAYOUT: layout},
            logits_to_keep=rows if len(rows) < ends[-1] else 0,
        )
    seconds = time.perf_counter() - start
    for state in states:
        state.counted(seconds)
    logits = out.logits[0]  # [sum(kept), V]
    return [part[:, : s.vocab] for part, s in zip(logits.split(kept), states, strict=True)]
