"""The FastAPI app: OpenAI-compatible routes over one `RapidEngine`.

    POST /v1/chat/completions   chat, streamed over SSE with stream=true
    POST /v1/completions        plain-text prompts (or token ids)
    POST /v1/responses          the Responses API (stateless), streamed as its events
    GET  /v1/models             the served model
    GET  /metrics               Prometheus text format
    GET  /health                liveness; the only route open without the API key

Each request takes a slot of the `SequenceQueue` per choice (`n`; `max_running` slots: the
batch size), then its calls join the server's batch (`rapid_integrations.batching.batcher.Batcher`: one
forward pass per model and step for every running call). Where the engine's models cannot be
packed, each request decodes in a worker thread of its own instead (`aio.aiter_in_thread`),
its choices one after another. The engine plans the call before
the response starts, so a bad prompt or option is an HTTP error, never a broken stream. A
client that goes away (or a request past its timeout) has its call cancelled after at most
the step in flight, which frees its KV caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import anyio
from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse

from rapid_integrations.adapters.aio import aiter_in_thread
from rapid_integrations.batching.batcher import Batcher, Event, Gauges
from rapid_integrations.engine.call_options import CallOptions
from rapid_integrations.engine.rapid_engine import RapidEngine
from rapid_integrations.errors import RapidConfigError
from rapid_integrations.output.outputs import Delta, RapidOutput

from .calls import (
    FINISH_REASONS,
    EngineCall,
    chat_call,
    check_choices,
    choice_options,
    chunk,
    completion_call,
    delta_chunks,
    response,
    usage_chunk,
)
from .collection import Collection
from .errors import ServeError, classify, install_error_handlers
from .metrics import Metrics, RequestCounter
from .openapi import (
    GET_ERRORS,
    ChatCompletion,
    Completion,
    Health,
    ModelList,
    ResponseObject,
    post_responses,
)
from .responses import ResponseEvents, response_object, responses_call
from .scheduler import Lease, SequenceQueue
from .schemas import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from .settings import ServeSettings, process_replica_id

_T = TypeVar("_T")
log = logging.getLogger("rapid.serve")
SSE_PING_SECONDS = 15
"""Keep-alive comments on idle streams (a long prefill), so proxies do not drop them."""


@dataclass
class _Server:
    """What the routes share: the engine, its queue and metrics, the served collections."""

    engine: RapidEngine
    settings: ServeSettings
    collections: dict[str, Collection]
    replica: str
    metrics: Metrics = field(default_factory=Metrics)
    queue: SequenceQueue = field(init=False)
    batcher: Batcher | None = field(init=False)  # None: a thread per request

    def __post_init__(self) -> None:
        self.queue = SequenceQueue(
            self.settings.max_running, self.settings.max_waiting, self.metrics.queue_changed
        )
        metrics = self.metrics  # looked up at each report: tests patch the gauges' methods
        gauges = Gauges(
            size=lambda calls: metrics.batch_size.set(calls),
            step_tokens=lambda tokens: metrics.step_tokens.observe(tokens),
            open_calls=lambda change: metrics.open_streams.inc(change),
        )
        self.batcher = Batcher.over(self.engine, gauges, _refused)

    def events(self, call: EngineCall) -> AsyncGenerator[Event, None]:
        """The events of the call's choices, decoded in the batch (or in a thread of its own)."""
        choices = choice_options(call)
        if self.batcher is not None:
            return self.batcher.events(call.prompt, choices)
        return aiter_in_thread(lambda: _decode(self, call, choices))

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """The batch's worker thread ends with the app."""
        yield
        if self.batcher is not None:
            self.batcher.close()


