"""`RapidLLM`: RAPID speculative decoding as a LlamaIndex `CustomLLM`.

The class only adapts: prompts and chat messages go to `RapidEngine.generate` / `stream`
unchanged (chat messages as role/content dicts, so the engine applies the tokenizer's chat
template), and the engine's `RapidOutput` comes back as LlamaIndex responses. Query engines
send finished template text, so the query the draft's retrieval needs is read out of it by a
`QueryExtractor` (see `templates.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from rapid_integrations import RapidConfig, RapidConfigError, RapidInputError, RapidOutput
from rapid_integrations.aio import aiter_in_thread
from rapid_integrations.config import check_mode

from .retrievers import as_context_retriever
from .templates import as_query_extractor

if TYPE_CHECKING:
    # Imported lazily at run time: torch and transformers load only when a RapidLLM is made.
    from pathlib import Path

    import torch
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.indices.base import BaseIndex
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rapid_integrations import RapidEngine
    from rapid_integrations.retrieval import ContextRetriever

    from .templates import QueryExtractorLike

    ModelSpec = PreTrainedModel | str | Path

# LlamaIndex roles with no chat-template counterpart, mapped to the nearest standard role.
_ROLES = {
    MessageRole.DEVELOPER: "system",
    MessageRole.FUNCTION: "tool",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}
# Blocks that carry input a text model cannot read (media) or that it cannot act on (tools).
_UNREADABLE_BLOCKS = frozenset({"image", "audio", "video", "document", "tool_call"})
R = TypeVar("R", CompletionResponse, ChatResponse)


class RapidLLM(CustomLLM):
    """A LlamaIndex LLM that decodes with RAPID (retrieval-augmented speculative decoding).

    Pass a ready `engine`, or the engine's arguments (`target`, `draft`, `tokenizer`,
    `config`, `device`, `dtype`), in which case the models load on first use; with neither,
    the embedded SmolLM2-135M-Instruct is used. `retriever` feeds the draft: a LlamaIndex
    retriever or index (wrapped in `RapidRetrieverAdapter`) or any `ContextRetriever`; without
    one the engine retrieves from the prompt itself. `query_extractor` finds the question in
    finished template text (LlamaIndex's QA / refine templates by default; pass your own
    templates or a callable ``str -> str | None``). Each response carries the run's
    `RapidStats` (``raw["rapid_stats"]`` and ``additional_kwargs["rapid_stats"]``, as dicts).
    """

    mode: str = Field(default="rapid", description="rapid | sd | lc | rag (see RapidEngine).")
    generate_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="RapidConfig overrides applied to every call (eta, gamma, max_new_tokens...).",
    )

    _engine: RapidEngine | None = PrivateAttr(default=None)
    _make_engine: Callable[[], RapidEngine] | None = PrivateAttr(default=None)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _retriever: ContextRetriever | None = PrivateAttr(default=None)
    _query_extractor: Callable[[str], str | None] = PrivateAttr()

    def __init__(
        self,
        target: ModelSpec | None = None,
        draft: ModelSpec | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        engine: RapidEngine | None = None,
        config: RapidConfig | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        retriever: ContextRetriever | BaseRetriever | BaseIndex | None = None,
        query_extractor: QueryExtractorLike | None = None,
        mode: str = "rapid",
        generate_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # Checked here, not by pydantic, so that bad values raise the package's own errors
        # at construction rather than on the first call.
        check_mode(mode)
        (config or RapidConfig()).replace(**(generate_kwargs or {}))
        model_args = (target, draft, tokenizer, config, device, dtype)
        if engine is not None and any(arg is not None for arg in model_args):
            raise RapidConfigError("engine", "pass an engine or its arguments, not both")
        super().__init__(mode=mode, generate_kwargs=generate_kwargs or {}, **kwargs)
        self._retriever = as_context_retriever(retriever)
        self._query_extractor = as_query_extractor(query_extractor)
        if engine is not None:
            self._engine = engine
        else:
            self._make_engine = _engine_factory(*model_args)

    @classmethod
    def class_name(cls) -> str:
        return "RapidLLM"

    @property
    def engine(self) -> RapidEngine:
        """The `RapidEngine`, built (models loaded) on first access."""
        if self._engine is None:
            with self._lock:
                if self._engine is None and self._make_engine is not None:
                    self._engine = self._make_engine()
        assert self._engine is not None
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        """Real sizes: the target's window and the configured number of new tokens."""
        engine = self.engine
        return LLMMetadata(
            context_window=engine.context_window,
            num_output=engine.config.replace(**self.generate_kwargs).max_new_tokens,
            is_chat_model=_has_chat_template(engine),
            model_name=engine.model_name,
        )

    # -- completion ---------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        return self._stream_complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        # Through the stream, so that a cancelled call stops decoding at its next token.
        return await _final(
            aiter_in_thread(lambda: self._stream_complete(prompt, formatted, kwargs))
        )

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return aiter_in_thread(lambda: self._stream_complete(prompt, formatted, kwargs))

    def _complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponse:
        prompt = self._completion_prompt(prompt, formatted)
        out = self.engine.generate(prompt, **self._call_args(prompt, kwargs))
        return CompletionResponse(text=out.text, **_report(out))

    def _stream_complete(
        self, prompt: str, formatted: bool, kwargs: dict[str, Any]
    ) -> CompletionResponseGen:
        prompt = self._completion_prompt(prompt, formatted)
        for text, delta, out in self._stream(prompt, self._call_args(prompt, kwargs)):
            yield CompletionResponse(text=text, delta=delta, **_report(out))

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        """`prompt`, checked and, unless `formatted`, passed through `completion_to_prompt`."""
        if not isinstance(prompt, str):
            raise RapidInputError(f"the prompt must be a string, got {type(prompt).__name__}")
        return prompt if formatted else self.completion_to_prompt(prompt)

    # -- chat ------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await _final(aiter_in_thread(lambda: self._stream_chat(messages, kwargs)))

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        return aiter_in_thread(lambda: self._stream_chat(messages, kwargs))

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        prompt = self._chat_prompt(messages)
        out = self.engine.generate(prompt, **self._call_args(prompt, kwargs))
        return ChatResponse(message=_assistant(out.text), **_report(out))

    def _stream_chat(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> ChatResponseGen:
        prompt = self._chat_prompt(messages)
        for text, delta, out in self._stream(prompt, self._call_args(prompt, kwargs)):
            yield ChatResponse(message=_assistant(text), delta=delta, **_report(out))

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> list[dict[str, str]] | str:
        """Role/content dicts for the engine's chat template, or flattened text without one."""
        _check_text_only(messages)
        if not _has_chat_template(self.engine):
            return self.messages_to_prompt(messages)
        return [
            {"role": _ROLES.get(m.role, m.role.value), "content": m.content or ""} for m in messages
        ]

    # -- shared --------------------------------------------------------------------------

    def _call_args(
        self, prompt: str | list[dict[str, str]], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """Engine arguments of one call: mode, retriever, the extracted query, overrides.

        A query given per call, or a `query_fn` in the configuration, wins over extraction.
        """
        args: dict[str, Any] = {"mode": self.mode, **self.generate_kwargs, **kwargs}
        if self._retriever is not None:
            args.setdefault("retriever", self._retriever)
        if "query" in args or args.get("query_fn", self.engine.config.query_fn) is not None:
            return args
        query = self._query_extractor(_last_user_text(prompt))
        return {**args, "query": query} if query else args

    def _stream(
        self, prompt: str | list[dict[str, str]], args: dict[str, Any]
    ) -> Iterator[tuple[str, str, RapidOutput | None]]:
        """(cumulative text, delta, None) per delta, then ("...", "", output) with the stats.

        The stats exist only once generation has ended, so they ride on a last, empty delta
        (as usage does in other providers' streams). Closing early frees the engine's caches.
        """
        text = ""
        with self.engine.stream(prompt, **args) as stream:
            for delta in stream:
                text += delta
                yield text, delta, None
            yield text, "", stream.output


def _engine_factory(
    target: ModelSpec | None,
    draft: ModelSpec | None,
    tokenizer: PreTrainedTokenizerBase | None,
    config: RapidConfig | None,
    device: str | torch.device | None,
    dtype: str | torch.dtype | None,
) -> Callable[[], RapidEngine]:
    """A deferred engine build, so constructing a RapidLLM loads nothing."""

    def build() -> RapidEngine:
        from rapid_integrations import RapidEngine

        if target is None:
            known = dataclasses.fields(config) if config is not None else ()
            fields = {f.name: getattr(config, f.name) for f in known}
            return RapidEngine.from_default(draft, device=device, dtype=dtype, **fields)
        return RapidEngine(target, draft, tokenizer, config, device=device, dtype=dtype)

    return build


def _has_chat_template(engine: RapidEngine) -> bool:
    return bool(getattr(engine.tokenizer, "chat_template", None))


def _last_user_text(prompt: str | list[dict[str, str]]) -> str:
    """The text a template filled: the prompt itself, or the last user message."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")


def _assistant(text: str) -> ChatMessage:
    return ChatMessage(role=MessageRole.ASSISTANT, content=text)


def _report(out: RapidOutput | None) -> dict[str, Any]:
    """`raw` and `additional_kwargs` of a response: usage (for token counters) and stats."""
    if out is None:
        return {}
    stats = out.stats.to_dict()
    usage = {"prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.token_ids)}
    raw = {"finish_reason": out.finish_reason, "usage": usage, "rapid_stats": stats}
    return {"raw": raw, "additional_kwargs": {**usage, "rapid_stats": stats}}


def _check_text_only(messages: Sequence[ChatMessage]) -> None:
    """Raise for content the model cannot read, which `ChatMessage.content` would silently drop."""
    for i, message in enumerate(messages):
        for block in message.blocks:
            if block.block_type in _UNREADABLE_BLOCKS:
                raise RapidInputError(
                    f"message {i}: {block.block_type!r} content is not supported; RapidLLM "
                    "reads text only and does not call tools"
                )


async def _final(responses: AsyncGenerator[R, None]) -> R:
    """The last response of a stream, as the non-streaming call returns it (no delta)."""
    last = None
    async with contextlib.aclosing(responses) as items:  # cancelled: the worker stops now
        async for response in items:
            last = response
    assert last is not None  # a stream ends with the response that carries the stats
    return last.model_copy(update={"delta": None})
