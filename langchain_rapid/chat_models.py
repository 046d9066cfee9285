"""`ChatRapid`: a LangChain chat model that decodes with RAPID."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Generator, Sequence
from typing import Any, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import (
    BaseChatModel,
    LangSmithParams,
    LanguageModelInput,
    ModelProfile,
)
from langchain_core.language_models.chat_models import (
    agenerate_from_stream,
    generate_from_stream,
)
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    ToolMessage,
)
from langchain_core.messages.tool import ToolCallChunk, tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from pydantic import BaseModel, ConfigDict

from rapid_integrations import CallFragment, Delta, RapidConfigError, RapidInputError, RapidOutput
from rapid_integrations.output.openai_logprobs import openai_chat_logprobs

from ._base import RapidParams, aiter_in_thread
from .structured import (
    StructuredMethod,
    ToolLike,
    openai_tools,
    response_format_grammar,
    structured_runnable,
    tool_choice_of,
)

# LangChain message types -> chat template roles. Function messages (OpenAI's old form,
# without call ids) are refused rather than dropped: dropping would change the conversation.
_ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}
_CALL_BLOCKS = frozenset({"tool_call", "tool_call_chunk", "invalid_tool_call"})
_CHAT_MESSAGE_ROLES = frozenset({"system", "user", "assistant"})
# `response_metadata["model_provider"]` of every message and chunk, as ChatOpenAI sets
# "openai" and ChatOllama "ollama": langchain-core picks a content-block translator by it
# (none is registered for "rapid", so `content_blocks` parses the standard fields).
MODEL_PROVIDER = "rapid"


class ChatRapid(RapidParams, BaseChatModel):
    """Chat model on a local Hugging Face causal LM, decoded by retrieval-augmented speculation.

    The target model reads the whole conversation; the draft reads the system message, the last
    user turn and passages retrieved from the rest (or from `retriever`), proposes tokens, and
    the target verifies them. Constructing it is cheap: the weights load on the first call
    unless an `engine` is passed in.

    Example:
        ```python
        from langchain_rapid import ChatRapid

        chat = ChatRapid(max_tokens=64)  # embedded SmolLM2-135M-Instruct
        chat.invoke("What is the capital of France?").content
        ```

    `response_metadata` holds `model_name`, `model_provider` ("rapid"), `finish_reason` and
    `rapid_stats` (the run's `RapidStats` as a dict: acceptance rate, context sizes, timings,
    decode tokens/s), and with `logprobs=True` ChatOpenAI's `logprobs`; `usage_metadata` holds
    the target's prompt tokens (those the prefix cache served in
    `input_token_details["cache_read"]`) and the generated tokens. A reasoning model's section is in
    `additional_kwargs["reasoning_content"]` (docs/langchain.md).
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    @property
    def _llm_type(self) -> str:
        return "rapid-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._identifying()

    def _resolve_model_profile(self) -> ModelProfile | None:
        """What the model can do; `max_input_tokens` read from its config (no weights load)."""
        return ModelProfile(
            max_input_tokens=self._handle.context_window(),
            text_inputs=True,
            image_inputs=False,
            image_url_inputs=False,
            pdf_inputs=False,
            audio_inputs=False,
            video_inputs=False,
            text_outputs=True,
            tool_calling=True,
            tool_choice=True,
            tool_call_streaming=True,
            # "Native" structured output: an OpenAI-style `response_format` next to the tools
            # (create_agent's ProviderStrategy), bound by `bind_tools` as the grammar an
            # answer that is no call must match.
            structured_output=True,
        )

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[Any] | None = None
    ) -> int:
        """Tokens the target reads for `messages`: through the chat template, with the
        model's own tokenizer (no weights load before the first call)."""
        from rapid_integrations.structured_output.tools import Tools, prepare_messages
        from rapid_integrations.tokens import render_chat

        tokenizer = self._handle.tokenizer()
        specs = Tools.parse(openai_tools(tools)) if tools else None
        # Rendered as the engine renders them: tools and calls through the template or its
        # system-prompt rendering.
        prepared, extra = prepare_messages(to_chat_messages(messages), specs, tokenizer)
        text = render_chat(prepared, tokenizer, extra)
        return len(tokenizer.encode(text, add_special_tokens=False))

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return LangSmithParams(**self._ls_params("chat", stop, kwargs))

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # No run_manager below: a plain invoke reports no per-token callbacks.
        return generate_from_stream(self._chunks(messages, stop, kwargs, stream_calls=False))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = self._achunks(messages, stop, kwargs, None, stream_calls=False)
        return await agenerate_from_stream(chunks)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Generator[ChatGenerationChunk, None, None]:
        for chunk in self._chunks(messages, stop, kwargs, stream_calls=True):
            message = cast(AIMessageChunk, chunk.message)  # `_chunks` makes AI chunks
            if run_manager and message.chunk_position != "last":
                run_manager.on_llm_new_token(chunk.text, chunk=chunk, logprobs=_logprobs(chunk))
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in self._achunks(messages, stop, kwargs, run_manager, stream_calls=True):
            yield chunk

    def _chunks(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        stream_calls: bool,
    ) -> Generator[ChatGenerationChunk, None, None]:
        """One chunk per engine step that released anything (answer text, reasoning in
        `additional_kwargs["reasoning_content"]`, log probabilities, tool-call fragments),
        then a last chunk with the metadata.

        `stream_calls`: the calls arrive as `tool_call_chunks` as the engine streams their
        fragments (`stream`); else whole on the last chunk, as the engine parsed them
        (`invoke`): a call cut off by the token limit streams fragments but is no call
        (docs/algorithm.md section 11), and a message should not hold a part of one.
        """
        run = self._start(to_chat_messages(messages), stop, kwargs)
        for delta in run.deltas():
            if delta.releases(calls=stream_calls):
                yield _chunk(delta, stream_calls)
        yield self._last_chunk(run.output, stream_calls)

    async def _achunks(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        run_manager: AsyncCallbackManagerForLLMRun | None,
        stream_calls: bool,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """`_chunks` run in a worker thread; the event loop stays free between chunks."""
        # aclosing: a consumer that stops early stops the worker now, not at garbage collection.
        stream = aiter_in_thread(lambda: self._chunks(messages, stop, kwargs, stream_calls))
        async with contextlib.aclosing(stream) as chunks:
            async for chunk in chunks:
                message = cast(AIMessageChunk, chunk.message)  # `_chunks` makes AI chunks
                if run_manager and message.chunk_position != "last":
                    await run_manager.on_llm_new_token(
                        chunk.text, chunk=chunk, logprobs=_logprobs(chunk)
                    )
                yield chunk

    def _last_chunk(self, output: RapidOutput, stream_calls: bool) -> ChatGenerationChunk:
        """The closing chunk: no text, the tool calls unless they were streamed, the usage
        and the response metadata (set once only). A call that asked for log probabilities
        gets an empty `logprobs` here, so the key is there even when no token was emitted."""
        calls = (
            []
            if stream_calls
            else [
                tool_call_chunk(name=c.name, args=c.arguments_json, id=c.id, index=i)
                for i, c in enumerate(output.tool_calls)
            ]
        )
        asked = output.logprobs is not None
        return ChatGenerationChunk(
            message=AIMessageChunk(
                content="",
                tool_call_chunks=calls,
                usage_metadata=self._usage(output),
                response_metadata={
                    **self._response_metadata(output),
                    "model_provider": MODEL_PROVIDER,
                },
                chunk_position="last",
            ),
            generation_info={"logprobs": openai_chat_logprobs(())} if asked else None,
        )

    def bind_tools(
        self,
        tools: Sequence[ToolLike],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        strict: bool | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: dict[str, Any] | type | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (anything `convert_to_openai_tool` takes); `tool_choice` "auto",
        "none", "any" / "required" / True, a tool's name, or OpenAI's dict. The engine
        constrains decoding to valid calls of these schemas (docs/agents.md); `strict` is
        accepted for compatibility, since calls always match their schema.
        `parallel_tool_calls=False` (as in ChatOpenAI) allows one call: decoding ends after it.
        `response_format` (OpenAI's, or a schema, as ChatOpenAI takes it; create_agent's
        provider strategy binds it) is what an answer that is no call must match: under "auto"
        the model calls tools or answers in it, under "none" it answers in it.

        The engine checks the tools when the bound model is called, before decoding anything:
        two tools of one name or a `tool_choice` naming no given tool raise `RapidInputError`,
        a schema that cannot compile `GrammarError`. (Binding itself accepts them, as other
        chat models do: LangChain's standard tests bind a class beside its own JSON schema.)
        """
        del strict  # always strict: decoding cannot leave the schema
        formatted = openai_tools(tools)
        choice = tool_choice_of(tool_choice)
        if choice is not None:
            kwargs["tool_choice"] = choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        if response_format is not None:
            kwargs["grammar"] = response_format_grammar(response_format)
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: StructuredMethod = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Answers as `schema` (a pydantic class, TypedDict or JSON schema): by a JSON-schema
        grammar ("json_schema"), a forced tool call ("function_calling") or any JSON object
        ("json_mode"); `include_raw` returns {"raw", "parsed", "parsing_error"}. `strict` is
        accepted for compatibility: the grammar always enforces the schema exactly."""
        del strict  # always strict: decoding cannot leave the schema
        if kwargs:
            raise RapidConfigError(sorted(kwargs)[0], "unknown with_structured_output argument")
        return structured_runnable(self, self.bind_tools, schema, method, include_raw)


def _chunk(delta: Delta, stream_calls: bool) -> ChatGenerationChunk:
    """One step's chunk: its text, its reasoning in `additional_kwargs["reasoning_content"]`
    (langchain-ollama's and DeepSeek's key, which `content_blocks` reads as a reasoning
    block), its tool-call fragments as `tool_call_chunks` (an OpenAI-style delta: the first
    has the call's id and name, later ones argument text) when `stream_calls`, and its
    tokens' log probabilities in ChatOpenAI's place and shape (`generation_info["logprobs"]
    = {"content": [...]}`, which LangChain copies into `response_metadata`). Adding the
    chunks joins each of them."""
    message = AIMessageChunk(
        content=delta.text,
        additional_kwargs={"reasoning_content": delta.reasoning} if delta.reasoning else {},
        tool_call_chunks=_call_chunks(delta.tool_calls) if stream_calls else [],
        response_metadata={"model_provider": MODEL_PROVIDER},
    )
    info = {"logprobs": openai_chat_logprobs(delta.logprobs)} if delta.logprobs else None
    return ChatGenerationChunk(message=message, generation_info=info)


def _call_chunks(fragments: Sequence[CallFragment]) -> list[ToolCallChunk]:
    """One `tool_call_chunk` per call of the step: LangChain merges chunks of one index
    across messages, not within one, so the step's fragments of a call are joined here (its
    first fragment's id and name, then its argument text)."""
    calls: dict[int, ToolCallChunk] = {}
    for f in fragments:
        if f.index in calls:
            calls[f.index]["args"] = (calls[f.index]["args"] or "") + f.arguments
        else:
            calls[f.index] = tool_call_chunk(name=f.name, args=f.arguments, id=f.id, index=f.index)
    return list(calls.values())


def _logprobs(chunk: ChatGenerationChunk) -> dict[str, Any] | None:
    """What ChatOpenAI hands `on_llm_new_token` as `logprobs`: the chunk's, if any."""
    return (chunk.generation_info or {}).get("logprobs")


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages -> the engine's chat messages (OpenAI shapes): role and content,
    an AI message's `tool_calls`, a tool message's `tool_call_id` and `name`.

    Raises `RapidInputError` for what the model cannot read: function messages (the old
    OpenAI form, without call ids), unknown roles, and non-text content such as images.
    """
    names = {c["id"]: c["name"] for m in messages if isinstance(m, AIMessage) for c in m.tool_calls}
    return [_as_dict(message, i, names) for i, message in enumerate(messages)]


def _as_dict(message: BaseMessage, index: int, names: dict[str | None, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": _role(message, index), "content": _text(message, index)}
    if isinstance(message, AIMessage) and (reasoning := _reasoning(message)):
        out["reasoning_content"] = reasoning  # the chat template renders or drops it
    if isinstance(message, AIMessage) and message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["args"]},
            }
            for c in message.tool_calls
        ]
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
        out["name"] = message.name or names.get(message.tool_call_id, "")
    return out


def _role(message: BaseMessage, index: int) -> str:
    if isinstance(message, ChatMessage) and message.role in _CHAT_MESSAGE_ROLES:
        return message.role
    if message.type in _ROLES:
        return _ROLES[message.type]
    raise RapidInputError(
        f"message {index}: {type(message).__name__} is not supported; ChatRapid takes system, "
        "human, AI and tool messages (and ChatMessage with role system, user or assistant)"
    )


def _is_tool_use(block: Any) -> bool:
    """An Anthropic-style tool_use block, which `tool_calls` carries too."""
    return block["type"] == "non_standard" and block.get("value", {}).get("type") == "tool_use"


def _reasoning(message: AIMessage) -> str:
    """An AI message's reasoning: its reasoning blocks, which `content_blocks` also makes of
    `additional_kwargs["reasoning_content"]` (what ChatRapid and langchain-ollama return)."""
    return "".join(
        b.get("reasoning", "") for b in message.content_blocks if b["type"] == "reasoning"
    )


def _text(message: BaseMessage, index: int) -> str:
    parts = []
    for block in message.content_blocks:
        if block["type"] in _CALL_BLOCKS or _is_tool_use(block):
            continue  # an AI message's calls: rendered from `tool_calls` by `_as_dict`
        if block["type"] == "reasoning" and isinstance(message, AIMessage):
            continue  # passed on as `reasoning_content` by `_as_dict`
        if block["type"] != "text":
            raise RapidInputError(
                f"message {index}: {block['type']!r} content is not supported; ChatRapid "
                "reads text only"
            )
        parts.append(block["text"])
    return "".join(parts)
