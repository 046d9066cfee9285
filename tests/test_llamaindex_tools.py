"""RapidLLM as a LlamaIndex FunctionCallingLLM, and its structured output, on tiny models.

Every answer is compared with the engine's own output for the same call (docs/algorithm.md
sections 10 and 11): the adapter converts messages, tools and answers, and must add or lose
nothing. The tiny models' character tokenizer can write JSON and the call markup.
"""

# No `from __future__ import annotations`: FunctionTool reads the tools' annotations as types.

import asyncio
import json
import re
from typing import Annotated, Any, Literal

import jsonschema
import pytest
from llama_index.core.base.llms.types import ToolCallBlock
from llama_index.core.llms import ChatMessage, ChatResponse, ImageBlock, TextBlock
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, ConfigDict, Field

from llamaindex_rapid import RapidLLM, StructuredOutputError
from rapid_integrations import (
    Grammar,
    GrammarError,
    RapidConfigError,
    RapidEngine,
    RapidError,
    RapidInputError,
)
from tests.tiny import tool_engine

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


def get_weather(city: Literal["paris", "rome"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
    """Weather of a city."""
    return f"sunny in {city} for {days} days"


def add(a: Annotated[int, Field(ge=0, le=9)]) -> int:
    """Add one."""
    return a + 1


# Short descriptions keep the prompts (one token per character here) and the tests short.
TOOLS = [
    FunctionTool.from_defaults(get_weather, description="weather of a city"),
    FunctionTool.from_defaults(add, description="add one"),
]
SPECS = [t.metadata.to_openai_tool(skip_length_check=True) for t in TOOLS]
SCHEMAS = {s["function"]["name"]: s["function"]["parameters"] for s in SPECS}
QUESTION = "weather in paris"
SAMPLED = {"temperature": 1.0}


class Forecast(BaseModel):
    city: Literal["paris", "rome"]
    days: int = Field(ge=1, le=7)
    sunny: bool


@pytest.fixture(scope="module")
def engine() -> RapidEngine:
    return tool_engine(11)


@pytest.fixture
def llm(engine: RapidEngine) -> RapidLLM:
    return RapidLLM(engine=engine)


def pairs(selections: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(s.tool_name, s.tool_kwargs) for s in selections]


def own(engine: RapidEngine, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    """The engine's own output for the call the adapter should make."""
    return engine.generate(messages, tools=SPECS, **kwargs)


# ---- function calling ------------------------------------------------------------------------


def test_metadata_says_function_calling_where_the_template_can_render_tools(
    engine: RapidEngine,
) -> None:
    assert RapidLLM(engine=engine).metadata.is_function_calling_model is True
    flattened = RapidLLM(engine=engine, messages_to_prompt=lambda ms: " ".join(map(str, ms)))
    assert flattened.metadata.is_function_calling_model is False


@pytest.mark.parametrize(
    ("options", "choice"),
    [
        ({"tool_required": True}, "required"),
        ({"tool_choice": "get_weather"}, "get_weather"),
        ({}, "auto"),
    ],
)
def test_chat_with_tools_equals_the_engines_own_call(
    llm: RapidLLM, engine: RapidEngine, options: dict[str, Any], choice: str
) -> None:
    response = llm.chat_with_tools(
        TOOLS, user_msg=QUESTION, seed=0, allow_parallel_tool_calls=True, **SAMPLED, **options
    )
    want = own(
        engine, [{"role": "user", "content": QUESTION}], tool_choice=choice, seed=0, **SAMPLED
    )
    selections = llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)
    assert pairs(selections) == [(c.name, c.arguments) for c in want.tool_calls]
    assert (response.message.content or "") == want.text
    assert response.raw["finish_reason"] == want.finish_reason
    for selection in selections:
        assert re.fullmatch(r"call_[0-9a-f]{24}", selection.tool_id)
        jsonschema.validate(selection.tool_kwargs, SCHEMAS[selection.tool_name])
    if choice != "auto":
        assert selections, "a required or named tool choice must give a call"


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_chat_with_tools_and_a_grammar_calls_or_answers_in_it(
    llm: RapidLLM, engine: RapidEngine, choice: str
) -> None:
    """Tools with a response format: `chat_with_tools(..., grammar=...)` is the engine's
    `tools=` with `grammar=`, calls or an answer in the schema."""
    grammar = Grammar.json_schema(Forecast.model_json_schema())
    answers = 0
    for seed in range(3):
        response = llm.chat_with_tools(
            TOOLS, user_msg=QUESTION, tool_choice=choice, grammar=grammar, seed=seed, **SAMPLED
        )
        messages = [{"role": "user", "content": QUESTION}]
        want = own(engine, messages, tool_choice=choice, grammar=grammar, seed=seed, **SAMPLED)
        selections = llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)
        assert pairs(selections) == [(c.name, c.arguments) for c in want.tool_calls]
        assert (response.message.content or "") == want.text
        if not selections and want.finish_reason == "eos":
            Forecast.model_validate_json(want.text)
            answers += 1
    assert answers > 0


def test_one_required_call_without_parallel_calls(llm: RapidLLM, engine: RapidEngine) -> None:
    """Required, no parallel calls: the grammar allows one call, so decoding ends after it;
    where the engine with parallel calls chains several, the answer is the first of them."""
    response = llm.chat_with_tools(TOOLS[:1], user_msg=QUESTION, tool_required=True, seed=1)
    assert len(llm.get_tool_calls_from_response(response)) == 1
    assert response.raw["finish_reason"] == "tool_calls"
    room = {"seed": 4, "max_new_tokens": 300, **SAMPLED}  # seed 4 chains two calls
    want = own(engine, [{"role": "user", "content": QUESTION}], tool_choice="required", **room)
    assert len(want.tool_calls) >= 2
    response = llm.chat_with_tools(TOOLS, user_msg=QUESTION, tool_required=True, **room)
    assert pairs(llm.get_tool_calls_from_response(response)) == [
        (c.name, c.arguments) for c in want.tool_calls[:1]
    ]
    assert response.raw["finish_reason"] == "tool_calls"
    assert response.raw["rapid_stats"]["new_tokens"] < len(want.token_ids)


def test_streams_and_async_give_the_same_answer(llm: RapidLLM) -> None:
    options = {"user_msg": QUESTION, "tool_required": True, "seed": 5, **SAMPLED}
    whole = llm.chat_with_tools(TOOLS, allow_parallel_tool_calls=True, **options)
    chunks = list(llm.stream_chat_with_tools(TOOLS, allow_parallel_tool_calls=True, **options))
    # Earlier chunks carry the calls as far as their fragments have come: the same calls by
    # name, growing (arguments as partial JSON text in the ToolCallBlocks).
    names = [
        [s.tool_name for s in llm.get_tool_calls_from_response(c, error_on_no_tool_call=False)]
        for c in chunks
    ]
    assert all(n == names[-1][: len(n)] for n in names)
    assert names[-1] in names[:-1]  # the calls were there before the last response
    assert "".join(c.delta or "" for c in chunks) == (whole.message.content or "")
    assert pairs(llm.get_tool_calls_from_response(chunks[-1])) == pairs(
        llm.get_tool_calls_from_response(whole)
    )

    async def run_async() -> tuple[ChatResponse, ChatResponse]:
        done = await llm.achat_with_tools(TOOLS, allow_parallel_tool_calls=True, **options)
        chunks = [
            c
            async for c in await llm.astream_chat_with_tools(
                TOOLS, allow_parallel_tool_calls=True, **options
            )
        ]
        return done, chunks[-1]

    for response in asyncio.run(run_async()):
        assert pairs(llm.get_tool_calls_from_response(response)) == pairs(
            llm.get_tool_calls_from_response(whole)
        )


def test_no_call_raises_or_gives_an_empty_list(llm: RapidLLM) -> None:
    response = llm.chat_with_tools(TOOLS, user_msg=QUESTION, tool_choice="none", max_new_tokens=6)
    assert response.message.additional_kwargs.get("tool_calls") is None
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(RapidInputError, match=r"no tool call .*tool_required=True"):
        llm.get_tool_calls_from_response(response)


def test_calls_with_json_text_arguments_are_parsed(llm: RapidLLM) -> None:
    """A ToolCallBlock may hold its arguments as JSON text (LlamaIndex's type allows it, other
    integrations write it): the selection gets them parsed, as from a dict; text that is no JSON
    object is refused, never turned into a call without arguments (ToolSelection's own rule)."""

    def response(kwargs: Any) -> ChatResponse:
        block = ToolCallBlock(tool_call_id="call_1", tool_name="add", tool_kwargs=kwargs)
        return ChatResponse(message=ChatMessage(role="assistant", blocks=[block]))

    for kwargs in ('{"a": 3}', {"a": 3}):
        assert pairs(llm.get_tool_calls_from_response(response(kwargs))) == [("add", {"a": 3})]
    for bad in ('{"a": ', "[3]"):
        with pytest.raises(RapidInputError, match="tool call arguments"):
            llm.get_tool_calls_from_response(response(bad))


# ---- history -------------------------------------------------------------------------------


def test_tool_history_round_trips_in_the_openai_shapes(llm: RapidLLM, engine: RapidEngine) -> None:
    """A call the LLM made and its result, sent back: the engine reads exactly the OpenAI
    messages (same tokens out, same prompt length), also after a JSON round trip of the
    messages (agent memory) and from history written with OpenAI's additional_kwargs."""
    user = ChatMessage(role="user", content=QUESTION)
    response = llm.chat_with_tools(TOOLS, user_msg=user, tool_choice="get_weather", seed=2)
    (call,) = llm.get_tool_calls_from_response(response)
    result = ChatMessage(
        role="tool", content="sunny", additional_kwargs={"tool_call_id": call.tool_id}
    )
    openai_history = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.tool_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(call.tool_kwargs)},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": call.tool_id, "name": "get_weather"},
    ]
    want = own(engine, openai_history, tool_choice="none", max_new_tokens=12, ignore_eos=True)
    assert want.prompt_tokens > own(engine, openai_history[:2], tool_choice="none").prompt_tokens
    written_by_openai = ChatMessage(
        role="assistant",
        content="",
        additional_kwargs={"tool_calls": openai_history[1]["tool_calls"]},
    )
    histories = {
        "as answered": [user, response.message, result],
        "after json": [
            ChatMessage.model_validate_json(m.model_dump_json())
            for m in (user, response.message, result)
        ],
        "openai kwargs": [user, written_by_openai, result],
    }
    for name, history in histories.items():
        again = llm.chat_with_tools(
            TOOLS, chat_history=history, tool_choice="none", max_new_tokens=12, ignore_eos=True
        )
        assert again.raw["usage"]["prompt_tokens"] == want.prompt_tokens, name
        assert again.message.content == want.text, name


