"""ChatRapid's tool calling and structured output on tiny random models: wiring, not quality.

Each adapter call is checked against the engine called directly with the same tools, grammar
and settings (docs/algorithm.md sections 10-11), so a lost argument, a dropped call or a
history rendered differently shows as a difference. Bad tools raise before decoding.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, ConfigDict, Field

from langchain_rapid import ChatRapid
from rapid_integrations import (
    Grammar,
    GrammarError,
    RapidEngine,
    RapidInputError,
)
from tests.tiny import tool_engine

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


@tool
def get_weather(city: Literal["paris", "rome"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
    """Weather of a city."""
    return f"sunny in {city} for {days} days"


@tool
def add(a: Annotated[int, Field(ge=0, le=9)]) -> int:
    """Add a digit."""
    return a + 1


class Flag(BaseModel):
    """A flag and a size."""

    model_config = ConfigDict(title="flag")  # the tiny tokenizer spells lowercase names only

    ok: bool
    size: Literal["s", "m", "l"]


FLAG_SCHEMA = Flag.model_json_schema()
TOOLS = [get_weather, add]
SPECS = [convert_to_openai_tool(t) for t in TOOLS]
PROMPT = "weather in paris"
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def engine() -> RapidEngine:
    return tool_engine(5)


@pytest.fixture
def chat(engine: RapidEngine) -> ChatRapid:
    return ChatRapid(engine=engine)


def calls_of(message: BaseMessage) -> list[tuple[str, dict[str, Any]]]:
    assert isinstance(message, AIMessage)
    return [(c["name"], c["args"]) for c in message.tool_calls]


def engine_calls(out: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, c.arguments) for c in out.tool_calls]


@pytest.mark.parametrize(
    ("choice", "engine_choice"),
    [("any", "required"), (True, "required"), ("get_weather", "get_weather"), (None, "auto")],
)
def test_bound_tools_reach_the_engine(
    chat: ChatRapid, engine: RapidEngine, choice: Any, engine_choice: str
) -> None:
    message = chat.bind_tools(TOOLS, tool_choice=choice).invoke(PROMPT)
    out = engine.generate(MESSAGES, tools=SPECS, tool_choice=engine_choice)
    assert calls_of(message) == engine_calls(out)
    assert message.content == out.text
    assert message.response_metadata["finish_reason"] == out.finish_reason
    if engine_choice != "auto":
        assert message.tool_calls, "a forced call is missing"
        assert all(c["id"].startswith("call_") for c in message.tool_calls)


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_reaches_the_engine(
    chat: ChatRapid, engine: RapidEngine, parallel: bool
) -> None:
    options = {"seed": 2, "temperature": 1.0}
    bound = chat.bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=parallel)
    message = bound.invoke(PROMPT, **options)
    out = engine.generate(
        MESSAGES, tools=SPECS, tool_choice="required", parallel_tool_calls=parallel, **options
    )
    assert calls_of(message) == engine_calls(out)
    assert message.usage_metadata["output_tokens"] == len(out.token_ids)


def test_streamed_calls_add_up_to_the_invoked_ones(chat: ChatRapid) -> None:
    bound = chat.bind_tools(TOOLS, tool_choice="required")
    full = None
    for chunk in bound.stream(PROMPT):
        full = chunk if full is None else full + chunk
    assert isinstance(full, AIMessage)
    assert full.tool_call_chunks and full.content == ""
    assert calls_of(full) == calls_of(bound.invoke(PROMPT))


def test_calls_and_results_in_history_render_as_openai_messages(
    chat: ChatRapid, engine: RapidEngine
) -> None:
    """LangChain's AI tool calls (string or Anthropic-style list content) and ToolMessages
    reach the engine as OpenAI's assistant tool_calls and tool messages."""
    args = {"city": "rome", "days": 2}
    call = {"name": "get_weather", "args": args, "id": "call_1", "type": "tool_call"}
    blocks = [
        {"type": "text", "text": "ok"},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": args},
    ]
    openai_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": args},
    }
    bound = chat.bind_tools(TOOLS, tool_choice="none")
    for ai, content in (
        (AIMessage("", tool_calls=[call]), ""),
        (AIMessage(blocks, tool_calls=[call]), "ok"),
    ):
        history = [HumanMessage("weather in rome"), ai, ToolMessage("sunny", tool_call_id="call_1")]
        want = engine.generate(
            [
                {"role": "user", "content": "weather in rome"},
                {"role": "assistant", "content": content, "tool_calls": [openai_call]},
                {
                    "role": "tool",
                    "content": "sunny",
                    "tool_call_id": "call_1",
                    "name": "get_weather",
                },
            ],
            tools=SPECS,
            tool_choice="none",
            max_new_tokens=12,
        )
        got = bound.invoke(history, max_tokens=12)
        assert got.content == want.text
        assert got.usage_metadata["input_tokens"] == want.prompt_tokens


