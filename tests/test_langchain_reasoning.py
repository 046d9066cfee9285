"""Reasoning sections and streamed tool calls through ChatRapid (docs/algorithm.md sections 11
and 13, docs/langchain.md): reasoning in `additional_kwargs["reasoning_content"]` as
langchain-ollama returns it (and so a reasoning block in `content_blocks`), streamed chunk by
chunk; tool calls streamed as `tool_call_chunks` that add up to the invoked calls; earlier
turns' reasoning passed to the chat template. On tiny float32 models whose chat template opens
a think section (tests/test_reasoning.py's), checked against the engine called directly."""

from __future__ import annotations

import asyncio
import functools
import operator
from pathlib import Path
from typing import Any

import pytest
import torch
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage

from langchain_rapid import ChatRapid, RapidLLM
from langchain_rapid.chat_models import to_chat_messages
from rapid_integrations import RapidConfig, RapidEngine
from tests.serve_fixtures import save_tiny_model
from tests.test_reasoning import OPEN_TEMPLATE, QUESTIONS, WEATHER
from tests.tiny import JSON_ALPHABET, char_tokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

THINK = {"max_reasoning_tokens": 7}
CALL = {"max_reasoning_tokens": 5, "max_new_tokens": 120}


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def reasoning_tokenizer() -> Any:
    """The character tokenizer that writes JSON and the call markup, with a chat template
    that opens a think section (tests/test_reasoning.py's)."""
    tok = char_tokenizer(JSON_ALPHABET + "\n")
    tok.chat_template = OPEN_TEMPLATE
    return tok


def save_reasoning_model(folder: Path) -> Path:
    """A tiny random model with `reasoning_tokenizer()`, saved as a model folder (the docs'
    `reasoning_model`)."""
    return save_tiny_model(folder, reasoning_tokenizer(), window=2048)


def reasoning_engine() -> RapidEngine:
    """tests/test_reasoning.py's tiny pair: JSON and call markup, a template that opens a
    think section; greedy, eta = 0."""
    tok = reasoning_tokenizer()
    target = tiny_llama(len(tok), seed=11, window=1024, dtype=torch.float32)
    draft = tiny_llama(len(tok), seed=12, layers=1, window=1024, dtype=torch.float32)
    return RapidEngine(target, draft, tokenizer=tok, config=RapidConfig(eta=0.0, max_new_tokens=60))


@pytest.fixture(scope="module")
def engine() -> RapidEngine:
    return reasoning_engine()


def caller(engine: RapidEngine, tokens: int = CALL["max_new_tokens"]) -> Any:
    """ChatRapid with CALL's settings, bound to the weather tool and made to call it."""
    model = ChatRapid(engine=engine, max_tokens=tokens, max_reasoning_tokens=5)
    return model.bind_tools([WEATHER], tool_choice="required")


def summed(chunks: list[AIMessageChunk]) -> AIMessageChunk:
    return functools.reduce(operator.add, chunks)


def calls_of(message: AIMessage) -> list[tuple[str, dict[str, Any]]]:
    """Name and arguments of each call (ids are drawn afresh by every call)."""
    return [(c["name"], c["args"]) for c in message.tool_calls]


# ---- reasoning ----------------------------------------------------------------------------------


def test_reasoning_is_reasoning_content_and_a_content_block(engine: RapidEngine) -> None:
    reply = ChatRapid(engine=engine, **THINK).invoke("ab 12")
    out = engine.generate(chat("ab 12"), **THINK)
    assert out.reasoning and out.text
    assert reply.additional_kwargs["reasoning_content"] == out.reasoning
    assert reply.content == out.text
    assert reply.content_blocks[0] == {"type": "reasoning", "reasoning": out.reasoning}
    assert reply.content_blocks[1]["type"] == "text"
    assert reply.usage_metadata is not None
    details = reply.usage_metadata.get("output_token_details")
    assert details == {"reasoning": out.stats.reasoning_tokens} and details["reasoning"] > 7


def test_streamed_reasoning_comes_first_and_adds_up(engine: RapidEngine) -> None:
    model = ChatRapid(engine=engine, **THINK)
    out = engine.generate(chat("ab 12"), **THINK)
    chunks = list(model.stream("ab 12"))
    pieces = [c.additional_kwargs.get("reasoning_content", "") for c in chunks]
    assert "".join(pieces) == out.reasoning and sum(map(bool, pieces)) > 1
    first_text = next(i for i, c in enumerate(chunks) if c.content)
    assert not any(pieces[first_text:])  # the answer follows the section
    whole = summed(chunks)
    assert whole.additional_kwargs == model.invoke("ab 12").additional_kwargs
    assert whole.content == out.text

    async def collect() -> list[AIMessageChunk]:
        return [c async for c in model.astream("ab 12")]

    assert summed(asyncio.run(collect())).additional_kwargs == whole.additional_kwargs


