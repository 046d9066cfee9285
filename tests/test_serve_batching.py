"""`rapid serve` decodes its running requests together on one `BatchRunner` (docs/serving.md):
concurrent requests share its steps and each answer is still the engine's own for that
request; a request that goes away frees its slot and its KV and changes no other answer;
models the runner cannot pack fall back to a thread per request.

The servers run in this process with a slowed-down forward, so that requests overlap.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import Gauge

from rapid_integrations import RapidEngine, RapidOutput
from rapid_integrations.grammar import Grammar
from rapid_integrations.serve import ServeSettings, create_app
from rapid_integrations.serve.calls import FINISH_REASONS
from tests.hardening import patched_forward, slow_down, track_caches
from tests.serve_fixtures import (
    DTYPE,
    MODEL,
    LiveServer,
    live_server,
    metric,
    metrics_of,
    save_tiny_model,
    wait_until,
)
from tests.test_serve_faults import LONG, SHORT, in_thread
from tests.test_serve_tools import JSON_SCHEMA_FORMAT, SCHEMA, TOOLS, api_calls, engine_calls
from tests.tiny import JSON_ALPHABET, char_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

STEP_SECONDS = 0.01  # added to every forward pass, so that the requests overlap
GREEDY = {"temperature": 0.0}
WEATHER = [{"role": "user", "content": "weather in paris"}]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# (messages, the request's options, the engine's options for the same call)
CHATS: list[tuple[list[dict[str, str]], dict[str, Any], dict[str, Any]]] = [
    (chat("a bad cafe"), {"max_tokens": 12}, {"max_new_tokens": 12}),
    (chat("deal a face. jade"), {"max_tokens": 30}, {"max_new_tokens": 30}),
    (
        WEATHER,
        {"tools": TOOLS, "tool_choice": "required", "max_tokens": 100},
        {"tools": TOOLS, "tool_choice": "required", "max_new_tokens": 100},
    ),
    (
        chat("is the lake jade?"),
        {"response_format": JSON_SCHEMA_FORMAT, "max_tokens": 60},
        {"grammar": Grammar.json_schema(SCHEMA), "max_new_tokens": 60},
    ),
]
STREAMED = (chat("a cab by the lake"), 20)
COMPLETION = ("jade lake", 16)


@pytest.fixture(scope="module")
def json_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose tokenizer writes JSON (tools, response_format)."""
    tok = char_tokenizer(JSON_ALPHABET + "\n")
    return save_tiny_model(tmp_path_factory.mktemp("tiny-batch-model"), tok, window=2048)


@pytest.fixture(scope="module")
def json_server(json_model_dir: Path) -> Iterator[LiveServer]:
    with live_server(json_model_dir, max_running=8) as live:
        yield live


def recorded(gauge: Gauge, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every value `gauge` is set to from now on."""
    values: list[float] = []
    set_value = gauge.set

    def recording(value: float) -> None:
        values.append(value)
        set_value(value)

    monkeypatch.setattr(gauge, "set", recording)
    return values


async def streamed_chat(
    client: openai.AsyncOpenAI, messages: list[dict[str, str]], max_tokens: int
) -> tuple[str, str | None]:
    """A streamed chat's text and finish reason."""
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, stream=True, **GREEDY
    )
    text, finish = "", None
    async for piece in stream:
        text += piece.choices[0].delta.content or ""
        finish = piece.choices[0].finish_reason or finish
    return text, finish


def finish_of(output: RapidOutput) -> str:
    return FINISH_REASONS[output.finish_reason]


