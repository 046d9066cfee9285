"""Runs the LangChain examples of docs/agents.md, in order, on the embedded SmolLM2 model.

The section is executed like a notebook: one namespace, one `###` subsection per test. Each
subsection's results are then checked here: the tools were really called, with arguments the
tool accepts, the tool's result came back as a ToolMessage, and the final answer uses it. So
the create_agent and LangGraph loops run end to end, and the page cannot drift from the code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

from rapid_integrations import RapidInputError
from tests.doc_examples import DOCS, python_subsections
from tests.test_langchain_reasoning import save_reasoning_model

PAGE = DOCS / "agents.md"
SECTIONS = python_subsections(PAGE, "LangChain")


def check_tool_loop(messages: list[BaseMessage], tool: Any, value: str) -> None:
    """human -> AI call -> the tool's own result -> an AI answer that quotes `value`."""
    assert [type(m) for m in messages] == [HumanMessage, AIMessage, ToolMessage, AIMessage]
    _, call_message, result, answer = messages
    [call] = call_message.tool_calls
    assert call["name"] == tool.name
    assert result.status == "success" and result.tool_call_id == call["id"]
    assert result.content == tool.invoke(call["args"])  # valid arguments, really run
    assert value in result.content
    assert not answer.tool_calls and value in answer.content
    assert "<" not in answer.content  # no call or result markup copied


def _check_bind_tools(ns: dict[str, Any]) -> None:
    check_tool_loop(
        [ns["question"], ns["call_message"], ns["tool_message"], ns["answer"]],
        ns["get_price"],
        "37",
    )
    assert "teapot" in ns["call_message"].tool_calls[0]["args"]["product"]


def _check_streamed(ns: dict[str, Any]) -> None:
    invoked = [(c["name"], c["args"]) for c in ns["call_message"].tool_calls]
    assert [(c["name"], c["args"]) for c in ns["streamed_call"].tool_calls] == invoked
    assert sum(bool(c.tool_call_chunks) for c in ns["call_chunks"]) > 1  # streamed
    scored = ns["scored_call"]
    assert [(c["name"], c["args"]) for c in scored.tool_calls] == invoked  # same call, scored
    assert len(ns["call_tokens"]) == scored.usage_metadata["output_tokens"]
    thought = ns["thought_call"]
    assert thought.additional_kwargs["reasoning_content"]
    assert [c["name"] for c in thought.tool_calls] == ["get_weather"]


def _check_structured(ns: dict[str, Any]) -> None:
    for city in ns["cities"].values():
        assert isinstance(city, ns["City"])
        assert (city.name, city.country) == ("Paris", "France")
    assert {key: value.lower() for key, value in ns["as_json"].items()} == {
        "name": "paris",
        "country": "france",
    }
    assert ns["with_raw"]["parsing_error"] is None
    assert ns["with_raw"]["parsed"] == ns["cities"]["json_schema"]
    assert isinstance(ns["cut_off"], OutputParserException)
    assert "finish_reason='length'" in str(ns["cut_off"])


def _check_create_agent(ns: dict[str, Any]) -> None:
    check_tool_loop(ns["state"]["messages"], ns["get_stock"], "412")


def _check_langgraph(ns: dict[str, Any]) -> None:
    check_tool_loop(ns["graph_state"]["messages"], ns["get_stock"], "412")


def _check_bad_input(ns: dict[str, Any]) -> None:
    assert isinstance(ns["same_name"], RapidInputError)
    assert "unique" in str(ns["same_name"])
    assert isinstance(ns["unknown_choice"], RapidInputError)
    assert "get_weather" in str(ns["unknown_choice"])


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "Tool calls with `bind_tools`": _check_bind_tools,
    "Streamed calls, log probabilities and reasoning": _check_streamed,
    "Structured output": _check_structured,
    "An agent with `create_agent`": _check_create_agent,
    "A LangGraph agent": _check_langgraph,
    "Bad input": _check_bad_input,
}


@pytest.fixture(scope="module")
def namespace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = save_reasoning_model(tmp_path_factory.mktemp("reasoning-model"))
    return {"reasoning_model": str(folder)}


def test_every_langchain_example_is_checked() -> None:
    assert [heading for heading, _ in SECTIONS] == list(CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize(("heading", "code"), SECTIONS, ids=[heading for heading, _ in SECTIONS])
def test_docs_agents(heading: str, code: str, namespace: dict[str, Any]) -> None:
    exec(compile(code, f"{PAGE.name}: {heading}", "exec"), namespace)
    CHECKS[heading](namespace)
