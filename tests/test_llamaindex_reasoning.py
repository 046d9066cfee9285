"""Reasoning sections and streamed tool calls through the LlamaIndex RapidLLM (docs/algorithm.md
sections 11 and 13, docs/llamaindex.md): the reasoning as a `ThinkingBlock` (and each step's
part as `thinking_delta`, which agents stream), tool calls growing in the streamed responses'
`ToolCallBlock`s and `additional_kwargs["tool_calls"]` as llama-index-llms-openai's do, the last
response's calls the engine's; earlier answers' `ThinkingBlock`s passed to the template."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from llama_index.core.base.llms.types import TextBlock, ThinkingBlock, ToolCallBlock
from llama_index.core.llms import ChatMessage, ChatResponse
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from llamaindex_rapid import RapidLLM
from rapid_integrations import RapidEngine
from tests.test_langchain_reasoning import CALL, THINK, chat, reasoning_engine
from tests.test_reasoning import QUESTIONS

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

QUESTION = [ChatMessage(role="user", content="ab 12")]


@pytest.fixture(scope="module")
def engine() -> RapidEngine:
    return reasoning_engine()


def get_weather(city: str) -> str:
    """weather"""
    return city


class City(BaseModel):
    city: str = Field(max_length=8)  # room for the call within CALL's tokens, as WEATHER's


TOOL = FunctionTool.from_defaults(get_weather, fn_schema=City)
SPEC = TOOL.metadata.to_openai_tool(skip_length_check=True)


def test_reasoning_is_a_thinking_block(engine: RapidEngine) -> None:
    response = RapidLLM(engine=engine, **THINK).chat(QUESTION)
    out = engine.generate(chat("ab 12"), **THINK)
    assert out.reasoning and out.text
    assert response.message.blocks == [
        ThinkingBlock(content=out.reasoning),
        TextBlock(text=out.text),
    ]
    assert response.message.content == out.text
    assert response.additional_kwargs["reasoning_content"] == out.reasoning
    assert response.raw["rapid_stats"]["reasoning_tokens"] == out.stats.reasoning_tokens
    completion = RapidLLM(engine=engine, **THINK).complete("ab 12")
    assert (completion.text, completion.additional_kwargs["reasoning_content"]) == (
        out.text,
        out.reasoning,
    )


def test_streamed_reasoning_grows_and_ends_as_chat(engine: RapidEngine) -> None:
    llm = RapidLLM(engine=engine, **THINK)
    whole = llm.chat(QUESTION)

    async def collect() -> list[ChatResponse]:
        return [r async for r in await llm.astream_chat(QUESTION)]

    for responses in (list(llm.stream_chat(QUESTION)), asyncio.run(collect())):
        deltas = [r.additional_kwargs.get("thinking_delta", "") for r in responses]
        assert "".join(deltas) == whole.additional_kwargs["reasoning_content"]
        assert sum(map(bool, deltas)) > 1
        thoughts = [
            b.content for r in responses for b in r.message.blocks if isinstance(b, ThinkingBlock)
        ]
        assert all(b.startswith(a) for a, b in itertools.pairwise(thoughts))
        assert thoughts[-1] == whole.additional_kwargs["reasoning_content"]
        assert responses[-1].message.blocks == whole.message.blocks


def test_reasoning_off_has_no_thinking_block(engine: RapidEngine) -> None:
    response = RapidLLM(engine=engine, reasoning=False).chat(QUESTION)
    assert not any(isinstance(b, ThinkingBlock) for b in response.message.blocks)
    assert "reasoning_content" not in response.additional_kwargs
    assert response.message.content == engine.generate(chat("ab 12"), reasoning=False).text


def test_an_earlier_thinking_block_goes_to_the_template(engine: RapidEngine) -> None:
    earlier = ChatMessage(
        role="assistant", blocks=[ThinkingBlock(content="efg"), TextBlock(text="cd")]
    )
    history = [
        ChatMessage(role="user", content="ab"),
        earlier,
        ChatMessage(role="user", content="hi"),
    ]
    turns = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "cd", "reasoning_content": "efg"},
        {"role": "user", "content": "hi"},
    ]
    response = RapidLLM(engine=engine, max_new_tokens=2).chat(history)
    assert response.raw["usage"]["prompt_tokens"] == engine.count_tokens(turns)
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in turns]
    assert engine.count_tokens(turns) == engine.count_tokens(plain) + len("<think>efg</think>")


def streamed_arguments(response: ChatResponse) -> list[str]:
    """The arguments' JSON text so far of each call, in OpenAI's shape."""
    calls = response.message.additional_kwargs.get("tool_calls", [])
    return [
        c["function"]["arguments"] if isinstance(c, dict) else c.function.arguments for c in calls
    ]


def test_streamed_tool_calls_grow_and_end_as_the_engines(engine: RapidEngine) -> None:
    """Each response has the calls so far: an OpenAI entry whose arguments are a beginning
    of the final JSON text, and a `ToolCallBlock` with them read so far; the last response's
    calls are the engine's (arguments parsed), as `chat_with_tools` returns them."""
    llm = RapidLLM(engine=engine, **CALL)
    for question in QUESTIONS:
        responses = list(llm.stream_chat_with_tools([TOOL], user_msg=question, tool_required=True))
        out = engine.generate(
            chat(question), tools=[SPEC], tool_choice="required", parallel_tool_calls=False, **CALL
        )
        (call,) = out.tool_calls
        partial = [a for r in responses[:-1] for a in streamed_arguments(r)]
        assert len(partial) > 1 and all(call.arguments_json.startswith(a) for a in partial)
        blocks = [
            b for r in responses[:-1] for b in r.message.blocks if isinstance(b, ToolCallBlock)
        ]
        assert len(blocks) == len(partial) and all(isinstance(b.tool_kwargs, dict) for b in blocks)
        entries = [
            e for r in responses[:-1] for e in r.message.additional_kwargs.get("tool_calls", [])
        ]
        assert {(e["id"], e["function"]["name"]) for e in entries} == {
            (entries[0]["id"], call.name)
        }
        assert entries[-1]["function"]["arguments"] == call.arguments_json
        final = llm.get_tool_calls_from_response(responses[-1])
        assert [(s.tool_name, s.tool_kwargs) for s in final] == [(call.name, call.arguments)]
        assert final[0].tool_id == entries[0]["id"]  # the id streamed first is the call's
        whole = llm.chat_with_tools([TOOL], user_msg=question, tool_required=True)
        assert [(s.tool_name, s.tool_kwargs) for s in llm.get_tool_calls_from_response(whole)] == [
            (call.name, call.arguments)
        ]