async def test_concurrent_requests_share_steps_and_each_equals_the_engine(
    json_server: LiveServer, json_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chats of different prompts and lengths, one with tools, one with a response_format, a
    streamed one and a completion, sent at once: each answer is the engine's own."""
    sizes = recorded(json_server.app.state.server.metrics.batch_size, monkeypatch)
    client = openai.AsyncOpenAI(base_url=json_server.url + "/v1", api_key="x", max_retries=0)
    with patched_forward(json_server.engine.target, slow_down(STEP_SECONDS)):
        *answers, streamed, completion = await asyncio.gather(
            *(
                client.chat.completions.create(model=MODEL, messages=m, **GREEDY, **options)
                for m, options, _ in CHATS
            ),
            streamed_chat(client, *STREAMED),
            client.completions.create(
                model=MODEL, prompt=COMPLETION[0], max_tokens=COMPLETION[1], **GREEDY
            ),
        )
    assert max(sizes) > 1, "the requests shared steps"
    assert sizes[-1] == 0
    engine = RapidEngine(str(json_model_dir), dtype=DTYPE, device="cpu")
    for (messages, _, options), answer in zip(CHATS, answers, strict=True):
        expected = engine.generate(messages, **GREEDY, **options)
        message = answer.choices[0].message
        assert api_calls(message) == engine_calls(expected)
        assert (message.content or "") == expected.text
        assert answer.choices[0].finish_reason == finish_of(expected)
        assert answer.usage.completion_tokens == len(expected.token_ids)
    assert api_calls(answers[2].choices[0].message), "the tool request made a call"
    expected = engine.generate(STREAMED[0], max_new_tokens=STREAMED[1], **GREEDY)
    assert streamed == (expected.text, finish_of(expected))
    expected = engine.generate(
        COMPLETION[0], max_new_tokens=COMPLETION[1], reasoning=False, **GREEDY
    )
    assert completion.choices[0].text == expected.text
    assert completion.usage.completion_tokens == len(expected.token_ids)


def test_a_cancelled_stream_frees_its_slot_and_changes_no_other_answer(
    served_model_dir: Path, reference: RapidEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two slots: a long stream is dropped mid-way while another request decodes beside it;
    its call leaves the batch (slot, KV), a newcomer takes the slot, and the other two
    answers are the engine's own."""
    caches = track_caches(monkeypatch)
    other = {**LONG, "messages": chat("deal a face"), "max_tokens": 120}
    with live_server(served_model_dir, max_running=2, max_waiting=0) as server:
        url = server.url + "/v1/chat/completions"
        sizes = recorded(server.app.state.server.metrics.batch_size, monkeypatch)
        with patched_forward(server.engine.target, slow_down(STEP_SECONDS)):
            thread, out = in_thread(lambda: httpx.post(url, json=other, timeout=60))
            assert wait_until(lambda: metric(metrics_of(server), "rapid_batch_size") == 1)
            with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as r:
                lines = (line for line in r.iter_lines() if line.startswith("data:"))
                assert [next(lines) for _ in range(4)]  # a few chunks in: both calls decode
                assert metric(metrics_of(server), "rapid_batch_size") == 2
                assert httpx.post(url, json=SHORT, timeout=60).status_code == 429  # both held
            # The stream is closed: its call is cancelled while the other decodes on.
            assert wait_until(lambda: metric(metrics_of(server), "rapid_open_streams") == 1, 10)
            assert metric(metrics_of(server), "rapid_running_requests") == 1
            newcomer = httpx.post(url, json=SHORT, timeout=60)
            assert thread.is_alive(), "the other request was still decoding"
            thread.join(60)
        assert wait_until(lambda: caches.alive() == 0, 5)
        text = metrics_of(server)
        assert metric(text, "rapid_open_streams") == metric(text, "rapid_batch_size") == 0
    assert max(sizes) == 2
    expected = reference.generate(
        other["messages"], max_new_tokens=120, ignore_eos=True, gamma=2, **GREEDY
    )
    assert out[0].json()["choices"][0]["message"]["content"] == expected.text
    expected = reference.generate(
        SHORT["messages"], max_new_tokens=3, ignore_eos=True, gamma=2, **GREEDY
    )
    assert newcomer.json()["choices"][0]["message"]["content"] == expected.text


def test_models_that_cannot_be_packed_decode_a_request_per_thread(
    served_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Eager attention cannot be packed: the server says so once, and serves as before."""
    engine = RapidEngine(
        str(served_model_dir),
        dtype=DTYPE,
        device="cpu",
        model_kwargs={"attn_implementation": "eager"},
    )
    with caplog.at_level(logging.WARNING, logger="rapid.serve"):
        app = create_app(engine, ServeSettings(served_model_name=MODEL))
    assert app.state.server.batcher is None
    said = [r.getMessage() for r in caplog.records if "not batched" in r.getMessage()]
    assert len(said) == 1 and "attention" in said[0]
    body = {"model": MODEL, "messages": chat("a bad cafe"), "max_tokens": 8, **GREEDY}
    with LiveServer(app) as server:
        url = server.url + "/v1/chat/completions"
        whole = httpx.post(url, json=body, timeout=60).json()
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data:")]
        assert wait_until(lambda: metric(metrics_of(server), "rapid_open_streams") == 0, 10)
    expected = engine.generate(body["messages"], max_new_tokens=8, **GREEDY)
    assert whole["choices"][0]["message"]["content"] == expected.text
    assert chunks[-1] == "data: [DONE]"
    deltas = [json.loads(c.removeprefix("data: "))["choices"][0]["delta"] for c in chunks[:-1]]
    assert "".join(d.get("content") or "" for d in deltas) == expected.text
