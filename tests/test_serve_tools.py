"""Tools and structured output over `rapid serve`: OpenAI `tools` / `tool_choice` /
`response_format` reach the engine's tool calling and grammars (docs/algorithm.md sections
10-11), calls come back as OpenAI `tool_calls` (whole, or streamed as deltas the SDK merges),
and everything equals the in-process engine's output for the same call.

The tiny model writes JSON with a character tokenizer that has JSON's characters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from rapid_integrations import RapidEngine
from rapid_integrations.grammar import Grammar
from tests.serve_fixtures import DTYPE, MODEL, live_server, save_tiny_model
from tests.tiny import json_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hour"],
        },
    },
}
CHAT = [{"role": "user", "content": "weather in paris"}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 5}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
}


@pytest.fixture(scope="module")
def json_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-json-model"), json_tokenizer())


@pytest.fixture(scope="module")
def json_reference(json_model_dir: Path) -> RapidEngine:
    return RapidEngine(str(json_model_dir), dtype=DTYPE, device="cpu")


@pytest.fixture(scope="module")
def client(json_model_dir: Path) -> Iterator[openai.OpenAI]:
    with live_server(json_model_dir) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def openai_calls(reference_output: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, c.arguments) for c in reference_output.tool_calls]


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "set_alarm"}}],
    ids=["required", "named"],
)
def test_tool_calls_equal_the_engine(
    client: openai.OpenAI, json_reference: RapidEngine, tool_choice: Any
) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=[WEATHER, ALARM], tool_choice=tool_choice, max_tokens=80
    )
    expected = json_reference.generate(
        CHAT, tools=[WEATHER, ALARM], tool_choice=tool_choice, max_new_tokens=80
    )
    assert expected.tool_calls, "the grammar forces at least one call"
    message = out.choices[0].message
    got = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert got == openai_calls(expected)
    assert all(c.id and c.type == "function" for c in message.tool_calls)
    assert out.choices[0].finish_reason == "tool_calls"
    if isinstance(tool_choice, dict):
        assert {name for name, _ in got} == {"set_alarm"}


def test_streamed_tool_calls_merge_into_the_engines_calls(
    client: openai.OpenAI, json_reference: RapidEngine
) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=80,
            stream=True,
        )
    )
    merged: dict[int, dict[str, str]] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = merged.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    expected = json_reference.generate(
        CHAT, tools=[WEATHER], tool_choice="required", max_new_tokens=80
    )
    got = [(e["name"], json.loads(e["arguments"])) for _, e in sorted(merged.items())]
    assert got == openai_calls(expected)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "<tool_call>" not in "".join(c.choices[0].delta.content or "" for c in chunks)


def test_a_tool_result_turn_is_accepted(client: openai.OpenAI, json_reference: RapidEngine) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "paris"}'},
    }
    messages = [
        *CHAT,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=10
    )
    expected = json_reference.generate(
        messages, tools=[WEATHER], tool_choice="none", max_new_tokens=10
    )
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("response_format", "grammar"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
            Grammar.json_schema(SCHEMA),
        ),
        ({"type": "json_object"}, Grammar.json_object()),
    ],
    ids=["json_schema", "json_object"],
)
def test_response_format_constrains_the_output_like_the_engine(
    client: openai.OpenAI, json_reference: RapidEngine, response_format: dict, grammar: Grammar
) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, response_format=response_format, max_tokens=60
    )
    expected = json_reference.generate(CHAT, grammar=grammar, max_new_tokens=60)
    assert out.choices[0].message.content == expected.text
    if expected.finish_reason != "length":
        value = json.loads(out.choices[0].message.content)
        assert isinstance(value, dict)
        if response_format["type"] == "json_schema":
            assert set(value) == {"answer", "sure"} and isinstance(value["sure"], bool)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
    ],
)
def test_bad_response_formats_are_422(client: openai.OpenAI, body: dict, param: str) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body=body)
    assert info.value.body["param"] == param


def test_bad_tools_are_400_with_the_engines_message(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="tool"):
        client.chat.completions.create(
            model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice="send_email"
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, tools=[{"type": "function"}])


def test_langchain_bind_tools_gets_the_engines_calls(
    json_model_dir: Path, json_reference: RapidEngine
) -> None:
    from langchain_openai import ChatOpenAI

    with live_server(json_model_dir) as server:
        llm = ChatOpenAI(
            model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=80
        )
        message = llm.bind_tools([WEATHER], tool_choice="required").invoke("weather in paris")
    expected = json_reference.generate(
        CHAT, tools=[WEATHER], tool_choice="required", max_new_tokens=80
    )
    assert [(c["name"], c["args"]) for c in message.tool_calls] == openai_calls(expected)
