"""Blocking generators consumed from asyncio, for the framework adapters' async methods.

Decoding blocks (Python and torch calls), an event loop must not. Each stream runs in a thread
of its own rather than in the loop's shared executor: an abandoned stream's thread then ends
by itself, and a long prefill never holds a pool slot that other calls wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import AsyncGenerator, Callable, Generator
from typing import Any, TypeVar

_T = TypeVar("_T")
_DONE = object()


async def aiter_in_thread(
    make: Callable[[], Generator[_T, None, None]],
) -> AsyncGenerator[_T, None]:
    """Iterate the generator `make()` in a worker thread without blocking the event loop.

    Items cross to the loop through a queue. If the consumer stops early (break, cancellation,
    an exception), the worker stops at its next item and closes the generator in its own
    thread (closing it from the loop's thread while a step runs would fail), so an abandoned
    generation frees its caches after at most one more step, and the thread ends.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()
    cancelled = threading.Event()

    def send(item: Any, error: BaseException | None = None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody listens
            loop.call_soon_threadsafe(queue.put_nowait, (item, error))

    def produce() -> None:
        try:
            with contextlib.closing(make()) as items:
                for item in items:
                    if cancelled.is_set():
                        return
                    send(item)
            send(_DONE)
        except BaseException as error:  # handed to the consumer, who re-raises it
            send(_DONE, error)

    # The context is copied so that callbacks and tracing see the caller's context variables.
    # Not a daemon: at exit the interpreter waits for the step in flight (killing a thread
    # inside torch aborts the process) and the worker, told to stop, ends after it.
    context = contextvars.copy_context()
    worker = threading.Thread(target=context.run, args=(produce,), name="rapid-stream")
    worker.start()
    try:
        while True:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        # Not joined on early exit: a worker inside a long prefill would delay the consumer;
        # it notices `cancelled` at its next item and ends on its own.
        cancelled.set()
