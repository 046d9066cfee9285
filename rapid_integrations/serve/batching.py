"""The running requests decoded together: one `BatchRunner` per server (docs/serving.md).

Every runner operation (submit, step, cancel) is a job of one worker thread, a
`ThreadPoolExecutor` of one: the runner and the engine's caches, prefix cache and schedules
are touched by that thread only, and jobs run in the order they were queued, so a cancel
queued before a newcomer's submit has freed its slot and KV first. An asyncio task, the
driver, steps the runner while any request listens, and hands each step's deltas, outputs
and errors to the requests' queues. A request that goes away (disconnect, timeout) queues
the cancel of its call, which runs between two steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..batch import BatchRunner
from ..call_options import CallOptions
from ..engine import RapidEngine
from ..errors import RapidConfigError
from ..outputs import Delta, RapidOutput
from ..tokens import Prompt
from .metrics import Metrics

log = logging.getLogger("rapid.serve")

Event = Delta | RapidOutput | None
"""What a request's events are: None once its call is planned, its `Delta`s, its output."""
_End = RapidOutput | Exception
_Sink = asyncio.Queue[Delta | _End]  # a request's queue: its call's deltas, then its end
_Report = tuple[_Sink, list[Delta], _End | None]  # a call's deltas of a step, and its end


class Batcher:
    """One `BatchRunner` over the engine, stepped on one thread for every request."""

    def __init__(self, runner: BatchRunner, metrics: Metrics) -> None:
        self._runner = runner
        self._metrics = metrics
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rapid-batch")
        self._sinks: dict[int, _Sink] = {}  # the calls in the runner (worker thread only)
        self._listening: set[_Sink] = set()  # queues of calls not ended (event loop only)
        self._driver: asyncio.Task[None] | None = None

    @classmethod
    def over(cls, engine: RapidEngine, metrics: Metrics) -> Batcher | None:
        """A batcher over `engine`, or None where its models cannot be packed (logged once:
        each request then decodes in a thread of its own)."""
        try:
            return cls(BatchRunner(engine), metrics)
        except RapidConfigError as exc:
            log.warning("rapid serve: requests decode one per thread, not batched: %s", exc)
            return None

    async def events(self, prompt: Prompt, options: CallOptions) -> AsyncGenerator[Event, None]:
        """The call's events; bad input raises before the first. Closing the generator
        early (the request went away) cancels the call, freeing its slot in the runner."""
        # The queue is the call's sink from its submit on, so no step's report can miss it.
        queue: _Sink = asyncio.Queue()
        self._listening.add(queue)
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        call_id = None
        try:
            call_id = await self._submitted(prompt, options, queue)
            yield None
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if isinstance(item, RapidOutput):
                    return
        finally:
            self._listening.discard(queue)
            if call_id is not None:
                self._later(self._cancel, call_id)  # a no-op for a call that has ended

    def close(self) -> None:
        """Stop the worker thread once the job in flight is done (the server shuts down)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _submitted(self, prompt: Prompt, options: CallOptions, queue: _Sink) -> int:
        """Submit the call on the worker thread (its planning errors raise here); if the
        request goes away meanwhile, the call is cancelled as soon as it is in."""
        future = self._pool.submit(self._submit, prompt, options, queue)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._later(self._cancel_submitted, future)  # runs after the submit: FIFO
            raise

    async def _drive(self) -> None:
        """Step the runner while a request waits for its call; each step's reports go to
        their queues (a request that has gone away reads its queue no more; its cancel is
        queued). A call's end is its request's last report: its queue is listened to no
        more, so the runner is not stepped idle while the request writes its last bytes."""
        loop = asyncio.get_running_loop()
        while self._listening:
            try:
                reports = await loop.run_in_executor(self._pool, self._step)
            except Exception as exc:  # not a call's failure (the runner keeps those): fail all
                reports = [(queue, [], exc) for queue in self._listening]
            for queue, deltas, end in reports:
                for delta in deltas:
                    queue.put_nowait(delta)
                if end is not None:
                    queue.put_nowait(end)
                    self._listening.discard(queue)

    def _later(self, job: Callable[..., Any], *args: Any) -> None:
        """Queue `job` on the worker thread without waiting for it (none after shutdown)."""
        with contextlib.suppress(RuntimeError):
            self._pool.submit(job, *args)

    # ---- the worker thread -------------------------------------------------------------------

    def _submit(self, prompt: Prompt, options: CallOptions, queue: _Sink) -> int:
        call_id = self._runner.submit(prompt, options=options)
        self._sinks[call_id] = queue
        self._metrics.open_streams.inc()
        self._sized()
        return call_id

    def _step(self) -> list[_Report]:
        """One step of the runner, and what it committed, finished or failed for each call."""
        tokens = self._runner.step()
        if tokens:  # no pass ran: only calls that failed as they were submitted
            self._metrics.step_tokens.observe(tokens)
        reports = [self._report(call_id) for call_id in list(self._sinks)]
        self._sized()
        return reports

    def _report(self, call_id: int) -> _Report:
        runner, queue = self._runner, self._sinks[call_id]
        deltas = runner.take_deltas(call_id)
        end: _End | None = runner.outputs.pop(call_id, None)
        if end is None:
            end = runner.errors.pop(call_id, None)
        if end is not None:
            self._left(call_id)
        return queue, deltas, end

    def _cancel(self, call_id: int) -> None:
        if call_id in self._sinks:
            self._runner.cancel(call_id)
            self._left(call_id)
            self._sized()

    def _cancel_submitted(self, future: Future[int]) -> None:
        if not future.cancelled() and future.exception() is None:
            self._cancel(future.result())

    def _left(self, call_id: int) -> None:
        del self._sinks[call_id]
        self._metrics.open_streams.dec()

    def _sized(self) -> None:
        self._metrics.batch_size.set(len(self._runner.running))
