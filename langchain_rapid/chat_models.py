"""`ChatRapid`: a LangChain chat model that decodes with RAPID."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, ModelProfile
from langchain_core.language_models.chat_models import (
    agenerate_from_stream,
    generate_from_stream,
)
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from pydantic import ConfigDict

from rapid_integrations import RapidInputError, RapidOutput
from rapid_integrations.adapter_params import tool_messages_refused

from ._base import RapidParams, aiter_in_thread

# LangChain message types -> chat template roles. Tool and function messages are refused
# (adapter_params.tool_messages_refused) until the engine renders them: dropping them
# silently would change the conversation.
_ROLES = {"system": "system", "human": "user", "ai": "assistant"}
_TOOL_TYPES = frozenset({"tool", "function"})
_CHAT_MESSAGE_ROLES = frozenset({"system", "user", "assistant"})


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

    `response_metadata` holds `model_name`, `finish_reason` and `rapid_stats` (the run's
    `RapidStats` as a dict: acceptance rate, context sizes, timings, decode tokens/s);
    `usage_metadata` holds the target's prompt tokens and the generated tokens.
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
            max_input_tokens=self._context_window(),
            text_inputs=True,
            image_inputs=False,
            image_url_inputs=False,
            pdf_inputs=False,
            audio_inputs=False,
            video_inputs=False,
            text_outputs=True,
            tool_calling=False,
            structured_output=False,
        )

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[Any] | None = None
    ) -> int:
        """Tokens the target reads for `messages`: through the chat template, with the
        model's own tokenizer (no weights load before the first call)."""
        if tools:
            raise RapidInputError("ChatRapid does not take tools yet; nothing to count them with")
        tokenizer = self._counting_tokenizer()
        text = tokenizer.apply_chat_template(
            to_chat_messages(messages), tokenize=False, add_generation_prompt=True
        )
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
        return generate_from_stream(self._stream(messages, stop, **kwargs))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, **kwargs))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        """One chunk per piece of text the engine commits, then a last chunk with the metadata."""
        run = self._start(to_chat_messages(messages), stop, kwargs)
        for delta in run:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(run.output)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """`_stream` run in a worker thread; the event loop stays free between chunks."""
        # aclosing: a consumer that stops early stops the worker now, not at garbage collection.
        stream = aiter_in_thread(lambda: self._stream(messages, stop, **kwargs))
        async with contextlib.aclosing(stream) as chunks:
            async for chunk in chunks:
                if run_manager and chunk.message.chunk_position != "last":
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    def _last_chunk(self, output: RapidOutput) -> ChatGenerationChunk:
        """The closing chunk: no text, the usage and the response metadata (set once only)."""
        return ChatGenerationChunk(
            message=AIMessageChunk(
                content="",
                usage_metadata=self._usage(output),
                response_metadata=self._response_metadata(output),
                chunk_position="last",
            )
        )


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages -> the engine's `{"role", "content"}` chat messages (text only).

    Raises `RapidInputError` for what a text chat template cannot carry: tool and function
    messages, tool calls, and non-text content such as images.
    """
    return [
        {"role": _role(message, i), "content": _text(message, i)}
        for i, message in enumerate(messages)
    ]


def _role(message: BaseMessage, index: int) -> str:
    if isinstance(message, ChatMessage) and message.role in _CHAT_MESSAGE_ROLES:
        return message.role
    if message.type in _ROLES:
        return _ROLES[message.type]
    if message.type in _TOOL_TYPES:
        raise tool_messages_refused(index, type(message).__name__)
    raise RapidInputError(
        f"message {index}: {type(message).__name__} is not supported; ChatRapid takes system, "
        "human and AI messages (and ChatMessage with role system, user or assistant)"
    )


def _text(message: BaseMessage, index: int) -> str:
    if isinstance(message, AIMessage) and message.tool_calls:
        raise tool_messages_refused(index, "an AI message with tool calls")
    parts = []
    for block in message.content_blocks:
        if block["type"] != "text":
            raise RapidInputError(
                f"message {index}: {block['type']!r} content is not supported; ChatRapid "
                "reads text only"
            )
        parts.append(block["text"])
    return "".join(parts)
