"""The OpenAI Agents SDK against a live `rapid serve` on the embedded SmolLM2: an `Agent` with a
function tool and a pydantic `output_type`, run by `Runner` over both of the SDK's OpenAI
models, `OpenAIResponsesModel` (its default: `POST /v1/responses` with `text.format`) and
`OpenAIChatCompletionsModel` (`response_format`), and streamed once over the Responses API.

The SDK sends the tools and the output type's strict JSON schema together on every turn; the
server's grammar admits a call of a tool or an answer in the schema (docs/algorithm.md section
11). The 135M model is forced to call the tool first (`ModelSettings(tool_choice="get_stock")`)
and to answer once the tool's result is in (`CallThenAnswer`). The SDK's own `reset_tool_choice`
leaves the second turn on "auto", where this model calls the tool again on every turn until the
run's max_turns (a capable model answers there). Its call names a product of its own ("Mocha",
as in docs/agents.md) rather than the red mugs asked about, so the tests check that the tool ran
with the arguments the model wrote, not which product it chose. The count can only come from
the tool's result, which the tests also find in the engine's prompt of the second turn.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from agents import (
    Agent,
    ItemHelpers,
    MessageOutputItem,
    Model,
    ModelResponse,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    RunResult,
    RunResultStreaming,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)
from agents.items import TResponseStreamEvent
from openai import AsyncOpenAI
from pydantic import BaseModel

from rapid_integrations.serve.calls import EngineCall
from tests.serve_fixtures import MODEL, LiveServer, live_server, recorded_calls

QUESTION = "How many red mugs are in stock?"
STOCK = "There are 412 red mugs in stock."
MAX_TOKENS = 64
SETTINGS = ModelSettings(tool_choice="get_stock", temperature=0.0, max_tokens=MAX_TOKENS)


class StockReport(BaseModel):
    product: str
    count: int


looked_up: list[str] = []  # the products get_stock was called with, in order


@function_tool
def get_stock(product: str) -> str:
    """Look up how many of a product are in stock."""
    looked_up.append(product)
    return STOCK


class CallThenAnswer(Model):
    """An SDK model that sends "none" once a tool's result is in its input (the answer in the
    schema is all the grammar then admits), and otherwise the agent's settings as they are."""

    def __init__(self, model: Model) -> None:
        self.model = model

    @staticmethod
    def forced(input: str | list[Any], model_settings: ModelSettings) -> ModelSettings:
        answered = any(
            isinstance(item, dict) and item.get("type") == "function_call_output" for item in input
        )
        if answered:
            return model_settings.resolve(ModelSettings(tool_choice="none"))
        return model_settings

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[Any],
        model_settings: ModelSettings,
        *args: Any,
        **kwargs: Any,
    ) -> ModelResponse:
        settings = self.forced(input, model_settings)
        return await self.model.get_response(system_instructions, input, settings, *args, **kwargs)

    def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[Any],
        model_settings: ModelSettings,
        *args: Any,
        **kwargs: Any,
    ) -> AsyncIterator[TResponseStreamEvent]:
        settings = self.forced(input, model_settings)
        return self.model.stream_response(system_instructions, input, settings, *args, **kwargs)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    from rapid_integrations.models.loading import ensure_default_model

    set_tracing_disabled(True)  # nothing goes to OpenAI's trace exporter
    with live_server(ensure_default_model(progress=False)) as live:
        yield live


@pytest.fixture
def calls(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> list[EngineCall]:
    """The engine calls the server makes, in order."""
    looked_up.clear()
    return recorded_calls(server, monkeypatch)


def agent(model: Model) -> Agent[Any]:
    return Agent(
        name="stock clerk",
        instructions="Answer questions about the stock.",
        model=CallThenAnswer(model),
        model_settings=SETTINGS,
        tools=[get_stock],
        output_type=StockReport,
    )


def client(server: LiveServer) -> AsyncOpenAI:
    """A client per run: `Runner.run_sync` runs each on an event loop of its own."""
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def check_run(result: RunResult | RunResultStreaming, calls: list[EngineCall], kind: str) -> None:
    """One call of the tool, its result back to the model, then a StockReport that says 412,
    in two engine calls of the endpoint's `kind` with the tool, the schema and max_tokens."""
    call, output, answer = result.new_items
    assert isinstance(call, ToolCallItem) and isinstance(output, ToolCallOutputItem)
    assert isinstance(answer, MessageOutputItem)
    raw_call: Any = call.raw_item
    assert raw_call.name == "get_stock"
    [product] = looked_up  # the tool ran once, with the arguments the model wrote
    assert json.loads(raw_call.arguments) == {"product": product}
    assert output.output == STOCK and output.call_id == raw_call.call_id
    assert len(result.raw_responses) == 2

    first, second = calls
    assert first.kind == second.kind == kind
    for engine_call in calls:
        options = engine_call.options
        assert [t["function"]["name"] for t in options.tools] == ["get_stock"]
        assert options.grammar is not None  # the output type's schema, next to the tool
        assert options.config["max_new_tokens"] == MAX_TOKENS
    assert first.options.tool_choice == {"type": "function", "function": {"name": "get_stock"}}
    assert second.options.tool_choice == "none"
    assert first.prompt[-1] == {"role": "user", "content": QUESTION}
    [tool_message] = [m for m in second.prompt if m["role"] == "tool"]  # type: ignore[index]
    assert tool_message == {"role": "tool", "content": STOCK, "tool_call_id": raw_call.call_id}

    report = result.final_output
    assert isinstance(report, StockReport)
    assert report == StockReport.model_validate_json(ItemHelpers.text_message_output(answer))
    assert report.count == 412  # only the tool knows it


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "kind"),
    [(OpenAIResponsesModel, "responses"), (OpenAIChatCompletionsModel, "chat")],
    ids=["responses", "chat"],
)
def test_an_agent_calls_its_tool_then_answers_in_its_output_type(
    server: LiveServer, calls: list[EngineCall], model_type: Any, kind: str
) -> None:
    model = model_type(model=MODEL, openai_client=client(server))
    check_run(Runner.run_sync(agent(model), QUESTION), calls, kind)


@pytest.mark.slow
async def test_a_streamed_run_over_the_responses_api(
    server: LiveServer, calls: list[EngineCall]
) -> None:
    model = OpenAIResponsesModel(model=MODEL, openai_client=client(server))
    result = Runner.run_streamed(agent(model), QUESTION)
    events = [event async for event in result.stream_events()]
    raw = [e.data.type for e in events if e.type == "raw_response_event"]
    assert raw.count("response.created") == raw.count("response.completed") == 2
    assert "response.function_call_arguments.delta" in raw  # the call, as the model wrote it
    assert "response.output_text.delta" in raw  # then the answer
    items = [e.name for e in events if e.type == "run_item_stream_event"]
    assert items == ["tool_called", "tool_output", "message_output_created"]
    check_run(result, calls, "responses")