def test_what_the_model_cannot_read_is_refused(engine: RapidEngine) -> None:
    llm = RapidLLM(engine=engine)
    function = ChatMessage(role="function", content="4")
    with pytest.raises(RapidInputError, match=r"function message .*tool_call_id"):
        llm.chat([ChatMessage(role="user", content="a"), function])
    result = ChatMessage(role="tool", content="4", additional_kwargs={"tool_call_id": "c"})
    flattened = RapidLLM(engine=engine, messages_to_prompt=lambda ms: " ".join(map(str, ms)))
    with pytest.raises(RapidInputError, match="need the tokenizer's chat template"):
        flattened.chat([ChatMessage(role="user", content="a"), result])
    image = ChatMessage(
        role="user", blocks=[TextBlock(text="a"), ImageBlock(url="https://e.x/a.png")]
    )
    with pytest.raises(RapidInputError, match="'image' content is not supported"):
        llm.chat([image])


# ---- bad tools -------------------------------------------------------------------------------


def test_bad_tools_raise_the_packages_errors_before_decoding(llm: RapidLLM) -> None:
    twice = [TOOLS[0], FunctionTool.from_defaults(add, name="get_weather")]
    with pytest.raises(RapidInputError, match=r"unique.*get_weather"):
        llm.chat_with_tools(twice, user_msg=QUESTION)
    with pytest.raises(RapidInputError, match="names no given tool"):
        llm.chat_with_tools(TOOLS, user_msg=QUESTION, tool_choice="search")
    with pytest.raises(RapidInputError, match="names no given tool"):
        list(llm.stream_chat_with_tools(TOOLS, user_msg=QUESTION, tool_choice="search"))
    with pytest.raises(RapidInputError, match="without tools"):
        llm.chat_with_tools([], user_msg=QUESTION, tool_required=True)


