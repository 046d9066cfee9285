"""`POST /v1/responses` against a live `rapid serve`, with the clients that speak it: the openai
SDK's `client.responses.create` / `.stream` / `.parse` and LangChain's
`ChatOpenAI(use_responses_api=True)`. Every answer equals the in-process engine's for the chat
messages the input items mean (text, tools and their results, `text.format`); the stream is
the Responses API's event sequence; bad input gets the Responses API's error shape.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema

from rapid_integrations.structured_output.grammar import Grammar
from tests import test_serve_tools
from tests.serve_fixtures import MODEL, LiveServer, live_server
from tests.test_serve_tools import CHAT, SCHEMA, TOOLS, WEATHER, Answer, EngineOutput, engine_calls

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

# The tiny JSON model, its in-process outputs and its live server: the chat tool tests' fixtures.
json_model_dir = test_serve_tools.json_model_dir
engine_output = test_serve_tools.engine_output
server = test_serve_tools.server  # a live server over it, with an openai SDK client
client = test_serve_tools.client

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
"""The chat tools in the Responses API's flat shape."""
INSTRUCTIONS = "be brief."
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]


def post(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json=body, timeout=60)


def api_calls(response: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of a response's function_call items, checking their ids."""
    calls = [item for item in response.output if item.type == "function_call"]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.call_id) for c in calls)
    assert all(c.id.startswith("fc_") and c.status == "completed" for c in calls)
    return [(c.name, json.loads(c.arguments)) for c in calls]


