"""LlamaIndex's FunctionAgent through a tool loop on the embedded SmolLM2 (slow).

The agent must call the tool with arguments that match its schema, send the tool's result back
to the model as a tool message, and end with an answer that contains the returned value, which
the model can only know from the tool.
"""

# No `from __future__ import annotations`: FunctionTool reads the tools' annotations as types.

import asyncio
from typing import Any, Literal

import pytest
from llama_index.core.agent.workflow import AgentInput, FunctionAgent, ToolCallResult
from llama_index.core.base.llms.types import ToolCallBlock
from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool

from llamaindex_rapid import RapidLLM
from rapid_integrations import RapidEngine

CODES = {"red": "4417", "blue": "9052", "green": "3868"}
# One worked example (a call, its result, an answer from it) in the history: the 135M model
# answers from a tool's result once it has seen one; it also sends tool history back.
WORKED_EXAMPLE = [
    ChatMessage(role="user", content="What is the secret code of the yellow box?"),
    ChatMessage(
        role="assistant",
        blocks=[
            ToolCallBlock(
                tool_call_id="call_0", tool_name="get_code", tool_kwargs={"box": "yellow"}
            )
        ],
    ),
    ChatMessage(
        role="tool",
        content="The yellow box holds the code 1234.",
        additional_kwargs={"tool_call_id": "call_0"},
    ),
    ChatMessage(role="assistant", content="The yellow box holds the code 1234."),
]


async def _run(agent: FunctionAgent, question: str) -> tuple[str, list[Any]]:
    handler = agent.run(question, chat_history=WORKED_EXAMPLE)
    events = [
        e async for e in handler.stream_events() if isinstance(e, AgentInput | ToolCallResult)
    ]
    return str(await handler), events


@pytest.mark.slow
def test_function_agent_calls_the_tool_and_answers_with_its_result(
    smol_engine: RapidEngine,
) -> None:
    calls: list[str] = []

    def get_code(box: Literal["red", "blue", "green"]) -> str:
        """Return the secret code written inside a box."""
        calls.append(box)
        return f"The {box} box holds the code {CODES[box]}."

    llm = RapidLLM(engine=smol_engine, max_new_tokens=32, temperature=0.0)
    agent = FunctionAgent(
        tools=[FunctionTool.from_defaults(get_code)], llm=llm, initial_tool_choice="get_code"
    )
    answer, events = asyncio.run(_run(agent, "What is the secret code of the blue box?"))
    assert calls == ["blue"]
    (result,) = [e for e in events if isinstance(e, ToolCallResult)]
    assert result.tool_kwargs == {"box": "blue"}
    assert result.tool_output.content == "The blue box holds the code 9052."
    # The model's next input holds the call it made and the tool's result for that call.
    last_input = [e for e in events if isinstance(e, AgentInput)][-1].input
    sent = [m for m in last_input if m.role == "tool"][-1]
    assert sent.content == result.tool_output.content
    assert sent.additional_kwargs["tool_call_id"] == result.tool_id
    assert "9052" in answer
