"""Request bodies of the OpenAI endpoints (pydantic), with the RAPID extension fields.

The models are the truth /openapi.json tells. Values are strict: a boolean is not a number, a
number is not a string (`max_tokens: true` and `prompt: [false]` are 422 naming the field).
Option objects (the requests, `response_format`, `text`, `stream_options`) refuse fields they
do not declare (400 `unknown_parameter` naming it; `additionalProperties: false` in the
schema). The `RapidConfig` fields in `RAPID_OPTIONS` are declared as top-level fields of their
config types and defaults (what `extra_body={...}` sends from the `openai` SDK); `RapidConfig`
checks their values (422 naming the field). Conversation content (messages, their content
parts, Responses input items, tool specs) accepts fields it does not use, as OpenAI's does
(clients send back e.g. `refusal`, `annotations` or an item's `id` and `status`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from rapid_integrations.config import SEED_RANGE, Mode, RapidConfig

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

Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]
"""OpenAI's `seed`: a signed 64-bit integer (`RapidConfig.seed`)."""
StopStrings = Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]]
"""`stop`: a string or a list of them, none empty (an empty one would stop at once)."""


class _Strict(BaseModel):
    """An option object: strict values, and no field it does not declare."""

    model_config = ConfigDict(extra="forbid", strict=True)


class _Lenient(BaseModel):
    """Conversation content: strict values; fields it does not use are accepted and ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


def _request_type(hint: Any) -> Any:
    """A `RapidConfig` field's type as a JSON request gives it: a fixed-size tuple is a list of
    that size (JSON has arrays; `RapidConfig` takes lists for tuples)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and Ellipsis not in args:
        return Annotated[list[args[0]], Field(min_length=len(args), max_length=len(args))]  # type: ignore[valid-type]
    return hint


def _rapid_fields() -> dict[str, Any]:
    """The `RAPID_OPTIONS` as pydantic fields: the config's types, its defaults (documented;
    only the fields a request sets reach the call, `rapid_options`)."""
    hints = typing.get_type_hints(RapidConfig)
    defaults = {f.name: f.default for f in dataclasses.fields(RapidConfig)}
    return {
        name: (
            _request_type(hints[name]),
            Field(
                default=defaults[name],
                description=f"RapidConfig.{name} (docs/algorithm.md); checked by RapidConfig",
            ),
        )
        for name in RAPID_OPTIONS
    }


if TYPE_CHECKING:
    _RapidFields = _Strict
else:
    _RapidFields = create_model("RapidOptions", __base__=_Strict, **_rapid_fields())


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    # developer: OpenAI's newer name for system (read as system).
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier turn's reasoning (vLLM's name)


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`; the schema is always enforced, as if `strict`."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; nothing is obfuscated


class _RapidRequest(_RapidFields):
    """What every endpoint's request has: the model, and the RAPID extensions."""

    _NOT_RAPID: ClassVar[frozenset[str]] = frozenset()  # RAPID_OPTIONS an OpenAI field shadows

    model: str
    # RAPID extensions (besides RAPID_OPTIONS): how the draft's context C^S is built.
    mode: Mode = "rapid"
    draft_prompt: str | list[ChatMessage] | None = None
    collection: str | None = None
    query: str | None = None

    def rapid_options(self) -> dict[str, Any]:
        """The `RAPID_OPTIONS` the request sets (values checked by `RapidConfig`)."""
        given = self.model_fields_set.intersection(RAPID_OPTIONS) - self._NOT_RAPID
        return {name: getattr(self, name) for name in given}


class _Request(_RapidRequest):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    # Checked here, so that a refusal names the client's field, not the engine's max_new_tokens.
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: StopStrings | None = None
    seed: Seed | None = None
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
    # "none", "auto", "required" or {"type": "function", "function": {"name"}}: Tools.parse
    # checks it ("required" and a named tool need tools; 400 without).
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


# ---- /v1/responses --------------------------------------------------------------------------


class TextFormat(_Strict):
    """`text.format` of the Responses API: the `response_format` of chat, flattened."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # a hint for OpenAI's models; only the default


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool | None = None  # accepted; nothing is obfuscated


class ResponsesRequest(_RapidRequest):
    """`POST /v1/responses`. Input items stay dicts: `responses.py` reads them, naming the item
    it refuses. Fields of stored state (previous_response_id, conversation, background,
    prompt) are declared so that they are refused by name, not as unknown. `truncation` is the
    Responses API's own field here, not RapidConfig's."""

    _NOT_RAPID: ClassVar[frozenset[str]] = frozenset({"truncation"})

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    # "auto", "none", "required" or {"type": "function", "name"}; "required" and a named tool
    # need tools (400 without).
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None  # accepted; nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    stream_options: ResponsesStreamOptions | None = None
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
    seed: Seed | None = None
    stop: StopStrings | None = None