def collapsed(types: list[str]) -> list[str]:
    """Event types with runs of one type written once."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


# ---- text ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.9, "seed": 7}],
    ids=["greedy", "seeded"],
)
def test_string_input_and_instructions_equal_the_engine(
    client: openai.OpenAI, engine_output: EngineOutput, sampling: dict[str, Any]
) -> None:
    seed = {"seed": sampling["seed"]} if "seed" in sampling else {}
    out = client.responses.create(
        model=MODEL,
        input="weather in paris",
        instructions=INSTRUCTIONS,
        max_output_tokens=12,
        temperature=sampling["temperature"],
        top_p=sampling.get("top_p"),
        extra_body=seed,
    )
    messages = [{"role": "system", "content": INSTRUCTIONS}, *CHAT]
    expected = engine_output(messages, max_new_tokens=12, **sampling)
    assert out.output_text == expected.text
    assert out.id.startswith("resp_") and out.object == "response"
    assert [item.type for item in out.output] == ["message"]
    assert out.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    if out.status == "incomplete":
        assert out.incomplete_details.reason == "max_output_tokens"
    usage = out.usage
    assert (usage.input_tokens, usage.output_tokens) == (
        expected.prompt_tokens,
        len(expected.token_ids),
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.rapid["new_tokens"] == len(expected.token_ids)  # the RAPID extension
    assert (out.instructions, out.max_output_tokens) == (INSTRUCTIONS, 12)


def test_input_items_with_roles_are_the_engines_messages(
    client: openai.OpenAI, engine_output: EngineOutput
) -> None:
    """Messages with string or part content; developer is the system role; an assistant
    message sent back (as clients send earlier outputs) is an assistant turn."""
    items: list[dict[str, Any]] = [
        {"role": "developer", "content": "be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "hello.", "annotations": []}],
        },
        {"role": "user", "content": "weather in paris"},
    ]
    out = client.responses.create(model=MODEL, input=items, max_output_tokens=12, temperature=0)
    messages = [
        {"role": "system", "content": "be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello."},
        {"role": "user", "content": "weather in paris"},
    ]
    expected = engine_output(messages, max_new_tokens=12, temperature=0.0)
    assert out.output_text == expected.text
    assert out.usage.input_tokens == expected.prompt_tokens


def test_the_stream_is_the_responses_event_sequence(
    client: openai.OpenAI, engine_output: EngineOutput
) -> None:
    """An answer cut off by max_output_tokens ends as OpenAI's does: `response.incomplete`
    (the SDK's `ResponseIncompleteEvent`) with status "incomplete" and the reason, never
    `response.completed`; its response is the non-streamed one."""
    kwargs: dict[str, Any] = {"model": MODEL, "input": "weather in paris", "temperature": 0}
    with client.responses.stream(**kwargs, max_output_tokens=12) as stream:
        events = list(stream)
    expected = engine_output(CHAT, max_new_tokens=12, temperature=0.0)
    assert expected.finish_reason == "length", "the answer is cut off"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert collapsed([e.type for e in events]) == [*TEXT_EVENTS[:-1], "response.incomplete"]
    assert isinstance(events[-1], openai.types.responses.ResponseIncompleteEvent)
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert events[-2].item.status == "incomplete"  # the cut-off message
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == expected.text
    item = events[2].item
    assert all((e.item_id, e.output_index) == (item.id, 0) for e in deltas)
    assert events[-2].item.id == final.output[0].id == item.id
    assert final.output_text == expected.text and final.id == events[0].response.id
    assert final.usage.output_tokens == len(expected.token_ids)
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    whole = client.responses.create(**kwargs, max_output_tokens=12)
    assert whole.model_dump(exclude={"id", "created_at", "output", "usage"}) == final.model_dump(
        exclude={"id", "created_at", "output", "usage"}
    )


# ---- tools ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tool_choice",
    ["auto", "required", {"type": "function", "name": "set_alarm"}],
    ids=["auto", "required", "named"],
)
def test_function_calls_equal_the_engines(
    client: openai.OpenAI, engine_output: EngineOutput, tool_choice: Any
) -> None:
    out = client.responses.create(
        model=MODEL,
        input="weather in paris",
        tools=FLAT_TOOLS,
        tool_choice=tool_choice,
        max_output_tokens=100,
    )
    engine_choice = tool_choice if isinstance(tool_choice, str) else tool_choice["name"]
    expected = engine_output(CHAT, tools=TOOLS, tool_choice=engine_choice, max_new_tokens=100)
    if tool_choice != "auto":
        assert expected.tool_calls
    assert api_calls(out) == engine_calls(expected)
    assert out.output_text == expected.text
    has_message = any(item.type == "message" for item in out.output)
    assert has_message == (bool(expected.text) or not expected.tool_calls)
    assert out.tools[0].name == "get_weather"  # the flat tools, repeated


def test_a_tool_round_trip_call_output_answer(
    client: openai.OpenAI, engine_output: EngineOutput
) -> None:
    """The call comes back as a function_call item; sent back with a function_call_output,
    the answer is the engine's for the assistant turn with the call and the tool's result."""
    first = client.responses.create(
        model=MODEL,
        input="weather in paris",
        tools=[FLAT_TOOLS[0]],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=100,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    items = [
        {"role": "user", "content": "weather in paris"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = client.responses.create(
        model=MODEL, input=items, tools=[FLAT_TOOLS[0]], tool_choice="none", max_output_tokens=10
    )
    function = {"name": call.name, "arguments": call.arguments}
    chat_call = {"id": call.call_id, "type": "function", "function": function}
    messages = [
        *CHAT,
        {"role": "assistant", "content": "", "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    expected = engine_output(messages, tools=[WEATHER], tool_choice="none", max_new_tokens=10)
    assert second.usage.input_tokens == expected.prompt_tokens
    assert second.output_text == expected.text
    assert [item.type for item in second.output] == ["message"]


def test_streamed_function_calls_merge_into_the_engines_calls(
    client: openai.OpenAI, engine_output: EngineOutput
) -> None:
    with client.responses.stream(
        model=MODEL,
        input="weather in paris",
        tools=[FLAT_TOOLS[0]],
        tool_choice="required",
        max_output_tokens=300,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    expected = engine_output(CHAT, tools=[WEATHER], tool_choice="required", max_new_tokens=300)
    assert len(expected.tool_calls) >= 2 and not expected.text, "several calls, no text"
    types = [e.type for e in events]
    once = [t for i, t in enumerate(types) if t != types[i - 1] or not t.endswith(".delta")]
    assert once == [*TEXT_EVENTS[:2], *CALL_EVENTS * len(expected.tool_calls), TEXT_EVENTS[-1]]
    assert types.count(CALL_EVENTS[1]) > len(expected.tool_calls)  # arguments in pieces
    assert api_calls(final) == engine_calls(expected)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, json.loads(e.arguments)) for e in done] == engine_calls(expected)
    assert [e.output_index for e in done] == list(range(len(done)))
    pieces: dict[int, str] = {}
    for e in events:
        if e.type == CALL_EVENTS[1]:
            pieces[e.output_index] = pieces.get(e.output_index, "") + e.delta
    assert [pieces[e.output_index] for e in done] == [e.arguments for e in done]


def test_text_format_json_schema_and_sdk_parse(
    client: openai.OpenAI, engine_output: EngineOutput
) -> None:
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA}
    out = client.responses.create(
        model=MODEL, input="weather in paris", text={"format": fmt}, max_output_tokens=60
    )
    expected = engine_output(CHAT, grammar=Grammar.json_schema(SCHEMA), max_new_tokens=60)
    assert out.output_text == expected.text and out.status == "completed"
    Answer.model_validate_json(out.output_text)
    parsed = client.responses.parse(
        model=MODEL, input="weather in paris", text_format=Answer, max_output_tokens=60
    )
    strict = Grammar.json_schema(to_strict_json_schema(Answer))
    assert parsed.output_parsed == Answer.model_validate_json(
        engine_output(CHAT, grammar=strict, max_new_tokens=60).text
    )
    mode = client.responses.create(
        model=MODEL,
        input="weather in paris",
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
    )
    json_object = engine_output(CHAT, grammar=Grammar.json_object(), max_new_tokens=60)
    assert mode.output_text == json_object.text and isinstance(json.loads(mode.output_text), dict)


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_tools_with_text_format_call_or_answer_in_it_like_the_engine(
    client: openai.OpenAI, engine_output: EngineOutput, tool_choice: str
) -> None:
    """Function tools next to `text.format` (the Agents SDK's `output_type` with tools): calls
    or a document of the schema, as the engine gives it for `tools=` with `grammar=`."""
    parsed = client.responses.parse(
        model=MODEL,
        input="weather in paris",
        tools=FLAT_TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,  # one call at most: a random model may chain them
        text_format=Answer,
        max_output_tokens=100,
    )
    expected = engine_output(
        CHAT,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        grammar=Grammar.json_schema(to_strict_json_schema(Answer)),
        max_new_tokens=100,
    )
    assert api_calls(parsed) == engine_calls(expected)
    assert parsed.output_text == expected.text
    if tool_choice == "none" or not expected.tool_calls:
        assert parsed.output_parsed == Answer.model_validate_json(expected.text)


def test_rapid_options_and_store_are_accepted(client: openai.OpenAI) -> None:
    """RAPID options go as extra fields, as in chat; `store` is accepted, nothing is stored."""
    out = client.responses.create(
        model=MODEL,
        input="jade lake",
        max_output_tokens=6,
        store=True,
        metadata={"run": "1"},
        extra_body={"eta": 1.5, "gamma": 3, "mode": "sd"},
    )
    stats = out.usage.rapid
    assert (stats["mode"], stats["gamma"], stats["eta"]) == ("sd", 3, 0.0)  # sd sets eta = 0
    assert out.metadata == {"run": "1"}


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param", "match"),
    [
        ({"previous_response_id": "resp_1"}, 400, "previous_response_id", "stateless"),
        ({"conversation": "conv_1"}, 400, "conversation", "stateless"),
        ({"background": True}, 400, "background", "stateless"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input.0.type", "stateless"),
        ({"input": [{"type": "computer_call", "id": "c"}]}, 400, "input.0.type", "'computer_call'"),
        ({"input": []}, 422, "input", "empty"),
        ({"input": [{"role": "tool", "content": "x"}]}, 400, "input.0.role", "got 'tool'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            400,
            "input.0.content",
            "only text",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input.0.call_id", ""),
        ({"tools": [{"type": "web_search"}]}, 400, "tools.0", "only function tools"),
        ({"tools": FLAT_TOOLS, "tool_choice": {"type": "web_search"}}, 400, "tool_choice", ""),
        ({"tools": FLAT_TOOLS, "tool_choice": "send_email"}, 400, "tool_choice", "names no"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 422, "text.format", "schema"),
        ({"top_logprobs": 2}, 400, "top_logprobs", "log probabilities"),
        ({"include": ["message.output_text.logprobs"]}, 400, "include", "log probabilities"),
        ({"reasoning": {"effort": "low"}}, 400, "reasoning", "not supported"),
        ({"truncation": "auto"}, 400, "truncation", "disabled"),
        ({"frobnicate": 1}, 400, "frobnicate", "Unrecognized request argument"),
        ({"model": "gpt-4o"}, 404, "model", "not found"),
    ],
    ids=lambda v: None if isinstance(v, dict) else str(v)[:30],
)
def test_bad_input_gets_the_error_shape_and_the_server_serves_on(
    server: LiveServer, body: dict, status: int, param: str, match: str
) -> None:
    r = post(server, {"model": MODEL, "input": "hi", "max_output_tokens": 4, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and re.search(match, error["message"]), error
    assert post(server, {"model": MODEL, "input": "hi", "max_output_tokens": 2}).status_code == 200


def test_an_error_mid_stream_is_an_error_event(server: LiveServer) -> None:
    """The tokenizer has no capital letters: a schema of "Zed" fails while decoding, after the
    response started; the stream's last event is `error`."""
    fmt = {"type": "json_schema", "name": "x", "schema": {"enum": ["Zed"]}}
    body = {"model": MODEL, "input": "hi", "text": {"format": fmt}, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    events = [json.loads(line[5:]) for line in lines]
    last = events[-1]
    assert last["type"] == "error" and "cannot write" in last["message"], events
    assert last["sequence_number"] == len(events) - 1


# ---- LangChain ----------------------------------------------------------------------------------


def chat_openai(server: LiveServer, **kwargs: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key="unused",
        use_responses_api=True,
        max_retries=0,
        **kwargs,
    )


def test_langchain_chat_openai_over_the_responses_api(
    server: LiveServer, engine_output: EngineOutput
) -> None:
    from langchain_core.messages import AIMessageChunk

    llm = chat_openai(server, temperature=0, max_tokens=12)
    expected = engine_output(CHAT, max_new_tokens=12, temperature=0.0)
    message = llm.invoke("weather in paris")
    assert message.text == expected.text
    assert message.usage_metadata["input_tokens"] == expected.prompt_tokens
    assert message.usage_metadata["output_tokens"] == len(expected.token_ids)
    streamed = AIMessageChunk(content="")
    for part in llm.stream("weather in paris"):
        streamed += part
    assert streamed.text == expected.text


def test_langchain_bind_tools_round_trip_over_the_responses_api(
    server: LiveServer, engine_output: EngineOutput
) -> None:
    from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage

    llm = chat_openai(server, max_tokens=100)
    bound = llm.bind_tools([WEATHER], tool_choice="required", parallel_tool_calls=False)
    expected = engine_output(
        CHAT, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_new_tokens=100
    )
    message = bound.invoke("weather in paris")
    streamed = sum(bound.stream("weather in paris"), AIMessageChunk(content=""))
    for got in (message, streamed):  # the call whole, and merged from the stream's chunks
        assert [(c["name"], c["args"]) for c in got.tool_calls] == engine_calls(expected)
    (call,) = message.tool_calls
    result = ToolMessage("sunny", tool_call_id=call["id"])
    answer = llm.bind_tools([WEATHER], tool_choice="none").invoke(
        [HumanMessage("weather in paris"), message, result]
    )
    function = {"name": call["name"], "arguments": json.dumps(call["args"])}
    chat_call = {"id": call["id"], "type": "function", "function": function}
    messages = [
        *CHAT,
        {"role": "assistant", "content": "", "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    after = engine_output(messages, tools=[WEATHER], tool_choice="none", max_new_tokens=100)
    assert answer.text == after.text


# ---- docs ---------------------------------------------------------------------------------------

DOC_SECTION = "The Responses API (`POST /v1/responses`)"


def test_the_serving_docs_example_runs_as_written(
    json_model_dir: Any, engine_output: EngineOutput
) -> None:
    """docs/serving.md's Responses API example, run as written against a live server serving
    the tiny JSON model as "rapid" (its URL swapped in)."""
    from tests.doc_examples import DOCS, python_sections

    code = dict(python_sections(DOCS / "serving.md"))[DOC_SECTION]
    assert 'base_url="http://127.0.0.1:8000/v1"' in code and 'model="rapid"' in code
    with live_server(json_model_dir, served_model_name="rapid") as live:
        ns: dict[str, Any] = {}
        exec(compile(code.replace("http://127.0.0.1:8000", live.url), DOC_SECTION, "exec"), ns)
    system = {"role": "system", "content": "Answer in one sentence."}
    asked = [system, {"role": "user", "content": "What does RAPID stand for?"}]
    greedy = engine_output(asked, max_new_tokens=64, temperature=0.0, eta=3.0, gamma=8)
    assert ns["response"].output_text == greedy.text
    assert ns["response"].usage.rapid["gamma"] == 8
    assert ns["final"].status in ("completed", "incomplete") and ns["final"].usage
    call = ns["call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    function = {"name": call.name, "arguments": call.arguments}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call.call_id, "function": function}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]
    weather = {
        "type": "function",
        "function": {k: v for k, v in ns["weather"].items() if k != "type"},
    }
    prompt = engine_output(messages, tools=[weather], max_new_tokens=1)
    assert ns["answer"].usage.input_tokens == prompt.prompt_tokens
