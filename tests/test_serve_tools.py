"""Tools and structured output over `rapid serve`: OpenAI `tools` / `tool_choice` /
`response_format` reach the engine's tool calling and grammars (docs/algorithm.md sections
10-11), calls come back as OpenAI `tool_calls` (whole, or streamed as deltas that the openai
SDK and LangChain merge), and everything equals the in-process engine's output for the same
call. Bad tools, choices and schemas get the OpenAI error shape, and the server serves on.

The tiny model writes JSON and the call markup with a character tokenizer that has JSON's
characters and the newline.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from rapid_integrations import RapidEngine, RapidOutput
from rapid_integrations.serve.calls import FINISH_REASONS
from rapid_integrations.structured_output.grammar import Grammar
from rapid_integrations.structured_output.tools import CALL_OPEN
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
from tests.test_tools import MULTIPLY
from tests.tiny import JSON_ALPHABET, char_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

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
TOOLS = [WEATHER, ALARM]
NAMED = {"type": "function", "function": {"name": "set_alarm"}}
REQUIRED = {"tools": TOOLS, "tool_choice": "required"}
CHAT = [{"role": "user", "content": "weather in paris"}]
SCHEMA = {
    "title": "answer",
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 5}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


class Answer(BaseModel):
    answer: str = Field(max_length=5)
    sure: bool


@pytest.fixture(scope="module")
def json_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = char_tokenizer(JSON_ALPHABET + "\n")
    return save_tiny_model(tmp_path_factory.mktemp("tiny-json-model"), tok, window=2048)


EngineOutput = Callable[..., RapidOutput]


@pytest.fixture(scope="module")
def engine_output(json_model_dir: Path) -> EngineOutput:
    """`engine.generate(messages, **options)` on an in-process engine loaded from the served
    folder; each distinct call runs once per module (tests share the slower ones)."""
    engine = RapidEngine(str(json_model_dir), dtype=DTYPE, device="cpu")
    outputs: dict[str, RapidOutput] = {}

    def generate(messages: list[dict[str, Any]], **options: Any) -> RapidOutput:
        key = json.dumps([messages, options], sort_keys=True, default=repr)
        if key not in outputs:
            outputs[key] = engine.generate(messages, **options)
        return outputs[key]

    return generate


@pytest.fixture(scope="module")
def server(json_model_dir: Path) -> Iterator[LiveServer]:
    with live_server(json_model_dir) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def engine_calls(output: RapidOutput) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, c.arguments) for c in output.tool_calls]


def api_calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of an SDK message's tool calls, checking their ids and type."""
    calls = message.tool_calls or []
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def strict(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool marked `strict` (the SDK's stream helper parses only strict tools' arguments;
    the server enforces every tool's schema anyway)."""
    return {**tool, "function": {**tool["function"], "strict": True}}


def post(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


# ---- tool calls ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tool_choice", ["auto", "required", NAMED], ids=["auto", "required", "named"]
)
def test_tool_calls_equal_the_engine(
    client: openai.OpenAI, engine_output: EngineOutput, tool_choice: Any
) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=tool_choice, max_tokens=100
    )
    expected = engine_output(CHAT, tools=TOOLS, tool_choice=tool_choice, max_new_tokens=100)
    if tool_choice != "auto":
        assert expected.tool_calls, "the grammar forces a call (and 100 tokens fit one)"
    message = out.choices[0].message
    assert api_calls(message) == engine_calls(expected)
    assert message.content == (expected.text or None if expected.tool_calls else expected.text)
    assert out.choices[0].finish_reason == FINISH_REASONS[expected.finish_reason]
    assert out.usage.completion_tokens == len(expected.token_ids)
    if tool_choice == NAMED:
        assert [name for name, _ in api_calls(message)] == ["set_alarm"]


@pytest.mark.parametrize(
    ("tools", "tool_choice"), [([WEATHER], "required"), (TOOLS, NAMED)], ids=["several", "named"]
)
def test_streamed_tool_calls_merge_into_the_engines_calls(
    client: openai.OpenAI, engine_output: EngineOutput, tools: list, tool_choice: Any
) -> None:
    """The SDK's stream helper merges the tool-call deltas by index (and parses strict
    arguments); here the model makes several calls of one tool, or the named one."""
    with client.chat.completions.stream(
        model=MODEL,
        messages=CHAT,
        tools=[strict(t) for t in tools],
        tool_choice=tool_choice,
        max_tokens=300,
    ) as stream:
        content = "".join(e.delta for e in stream if e.type == "content.delta")
        final = stream.get_final_completion()
    expected = engine_output(CHAT, tools=tools, tool_choice=tool_choice, max_new_tokens=300)
    assert expected.tool_calls and expected.finish_reason == "tool_calls"
    message = final.choices[0].message
    assert api_calls(message) == engine_calls(expected)
    assert [c.function.parsed_arguments for c in message.tool_calls or []] == [
        c.arguments for c in expected.tool_calls
    ]
    assert content == expected.text == ""
    assert final.choices[0].finish_reason == "tool_calls"


def test_streamed_text_next_to_tools_is_the_content_alone(
    client: openai.OpenAI, engine_output: EngineOutput
) -> None:
    """tool_choice "auto": the content deltas are the engine's text (no call markup) and the
    calls, if any, come as tool-call deltas."""
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="auto", max_tokens=100, stream=True
        )
    )
    expected = engine_output(CHAT, tools=TOOLS, tool_choice="auto", max_new_tokens=100)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    merged: dict[int, dict[str, str]] = {}
    for d in deltas:
        for call in d.tool_calls or []:
            entry = merged.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    got = [(e["name"], json.loads(e["arguments"])) for _, e in sorted(merged.items())]
    assert got == engine_calls(expected)
    content = "".join(d.content or "" for d in deltas)
    assert content == expected.text and CALL_OPEN not in content
    assert chunks[-1].choices[0].finish_reason == FINISH_REASONS[expected.finish_reason]