def test_a_streamed_partial_call_reads_as_far_as_it_goes(engine: RapidEngine) -> None:
    """`get_tool_calls_from_response` serves a response mid-call (FunctionAgent reads each
    one): its block holds the partial JSON read by LlamaIndex's own `parse_partial_json`, as
    llama-index-llms-openai reads its streamed calls."""
    llm = RapidLLM(engine=engine, **CALL)
    responses = list(llm.stream_chat_with_tools([TOOL], user_msg="ab 12", tool_required=True))
    mid = [r for r in responses[:-1] if streamed_arguments(r)]
    selections = [llm.get_tool_calls_from_response(r, error_on_no_tool_call=False) for r in mid]
    assert all(s[0].tool_name == "get_weather" for s in selections)
    assert (
        selections[-1][0].tool_kwargs
        == llm.get_tool_calls_from_response(responses[-1])[0].tool_kwargs
    )


def test_a_call_cut_off_by_the_token_limit_is_none_at_the_end(engine: RapidEngine) -> None:
    """The stream showed the call's fragments; the engine returns no call (its markup is not
    closed), and neither does the last response, nor `chat_with_tools`."""
    llm = RapidLLM(engine=engine, max_reasoning_tokens=5, max_new_tokens=88)
    responses = list(llm.stream_chat_with_tools([TOOL], user_msg="ab 12", tool_required=True))
    assert any(streamed_arguments(r) for r in responses[:-1])
    assert llm.get_tool_calls_from_response(responses[-1], error_on_no_tool_call=False) == []
    assert responses[-1].raw["finish_reason"] == "length"
    whole = llm.chat_with_tools([TOOL], user_msg="ab 12", tool_required=True)
    assert llm.get_tool_calls_from_response(whole, error_on_no_tool_call=False) == []
