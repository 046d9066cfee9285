"""Runs every example of docs/llamaindex.md, in order, on the embedded SmolLM2 model.

The page is executed like a notebook: one namespace, one section per test, with `long_text`
preset to the shared long document. Each section's results are then checked here, so the
page's claims (right answers, stats, errors) are tested rather than only run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from llama_index.core.base.llms.types import ThinkingBlock, ToolCallBlock

from rapid_integrations import ContextWindowExceededError
from tests.doc_examples import DOCS, python_sections
from tests.llamaindex_data import ANSWER, long_document
from tests.test_langchain_reasoning import save_reasoning_model

DOC = DOCS / "llamaindex.md"
SECTIONS = python_sections(DOC)


def _check_setup(ns: dict[str, Any]) -> None:
    meta = ns["llm"].metadata
    assert meta.context_window == ns["llm"].get_engine().context_window == 8192
    assert meta.is_chat_model and meta.num_output == 24


def _check_compact(ns: dict[str, Any]) -> None:
    assert ANSWER in str(ns["response"])
    stats = ns["stats"]
    assert stats["mode"] == "rapid" and stats["retrieved_tokens"] > 0
    assert stats["draft_context_tokens"] * 3 < stats["target_context_tokens"]
    assert "Paris" in ns["completion"].text  # a plain question, answered as a user turn
    assert ns["completion"].raw["rapid_stats"]["new_tokens"] > 0


def _check_streaming(ns: dict[str, Any]) -> None:
    assert ANSWER in ns["streamed"]


def _check_logprobs(ns: dict[str, Any]) -> None:
    scored = ns["scored"]
    assert "Paris" in scored.text
    assert len(scored.logprobs) == scored.raw["usage"]["completion_tokens"]
    assert b"".join(bytes(token[0].bytes) for token in scored.logprobs).decode() == scored.text
    assert all(len(token) == 3 for token in scored.logprobs)  # emitted + 2 alternatives
    sizes = ns["sizes"]
    assert sizes == sorted(sizes) and sizes[0] > 0 and sizes[-1] > 4


def _check_reasoning(ns: dict[str, Any]) -> None:
    thinking, answer = ns["thinking"], ns["answer"]
    assert isinstance(thinking, ThinkingBlock) and thinking.content
    assert ns["thought"].message.content == answer.text
    assert ns["streamed_thought"] == thinking.content
    responses = ns["call_stream"]
    blocks = [b for r in responses[:-1] for b in r.message.blocks if isinstance(b, ToolCallBlock)]
    assert len(blocks) > 1 and all(isinstance(b.tool_kwargs, dict) for b in blocks)
    [selection] = ns["selections"]
    assert selection.tool_name == "get_weather" and set(selection.tool_kwargs) == {"city"}
    [entry] = responses[-2].message.additional_kwargs["tool_calls"]  # JSON text so far
    assert json.loads(entry["function"]["arguments"]) == selection.tool_kwargs


def _check_summary(ns: dict[str, Any]) -> None:
    assert ANSWER in str(ns["summary_answer"])


def _check_chat(ns: dict[str, Any]) -> None:
    assert ANSWER in str(ns["first"])
    assert all(str(ns[turn]).strip() for turn in ("second", "third"))
    assert len(ns["chat_engine"].chat_history) == 6


def _check_agent(ns: dict[str, Any]) -> None:
    assert "9052" in ns["agent_answer"]


def _check_overflow(ns: dict[str, Any]) -> None:
    overflow = ns["overflow"]
    assert isinstance(overflow, ContextWindowExceededError)
    assert overflow.context_window == 8192 < overflow.prompt_tokens


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "An LLM and an index": _check_setup,
    'A query engine with `response_mode="compact"`': _check_compact,
    "Streaming through a query engine": _check_streaming,
    "Log probabilities": _check_logprobs,
    "Reasoning models and streamed tool calls": _check_reasoning,
    "A summary index over the whole document": _check_summary,
    "A chat engine over several turns": _check_chat,
    "A ReAct agent with one tool": _check_agent,
    "Prompts longer than the window": _check_overflow,
}


@pytest.fixture(scope="module")
def namespace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = save_reasoning_model(tmp_path_factory.mktemp("reasoning-model"))
    return {"long_text": long_document(), "reasoning_model": str(folder)}


def test_every_section_with_code_is_checked() -> None:
    assert [heading for heading, _ in SECTIONS] == list(CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize(("heading", "code"), SECTIONS, ids=list(CHECKS))
def test_docs_example(heading: str, code: str, namespace: dict[str, Any]) -> None:
    # dont_inherit: this module's `from __future__ import annotations` would turn the tools'
    # annotations into strings, which FunctionTool cannot resolve in this namespace.
    exec(compile(code, f"{DOC.name}: {heading}", "exec", dont_inherit=True), namespace)
    CHECKS[heading](namespace)
