"""`rapid serve` over real HTTP: the OpenAI endpoints, streaming, usage and the RAPID extension
fields, metrics, collections, and every refusal in the OpenAI error shape.

Answers are compared token for token with an in-process engine loaded from the same folder
(greedy and seeded sampling): the server must add nothing to, and lose nothing of, a call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from rapid_integrations import RapidEngine
from rapid_integrations.retrieval import FaissContextRetriever
from rapid_integrations.serve import ServeSettings, create_app
from rapid_integrations.serve.collection import Collection
from tests.retrieval_fixtures import HashingEmbedder
from tests.serve_fixtures import DTYPE, MODEL, LiveServer, metric

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

CHAT = [
    {"role": "system", "content": "be brief."},
    {"role": "user", "content": "a bad cafe. deal a face"},
]
SAMPLED = {"temperature": 0.9, "top_p": 0.9, "seed": 7}
# A document of about 630 characters (tokens, under the character tokenizer), above the
# smallest retrieval budget (512), so that C^S really is retrieved from it.
DOCUMENT = " ".join(
    f"{w} {w[::-1]} held a deal." for w in ("bead", "cafe", "face", "jade", "lake") * 6
)


@pytest.fixture(scope="module")
def server(served_model_dir: Path) -> Iterator[LiveServer]:
    engine = RapidEngine(str(served_model_dir), dtype=DTYPE, device="cpu")
    retriever = FaissContextRetriever(
        DOCUMENT, engine.tokenizer, embedder=HashingEmbedder(), budget=64
    )
    collections = {"lake": Collection("lake", DOCUMENT, retriever)}
    app = create_app(engine, ServeSettings(served_model_name=MODEL), collections=collections)
    with LiveServer(app) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server: LiveServer, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(
        server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60
    )


# ---- answers equal the in-process engine's ---------------------------------------------------


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, SAMPLED], ids=["greedy", "seeded"])
def test_chat_equals_the_engine(
    client: openai.OpenAI, reference: RapidEngine, sampling: dict
) -> None:
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, **sampling)
    expected = reference.generate(CHAT, max_new_tokens=12, **sampling)
    assert out.choices[0].message.content == expected.text
    assert (
        out.choices[0].finish_reason == {"eos": "stop", "length": "length"}[expected.finish_reason]
    )
    assert out.usage.prompt_tokens == expected.prompt_tokens
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == expected.prompt_tokens + len(expected.token_ids)
    stats = out.usage.model_extra["rapid"]
    assert stats["drafted_tokens"] == expected.stats.drafted_tokens
    assert stats["accepted_tokens"] == expected.stats.accepted_tokens
    assert stats["replica"]


def test_streamed_chat_equals_the_engine(client: openai.OpenAI, reference: RapidEngine) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **SAMPLED,
        )
    )
    expected = reference.generate(CHAT, max_new_tokens=12, **SAMPLED)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finished = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finished == [{"eos": "stop", "length": "length"}[expected.finish_reason]]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].usage.model_extra["rapid"]["new_tokens"] == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_counts_the_prompt_tokens_read_from_the_prefix_cache(client: openai.OpenAI) -> None:
    """`usage.prompt_tokens_details.cached_tokens`, where OpenAI reports its prompt cache: the
    target's prompt tokens the engine's prefix cache supplied, which the second of two calls
    on one document reads."""
    messages = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "a deal?"}]
    outs = [
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        for _ in range(2)
    ]
    for out in outs:
        cached = out.usage.model_extra["rapid"]["cached_prefix_tokens"]
        assert out.usage.prompt_tokens_details.cached_tokens == cached
    assert 0 < outs[1].usage.prompt_tokens_details.cached_tokens < outs[1].usage.prompt_tokens


def test_stream_without_include_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stream=True)
    )
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason is not None


async def test_async_client_concurrent_requests_equal_the_engine(
    server: LiveServer, reference: RapidEngine
) -> None:
    import asyncio

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    questions = [
        [{"role": "user", "content": f"deal {w}"}] for w in ("a bad", "jade", "cab", "face")
    ]
    outs = await asyncio.gather(
        *(
            client.chat.completions.create(
                model=MODEL, messages=q, max_tokens=10, seed=i, temperature=0.7
            )
            for i, q in enumerate(questions)
        )
    )
    for i, (q, out) in enumerate(zip(questions, outs, strict=True)):
        assert (
            out.choices[0].message.content
            == reference.generate(q, max_new_tokens=10, seed=i, temperature=0.7).text
        )
    stream = await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == reference.generate(CHAT, max_new_tokens=8).text
    await client.close()


def test_completions_with_stop_and_rapid_options(
    client: openai.OpenAI, reference: RapidEngine
) -> None:
    # The draft reads less than the target, or the call would run as eta 0 (no lean without
    # retrieval, docs/algorithm.md section 1.1).
    options = {"eta": 2.0, "gamma": 3, "mode": "rapid", "ignore_eos": True, "draft_prompt": "cab"}
    out = client.completions.create(
        model=MODEL, prompt="a cab faded", max_tokens=16, extra_body=options
    )
    expected = reference.generate(
        "a cab faded", "cab", max_new_tokens=16, eta=2.0, gamma=3, ignore_eos=True
    )
    assert out.choices[0].text == expected.text
    stats = out.usage.model_extra["rapid"]
    assert (stats["eta"], stats["gamma"], stats["mode"]) == (2.0, 3, "rapid")
    stop = expected.text[3:5]
    cut = client.completions.create(
        model=MODEL, prompt="a cab faded", max_tokens=16, stop=[stop], extra_body=options
    )
    assert cut.choices[0].text == expected.text[: expected.text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="a cab faded", max_tokens=16, stream=True, extra_body=options
    )
    assert "".join(c.choices[0].text for c in streamed) == expected.text


def test_modes_and_draft_prompt_reach_the_engine(
    client: openai.OpenAI, reference: RapidEngine
) -> None:
    for mode in ("sd", "lc", "rag"):
        out = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=8, extra_body={"mode": mode}
        )
        assert out.usage.model_extra["rapid"]["mode"] == mode
        assert (
            out.choices[0].message.content
            == reference.generate(CHAT, mode=mode, max_new_tokens=8).text
        )
    draft = [{"role": "user", "content": "deal"}]
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, extra_body={"draft_prompt": draft, "eta": 3.0}
    )
    expected = reference.generate(CHAT, draft, max_new_tokens=8, eta=3.0)
    assert out.choices[0].message.content == expected.text
    assert (
        out.usage.model_extra["rapid"]["draft_context_tokens"]
        == expected.stats.draft_context_tokens
    )


def test_collection_puts_the_document_before_the_chat_and_retrieves_from_it(
    server: LiveServer, client: openai.OpenAI, reference: RapidEngine
) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, extra_body={"collection": "lake"}
    )
    collection = server.app.state.server.collections["lake"]
    messages = collection.messages(CHAT)
    assert messages[1]["content"].endswith(DOCUMENT) and messages[2] == CHAT[1]
    expected = reference.generate(messages, max_new_tokens=8, retriever=collection.retriever)
    assert out.choices[0].message.content == expected.text
    stats = out.usage.model_extra["rapid"]
    assert stats["target_context_tokens"] == expected.stats.target_context_tokens > len(DOCUMENT)
    assert 0 < stats["retrieved_tokens"] <= 64 and stats["draft_context_tokens"] < 200


def test_models_health_and_metrics(server: LiveServer, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 1024
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    before = metric(httpx.get(server.url + "/metrics").text, "rapid_completion_tokens_total")
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6)
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "rapid_completion_tokens_total") == before + out.usage.completion_tokens
    assert metric(text, "rapid_open_streams") == 0
    assert metric(text, "rapid_queue_depth") == 0
    assert 'rapid_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert "rapid_time_to_first_token_seconds_count" in text


# ---- refusals: the OpenAI error shape, and the server keeps serving ---------------------------

GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "a cab"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ('{"model": "tiny", "messages": [', 400, None, "invalid_json"),
        ("[1, 2]", 400, None, "invalid_json"),
        ({**GOOD, "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
        ({**GOOD, "n": 0}, 400, "n", "integer_below_min_value"),
        ({**GOOD, "n": 99}, 400, "n", "integer_above_max_value"),
        ({**GOOD, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
        ({**GOOD, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs", "invalid_value"),
        ({**GOOD, "top_logprobs": 3}, 400, "top_logprobs", "invalid_value"),
        ({**GOOD, "logprobs_p_hat": True}, 422, "logprobs_p_hat", "invalid_value"),
        ({**GOOD, "presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter"),
        ({**GOOD, "gamma": 0}, 422, "gamma", "invalid_value"),
        ({**GOOD, "temperature": -1}, 422, "temperature", "invalid_value"),
        ({**GOOD, "top_p": 0}, 422, "top_p", "invalid_value"),
        ({**GOOD, "max_tokens": 0}, 422, "max_tokens", "invalid_value"),
        ({**GOOD, "max_completion_tokens": 0}, 422, "max_completion_tokens", "invalid_value"),
        ({**GOOD, "mode": "turbo"}, 422, "mode", "invalid_value"),
        ({**GOOD, "max_tokens": "many"}, 422, "max_tokens", "invalid_value"),
        ({**GOOD, "messages": "hello"}, 422, "messages", "invalid_value"),
        ({**GOOD, "messages": []}, 422, "messages", "invalid_value"),
        (
            {**GOOD, "messages": [{"role": "wizard", "content": "a"}]},
            422,
            "messages.0.role",
            "invalid_value",
        ),
        ({"messages": GOOD["messages"]}, 422, "model", "invalid_value"),
        ({**GOOD, "model": "gpt-4o"}, 404, "model", "model_not_found"),
        ({**GOOD, "collection": "nope"}, 404, "collection", "collection_not_found"),
        (
            {**GOOD, "messages": [{"role": "user", "content": "a " * 600}]},
            400,
            None,
            "context_length_exceeded",
        ),
    ],
    ids=lambda v: str(v)[:40] if not isinstance(v, dict) else None,
)
def test_bad_requests_get_the_openai_error_shape(
    server: LiveServer, body: Any, status: int, param: str | None, code: str
) -> None:
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"] and error["type"]
    assert post(server, "/v1/chat/completions", GOOD).status_code == 200


def test_completion_refusals(server: LiveServer) -> None:
    base = {"model": MODEL, "prompt": "a cab", "max_tokens": 2}
    for extra, param in [
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ]:
        r = post(server, "/v1/completions", {**base, **extra})
        assert (r.status_code, r.json()["error"]["param"]) == (400, param)
    r = post(server, "/v1/completions", {**base, "prompt": [3, 4, 5]})
    assert r.status_code == 200
    r = post(server, "/v1/completions", {**base, "prompt": [3, 10_000]})
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]


def test_sdk_raises_its_own_errors_with_the_message(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="at most"):
        client.chat.completions.create(model=MODEL, messages=CHAT, n=99)
    with pytest.raises(openai.UnprocessableEntityError, match="gamma"):
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"gamma": 100})
    with pytest.raises(openai.NotFoundError, match="tiny"):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="extra_body") as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a " * 600}]
        )
    assert info.value.code == "context_length_exceeded"


def test_completion_with_a_collection(
    server: LiveServer, client: openai.OpenAI, reference: RapidEngine
) -> None:
    out = client.completions.create(
        model=MODEL, prompt="where is the lake?", max_tokens=6, extra_body={"collection": "lake"}
    )
    collection = server.app.state.server.collections["lake"]
    prompt = collection.prompt("where is the lake?")
    assert prompt.startswith("Document (lake):\n" + DOCUMENT)
    expected = reference.generate(prompt, max_new_tokens=6, retriever=collection.retriever)
    assert out.choices[0].text == expected.text
    assert out.usage.model_extra["rapid"]["retrieved_tokens"] > 0
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [3, 4], "collection": "lake"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt")
