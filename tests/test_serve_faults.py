"""`rapid serve` under load and faults: a full queue answers 429 with Retry-After, a client that
goes away stops its decoding and frees its caches, timeouts, the API key, graceful shutdown.

Each test runs its own server over a fresh engine whose forward is slowed down (so that
requests overlap), in this process, so that the engine's KV caches can be watched.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import openai
import pytest

from rapid_integrations.serve.app import _Run
from rapid_integrations.serve.errors import ServeError
from rapid_integrations.serve.scheduler import SequenceQueue
from tests.hardening import held_until, patched_forward, slow_down, track_caches
from tests.serve_fixtures import MODEL, live_server, metric, metrics_of, wait_until

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "a cab"}],
    "max_tokens": 200,
    "ignore_eos": True,
    "gamma": 2,
}
MEDIUM = {**LONG, "max_tokens": 40}
SHORT = {**LONG, "max_tokens": 3}
SDK_SHORT = {"model": MODEL, "messages": LONG["messages"], "max_tokens": 3}  # no RAPID fields
STEP_SECONDS = 0.02  # added to every forward pass (a step is gamma + 1 passes)


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    return thread, result


def counting_forward(calls: list[float]) -> Callable[..., Any]:
    """A slowed-down forward that records when each pass ran."""
    slow = slow_down(STEP_SECONDS)

    def around(forward: Any, **kwargs: Any) -> Any:
        calls.append(time.monotonic())
        return slow(forward, **kwargs)

    return around


def test_full_queue_answers_429_with_retry_after(served_model_dir: Path) -> None:
    gate = threading.Event()  # the first request holds the only slot until both refusals are seen
    with live_server(served_model_dir, max_running=1, max_waiting=1) as server:
        with patched_forward(server.engine.target, held_until(gate)):
            try:
                url = server.url + "/v1/chat/completions"
                first, first_out = in_thread(lambda: httpx.post(url, json=MEDIUM, timeout=120))
                assert wait_until(lambda: metric(metrics_of(server), "rapid_running_requests") == 1)
                second, second_out = in_thread(lambda: httpx.post(url, json=SHORT, timeout=120))
                assert wait_until(lambda: metric(metrics_of(server), "rapid_queue_depth") == 1)
                refused = httpx.post(url, json=SHORT, timeout=60)
                assert refused.status_code == 429
                assert int(refused.headers["Retry-After"]) >= 1
                assert refused.json()["error"]["code"] == "queue_full"
                client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
                with pytest.raises(openai.RateLimitError, match="busy"):
                    client.chat.completions.create(**SDK_SHORT)
            finally:
                gate.set()  # a failed assertion must not leave the worker waiting
            first.join(120)
            second.join(120)
        assert first_out[0].status_code == 200
        assert first_out[0].json()["usage"]["completion_tokens"] == 40
        assert second_out[0].status_code == 200  # it waited for the slot
        assert httpx.post(url, json=SHORT, timeout=60).status_code == 200


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_disconnects_stops_decoding_and_frees_its_caches(
    served_model_dir: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    caches = track_caches(monkeypatch)
    passes: list[float] = []
    with live_server(served_model_dir) as server:
        url = server.url + "/v1/chat/completions"
        with patched_forward(server.engine.target, counting_forward(passes)):
            if stream:
                with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as r:
                    lines = r.iter_lines()
                    assert sum(
                        1
                        for line, _ in zip(lines, range(6), strict=False)
                        if line.startswith("data:")
                    )
            else:
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(url, json=LONG, timeout=httpx.Timeout(60, read=0.5))
            # The server notices, and its worker closes the engine stream after the step in flight.
            assert wait_until(lambda: metric(metrics_of(server), "rapid_open_streams") == 0, 10)
            stopped = len(passes)
            time.sleep(10 * (LONG["gamma"] + 1) * STEP_SECONDS)
            assert len(passes) == stopped  # no more forward passes
            assert wait_until(lambda: caches.alive() == 0, 5)
            # 200 tokens take at least 200 passes (gamma drafts + 1 verify for gamma + 1 tokens).
            assert stopped < 100
            text = metrics_of(server)
            assert metric(text, "rapid_completion_tokens_total") == 0  # it never finished
            assert metric(text, "rapid_running_requests") == 0
        assert httpx.post(url, json=SHORT, timeout=60).status_code == 200


def test_requests_past_their_timeout_get_504_and_stop(served_model_dir: Path) -> None:
    with (
        live_server(served_model_dir, request_timeout=0.5) as server,
        patched_forward(server.engine.target, slow_down(STEP_SECONDS)),
    ):
        r = httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        body = {k: v for k, v in LONG.items() if k not in ("ignore_eos", "gamma")}
        stream = client.chat.completions.create(
            **body, stream=True, extra_body={"ignore_eos": True, "gamma": 2}
        )
        with pytest.raises(openai.APIError, match="timed out"):
            for _ in stream:
                pass
        assert wait_until(lambda: metric(metrics_of(server), "rapid_open_streams") == 0, 10)


def test_api_key_guards_every_route_but_health(served_model_dir: Path) -> None:
    with live_server(served_model_dir, api_key="sekret") as server:
        assert httpx.get(server.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(server.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        bearer = {"Authorization": "Bearer sekret"}
        assert httpx.get(server.url + "/metrics", headers=bearer).status_code == 200
        r = httpx.post(server.url + "/v1/chat/completions", json=SHORT)
        assert r.status_code == 401
        wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(**SDK_SHORT)
        right = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)
        assert right.chat.completions.create(**SDK_SHORT).choices[0].finish_reason in (
            "stop",
            "length",
        )


def test_graceful_shutdown_finishes_the_request_in_flight(served_model_dir: Path) -> None:
    with live_server(served_model_dir, shutdown_timeout=60) as server:
        with patched_forward(server.engine.target, slow_down(STEP_SECONDS)):
            body = {**LONG, "max_tokens": 20}
            url = server.url + "/v1/chat/completions"
            request, out = in_thread(lambda: httpx.post(url, json=body, timeout=60))
            assert wait_until(lambda: metric(metrics_of(server), "rapid_running_requests") == 1)
            server.server.should_exit = True
            request.join(60)
            server.thread.join(30)
        assert out[0].status_code == 200
        assert out[0].json()["usage"]["completion_tokens"] == 20
        assert not server.thread.is_alive()
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health")


# A client that goes away cancels its handler. Where the cancel lands in the same event-loop
# tick as the step it waited for completes, `asyncio.wait_for` (Python < 3.12) returned the
# step's result and dropped the cancel: the request then decoded to its end for nobody
# (a CI run saw it: 188 passes of 200). Both waits with a deadline must let the cancel through.


async def test_a_cancel_that_lands_as_an_engine_event_arrives_is_not_lost() -> None:
    settings = SimpleNamespace(request_timeout=60.0)
    run = _Run(cast(Any, SimpleNamespace(settings=settings)), cast(Any, None), time.perf_counter())
    event: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(run.within_deadline(event))
    await asyncio.sleep(0)  # it waits for the event
    event.set_result("delta")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_a_cancel_that_lands_as_a_slot_frees_is_not_lost_nor_holds_the_slot() -> None:
    queue = SequenceQueue(max_running=1, max_waiting=4)
    held = await queue.enter(60)
    waiting = asyncio.ensure_future(queue.enter(60))
    await asyncio.sleep(0)  # it waits for the slot
    held.release()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert (queue.running, queue.waiting) == (0, 0)
    (await asyncio.wait_for(queue.enter(60), 1)).release()  # the slot is free


async def test_a_wait_for_a_slot_past_its_deadline_is_a_504_and_gives_back_what_it_took() -> None:
    queue = SequenceQueue(max_running=2, max_waiting=4)
    held = await queue.enter(60)
    with pytest.raises(ServeError) as refused:
        await queue.enter(0.05, slots=2)  # takes one slot, waits for the other
    assert refused.value.status == 504
    assert (queue.running, queue.waiting) == (1, 0)
    held.release()
    (await asyncio.wait_for(queue.enter(60, slots=2), 1)).release()
