"""`POST /v1/responses`: a Responses API request -> one engine call; its output -> a `response`
object, or the API's stream of events.

The request is read as the chat completion it means (input items -> messages, flat function
tools -> chat tools, `text.format` -> `response_format`), and `chat_call` builds the engine call,
so both endpoints share one path into the engine (tools, grammars, collections, RAPID options).

Stateless: nothing is stored, so `previous_response_id` (and `conversation`, `background`) is
refused; a client sends the whole conversation as input items, earlier outputs included.

A stream is `response.created`, `response.in_progress`, then per output item
`response.output_item.added` ... `response.output_item.done` (a message: its content part and
text deltas; a function call: its argument deltas, as the model writes them), then
`response.completed`, each event with its `sequence_number`. An answer cut off by
`max_output_tokens` ends with `response.incomplete` instead (its response says status
"incomplete" and why), as OpenAI's does; an error mid-stream is one `error` event.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Mapping
from typing import Any

from rapid_integrations.output.outputs import Delta, RapidOutput

from .calls import EngineCall, chat_call, usage
from .collection import Collection
from .errors import ServeError, unsupported
from .schemas import ChatCompletionRequest, ResponsesRequest, TextConfig

STATELESS = (
    "this server is stateless and stores no responses: send the whole conversation as "
    "`input` items (earlier outputs and function_call_output items included)"
)
_LOGPROBS = "log probabilities are not returned by /v1/responses"


def responses_call(request: ResponsesRequest, collections: Mapping[str, Collection]) -> EngineCall:
    """The engine call of a Responses API request; raises `ServeError` for what is refused."""
    _refuse_stateful(request)
    chat: dict[str, Any] = {
        "model": request.model,
        "messages": _messages(request),
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "stop": request.stop,
        "stream": request.stream,
        "tools": _chat_tools(request.tools),
        "tool_choice": _chat_tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": _response_format(request.text),
        "mode": request.mode,
        "draft_prompt": request.draft_prompt,
        "collection": request.collection,
        "query": request.query,
    }
    try:
        call = chat_call(ChatCompletionRequest(**chat, **request.rapid_options()), collections)
    except ServeError as exc:
        raise _renamed(exc) from exc
    return dataclasses.replace(call, kind="responses", id=_id("resp"), echo=_echo(request))


def _refuse_stateful(request: ResponsesRequest) -> None:
    """400 for the fields that need stored state or output this server does not have."""
    for name in ("previous_response_id", "conversation", "prompt"):
        if getattr(request, name) is not None:
            raise unsupported(name, STATELESS)
    if request.background:
        raise unsupported("background", "background responses need stored state; " + STATELESS)
    if request.top_logprobs:
        raise unsupported("top_logprobs", _LOGPROBS)
    if "message.output_text.logprobs" in (request.include or ()):
        raise unsupported("include", _LOGPROBS)
    if request.reasoning is not None:
        raise unsupported("reasoning", "reasoning options are not supported")
    if request.truncation == "auto":
        raise unsupported("truncation", 'only "disabled": an input over the window is an error')
    if request.max_tool_calls is not None:
        raise unsupported("max_tool_calls", "send parallel_tool_calls=false for one call at most")


# ---- input items -> chat messages ----------------------------------------------------------


def _messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` (a system message first), then the input items as chat messages:
    function_call items join the assistant message before them as its `tool_calls`, and a
    function_call_output is a `tool` message."""
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    if isinstance(request.input, str):
        return [*messages, {"role": "user", "content": request.input}]
    if not request.input:
        raise ServeError(422, "input: must not be empty", param="input", code="invalid_value")
    for i, item in enumerate(request.input):
        _add_item(messages, item, f"input.{i}")
    return messages


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise ServeError(
                400,
                f"{param}.role: one of user, system, developer, assistant, got {role!r}",
                param=f"{param}.role",
                code="invalid_value",
            )
        content = _text(item.get("content"), f"{param}.content")
        if role == "assistant" and _thinking(messages):
            messages[-1]["content"] = content
        else:
            messages.append({"role": "system" if role == "developer" else role, "content": content})
    elif kind == "reasoning":
        # An earlier output's reasoning item: the next assistant turn's `reasoning_content`,
        # which the chat template renders or drops (docs/algorithm.md section 13).
        text = _text(item.get("content") or [], f"{param}.content")
        messages.append({"role": "assistant", "content": "", "reasoning_content": text})
    elif kind == "function_call":
        call = {
            "id": _string(item, "call_id", param),
            "type": "function",
            "function": {
                "name": _string(item, "name", param),
                "arguments": _string(item, "arguments", param),
            },
        }
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        messages[-1].setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        output = _text(item.get("output"), f"{param}.output")
        call_id = _string(item, "call_id", param)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    elif kind == "item_reference":
        raise unsupported(f"{param}.type", STATELESS)
    else:
        raise unsupported(
            f"{param}.type",
            f"input items of type {kind!r} are not supported "
            "(message, reasoning, function_call, function_call_output are)",
        )


