"""LlamaIndex chat messages to the engine's chat messages and back, tool calls included.

History goes to the engine in the OpenAI shapes (docs/algorithm.md section 11 renders them):
role/content dicts, an assistant's `tool_calls` (from its `ToolCallBlock`s, else from
`additional_kwargs["tool_calls"]`) and a tool result's `tool_call_id` and `name`. Answers come
back as assistant messages whose calls are `ToolCallBlock`s, with the OpenAI `tool_calls` in
`additional_kwargs` too, and whose reasoning is a `ThinkingBlock`, as llama-index-llms-openai
returns them; an earlier answer's `ThinkingBlock` goes back as its `reasoning_content`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.llms.utils import parse_partial_json

from rapid_integrations import CallFragment, RapidInputError, ToolCall
from rapid_integrations.structured_output.tools import call_arguments

# LlamaIndex roles with no chat-template counterpart, mapped to the nearest standard role.
_ROLES = {
    MessageRole.DEVELOPER: "system",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}
_MEDIA_BLOCKS = frozenset({"image", "audio", "video", "document"})


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """Raise for what the model cannot read, which `ChatMessage.content` would silently drop:
    media blocks, and function-role messages (OpenAI's old form, without call ids)."""
    for i, message in enumerate(messages):
        if message.role == MessageRole.FUNCTION:
            raise RapidInputError(
                f"message {i}: a function message (OpenAI's old form, without a call id) is "
                "not supported; give a tool result as a tool message with "
                "additional_kwargs={'tool_call_id': ...}, as FunctionAgent does"
            )
        for block in message.blocks:
            if block.block_type in _MEDIA_BLOCKS:
                raise RapidInputError(
                    f"message {i}: {block.block_type!r} content is not supported; RapidLLM "
                    "reads text only"
                )


def has_tool_turns(messages: Sequence[ChatMessage]) -> bool:
    """Whether any message is a tool result or carries tool calls."""
    return any(m.role == MessageRole.TOOL or _calls(m) for m in messages)


def to_engine_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The engine's chat messages: role, text content, and the OpenAI tool keys.

    A tool result without `additional_kwargs["name"]` is named after the call it answers.
    """
    names = {
        block.tool_call_id: block.tool_name
        for message in messages
        for block in message.blocks
        if isinstance(block, ToolCallBlock)
    }
    out = []
    for message in messages:
        item: dict[str, Any] = {
            "role": _ROLES.get(message.role, message.role.value),
            "content": message.content or "",
        }
        thinking = [b.content for b in message.blocks if isinstance(b, ThinkingBlock) and b.content]
        if thinking:  # an earlier answer's reasoning: the chat template renders or drops it
            item["reasoning_content"] = "".join(thinking)
        calls = _calls(message)
        if calls:
            item["tool_calls"] = calls
        if message.role == MessageRole.TOOL:
            call_id = message.additional_kwargs.get("tool_call_id")
            item["tool_call_id"] = call_id
            item["name"] = message.additional_kwargs.get("name") or names.get(call_id)
        out.append(item)
    return out


def _calls(message: ChatMessage) -> list[Any]:
    """A message's tool calls as OpenAI `tool_calls` entries (the engine checks their shape)."""
    blocks = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
    if blocks:
        return [
            {
                "id": b.tool_call_id,
                "type": "function",
                "function": {"name": b.tool_name, "arguments": b.tool_kwargs},
            }
            for b in blocks
        ]
    # History written by other integrations: OpenAI's call objects, or plain dicts.
    calls = message.additional_kwargs.get("tool_calls") or []
    return [c.model_dump() if hasattr(c, "model_dump") else c for c in calls]


@dataclass(frozen=True)
class StreamedCall:
    """A tool call as far as its streamed fragments have come: `arguments` is a beginning of
    its arguments' JSON text (the whole of it once the call is complete)."""

    id: str
    name: str
    arguments: str = ""


def with_fragments(
    calls: tuple[StreamedCall, ...], fragments: Sequence[CallFragment]
) -> tuple[StreamedCall, ...]:
    """`calls` with one step's fragments added (docs/algorithm.md section 11: a call's first
    fragment names it, the next ones carry argument text)."""
    out = list(calls)
    for f in fragments:
        if f.index == len(out):
            out.append(StreamedCall(f.id or "", f.name or ""))
        out[f.index] = dataclasses.replace(
            out[f.index], arguments=out[f.index].arguments + f.arguments
        )
    return tuple(out)


def assistant_message(
    text: str,
    calls: Sequence[ToolCall | StreamedCall] = (),
    reasoning: str | None = None,
) -> ChatMessage:
    """An answer: its reasoning (a `ThinkingBlock`), its text (a block only when there is
    text or no call), then its calls, as `ToolCallBlock`s and in OpenAI's shape in
    `additional_kwargs["tool_calls"]` (llama-index-llms-openai's). A call still streaming
    has in its block the arguments read so far, and in `additional_kwargs` their JSON text so
    far, as llama-index-llms-openai's streamed ones."""
    blocks: list[Any] = [ThinkingBlock(content=reasoning)] if reasoning else []
    blocks += [TextBlock(text=text)] if text or not calls else []
    blocks += [
        ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=_kwargs(c)) for c in calls
    ]
    extra = {"tool_calls": [_openai_call(c) for c in calls]} if calls else {}
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)


def _kwargs(call: ToolCall | StreamedCall) -> dict[str, Any]:
    """A call's arguments; a streaming call's partial JSON text read as far as it goes with
    LlamaIndex's own `parse_partial_json` (as llama-index-llms-openai reads its streamed
    calls), so that `get_tool_calls_from_response`, which refuses arguments that are no JSON
    object, serves every streamed response (FunctionAgent reads each one)."""
    if isinstance(call, ToolCall):
        return call.arguments
    try:
        value = parse_partial_json(call.arguments)
    except (ValueError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


def _openai_call(call: ToolCall | StreamedCall) -> dict[str, Any]:
    if isinstance(call, ToolCall):
        return call.to_openai()
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}


def tool_selections(response: ChatResponse, error_on_no_tool_call: bool) -> list[ToolSelection]:
    """The response's calls as `ToolSelection`s; none raises when `error_on_no_tool_call`."""
    blocks = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
    if not blocks and error_on_no_tool_call:
        finish = (response.raw or {}).get("finish_reason")
        raise RapidInputError(
            f"the response has no tool call (finish_reason={finish!r}); pass "
            "tool_required=True to make the model call a tool, or error_on_no_tool_call=False "
            "to get an empty list"
        )
    return [
        # Arguments as JSON text (other integrations' blocks) are parsed: ToolSelection would
        # silently turn them into no arguments.
        ToolSelection(
            tool_id=b.tool_call_id or "",
            tool_name=b.tool_name,
            tool_kwargs=call_arguments({"arguments": b.tool_kwargs}),
        )
        for b in blocks
    ]
