"""What /openapi.json says each route answers: statuses, content types and body schemas.

The request bodies are `schemas.py`'s models; this module documents the answers. A whole
answer is JSON (`application/json`); a streamed one (`stream: true`) is server-sent events
(`text/event-stream`); `/metrics` is Prometheus text (`text/plain`). Every error status has
the OpenAI error body (`errors.ErrorBody`). The answer models declare the fields every answer
has and allow the rest (`usage.rapid`, logprobs, tool calls), whose shapes docs/serving.md
gives.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from .errors import ErrorBody


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatChoice(_Answer):
    index: int
    message: dict[str, Any]
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(_Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Answer):
    index: int
    text: str
    finish_reason: Literal["stop", "length", "tool_calls"]


class Completion(_Answer):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ResponseUsage(_Answer):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponseObject(_Answer):
    """A Responses API `response` (stateless: never stored)."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["completed", "incomplete"]
    output: list[dict[str, Any]]
    usage: ResponseUsage


class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    owned_by: str
    max_model_len: int


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]
    replica: str


def _errors(*statuses: tuple[int, str]) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorBody, "description": why} for status, why in statuses}


_UNAUTHORIZED = (401, "a missing or wrong API key (when the server has one)")
_POST_ERRORS = _errors(
    (400, "malformed: bad JSON, an unknown field, an unsupported option, an unusable prompt"),
    _UNAUTHORIZED,
    (404, "an unknown model or collection"),
    (422, "a value of the wrong type or out of range; `param` names the field"),
    (429, "the waiting room is full (see Retry-After)"),
    (500, "an internal error"),
    (503, "out of memory"),
    (504, "past the server's request timeout"),
)
_EVENT_STREAM = {"text/event-stream": {"schema": {"type": "string"}}}


def post_responses(answer: type[BaseModel], stream: str) -> dict[int | str, dict[str, Any]]:
    """The statuses of a POST route: 200 with `answer` as JSON, or `stream` events as SSE."""
    ok = {
        "model": answer,
        "description": f"the whole answer, or with `stream: true` {stream}",
        "content": _EVENT_STREAM,
    }
    return {200: ok, **_POST_ERRORS}


GET_ERRORS = _errors(_UNAUTHORIZED)
"""The error statuses of a GET route (all but /health need the API key)."""