# ---- structured output ---------------------------------------------------------------------

PROMPT = PromptTemplate("weather in {city}")


def test_structured_predict_validates_and_equals_the_constrained_engine(
    llm: RapidLLM, engine: RapidEngine
) -> None:
    from rapid_integrations import Grammar

    grammar = Grammar.json_schema(Forecast.model_json_schema())
    for seed in range(2):
        got = llm.structured_predict(
            Forecast, PROMPT, llm_kwargs={"seed": seed, **SAMPLED}, city="paris"
        )
        want = engine.generate(
            [{"role": "user", "content": "weather in paris"}], grammar=grammar, seed=seed, **SAMPLED
        )
        assert isinstance(got, Forecast)
        assert got == Forecast.model_validate_json(want.text)


def test_structured_variants_agree(llm: RapidLLM) -> None:
    kwargs = {"llm_kwargs": {"seed": 3, **SAMPLED}, "city": "rome"}
    whole = llm.structured_predict(Forecast, PROMPT, **kwargs)
    streamed = list(llm.stream_structured_predict(Forecast, PROMPT, **kwargs))
    assert streamed[-1] == whole and len(streamed) > 2
    assert all(not isinstance(p, Forecast) or p == whole for p in streamed)

    async def run_async() -> list[Any]:
        done = await llm.astructured_predict(Forecast, PROMPT, **kwargs)
        partials = [
            p async for p in await llm.astream_structured_predict(Forecast, PROMPT, **kwargs)
        ]
        return [done, partials[-1]]

    assert asyncio.run(run_async()) == [whole, whole]
    structured = llm.as_structured_llm(Forecast)
    response = structured.chat(
        [ChatMessage(role="user", content="weather in rome")], seed=3, **SAMPLED
    )
    assert response.raw == whole and Forecast.model_validate_json(response.message.content) == whole