def _thinking(messages: list[dict[str, Any]]) -> bool:
    """Whether the last message is an assistant turn holding reasoning alone so far."""
    last = messages[-1] if messages else {}
    return bool(last.get("reasoning_content")) and not (last["content"] or last.get("tool_calls"))


def _text(content: object, param: str) -> str:
    """A string, or the text of a list of text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else None
    if parts is None or not all(
        isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str)
        for p in parts
    ):
        raise unsupported(param, "only text is supported: a string or input_text/output_text parts")
    return "".join(p["text"] for p in parts)


_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text")


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ServeError(
            400,
            f"{param}.{key}: a string is required",
            param=f"{param}.{key}",
            code="invalid_value",
        )
    return value


# ---- tools and text.format as chat completions write them ---------------------------------


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat function tools `{"type": "function", "name", "parameters", ...}` -> chat's
    `{"type": "function", "function": {...}}` (the engine checks the rest)."""
    if tools is None:
        return None
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise unsupported(
                f"tools.{i}",
                'only function tools {"type": "function", "name", "parameters"} are supported, '
                f"got {tool!r:.200}",
            )
    return [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools
    ]


def _chat_tool_choice(choice: object) -> object:
    """`{"type": "function", "name"}` -> chat's `{"type": "function", "function": {"name"}}`;
    the strings pass as they are."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported(
        "tool_choice", f'"auto", "none", "required" or {{"type": "function", "name"}}, got {choice}'
    )


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`."""
    if text is None or text.format is None:
        return None
    fmt = text.format
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_}
    return {"type": "json_schema", "json_schema": schema | {"strict": fmt.strict}}


def _renamed(exc: ServeError) -> ServeError:
    """A chat `response_format` error named as the Responses API's `text.format`."""
    for old in ("response_format.json_schema", "response_format"):
        if exc.param and exc.param.startswith(old):
            return ServeError(
                exc.status,
                exc.message.replace(old, "text.format"),
                type=exc.type,
                param="text.format" + exc.param[len(old) :],
                code=exc.code,
            )
    return exc


def _echo(request: ResponsesRequest) -> dict[str, Any]:
    """The request fields a response object repeats."""
    text = request.text.model_dump(by_alias=True, exclude_none=True) if request.text else {}
    return {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": None,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tool_choice": request.tool_choice or "auto",
        "tools": request.tools or [],
        "text": {"format": {"type": "text"}} | text,
        "truncation": "disabled",
        "user": request.user,
    }


# ---- the output -> a response object, or its events -----------------------------------------


def response_object(call: EngineCall, output: RapidOutput, replica: str) -> dict[str, Any]:
    """The whole (non-streamed) response."""
    events = ResponseEvents(call, replica)
    events.finish(output)
    return events.response


