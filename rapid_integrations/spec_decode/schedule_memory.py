"""`ScheduleMemory`: what an engine's earlier calls measured about drafting, per length
(docs/algorithm.md section 2.11).

A measured schedule (`adaptive_gamma="measured"` or `speculate_min_context="auto"`) learns
the device's step costs and the text's acceptance from its own passes. Alone, every call pays
for that again: a timed plain step, a first guess of gamma, and where speculation loses, the
passes it takes to find out (fp32 at 2K on a 2-core CPU: 7 of a 128-token call's passes).
An engine keeps the schedule each call left, per length, and the next call like it starts
where that one ended.
"""

from __future__ import annotations

import copy
import math
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from rapid_integrations.config import RapidConfig
from rapid_integrations.spec_decode.schedule import GammaSchedule

SCHEDULE_FIELDS = (
    "eta",
    "temperature",
    "gamma",
    "adaptive_gamma",
    "gamma_max",
    "speculate_min_context",
    "draft_confidence_threshold",
    "lookup_ngram",
    "lookup_tokens",
)
"""The `RapidConfig` fields a measured schedule's costs or acceptance depend on: calls that
differ in one of them measure apart."""


def schedule_key(
    mode: str, target_tokens: int, cfg: RapidConfig, shaped: bool
) -> tuple[Hashable, ...]:
    """Which calls share a schedule: the same mode, target prompts in the same quarter octave
    of length (a target step's cost grows with the length it reads; a quarter octave is at
    most 19% longer), logits shaped by a grammar or not (the lookup is off under one, and the
    matcher adds to every pass), and the settings of `SCHEDULE_FIELDS`. Not the draft's
    length: rapid's draft reads a retrieved context whose length moves its step little (the 8K
    QA set: 70 to 372 tokens, which split 15 calls over 11 keys), and sd's reads the target's
    prompt."""
    octaves = round(4 * math.log2(target_tokens)) if target_tokens > 0 else -1
    return (mode, octaves, shaped, *(getattr(cfg, name) for name in SCHEDULE_FIELDS))


@dataclass
class _Kept:
    schedule: GammaSchedule  # as the last call at its key left it
    calls_left: int  # calls it still starts before one measures afresh
    lifetime: int  # the calls the last fresh measurement bought


class ScheduleMemory:
    """Thread-safe LRU store of the measured schedules calls left, by `schedule_key`.

    A fresh measurement (a call that starts from a new `GammaSchedule`) buys the next
    `lifetime` calls at its key a copy of the schedule the latest of them left: no plain step
    to time, gamma where it was, the costs and acceptance curve as measured, and stopped if
    drafting was stopped (a stopped call decodes like the target alone from its first pass).
    `lifetime` doubles, up to `MAX_LIFETIME`, each time a fresh measurement reaches the same
    verdict (stopped or not) as the calls before it, and is 1 after a change: speculation that
    loses is tried again after 1, 2, 4, ... 16 calls, never given up, and one slow pass (a
    plain step timed during a pause) misleads at most that many calls.
    """

    MAX_LIFETIME = 16
    MAX_KEYS = 256

    def __init__(self) -> None:
        self._kept: OrderedDict[Hashable, _Kept] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def clear(self) -> None:
        """Forget every kept schedule: the next call at any key measures afresh."""
        with self._lock:
            self._kept.clear()

    def start(self, key: Hashable, cfg: RapidConfig) -> tuple[GammaSchedule, bool]:
        """The schedule for a call at `key`, and whether it is fresh (measures from scratch):
        a copy of the kept one while it has calls left, else a new one."""
        fresh = GammaSchedule(cfg)
        with self._lock:
            kept = self._kept.get(key)
            if not fresh.measures or kept is None or kept.calls_left == 0:
                return fresh, True
            kept.calls_left -= 1
            self._kept.move_to_end(key)
            return copy.deepcopy(kept.schedule), False

    def keep(self, key: Hashable, schedule: GammaSchedule, fresh: bool) -> None:
        """Store the schedule a call at `key` ended with; `fresh` as `start` said."""
        if not schedule.measures:
            return
        with self._lock:
            kept = self._kept.get(key)
            if fresh:
                lifetime = 1
                if kept is not None and kept.schedule.stopped == schedule.stopped:
                    lifetime = min(2 * kept.lifetime, self.MAX_LIFETIME)
                self._kept[key] = _Kept(schedule, lifetime, lifetime)
            elif kept is not None:
                kept.schedule = schedule
            else:
                return  # evicted while the call ran
            self._kept.move_to_end(key)
            while len(self._kept) > self.MAX_KEYS:
                self._kept.popitem(last=False)
