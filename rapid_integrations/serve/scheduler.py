"""The bounded queue in front of the engine: at most `max_running` sequences decode at once
(the batch size; a request takes a slot per sequence, one per choice), at most `max_waiting`
requests wait for their slots.

A request that finds the waiting room full is refused at once with 429 and a `Retry-After`
estimated from recent request durations; one that waits longer than its timeout gets 504.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import anyio

from .errors import ServeError, timed_out

RETRY_AFTER_BOUNDS = (1, 60)
"""Seconds a 429 tells the client to wait, at least and at most."""


class Lease:
    """Held slots; `release()` gives them back (idempotent)."""

    def __init__(self, queue: SequenceQueue, start: float, slots: int) -> None:
        self._queue = queue
        self._start = start
        self._slots = slots
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._queue._release(asyncio.get_running_loop().time() - self._start, self._slots)


class SequenceQueue:
    """asyncio semaphore of `max_running` slots plus a bound on the requests waiting for one.

    `on_change(running, waiting)` is called whenever either count changes (metrics).
    """

    def __init__(
        self,
        max_running: int,
        max_waiting: int,
        on_change: Callable[[int, int], None] = lambda running, waiting: None,
    ) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(max_running)
        # One request takes its slots at a time: two that each held some of theirs could
        # wait for each other's forever.
        self._taking = asyncio.Lock()
        self._on_change = on_change
        self._mean_seconds = 1.0  # moving average of how long a slot is held

    async def enter(self, timeout: float, slots: int = 1) -> Lease:
        """Wait for `slots` slots (at most `max_running`); raises 429 `ServeError` if the
        waiting room is full, 504 on timeout."""
        if self._slots.locked() and self.waiting >= self.max_waiting:
            raise ServeError(
                429,
                f"the server is busy ({self.running} requests running, {self.waiting} waiting); "
                "retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after())},
            )
        self._count(waiting=+1)
        try:
            with anyio.fail_after(timeout):  # not wait_for: see `_Run.within_deadline`
                await self._take(slots)
        except TimeoutError:
            raise timed_out() from None
        finally:
            self._count(waiting=-1)
        self._count(running=+slots)
        return Lease(self, asyncio.get_running_loop().time(), slots)

    def retry_after(self) -> int:
        """Seconds until a slot is likely free for a new request (whole, within the bounds)."""
        ahead = (self.waiting + 1) / self.max_running
        low, high = RETRY_AFTER_BOUNDS
        return max(low, min(high, math.ceil(self._mean_seconds * ahead)))

    async def _take(self, slots: int) -> None:
        """Acquire `slots` slots; those taken are given back if the wait ends first."""
        taken = 0
        try:
            async with self._taking:
                while taken < slots:
                    await self._slots.acquire()
                    taken += 1
        except BaseException:
            for _ in range(taken):
                self._slots.release()
            raise

    def _release(self, held_seconds: float, slots: int) -> None:
        self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * held_seconds
        for _ in range(slots):
            self._slots.release()
        self._count(running=-slots)

    def _count(self, running: int = 0, waiting: int = 0) -> None:
        self.running += running
        self.waiting += waiting
        self._on_change(self.running, self.waiting)