def test_parallel_tool_calls_false_decodes_the_first_call_only(
    client: openai.OpenAI, engine_output: EngineOutput
) -> None:
    kwargs: dict[str, Any] = {"tools": [WEATHER], "tool_choice": "required"}
    expected = engine_output(CHAT, max_new_tokens=300, **kwargs)
    assert len(expected.tool_calls) >= 2, "the model calls the tool several times here"
    many = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300, **kwargs)
    one = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=300, parallel_tool_calls=False, **kwargs
    )
    assert api_calls(many.choices[0].message) == engine_calls(expected)
    # The grammar allows one call: decoding ends after it, rather than trimming the rest.
    assert api_calls(one.choices[0].message) == engine_calls(expected)[:1]
    assert one.choices[0].finish_reason == "tool_calls"
    assert one.usage.completion_tokens < many.usage.completion_tokens


def test_a_tool_result_turn_is_rendered_as_the_engine_does(
    client: openai.OpenAI, engine_output: EngineOutput
) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "paris"}'},
    }
    messages = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=10
    )
    expected = engine_output(messages, tools=[WEATHER], tool_choice="none", max_new_tokens=10)
    assert out.usage.prompt_tokens == expected.prompt_tokens
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].message.tool_calls is None


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_smol_required_ends_with_tool_calls_after_its_call(stream: bool) -> None:
    """Over the API, SmolLM2 under tool_choice "required" (parallel calls allowed) once
    wrote its call twice, so max_tokens=64 returned one call with finish_reason
    "length"; now decoding ends after the call (docs/algorithm.md section 11)."""
    from rapid_integrations.models.loading import ensure_default_model

    question = [{"role": "user", "content": "What is 23 times 37?"}]
    kwargs: dict[str, Any] = {"tools": [strict(MULTIPLY)], "tool_choice": "required"}
    with live_server(ensure_default_model(progress=False)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        if stream:
            with client.chat.completions.stream(
                model=MODEL, messages=question, max_tokens=64, **kwargs
            ) as events:
                out = events.get_final_completion()
        else:
            out = client.chat.completions.create(
                model=MODEL, messages=question, max_tokens=64, **kwargs
            )
    assert out.choices[0].finish_reason == "tool_calls"
    assert api_calls(out.choices[0].message) == [("multiply", {"a": 23, "b": 37})]
    if not stream:
        assert out.usage.completion_tokens < 64


# ---- structured output -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response_format", "grammar"),
    [
        (JSON_SCHEMA_FORMAT, Grammar.json_schema(SCHEMA)),
        ({"type": "json_object"}, Grammar.json_object()),
    ],
    ids=["json_schema", "json_object"],
)
def test_response_format_constrains_the_output_like_the_engine(
    client: openai.OpenAI, engine_output: EngineOutput, response_format: dict, grammar: Grammar
) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, response_format=response_format, max_tokens=60
    )
    expected = engine_output(CHAT, grammar=grammar, max_new_tokens=60)
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].finish_reason == FINISH_REASONS[expected.finish_reason] == "stop"
    value = json.loads(out.choices[0].message.content)
    assert isinstance(value, dict)
    if response_format["type"] == "json_schema":
        Answer.model_validate(value)


