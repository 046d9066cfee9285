"""Log probabilities through a live `rapid serve` (docs/serving.md), read by real clients: the
openai SDK (chat and legacy completions, whole and streamed) and LangChain's `ChatOpenAI`.

The values must be the in-process engine's for the same call (whose own values are checked
against transformers in tests/test_logprobs.py); the shapes are OpenAI's, written out here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from rapid_integrations import RapidEngine, RapidOutput
from tests.serve_fixtures import MODEL, LiveServer, live_server

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

CHAT = [{"role": "user", "content": "a bad cafe. deal a face"}]
SAMPLED = {"temperature": 0.9, "top_p": 0.9, "seed": 7}


@pytest.fixture(scope="module")
def server(served_model_dir: Path) -> Iterator[LiveServer]:
    with live_server(served_model_dir) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_content(reference: RapidEngine, out: RapidOutput) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content` of `out`, built from the tokenizer: token text, its UTF-8
    bytes (one character per token here), the engine's log p, the alternatives likewise."""

    def token(token_id: int, logprob: float) -> dict[str, Any]:
        text = reference.tokenizer.convert_ids_to_tokens(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [
        {
            **token(e.token_id, e.logprob),
            "top_logprobs": [token(t.token_id, t.logprob) for t in e.top_logprobs],
        }
        for e in out.logprobs
    ]


ROUNDING = 1e-5


def alike(got: Any, want: Any) -> bool:
    """Equal, but for floats, which may differ by `ROUNDING`: the server's calls on a prompt
    an earlier test sent read its KV in place (shared-prefix attention, docs/algorithm.md
    section 14.1), and its passes may reduce in another order (thread counts), both of which
    round otherwise than the reference's own call (about 1e-7): float32 rounding, not another
    law."""
    if isinstance(got, float) and isinstance(want, float):
        return abs(got - want) <= ROUNDING
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(alike(got[k], want[k]) for k in got)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(map(alike, got, want))
    return got == want


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "seeded"])
def test_chat_logprobs_whole_and_streamed(client, reference, sampling):
    asked = {"logprobs": True, "top_logprobs": 3, "max_tokens": 12, **sampling}
    out = reference.generate(CHAT, max_new_tokens=12, logprobs=True, top_logprobs=3, **sampling)
    want = chat_content(reference, out)
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, **asked)
    got = [e.model_dump(exclude_none=True) for e in whole.choices[0].logprobs.content]
    assert alike(got, want) and len(want) == len(out.token_ids), (got, want)
    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}, **asked
    ):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += [e.model_dump(exclude_none=True) for e in choice.logprobs.content]
    assert alike(streamed, want), (streamed, want)


def test_chat_without_logprobs_has_none(client):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert plain.choices[0].logprobs is None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, stream=True
    ):
        assert all(c.logprobs is None for c in chunk.choices)


def test_p_hat_logprob_is_an_extension_field_when_asked(client, reference):
    out = reference.generate(CHAT, max_new_tokens=6, logprobs=True, logprobs_p_hat=True, eta=2.0)
    whole = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        logprobs=True,
        extra_body={"logprobs_p_hat": True, "eta": 2.0},
    )
    entries = whole.choices[0].logprobs.content
    got = [e.model_extra["p_hat_logprob"] for e in entries]
    assert alike(got, [e.p_hat_logprob for e in out.logprobs]), got
    assert [e.top_logprobs for e in entries] == [[]] * len(entries)  # top_logprobs 0


def test_completion_logprobs_whole_and_streamed(client, reference):
    prompt = "a bad cafe. deal a"
    out = reference.generate(prompt, max_new_tokens=10, logprobs=True, top_logprobs=2)
    text = [reference.tokenizer.convert_ids_to_tokens(i) for i in out.token_ids]
    want = {
        "tokens": text,
        "token_logprobs": [e.logprob for e in out.logprobs],
        "top_logprobs": [
            {
                reference.tokenizer.convert_ids_to_tokens(t.token_id): t.logprob
                for t in e.top_logprobs
            }
            for e in out.logprobs
        ],
        "text_offset": [len("".join(text[:i])) for i in range(len(text))],
    }
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, logprobs=2)
    assert alike(whole.choices[0].logprobs.model_dump(), want)
    assert whole.choices[0].text == "".join(text) == out.text
    joined: dict[str, list[Any]] = {key: [] for key in want}
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, logprobs=2, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key, values in chunk.choices[0].logprobs.model_dump().items():
                joined[key] += values
    assert alike(joined, want), (joined, want)


def test_out_of_range_top_logprobs_is_the_sdks_bad_request(client):
    for options in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=CHAT, **options)
        assert info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="a cab", logprobs=30)
    assert info.value.body["param"] == "logprobs"


def test_chat_openai_fills_response_metadata_logprobs(server, reference):
    """langchain-openai's own reading of the server: `response_metadata["logprobs"]`, whole
    and added up from streamed chunks."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key="unused",
        max_tokens=8,
        temperature=0.0,
        max_retries=0,
        logprobs=True,
        top_logprobs=2,
    )
    out = reference.generate(CHAT, max_new_tokens=8, logprobs=True, top_logprobs=2)
    want = chat_content(reference, out)
    assert alike(llm.invoke(CHAT).response_metadata["logprobs"]["content"], want)
    total = None
    for chunk in llm.stream(CHAT):
        total = chunk if total is None else total + chunk
    assert alike(total.response_metadata["logprobs"]["content"], want)
