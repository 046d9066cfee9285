"""Calls from any thread or event loop decoded together: one `BatchRunner` stepped on one
worker thread (docs/algorithm.md section 14). `rapid serve` and the framework adapters use it.

Every runner operation (submit, step, cancel) is a job of one worker thread, a
`ThreadPoolExecutor` of one: the runner and the engine's caches, prefix cache and schedules
are touched by that thread only, and jobs run in the order they were queued, so a cancel
queued before a newcomer's submit has freed its slot and KV first. While any call is in the
runner, the worker steps it: each step is a job that queues the next one after it, so the
submits and cancels queued meanwhile run between two steps. Each step's deltas, outputs and
errors go to the calls' sinks (thread-safe callables); a consumer that goes away queues the
cancel of its call, which runs after at most the step in flight.

Two consumers: `Batcher.stream`, a `RapidStream` for a thread (the adapters, through
`batched_stream`, which shares one batcher per engine among all their calls), and
`Batcher.events`, an async generator for an event loop (the server: n calls on one prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from rapid_integrations.engine.call_options import CallOptions
from rapid_integrations.errors import RapidConfigError
from rapid_integrations.output.outputs import Delta, RapidOutput, RapidStream
from rapid_integrations.tokens import Prompt

if TYPE_CHECKING:
    from rapid_integrations.batching.runner import BatchRunner
    from rapid_integrations.engine.rapid_engine import RapidEngine

log = logging.getLogger("rapid")

Item = Delta | RapidOutput | Exception
"""What a call's sink receives: its `Delta`s, then its output or its error."""
Sink = Callable[[Item], None]
Event = tuple[int, Delta | RapidOutput] | None
"""An event of `Batcher.events`: None once every call is planned, then (call index, item)."""


def _ignore(value: int) -> None:
    """A gauge nobody reads."""


@dataclass(frozen=True)
class Gauges:
    """What a batcher reports as it runs (a server's metrics); nothing by default.

    size: the calls in the runner, after each change; step_tokens: the tokens one step's
    passes read (prefill chunks, pending tokens, drafts); open_calls: +1 as a call joins,
    -1 as it leaves (its KV caches alive in between)."""

    size: Callable[[int], None] = _ignore
    step_tokens: Callable[[int], None] = _ignore
    open_calls: Callable[[int], None] = _ignore