def test_the_llm_reports_the_section_in_generation_info(engine: RapidEngine) -> None:
    generation = RapidLLM(engine=engine, **THINK).generate(["ab 12"]).generations[0][0]
    out = engine.generate(chat("ab 12"), **THINK)
    assert generation.text == out.text
    assert generation.generation_info["reasoning_content"] == out.reasoning


def test_reasoning_off_leaves_the_markers_as_text(engine: RapidEngine) -> None:
    reply = ChatRapid(engine=engine, reasoning=False).invoke("ab 12")
    out = engine.generate(chat("ab 12"), reasoning=False)
    assert "reasoning_content" not in reply.additional_kwargs
    assert reply.content == out.text and out.reasoning is None
    assert "output_token_details" not in (reply.usage_metadata or {})


def test_earlier_reasoning_goes_to_the_template(engine: RapidEngine) -> None:
    """An AI message's reasoning, as `reasoning_content` (what ChatRapid returns) or as a
    reasoning content block, reaches the template as the turn's `reasoning_content`."""
    as_kwargs = AIMessage("cd", additional_kwargs={"reasoning_content": "efg"})
    as_block = AIMessage(
        [{"type": "reasoning", "reasoning": "efg"}, {"type": "text", "text": "cd"}]
    )
    turns = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "cd", "reasoning_content": "efg"},
        {"role": "user", "content": "hi"},
    ]
    model = ChatRapid(engine=engine, max_tokens=2)
    for earlier in (as_kwargs, as_block):
        history = [HumanMessage("ab"), earlier, HumanMessage("hi")]
        assert to_chat_messages(history) == turns
        usage = model.invoke(history).usage_metadata
        assert usage is not None and usage["input_tokens"] == engine.count_tokens(turns)
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in turns]
    assert engine.count_tokens(turns) == engine.count_tokens(plain) + len("<think>efg</think>")


# ---- streamed tool calls ------------------------------------------------------------------------


def test_streamed_tool_calls_add_up_to_the_invoked_ones(engine: RapidEngine) -> None:
    """The calls arrive as `tool_call_chunks` over several chunks (id and name first, then
    argument text, the arguments' JSON exactly as the engine's), and the chunks' sum has
    the calls `invoke` returns, which are the engine's."""
    bound = caller(engine)
    for question in QUESTIONS:
        chunks = list(bound.stream(question))
        with_calls = [c for c in chunks if c.tool_call_chunks]
        assert len(with_calls) > 1  # streamed, not only at the end
        first = with_calls[0].tool_call_chunks[0]
        assert first["id"].startswith("call_") and first["name"] == "get_weather"
        assert all(
            (t["id"], t["name"]) == (None, None) for c in with_calls[1:] for t in c.tool_call_chunks
        )
        whole = summed(chunks)
        out = engine.generate(chat(question), tools=[WEATHER], tool_choice="required", **CALL)
        assert [t["args"] for t in whole.tool_call_chunks] == [
            c.arguments_json for c in out.tool_calls
        ]
        assert calls_of(whole) == calls_of(bound.invoke(question))
        assert calls_of(whole) == [(c.name, c.arguments) for c in out.tool_calls]
        assert whole.tool_calls[0]["id"] == first["id"]
        assert whole.additional_kwargs["reasoning_content"] == out.reasoning


def test_a_call_cut_off_by_the_token_limit_is_none_when_invoked(engine: RapidEngine) -> None:
    """At 88 tokens the call's arguments are complete but its markup is not closed: the
    engine returns no call, and neither does `invoke`, though the stream showed its
    fragments as they came (as a streaming OpenAI model's would)."""
    cut = {**CALL, "max_new_tokens": 88}
    out = engine.generate(chat("ab 12"), tools=[WEATHER], tool_choice="required", **cut)
    assert out.finish_reason == "length" and out.tool_calls == []
    bound = caller(engine, 88)
    reply = bound.invoke("ab 12")
    assert reply.tool_calls == [] and reply.response_metadata["finish_reason"] == "length"
    assert summed(list(bound.stream("ab 12"))).tool_call_chunks  # what the stream showed

    async def ainvoke() -> AIMessage:
        return await bound.ainvoke("ab 12")

    assert asyncio.run(ainvoke()).tool_calls == []


def test_astream_tool_calls_add_up_too(engine: RapidEngine) -> None:
    bound = caller(engine)

    async def collect() -> list[AIMessageChunk]:
        return [c async for c in bound.astream("ab 12")]

    assert calls_of(summed(asyncio.run(collect()))) == calls_of(bound.invoke("ab 12"))