def test_a_cut_off_structured_answer_raises_naming_the_cause(llm: RapidLLM) -> None:
    short = {"llm_kwargs": {"max_new_tokens": 5}, "city": "paris"}
    with pytest.raises(StructuredOutputError, match=r"cut off .*finish_reason='length'") as caught:
        llm.structured_predict(Forecast, PROMPT, **short)
    assert isinstance(caught.value, RapidError) and caught.value.text.startswith("{")
    with pytest.raises(StructuredOutputError):
        list(llm.stream_structured_predict(Forecast, PROMPT, **short))
    stopped = {"llm_kwargs": {"stop": ["days"]}, "city": "paris"}  # a key every answer has
    with pytest.raises(StructuredOutputError, match="stop string") as caught:
        llm.structured_predict(Forecast, PROMPT, **stopped)
    assert caught.value.finish_reason == "stop" and caught.value.text.endswith('"')
    with pytest.raises(RapidConfigError, match="grammar"):
        llm.structured_predict(Forecast, PROMPT, llm_kwargs={"grammar": None}, city="paris")

    class Unsupported(BaseModel):  # a look-behind in the schema, which xgrammar cannot compile
        when: str = Field(json_schema_extra={"pattern": "(?<=a)b"})

    with pytest.raises(GrammarError, match="cannot compile"):
        llm.structured_predict(Unsupported, PROMPT, city="paris")


def test_function_program_mode_goes_through_a_forced_tool_call(engine: RapidEngine) -> None:
    """pydantic_program_mode="function" keeps LlamaIndex's FunctionCallingProgram, which calls
    predict_and_call: the output class becomes the one required tool, so the call is named."""

    class Named(Forecast):  # the tool's name is the schema's title; this tokenizer has no capitals
        model_config = ConfigDict(title="forecast")

    llm = RapidLLM(engine=engine, pydantic_program_mode="function")
    got = llm.structured_predict(Named, PROMPT, llm_kwargs={"seed": 0, **SAMPLED}, city="paris")
    from llama_index.core.program.function_program import get_function_tool

    spec = get_function_tool(Named).metadata.to_openai_tool(skip_length_check=True)
    want = engine.generate(
        [{"role": "user", "content": "weather in paris"}],
        tools=[spec],
        tool_choice="forecast",
        seed=0,
        **SAMPLED,
    )
    assert got == Named(**want.tool_calls[0].arguments)
