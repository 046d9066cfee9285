"""Request bodies of the OpenAI endpoints (pydantic), with the RAPID extension fields.

Unknown top-level fields are collected (`extra="allow"`) and checked by `rapid_options`: the
`RapidConfig` fields in `RAPID_OPTIONS` are accepted (what `extra_body={...}` sends from the
`openai` SDK), anything else is a 400 naming it. Messages accept and ignore fields they do not
use (clients add e.g. `refusal` or `name`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rapid_integrations.config import RapidConfig

from .errors import ServeError

# RapidConfig fields an OpenAI field already sets (temperature, top_p, max_tokens, stop, seed)
# or that only the server's operator may set (memory, timeouts, callables, the embedder).
_OPENAI_NAMED = frozenset(
    {"temperature", "top_p", "max_new_tokens", "stop", "seed", "logprobs", "top_logprobs"}
)
_SERVER_ONLY = frozenset(
    {
        "query_fn",
        "retrieval_embedder",
        "prefix_cache_bytes",
        "prefill_chunk_size",
        "retrieval_timeout",
    }
)
RAPID_OPTIONS = tuple(
    f.name for f in dataclasses.fields(RapidConfig) if f.name not in _OPENAI_NAMED | _SERVER_ONLY
)
"""`RapidConfig` fields a request may set as extra top-level fields (e.g. eta, gamma)."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier turn's reasoning (vLLM's name)


class JsonSchemaFormat(_Lenient):
    """`response_format.json_schema`; the schema is always enforced, as if `strict`."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class _RapidRequest(BaseModel):
    """What every endpoint's request has: the model, and the RAPID extensions."""

    model_config = ConfigDict(extra="allow")

    model: str
    # RAPID extensions (besides RAPID_OPTIONS): how the draft's context C^S is built.
    mode: str | None = None
    draft_prompt: str | list[ChatMessage] | None = None
    collection: str | None = None
    query: str | None = None

    def rapid_options(self) -> dict[str, Any]:
        """The extra fields, which must be `RAPID_OPTIONS` (values checked by `RapidConfig`)."""
        extra = dict(self.model_extra or {})
        for name in extra:
            if name not in RAPID_OPTIONS:
                raise ServeError(
                    400,
                    f"Unrecognized request argument supplied: {name}. RAPID options accepted as "
                    f"extra fields: {', '.join(RAPID_OPTIONS)}",
                    param=name,
                    code="unknown_parameter",
                )
        return extra


class _Request(_RapidRequest):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    # Checked here, so that a refusal names the client's field, not the engine's max_new_tokens.
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # a name, a choice or {"function": {"name"}}: Tools.parse checks it
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


# ---- /v1/responses --------------------------------------------------------------------------


class TextFormat(_Lenient):
    """`text.format` of the Responses API: the `response_format` of chat, flattened."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # a hint for OpenAI's models; only the default


class ResponsesRequest(_RapidRequest):
    """`POST /v1/responses`. Input items stay dicts: `responses.py` reads them, naming the item
    it refuses. Fields of stored state (previous_response_id, conversation, background,
    prompt) are declared so that they are refused by name, not as unknown."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # "auto", "none", "required" or {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None  # accepted; nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    # Extensions that chat completions take as OpenAI fields.
    seed: int | None = None
    stop: str | list[str] | None = None