class Batcher:
    """One `BatchRunner` over an engine, stepped on one thread for every call."""

    def __init__(self, runner: BatchRunner, gauges: Gauges | None = None) -> None:
        self._runner = runner
        self._gauges = gauges or Gauges()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rapid-batch")
        self._sinks: dict[int, Sink] = {}  # the calls in the runner (worker thread only)
        self._stepping = False  # a step job is queued or running (worker thread only)
        self._worker: int | None = None  # the worker thread's id, once it has run a submit

    @classmethod
    def over(
        cls,
        engine: RapidEngine,
        gauges: Gauges | None = None,
        refused: Callable[[RapidConfigError], None] = lambda exc: None,
    ) -> Batcher | None:
        """A batcher over `engine`, or None where its models cannot be packed (`refused`
        is told why: each call then decodes by itself)."""
        from rapid_integrations.batching.runner import (
            BatchRunner,  # torch loads with the first call, not with the adapters
        )
        from rapid_integrations.spec_decode.batch_caps import BatchCosts

        try:
            # Speculation adapts to load (docs/algorithm.md section 14.2).
            return cls(BatchRunner(engine, BatchCosts()), gauges)
        except RapidConfigError as exc:
            refused(exc)
            return None

    def stream(self, prompt: Prompt, options: CallOptions) -> RapidStream:
        """`engine.stream(prompt, options=options)` as a call of the batch: planned now (bad
        input raises here), its deltas as the steps commit them. Closing the stream (or
        dropping it) cancels the call."""
        events = self._call(prompt, options)
        next(events)  # planned; from here on, closing the generator cancels the call
        return RapidStream(cast(Generator[Delta, None, RapidOutput], events))

    async def events(
        self, prompt: Prompt, choices: Sequence[CallOptions]
    ) -> AsyncGenerator[Event, None]:
        """The events of one call per entry of `choices`, all on `prompt`: None once all are
        planned (bad input raises before), then (index in `choices`, `Delta` or
        `RapidOutput`) as the steps commit them, until every call has ended; a call's error
        raises. Closing the generator early (the request went away) cancels every call."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[tuple[int, Item]] = asyncio.Queue()
        ids: list[int] = []
        try:
            for index, options in enumerate(choices):
                sink = _loop_sink(loop, items, index)
                ids.append(await self._submitted(prompt, options, sink))
            yield None
            left = len(ids)  # calls not ended
            while left:
                index, item = await items.get()
                if isinstance(item, Exception):
                    raise item
                left -= isinstance(item, RapidOutput)
                yield index, item
        finally:
            for call_id in ids:
                self._later(self._cancel, call_id)  # a no-op for a call that has ended

    def close(self) -> None:
        """Stop the worker thread once the job in flight is done (the server shuts down)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _call(
        self, prompt: Prompt, options: CallOptions
    ) -> Generator[Delta | None, None, RapidOutput]:
        """One call for a thread: None once it is planned, then its deltas; returns its
        output, raises its error; cancels it when closed before its end."""
        items: queue.SimpleQueue[Item] = queue.SimpleQueue()
        future = self._pool.submit(self._submit, prompt, options, items.put)
        try:
            call_id = future.result()
        except BaseException:
            self._later(self._cancel_submitted, future)  # interrupted: cancel it once it is in
            raise
        item: Item | None = None
        try:
            yield None
            while isinstance(item := items.get(), Delta):
                yield item
            if isinstance(item, Exception):
                raise item
            return item
        finally:
            if item is None or isinstance(item, Delta):  # closed before its end
                self._cancel_now(call_id)

    async def _submitted(self, prompt: Prompt, options: CallOptions, sink: Sink) -> int:
        """Submit the call on the worker thread (its planning errors raise here); if the
        consumer goes away meanwhile, the call is cancelled as soon as it is in."""
        future = self._pool.submit(self._submit, prompt, options, sink)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._later(self._cancel_submitted, future)  # runs after the submit: FIFO
            raise

    def _cancel_now(self, call_id: int) -> None:
        """Cancel the call and wait until it is (after at most the step in flight), so that a
        closed stream has freed its caches, as `engine.stream`'s has. On the worker thread (a
        stream collected there) the cancel is queued: waiting there would never end."""
        with contextlib.suppress(RuntimeError):  # shut down: the runner steps no more
            cancelled = self._pool.submit(self._cancel, call_id)
            if threading.get_ident() != self._worker:
                cancelled.result()

    def _later(self, job: Callable[..., Any], *args: Any) -> None:
        """Queue `job` on the worker thread without waiting for it (none after shutdown)."""
        with contextlib.suppress(RuntimeError):
            self._pool.submit(job, *args)

    # ---- the worker thread -------------------------------------------------------------------

    def _submit(self, prompt: Prompt, options: CallOptions, sink: Sink) -> int:
        self._worker = threading.get_ident()
        call_id = self._runner.submit(prompt, options=options)
        self._sinks[call_id] = sink
        self._gauges.open_calls(1)
        self._sized()
        if not self._stepping:
            self._stepping = True
            self._later(self._step)
        return call_id

    def _step(self) -> None:
        """One step of the runner; each call's deltas, and its end, go to its sink. The next
        step is queued after the jobs that came meanwhile, until no call is left."""
        if not self._sinks:
            self._stepping = False
            return
        try:
            tokens = self._runner.step()
        except Exception as exc:  # not a call's failure (the runner keeps those): fail all
            for call_id, sink in list(self._sinks.items()):
                sink(exc)
                self._cancel(call_id)
        else:
            if tokens:  # no pass ran: only calls that failed as they were submitted
                self._gauges.step_tokens(tokens)
            for call_id in list(self._sinks):
                self._report(call_id)
            self._sized()
        self._later(self._step)

    def _report(self, call_id: int) -> None:
        runner, sink = self._runner, self._sinks[call_id]
        for delta in runner.take_deltas(call_id):
            sink(delta)
        end: Item | None = runner.outputs.pop(call_id, None)
        if end is None:
            end = runner.errors.pop(call_id, None)
        if end is not None:
            sink(end)
            self._left(call_id)

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
        self._gauges.open_calls(-1)

    def _sized(self) -> None:
        self._gauges.size(len(self._runner.running))


def _loop_sink(
    loop: asyncio.AbstractEventLoop, items: asyncio.Queue[tuple[int, Item]], index: int
) -> Sink:
    """A sink that hands a call's items, tagged with its `index`, to `items` on `loop`."""

    def sink(item: Item) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            loop.call_soon_threadsafe(items.put_nowait, (index, item))

    return sink


# ---- one batcher per engine, shared by the adapters' calls ---------------------------------------

_SHARED: weakref.WeakValueDictionary[int, Batcher] = weakref.WeakValueDictionary()
"""The batcher of each engine (by id) while any of its calls holds it: an engine's id is not
reused while its batcher, whose runner holds the engine, is alive."""
_REFUSED: weakref.WeakSet[RapidEngine] = weakref.WeakSet()  # engines whose models cannot pack
_SHARING = threading.Lock()


def batched_stream(engine: RapidEngine, prompt: Prompt, options: CallOptions) -> RapidStream:
    """`engine.stream(prompt, options=options)`, decoded in one batch with every other call
    made here on `engine` at the same time, from any thread; alone where the engine's models
    cannot be packed (the server's condition, `BatchRunner`'s check). Its output is the one
    `engine.stream` gives (docs/algorithm.md section 14)."""
    batcher = _shared(engine)
    if batcher is None:
        return engine.stream(prompt, options=options)
    return batcher.stream(prompt, options)


def _shared(engine: RapidEngine) -> Batcher | None:
    """The engine's batcher (made on first use, once, even under concurrent calls), or None
    where its models cannot be packed (logged once per engine)."""
    with _SHARING:
        if engine in _REFUSED:
            return None
        batcher = _SHARED.get(id(engine))
        if batcher is None:
            batcher = Batcher.over(engine, refused=lambda exc: _refuse(engine, exc))
            if batcher is not None:
                _SHARED[id(engine)] = batcher
        return batcher


def _refuse(engine: RapidEngine, exc: RapidConfigError) -> None:
    _REFUSED.add(engine)
    log.info("rapid: calls on this engine decode one at a time, not batched: %s", exc)
