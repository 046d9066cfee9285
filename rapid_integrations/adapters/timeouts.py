"""A call's time limit, shared by the framework adapters (`timeout=` in both)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from rapid_integrations.errors import RapidError
from rapid_integrations.output.outputs import Delta, RapidOutput, RapidStream


class RapidTimeoutError(RapidError, TimeoutError):
    """A call ran longer than its `timeout`; generation was stopped and its caches freed."""


class TimedRun:
    """One engine stream as an iterator of committed text, bounded by `timeout` seconds.

    The limit is checked as tokens are committed, so a long prefill is not cut short. The
    stream is closed when iteration ends for any reason (exhausted, timed out, or abandoned
    by the consumer), which frees its KV caches at once.
    """

    def __init__(self, stream: RapidStream, timeout: float | None) -> None:
        self._stream = stream
        self._timeout = timeout

    def __iter__(self) -> Iterator[str]:
        return (delta.text for delta in self.deltas() if delta.text)

    def deltas(self) -> Iterator[Delta]:
        """The stream's `Delta`s, under the same limit."""
        start = time.monotonic()
        with self._stream:
            for delta in self._stream.deltas():
                yield delta
                if self._timeout is not None and time.monotonic() - start > self._timeout:
                    raise RapidTimeoutError(f"generation took longer than {self._timeout} s")

    def close(self) -> None:
        """Stop the call (one not yet read, too), freeing its caches."""
        self._stream.close()

    @property
    def output(self) -> RapidOutput:
        """The finished call's `RapidOutput` (available once iteration is complete)."""
        if self._stream.output is None:
            raise RuntimeError("the run has not finished")
        return self._stream.output
