"""Measurements taken around a generation call without touching the code that generates.

`ForwardProbe` times every forward pass of the models through module hooks, so one run tells
apart the time spent in model forwards (target decode steps, verify steps, draft steps) from
the time outside them; `current_memory_bytes` and `peak_memory_bytes` report memory in use
before a call and at its peak.
"""

from __future__ import annotations

import contextlib
import re
import resource
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class ForwardCall:
    """One forward pass: which KV cache it extended (0 = the first seen: the model that decodes,
    1 = the draft), how many tokens it read, when it started and how long it took (seconds)."""

    role: int
    tokens: int
    start: float
    seconds: float


@dataclass(frozen=True)
class DecodeTimings:
    """Forward-pass time of the decode phase of one call (seconds; None when no such pass).

    forward_seconds: all forwards after prefill; main_step_seconds: mean pass of the decoding
    model reading one token (a plain decode step); verify_step_seconds: mean pass of the
    decoding model reading several tokens (a verify of gamma + 1); draft_step_seconds: mean
    pass of the draft.
    """

    forward_seconds: float
    main_step_seconds: float | None
    verify_step_seconds: float | None
    draft_step_seconds: float | None


@dataclass
class ForwardProbe:
    """Hooks on `models` that log every forward pass while the probe is entered.

    Roles come from the KV cache each pass extends, in order of first appearance: the engine
    and transformers `generate` prefill the decoding model's cache before the draft's.
    """

    models: Iterable[torch.nn.Module]
    calls: list[ForwardCall] = field(default_factory=list)
    _caches: dict[int, int] = field(default_factory=dict)
    _handles: list[Any] = field(default_factory=list)
    _open: dict[int, tuple[int, int, float]] = field(default_factory=dict)

    def __enter__(self) -> ForwardProbe:
        for model in {id(m): m for m in self.models}.values():
            self._handles.append(model.register_forward_pre_hook(self._before, with_kwargs=True))
            self._handles.append(model.register_forward_hook(self._after, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> None:
        """Forget the passes logged so far (call before each measured generation)."""
        self.calls.clear()
        self._caches.clear()

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        role = self._caches.setdefault(id(cache), len(self._caches))
        _sync(module)
        tokens = int(ids.shape[-1]) if ids is not None else 0
        self._open[id(module)] = (role, tokens, time.perf_counter())

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        _sync(module)
        role, tokens, start = self._open.pop(id(module))
        self.calls.append(ForwardCall(role, tokens, start, time.perf_counter() - start))

    def decode_timings(self, decode_start: float, main_passes: int | None = None) -> DecodeTimings:
        """Summarize the passes that started at or after `decode_start` (a perf_counter time).

        `main_passes`: how many passes the decoding model made, when known: it tells that
        model's cache apart when its prompt KV was reused and the draft's prefill came first.
        """
        decode = [c for c in self.calls if c.start >= decode_start]
        main_role = _main_role(decode, main_passes)
        main = [c for c in decode if c.role == main_role]
        return DecodeTimings(
            forward_seconds=sum(c.seconds for c in decode),
            main_step_seconds=_mean(c.seconds for c in main if c.tokens == 1),
            verify_step_seconds=_mean(c.seconds for c in main if c.tokens > 1),
            draft_step_seconds=_mean(c.seconds for c in decode if c.role != main_role),
        )


def _main_role(decode: list[ForwardCall], main_passes: int | None) -> int:
    """The role of the decoding model: the first seen, or the one that made `main_passes`
    passes (ties: the one reading more tokens per pass, as a verify reads gamma + 1)."""
    roles = sorted({c.role for c in decode})
    if main_passes is None or len(roles) < 2:
        return roles[0] if roles else 0
    passes = {r: [c.tokens for c in decode if c.role == r] for r in roles}
    matching = [r for r in roles if len(passes[r]) == main_passes] or roles
    return max(matching, key=lambda r: (fmean(passes[r]), -r))


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return fmean(values) if values else None


def _sync(module: torch.nn.Module) -> None:
    # CUDA runs asynchronously: without a sync the hooks would time kernel launches only.
    device = next(module.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA allocator, or the process's resident set on Linux)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif _CLEAR_REFS.exists():
        # "5" resets the kernel's peak resident set size (VmHWM) of this process; where that
        # is not permitted, the peak covers the whole process lifetime.
        with contextlib.suppress(OSError):
            _CLEAR_REFS.write_text("5")


def current_memory_bytes(device: torch.device) -> int | None:
    """Memory in use now: CUDA allocated memory, else the resident set on Linux (VmRSS)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int | None:
    if not _STATUS.exists():
        return None
    found = re.search(rf"{field}:\s+(\d+) kB", _STATUS.read_text())
    return int(found.group(1)) * 1024 if found else None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes since `reset_peak_memory`: CUDA allocated memory, else the resident set
    (Linux VmHWM; elsewhere the process-lifetime maximum from getrusage)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux kB