def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI, engine_output: EngineOutput):
    """`client.chat.completions.parse(response_format=Model)`: the SDK sends the model's
    strict JSON schema and parses the answer into the model."""
    out = client.chat.completions.parse(
        model=MODEL, messages=CHAT, response_format=Answer, max_tokens=60
    )
    grammar = Grammar.json_schema(to_strict_json_schema(Answer))
    expected = engine_output(CHAT, grammar=grammar, max_new_tokens=60)
    assert out.choices[0].message.parsed == Answer.model_validate_json(expected.text)


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_tools_with_a_response_format_call_or_answer_in_it_like_the_engine(
    client: openai.OpenAI, engine_output: EngineOutput, tool_choice: str
) -> None:
    """Tools next to `response_format` (the Agents SDK's `output_type` with tools, LangChain's
    create_agent with a provider strategy): the answer is calls or a document of the schema,
    as the engine gives it for `tools=` with `grammar=`; under "none" always the document."""
    out = client.chat.completions.parse(
        model=MODEL,
        messages=CHAT,
        tools=[strict(t) for t in TOOLS],
        tool_choice=tool_choice,
        parallel_tool_calls=False,  # one call at most: a random model may chain them
        response_format=Answer,
        max_tokens=100,
    )
    expected = engine_output(
        CHAT,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        grammar=Grammar.json_schema(to_strict_json_schema(Answer)),
        max_new_tokens=100,
    )
    message = out.choices[0].message
    assert api_calls(message) == engine_calls(expected)
    assert out.choices[0].finish_reason == FINISH_REASONS[expected.finish_reason]
    if tool_choice == "none" or not expected.tool_calls:
        assert message.parsed == Answer.model_validate_json(expected.text)


@pytest.mark.parametrize(
    ("body", "engine_kwargs", "max_tokens"),
    [
        ({"response_format": JSON_SCHEMA_FORMAT}, {"grammar": Grammar.json_schema(SCHEMA)}, 6),
        (REQUIRED, REQUIRED, 20),
    ],
    ids=["json_schema", "tool_call"],
)
def test_a_cut_off_structured_answer_is_length(
    client: openai.OpenAI,
    engine_output: EngineOutput,
    body: dict,
    engine_kwargs: dict,
    max_tokens: int,
) -> None:
    """Cut off by max_tokens: finish_reason "length", the partial JSON as the engine wrote it,
    and a partial call is no call."""
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=max_tokens, **body)
    expected = engine_output(CHAT, max_new_tokens=max_tokens, **engine_kwargs)
    assert out.choices[0].finish_reason == expected.finish_reason == "length"
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].message.tool_calls is None and not expected.tool_calls


# ---- bad input -------------------------------------------------------------------------------

BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": 3}}}
BAD_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
BAD_CALL_TURN = {"role": "assistant", "tool_calls": [BAD_CALL]}


@pytest.mark.parametrize(
    ("body", "status", "param", "match"),
    [
        ({"tools": [WEATHER, WEATHER]}, 400, "tools", "unique.*get_weather"),
        ({"tools": [{"type": "function"}]}, 400, "tools", "tool 0 must be"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
            400,
            "tools",
            "invalid JSON schema",
        ),
        ({"tools": TOOLS, "tool_choice": "send_email"}, 400, "tool_choice", "names no given"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, 400, "tool_choice", "names no"),
        ({"tool_choice": "required"}, 400, "tool_choice", "without tools"),
        ({"tools": TOOLS, "tool_choice": 3}, 422, "tool_choice", "valid string"),
        ({"response_format": {"type": "xml"}}, 422, "response_format.type", ""),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            422,
            "response_format.json_schema",
            "schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": BAD_SCHEMA}}},
            400,
            "response_format.json_schema.schema",
            "invalid JSON schema",
        ),
        ({"messages": [*CHAT, BAD_CALL_TURN]}, 400, None, "not JSON"),
    ],
    ids=lambda v: None if isinstance(v, dict) else str(v)[:30],
)
def test_bad_tools_and_formats_get_the_openai_error_shape(
    server: LiveServer, body: dict, status: int, param: str | None, match: str
) -> None:
    r = post(server, {"model": MODEL, "messages": CHAT, "max_tokens": 4, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and re.search(match, error["message"]), error
    assert post(server, {"model": MODEL, "messages": CHAT, "max_tokens": 4}).status_code == 200


UNWRITABLE = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["Zed"]}}}


def test_a_grammar_error_while_decoding_is_400_and_the_server_serves_on(
    server: LiveServer, client: openai.OpenAI
) -> None:
    """The tokenizer has no capital letters: the engine's GrammarError ("cannot write") is a
    400 for a whole response, an error event the SDK raises in a stream; the slots and the engine streams are freed."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "response_format": UNWRITABLE}
    r = post(server, body)
    assert r.status_code == 400 and "cannot write" in r.json()["error"]["message"]
    with pytest.raises(openai.APIError, match="cannot write"):
        for _ in client.chat.completions.create(**body, stream=True):
            pass
    for name in ("rapid_running_requests", "rapid_open_streams"):
        assert wait_until(lambda name=name: metric(metrics_of(server), name) == 0, 10), name
    assert post(server, {"model": MODEL, "messages": CHAT, "max_tokens": 2}).status_code == 200


# ---- LangChain, the client agents use ----------------------------------------------------------


@pytest.mark.parametrize(
    ("tool_choice", "engine_choice"), [("required", "required"), ("set_alarm", NAMED)]
)
def test_langchain_bind_tools_gets_the_engines_calls(
    server: LiveServer, engine_output: EngineOutput, tool_choice: str, engine_choice: Any
) -> None:
    from langchain_core.messages import AIMessageChunk
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", max_tokens=100, max_retries=0
    )
    bound = llm.bind_tools(TOOLS, tool_choice=tool_choice)
    expected = engine_output(CHAT, tools=TOOLS, tool_choice=engine_choice, max_new_tokens=100)
    assert expected.tool_calls
    message = bound.invoke("weather in paris")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == engine_calls(expected)
    streamed = AIMessageChunk(content="")
    for part in bound.stream("weather in paris"):
        streamed += part
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == engine_calls(expected)
    assert all(c["id"] for c in message.tool_calls + streamed.tool_calls)


def test_langchain_structured_output_gets_the_engines_json(
    server: LiveServer, engine_output: EngineOutput
) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", max_tokens=60, max_retries=0
    )
    got = llm.with_structured_output(SCHEMA, method="json_schema").invoke("weather in paris")
    expected = engine_output(CHAT, grammar=Grammar.json_schema(SCHEMA), max_new_tokens=60)
    assert got == json.loads(expected.text)