@pytest.mark.parametrize(
    ("tools", "choice", "error", "match"),
    [
        ([get_weather, get_weather], "auto", RapidInputError, "unique"),
        (TOOLS, "get_time", RapidInputError, "names no given tool"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, RapidInputError, "nope"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
            None,
            GrammarError,
            "invalid JSON schema",
        ),
    ],
)
def test_bad_tools_raise_before_decoding(
    engine: RapidEngine, tools: list[Any], choice: Any, error: type, match: str
) -> None:
    """The engine's own checks, reached through the binding, before any token is decoded;
    the engine serves on."""
    chat = ChatRapid(engine=engine, max_tokens=2)
    bound = chat.bind_tools(tools, tool_choice=choice)
    with pytest.raises(error, match=match):
        bound.invoke(PROMPT)
    assert chat.invoke(PROMPT).usage_metadata["output_tokens"] > 0


def test_json_schema_answers_are_the_engines_constrained_text(
    chat: ChatRapid, engine: RapidEngine
) -> None:
    out = engine.generate(MESSAGES, grammar=Grammar.json_schema(Flag.model_json_schema()))
    assert out.finish_reason == "eos"
    assert chat.with_structured_output(Flag).invoke(PROMPT) == Flag.model_validate_json(out.text)
    as_dict = chat.with_structured_output(Flag.model_json_schema()).invoke(PROMPT)
    assert as_dict == json.loads(out.text)


def test_function_calling_answers_are_the_engines_forced_call(
    chat: ChatRapid, engine: RapidEngine
) -> None:
    out = engine.generate(MESSAGES, tools=[convert_to_openai_tool(Flag)], tool_choice="flag")
    [call] = out.tool_calls
    structured = chat.with_structured_output(Flag, method="function_calling", include_raw=True)
    result = structured.invoke(PROMPT)
    assert result["parsed"] == Flag(**call.arguments)
    assert result["parsing_error"] is None
    assert calls_of(result["raw"]) == [("flag", call.arguments)]


def test_json_mode_answers_any_json_object(chat: ChatRapid, engine: RapidEngine) -> None:
    out = engine.generate(MESSAGES, grammar=Grammar.json_object(), max_new_tokens=200)
    structured = ChatRapid(engine=engine, max_tokens=200).with_structured_output(method="json_mode")
    if out.finish_reason == "length":  # a random model may write one long string
        with pytest.raises(OutputParserException, match="finish_reason='length'"):
            structured.invoke(PROMPT)
    else:
        assert structured.invoke(PROMPT) == json.loads(out.text)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_an_answer_cut_off_by_max_tokens_names_the_cause(engine: RapidEngine, method: str) -> None:
    short = ChatRapid(engine=engine, max_tokens=1)  # "{" alone: even "{}" is cut off
    schema = None if method == "json_mode" else Flag
    with pytest.raises(OutputParserException, match="finish_reason='length'"):
        short.with_structured_output(schema, method=method).invoke(PROMPT)
    result = short.with_structured_output(schema, method=method, include_raw=True).invoke(PROMPT)
    assert result["parsed"] is None
    assert isinstance(result["parsing_error"], OutputParserException)
    assert result["raw"].response_metadata["finish_reason"] == "length"


FLAG_FORMAT = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG_SCHEMA}}


@pytest.mark.parametrize("response_format", [FLAG_FORMAT, Flag], ids=["openai", "class"])
@pytest.mark.parametrize("choice", ["auto", "none"])
def test_tools_with_a_response_format_are_the_engines_calls_or_answer(
    chat: ChatRapid, engine: RapidEngine, response_format: Any, choice: str
) -> None:
    """`bind_tools(tools, response_format=...)`, as create_agent's provider strategy binds it:
    the engine's tools with the format's grammar, so calls or an answer in the format."""
    bound = chat.bind_tools(TOOLS, tool_choice=choice, response_format=response_format)
    grammar = Grammar.json_schema(FLAG_SCHEMA)
    answers = 0
    for seed in range(4):
        message = bound.invoke(PROMPT, seed=seed, temperature=1.0)
        out = engine.generate(
            MESSAGES, tools=SPECS, tool_choice=choice, grammar=grammar, seed=seed, temperature=1.0
        )
        assert calls_of(message) == engine_calls(out)
        assert message.content == out.text
        if not out.tool_calls and out.finish_reason == "eos":
            Flag.model_validate_json(message.content)
            answers += 1
    assert answers > 0  # this random model rarely calls: the engine's tests see both branches


@pytest.mark.parametrize(
    ("response_format", "match"),
    [
        ({"type": "xml"}, "type must be"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "'schema' object"),
        (3, "nor a schema"),
    ],
)
def test_a_bad_response_format_is_refused_when_bound(
    chat: ChatRapid, response_format: Any, match: str
) -> None:
    from rapid_integrations import RapidConfigError

    with pytest.raises(RapidConfigError, match=match):
        chat.bind_tools(TOOLS, response_format=response_format)


def test_structured_output_arguments_are_checked(chat: ChatRapid) -> None:
    from rapid_integrations import RapidConfigError

    with pytest.raises(RapidConfigError, match="method"):
        chat.with_structured_output(Flag, method="xml")  # type: ignore[arg-type]
    with pytest.raises(RapidConfigError, match="schema"):
        chat.with_structured_output(None)
    with pytest.raises(RapidConfigError, match="temperature"):
        chat.with_structured_output(Flag, temperature=0.5)