def create_app(
    engine: RapidEngine,
    settings: ServeSettings | None = None,
    *,
    collections: dict[str, Collection] | None = None,
    replica: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over `engine`. `collections` default to loading
    `settings.collections`; `replica` names this process in `usage.rapid.replica`."""
    settings = settings or ServeSettings()
    if collections is None:
        collections = settings.load_collections(engine)
    server = _Server(engine, settings, collections, replica or process_replica_id())
    app = FastAPI(
        title="rapid serve", description="OpenAI-compatible RAPID server", lifespan=server.lifespan
    )
    app.state.server = server
    install_error_handlers(app)
    app.add_middleware(RequestCounter, metrics=server.metrics)

    @app.get("/health", responses={200: {"model": Health}})
    async def health() -> dict[str, str]:
        return {"status": "ok", "replica": server.replica}

    router = APIRouter(dependencies=[Depends(_api_key_check(settings.api_key))])

    @router.get("/v1/models", responses={200: {"model": ModelList}, **GET_ERRORS})
    async def models() -> dict[str, Any]:
        card = {
            "id": settings.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "rapid-integrations",
            "root": engine.model_name,
            "max_model_len": engine.context_window,
        }
        return {"object": "list", "data": [card]}

    @router.post(
        "/v1/chat/completions",
        responses=post_responses(ChatCompletion, "`chat.completion.chunk` objects, then [DONE]"),
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _answer(server, chat_call(body, server.collections), request)

    @router.post(
        "/v1/completions",
        responses=post_responses(Completion, "`text_completion` chunks, then [DONE]"),
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _answer(server, completion_call(body, server.collections), request)

    @router.post(
        "/v1/responses",
        responses=post_responses(ResponseObject, "the Responses API's events"),
    )
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await _answer(server, responses_call(body, server.collections), request)

    @router.get("/metrics", response_class=PlainTextResponse, responses=GET_ERRORS)
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(router)
    return app


def _api_key_check(key: str | None) -> Any:
    """A dependency requiring `Authorization: Bearer <key>` (none when `key` is None)."""

    async def check(authorization: str | None = Header(default=None)) -> None:
        if key is None:
            return
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), key.encode()):
            raise ServeError(
                401,
                "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return check


async def _answer(server: _Server, call: EngineCall, request: Request) -> Response:
    """Queue, plan and run `call`; a streamed or a whole response."""
    if call.model != server.settings.served_model_name:
        raise ServeError(
            404,
            f"model {call.model!r} not found; this server serves {server.settings.served_model_name!r}",
            param="model",
            code="model_not_found",
        )
    check_choices(call.n, server.settings.max_running)
    run = _Run(server, call, time.perf_counter())
    lease = await server.queue.enter(run.seconds_left(), call.n)
    run.start(server.events(call), lease)
    handed_over = False  # to the streamed response, which closes the run when it ends
    try:
        await run.plan()  # bad input raises here, before any byte of the response
        if call.stream:
            handed_over = True
            return _EventStream(run)
        body = await _unless_disconnected(request, run.whole())
        return JSONResponse(body) if body is not None else Response(status_code=499)
    finally:
        if not handed_over:
            await run.close()


def _refused(exc: RapidConfigError) -> None:
    log.warning("rapid serve: requests decode one per thread, not batched: %s", exc)


def _decode(
    server: _Server, call: EngineCall, choices: list[CallOptions]
) -> Generator[Event, None, None]:
    """Worker thread (a request's own, where the batch cannot run): None once the first choice
    is planned (the others differ by their seed only), then each choice's (index, `Delta`)s
    and (index, output), one choice after another.
    Closing it (the consumer left) closes the engine stream, freeing its caches."""
    server.metrics.open_streams.inc()
    try:
        for index, options in enumerate(choices):
            with server.engine.stream(call.prompt, options=options) as stream:
                if index == 0:
                    yield None
                yield from ((index, delta) for delta in stream.deltas())
                yield index, cast(RapidOutput, stream.output)
    finally:
        server.metrics.open_streams.dec()


class _Run:
    """One admitted request: its events, its slot, its deadline and its metrics."""

    def __init__(self, server: _Server, call: EngineCall, arrived: float) -> None:
        self.server = server
        self.call = call
        self.arrived = arrived
        self.deadline = arrived + server.settings.request_timeout
        self.events: AsyncGenerator[Any, None] | None = None
        self.lease: Lease | None = None

    def seconds_left(self) -> float:
        return max(0.0, self.deadline - time.perf_counter())

    async def within_deadline(self, step: Awaitable[_T]) -> _T:
        # anyio's deadline, not `asyncio.wait_for`: before Python 3.12, wait_for swallows a
        # cancellation (the client went away) that lands as `step` completes, and the request
        # then decoded to its end for nobody.
        try:
            with anyio.fail_after(self.seconds_left()):
                return await step
        except TimeoutError:
            raise classify(TimeoutError()) from None

    def start(self, events: AsyncGenerator[Any, None], lease: Lease) -> None:
        self.events, self.lease = events, lease

    async def plan(self) -> None:
        """Wait for the engine to plan the call (its first event)."""
        assert self.events is not None
        await self.within_deadline(anext(self.events))

    async def deltas(self) -> AsyncIterator[tuple[int, Delta | RapidOutput]]:
        """Each choice's (index, `Delta`)s, then its (index, `RapidOutput`), until every
        choice has ended; the slots and the streams are released at the end however it ends
        (done, failed, timed out, cancelled by a disconnect)."""
        assert self.events is not None and self.lease is not None
        metrics = self.server.metrics
        first, left = True, self.call.n  # choices not ended
        try:
            while left:
                event = await self.within_deadline(anext(self.events))
                assert event is not None  # the planned event came first (`plan`)
                if first:
                    metrics.time_to_first_token.observe(time.perf_counter() - self.arrived)
                    first = False
                yield event
                if isinstance(event[1], RapidOutput):
                    metrics.finished(event[1], time.perf_counter() - self.arrived)
                    left -= 1
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop the engine stream and give back the slot (idempotent)."""
        if self.events is not None:
            await self.events.aclose()
        if self.lease is not None:
            self.lease.release()

    async def whole(self) -> dict[str, Any]:
        ended = {
            index: item async for index, item in self.deltas() if isinstance(item, RapidOutput)
        }
        outputs = [ended[index] for index in range(self.call.n)]
        if self.call.kind == "responses":
            return response_object(self.call, outputs[0], self.server.replica)
        return response(self.call, outputs, self.server.replica)

    async def sse(self) -> AsyncIterator[str]:
        """Server-sent events: the chunks, then `[DONE]`; an error mid-stream is one event in
        the OpenAI error shape (the SDK raises it), and the stream ends."""
        call = self.call
        asked = bool(call.options.config.get("logprobs"))
        # Per choice: where its next chunk's tokens start in its text (completions' text_offset).
        offsets = [0] * call.n
        ended: dict[int, RapidOutput] = {}
        try:
            if call.kind == "chat":
                for index in range(call.n):
                    yield _json(chunk(call, role=True, index=index))
            async for index, item in self.deltas():
                if isinstance(item, Delta):
                    entries = item.logprobs if asked else None
                    for piece in delta_chunks(call, item, entries, offsets[index], index):
                        yield _json(piece)
                    offsets[index] += sum(len(e.token) for e in item.logprobs)
                else:
                    yield _json(chunk(call, finish=_finish_reason(item), index=index))
                    ended[index] = item
            if call.include_usage:
                outputs = [ended[index] for index in range(call.n)]
                yield _json(usage_chunk(call, outputs, self.server.replica))
            yield "[DONE]"
        except Exception as exc:
            yield _json(classify(exc).body())

    async def response_events(self) -> AsyncIterator[dict[str, str]]:
        """The Responses API's events (each named by its type, as OpenAI sends them); an error
        mid-stream is an `error` event, and the stream ends."""
        events = ResponseEvents(self.call, self.server.replica)
        try:
            for event in events.start():
                yield _named(event)
            async for _, item in self.deltas():  # one choice
                batch = events.delta(item) if isinstance(item, Delta) else events.finish(item)
                for event in batch:
                    yield _named(event)
        except Exception as exc:
            yield _named(events.error(classify(exc)))


class _EventStream(EventSourceResponse):
    """The SSE response of a run; closes the run however the response ends, even when the
    client left before the first event (the events' own cleanup never ran then)."""

    def __init__(self, run: _Run) -> None:
        events = run.response_events() if run.call.kind == "responses" else run.sse()
        super().__init__(events, ping=SSE_PING_SECONDS)
        self.run = run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.run.close()


def _finish_reason(output: RapidOutput) -> str:
    return FINISH_REASONS[output.finish_reason]


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _named(event: dict[str, Any]) -> dict[str, str]:
    return {"event": event["type"], "data": _json(event)}


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T | None:
    """`await work`, cancelled (and None returned) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