class ResponseEvents:
    """The events of one streamed response, numbered; `response` is the response so far.

    Items are opened, filled and closed one after the other, as the output streams: the
    reasoning (docs/algorithm.md section 13), the answer's text (a message), then each function
    call, whose arguments stream as the engine's call fragments. What a stream did not bring
    (all of it, for a response that is not streamed) is added at the end in the same order.
    """

    def __init__(self, call: EngineCall, replica: str) -> None:
        self.call = call
        self.replica = replica
        self.sequence = 0
        self.response = _response(call, "in_progress", [])
        self._open: str | None = None  # the type of the item being filled, if one is
        self._streamed: set[str] = set()  # the item types and call ids already streamed

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.response),
            self._event("response.in_progress", response=self.response),
        ]

    def delta(self, delta: Delta) -> list[dict[str, Any]]:
        events = self._reasoning(delta.reasoning) if delta.reasoning else []
        if delta.text:
            events += self._text(delta.text)
        for fragment in delta.tool_calls:
            if fragment.id is not None:
                events += self._open_call(fragment.id, fragment.name or "")
            if fragment.arguments:
                events += self._arguments(fragment.arguments)
        return events

    def finish(self, output: RapidOutput) -> list[dict[str, Any]]:
        """Close the open item, add what was not streamed (an empty message when there is
        neither text nor a call), and end the response: `response.completed`, or
        `response.incomplete` (status "incomplete") past max_output_tokens."""
        cut = output.finish_reason == "length"
        events = self._close("incomplete" if cut else "completed")
        if output.reasoning is not None and "reasoning" not in self._streamed:
            events += self._reasoning(output.reasoning) + self._close("completed")
        if "message" not in self._streamed and (output.text or not output.tool_calls):
            events += self._text(output.text) + self._close("incomplete" if cut else "completed")
        for call in output.tool_calls:
            if call.id not in self._streamed:
                events += self._open_call(call.id, call.name)
                events += self._arguments(call.arguments_json) + self._close("completed")
        self.response |= {
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": _usage(output, self.replica),
        }
        end = "response.incomplete" if cut else "response.completed"
        return [*events, self._event(end, response=self.response)]

    def error(self, error: ServeError) -> dict[str, Any]:
        """The event of a failure mid-stream (the stream ends after it)."""
        return self._event("error", code=error.code, message=error.message, param=error.param)

    # ---- items

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        """Reasoning text: the reasoning item's `reasoning_text` part grows."""
        events = []
        if self._open != "reasoning":
            events += self._close("completed")
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": []}
            events += self._add(item | {"status": "in_progress"}, "reasoning")
            self._item["content"].append({"type": "reasoning_text", "text": ""})
        self._item["content"][0]["text"] += text
        return [*events, self._event("response.reasoning_text.delta", **self._part(), delta=text)]

    def _text(self, text: str) -> list[dict[str, Any]]:
        """Answer text: the message's `output_text` part grows."""
        events = []
        if self._open != "message":
            events += self._close("completed")
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "content": []}
            events += self._add(item | {"status": "in_progress"}, "message")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._item["content"].append(part)
            events.append(self._event("response.content_part.added", **self._part(), part=part))
        self._item["content"][0]["text"] += text
        if text:
            events.append(self._event("response.output_text.delta", **self._part(), delta=text))
        return events

    def _open_call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        events = self._close("completed")
        item = {"id": _id("fc"), "type": "function_call", "status": "in_progress"}
        self._streamed.add(call_id)
        item |= {"call_id": call_id, "name": name, "arguments": ""}
        return [*events, *self._add(item, "function_call")]

    def _arguments(self, fragment: str) -> list[dict[str, Any]]:
        self._item["arguments"] += fragment
        return [self._event("response.function_call_arguments.delta", **self._at(), delta=fragment)]

    def _close(self, status: str) -> list[dict[str, Any]]:
        """Close the open item (none: no events) with its done events."""
        kind, self._open = self._open, None
        item = self._item if kind else None
        if item is None:
            return []
        if kind == "function_call":
            done = [
                self._event(
                    "response.function_call_arguments.done",
                    **self._at(),
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        else:
            part = item["content"][0]
            which = "reasoning_text" if kind == "reasoning" else "output_text"
            done = [self._event(f"response.{which}.done", **self._part(), text=part["text"])]
            if kind == "message":
                done.append(self._event("response.content_part.done", **self._part(), part=part))
        return [*done, *self._done(status)]

    def _add(self, item: dict[str, Any], kind: str) -> list[dict[str, Any]]:
        self.response["output"].append(item)
        self._open = kind
        self._streamed.add(kind)
        return [self._event("response.output_item.added", output_index=self._index, item=item)]

    def _done(self, status: str) -> list[dict[str, Any]]:
        self._item["status"] = status
        return [self._event("response.output_item.done", output_index=self._index, item=self._item)]

    @property
    def _index(self) -> int:
        return len(self.response["output"]) - 1

    @property
    def _item(self) -> dict[str, Any]:
        return self.response["output"][-1]

    def _at(self) -> dict[str, Any]:
        return {"item_id": self._item["id"], "output_index": self._index}

    def _part(self) -> dict[str, Any]:
        return {**self._at(), "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """One event, its objects copied as they are now (later events change them)."""
        event = json.loads(json.dumps({"type": kind, "sequence_number": self.sequence, **fields}))
        self.sequence += 1
        return event


def _response(call: EngineCall, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": call.id,
        "object": "response",
        "created_at": call.created,
        "model": call.model,
        "status": status,
        "output": output,
        "usage": None,
        "error": None,
        "incomplete_details": None,
        **call.echo,
    }


def _usage(output: RapidOutput, replica: str) -> dict[str, Any]:
    """The Responses API's usage names of chat's `usage` (the RAPID stats under `rapid`)."""
    counts = usage([output], replica)
    return {
        "input_tokens": counts["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": output.stats.cached_prefix_tokens},
        "output_tokens": counts["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": output.stats.reasoning_tokens},
        "total_tokens": counts["total_tokens"],
        "rapid": counts["rapid"],
    }


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"
