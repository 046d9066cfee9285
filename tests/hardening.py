"""Shared tools of the hardening tests (tests/test_hardening_*.py): fault injection into a
model's forward, and weak references to the KV caches the engine allocates."""

from __future__ import annotations

import functools
import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

from rapid_integrations.runtime import kv

Forward = Callable[..., Any]


@contextmanager
def patched_forward(model: PreTrainedModel, around: Callable[..., Any]) -> Iterator[None]:
    """Route this model instance's forward through `around(forward, **kwargs)` meanwhile."""
    model.forward = functools.partial(around, model.forward)
    try:
        yield
    finally:
        del model.forward  # the class's forward again


def poison_logits(at_call: int, value: float) -> Callable[..., Any]:
    """A forward that returns logits all equal to `value` on its `at_call`-th call (1-based)."""
    calls = iter(range(1, 10**9))

    def around(forward: Forward, **kwargs: Any) -> Any:
        out = forward(**kwargs)
        if next(calls) == at_call:
            out.logits = torch.full_like(out.logits, value)
        return out

    return around


def fail_past(tokens: int, error: BaseException) -> Callable[..., Any]:
    """A forward that raises `error` once the sequence would grow past `tokens` tokens (of a
    packed pass, `kv.PackedCache`, as a call on a shared prefix runs alone: its sequence's)."""

    def around(forward: Forward, **kwargs: Any) -> Any:
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        held = max(c.get_seq_length() for c in getattr(cache, "caches", [cache]))
        if held + kwargs["input_ids"].shape[-1] > tokens:
            raise error
        return forward(**kwargs)

    return around


def slow_down(seconds: float) -> Callable[..., Any]:
    """A forward that takes `seconds` longer: generations outlast the consumers in a test."""

    def around(forward: Forward, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return forward(**kwargs)

    return around


def held_until(gate: threading.Event, timeout: float = 120) -> Callable[..., Any]:
    """A forward that waits for `gate` first: a request stays in flight until the test lets it go,
    however slow the machine is."""

    def around(forward: Forward, **kwargs: Any) -> Any:
        gate.wait(timeout)
        return forward(**kwargs)

    return around


class CacheTracker:
    """Weak references to every KV cache the engine allocates while installed."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[DynamicCache]] = []
        self._make = kv.new_cache

    def new_cache(
        self, model: PreTrainedModel, capacity: int, *args: Any, **kwargs: Any
    ) -> DynamicCache:
        cache = self._make(model, capacity, *args, **kwargs)
        self.refs.append(weakref.ref(cache))
        return cache

    def alive(self) -> int:
        """Caches still reachable after a full garbage collection."""
        gc.collect()
        return sum(ref() is not None for ref in self.refs)


def track_caches(monkeypatch: pytest.MonkeyPatch) -> CacheTracker:
    """A `CacheTracker` installed for the rest of the test."""
    tracker = CacheTracker()
    monkeypatch.setattr(kv, "new_cache", tracker.new_cache)
    return tracker


def settle_threads(baseline: int, timeout: float = 10.0) -> int:
    """`threading.active_count()` once it is back to `baseline` or `timeout` has passed.
    Garbage is collected meanwhile: an engine's shared batcher (rapid_integrations/batching/batcher.py)
    and its worker thread go once no call holds them, which may take a collection."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > baseline and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return threading.active_count()


def idle_threads(timeout: float = 10.0) -> int:
    """The thread count once no batcher's worker thread ("rapid-batch") and no async stream's
    ("rapid-stream", which ends just after its consumer has the last item) is left: the
    baseline a test compares with after its calls, whose threads have gone too by then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
        t.name.startswith(("rapid-batch", "rapid-stream")) for t in threading.enumerate()
    ):
        gc.collect()
        time.sleep(0.01)
    return threading.active_count()
