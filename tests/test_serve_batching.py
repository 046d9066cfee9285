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
from rapid_integrations.serve import ServeSettings, create_app
from rapid_integrations.serve.calls import FINISH_REASONS, choice_seed
from rapid_integrations.structured_output.grammar import Grammar
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
        two = httpx.post(url, json={**body, "n": 2}, timeout=60).json()  # one after another
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data:")]
        assert wait_until(lambda: metric(metrics_of(server), "rapid_open_streams") == 0, 10)
    expected = engine.generate(body["messages"], max_new_tokens=8, **GREEDY)
    assert whole["choices"][0]["message"]["content"] == expected.text
    assert [c["message"]["content"] for c in two["choices"]] == [expected.text] * 2
    assert chunks[-1] == "data: [DONE]"
    deltas = [json.loads(c.removeprefix("data: "))["choices"][0]["delta"] for c in chunks[:-1]]
    assert "".join(d.get("content") or "" for d in deltas) == expected.text


# ---- n > 1: choices are sequences of the batch sharing their prompt --------------------------


def post(server: LiveServer, body: dict[str, Any], route: str = "chat/completions") -> Any:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": MODEL, **body}, timeout=60)


def contents(answer: dict[str, Any]) -> list[str]:
    return [c["message"]["content"] for c in answer["choices"]]


def test_n_greedy_choices_decode_together_and_usage_counts_the_prompt_once(
    json_server: LiveServer, json_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n = 3 chats and n = 2 completions: the choices are sequences of one batch, indexed 0..n-1,
    each the engine's own greedy answer (so all equal, as OpenAI's greedy choices are); usage
    counts the prompt once and every choice's tokens (OpenAI's and vLLM's n > 1 counts)."""
    sizes = recorded(json_server.app.state.server.metrics.batch_size, monkeypatch)
    messages = chat("a bad cafe")
    with patched_forward(json_server.engine.target, slow_down(STEP_SECONDS)):
        answer = post(json_server, {"messages": messages, "max_tokens": 12, "n": 3, **GREEDY})
        text = post(
            json_server, {"prompt": COMPLETION[0], "max_tokens": 8, "n": 2, **GREEDY}, "completions"
        )
    assert max(sizes) == 3, "the three choices shared steps"
    engine = RapidEngine(str(json_model_dir), dtype=DTYPE, device="cpu")
    expected = engine.generate(messages, max_new_tokens=12, **GREEDY)
    answer = answer.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert contents(answer) == [expected.text] * 3
    generated = 3 * len(expected.token_ids)
    assert {
        k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    } == {
        "prompt_tokens": expected.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": expected.prompt_tokens + generated,
    }
    expected = engine.generate(COMPLETION[0], max_new_tokens=8, reasoning=False, **GREEDY)
    text = text.json()
    assert [(c["index"], c["text"]) for c in text["choices"]] == [
        (0, expected.text),
        (1, expected.text),
    ]
    assert text["usage"]["completion_tokens"] == 2 * len(expected.token_ids)


def test_n_sampled_choices_have_seeds_of_their_own_and_repeat_with_the_request_seed(
    json_server: LiveServer, json_model_dir: Path
) -> None:
    """Sampled with a seed: the choices differ, the same request gives them again, choice 0 is
    the n = 1 answer, and choice i is the engine's own answer with the seed derived for it."""
    body = {"messages": chat("deal a face"), "max_tokens": 16, "temperature": 1.0, "seed": 7}
    texts = contents(post(json_server, {**body, "n": 3}).json())
    assert len(set(texts)) == 3, "each choice sampled with its own seed"
    assert contents(post(json_server, {**body, "n": 3}).json()) == texts
    assert contents(post(json_server, body).json()) == texts[:1]
    engine = RapidEngine(str(json_model_dir), dtype=DTYPE, device="cpu")
    for index, text in enumerate(texts):
        seed = choice_seed(7, index)
        assert (
            engine.generate(body["messages"], max_new_tokens=16, temperature=1.0, seed=seed).text
            == text
        )


def test_n_streamed_chunks_carry_their_choice_index_and_usage_comes_last(
    json_server: LiveServer,
) -> None:
    """A streamed n = 2 chat: a role chunk per choice, each choice's deltas, logprobs and
    finish under its own index, reassembling the whole response's choices; the usage chunk,
    last, counts them all."""
    body = {
        "messages": chat("deal a face"),
        "max_tokens": 10,
        "n": 2,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": True,
    }
    whole = post(json_server, body).json()
    streamed = {**body, "model": MODEL, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{json_server.url}/v1/chat/completions", json=streamed) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant"] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    *pieces, last = chunks
    assert (
        last["choices"] == []
        and last["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    )
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in pieces if c["choices"][0]["index"] == choice["index"]]
        assert (
            "".join(c["delta"].get("content") or "" for c in mine) == choice["message"]["content"]
        )
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [choice["finish_reason"]]
        tokens = [t["token"] for c in mine if c["logprobs"] for t in c["logprobs"]["content"]]
        assert tokens == [t["token"] for t in choice["logprobs"]["content"]]


@pytest.mark.parametrize("n", [0, -2, 9])
def test_an_n_out_of_range_is_a_400_naming_it(json_server: LiveServer, n: int) -> None:
    """n below 1, or above the running limit (8 here: every choice is a sequence of the
    batch), is refused in OpenAI's error shape."""
    answer = post(json_server, {"messages": chat("a bad cafe"), "n": n})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "n")
    assert error["code"] in ("integer_below_min_value", "integer_above_max_value")


def test_a_dropped_stream_of_n_choices_cancels_every_choice(
    json_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that leaves an n = 3 stream: all three calls leave the batch, their slots and
    KV caches are freed."""
    caches = track_caches(monkeypatch)
    # Far longer than the wait below: the calls end because they were cancelled.
    body = {**LONG, "messages": chat("deal a face"), "n": 3, "stream": True, "max_tokens": 1000}
    with patched_forward(json_server.engine.target, slow_down(STEP_SECONDS)):
        with httpx.stream("POST", f"{json_server.url}/v1/chat/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data:"))
            assert [next(lines) for _ in range(8)]
            assert metric(metrics_of(json_server), "rapid_batch_size") == 3
            assert metric(metrics_of(json_server), "rapid_running_requests") == 3
        assert wait_until(lambda: metric(metrics_of(json_server), "rapid_open_streams") == 0, 3)
    assert wait_until(lambda: caches.alive() == 0, 3)
    text = metrics_of(json_server)
    assert metric(text, "rapid_batch_size") == metric(text, "rapid_running_requests") == 0
