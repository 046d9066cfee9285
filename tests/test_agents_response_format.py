"""Agents with tools and a response format, on SmolLM2: call tools, then answer in the schema.

LangChain's `create_agent(model, tools=[...], response_format=Schema)` picks its provider
strategy for a model whose profile declares native structured output, as `ChatRapid`'s does:
it binds the tools with OpenAI's `response_format`, and the model either calls a tool or
answers in the schema (the engine's union grammar, docs/algorithm.md section 11). The 135M
model is forced to call the tool first (a middleware names it), then answers under "none".
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import wrap_model_call
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel

from langchain_rapid import ChatRapid
from rapid_integrations import RapidEngine


class StockReport(BaseModel):
    """How many of a product are in stock."""

    product: str
    count: int


@tool
def get_stock(product: str) -> str:
    """Look up how many of a product are in stock."""
    return f"There are 412 {product}s in stock."


@wrap_model_call
def call_then_answer(request: Any, handler: Any) -> Any:
    """Force one call of the tool first; once its result is in, answer in the schema. The
    provider strategy binds `model_settings`, not the request's `tool_choice`."""
    answered = any(isinstance(m, ToolMessage) for m in request.messages)
    choice = "none" if answered else "get_stock"
    return handler(
        request.override(model_settings={**request.model_settings, "tool_choice": choice})
    )


@pytest.mark.slow
def test_create_agent_with_tools_and_a_response_format(smol_engine: RapidEngine) -> None:
    chat = ChatRapid(engine=smol_engine, temperature=0.0, max_tokens=64)
    agent = create_agent(
        chat, tools=[get_stock], response_format=StockReport, middleware=[call_then_answer]
    )
    state = agent.invoke({"messages": [HumanMessage("How many red mugs are in stock?")]})
    _question, call, result, answer = state["messages"]
    assert isinstance(call, AIMessage) and [c["name"] for c in call.tool_calls] == ["get_stock"]
    assert isinstance(result, ToolMessage) and "412" in result.content
    assert isinstance(answer, AIMessage) and not answer.tool_calls
    report = state["structured_response"]
    assert report == StockReport.model_validate_json(answer.content)
    assert report.count == 412  # only the tool knows it
