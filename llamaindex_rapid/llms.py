"""`RapidLLM`: RAPID speculative decoding as a LlamaIndex `FunctionCallingLLM`.

The class only adapts: prompts and chat messages go to `RapidEngine.stream` (chat messages as
OpenAI-shaped dicts, `messages.py`, so the engine applies the tokenizer's chat template and
renders tool calls and results), tools go as OpenAI specs with a tool choice, and the engine's
`RapidOutput` comes back as LlamaIndex responses, its calls as `ToolCallBlock`s. Structured
output is constrained by a JSON-schema grammar (`structured.py`). Query engines send finished
template text, so the query the draft's retrieval needs is read out of it by a
`QueryExtractor` (see `templates.py`). Its arguments are the vocabulary both adapters share (docs/migration.md),
plus `HuggingFaceLLM`'s wherever they overlap.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    LogProb,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.prompts import PromptTemplate

from rapid_integrations import RapidConfig, RapidConfigError, RapidInputError, RapidOutput
from rapid_integrations.adapters.aio import aiter_in_thread
from rapid_integrations.adapters.handle import EngineHandle
from rapid_integrations.adapters.params import (
    completion_prompt,
    config_overrides,
    deprecated,
    has_chat_template,
    merge_overrides,
    translate_generate_kwargs,
    with_device_map,
)
from rapid_integrations.config import FIELD_NAMES, Mode, check_mode
from rapid_integrations.engine.args import LOADING_FIELDS
from rapid_integrations.engine.call_options import CALL_NAMES, CallOptions
from rapid_integrations.output.openai_logprobs import openai_chat_logprobs, openai_token
from rapid_integrations.output.outputs import Delta, TokenLogprob

from .messages import (
    StreamedCall,
    assistant_message,
    check_messages,
    has_tool_turns,
    to_engine_messages,
    tool_selections,
    with_fragments,
)
from .retrievers import as_context_retriever
from .structured import StructuredByGrammar
from .templates import as_query_extractor

if TYPE_CHECKING:
    # Imported lazily at run time: torch and transformers load only when a model is used.
    from pathlib import Path

    import torch
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.indices.base import BaseIndex
    from llama_index.core.tools.types import BaseTool
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rapid_integrations import RapidEngine
    from rapid_integrations.retrieval import ContextRetriever

    from .templates import QueryExtractorLike

    ModelSpec = PreTrainedModel | str | Path
    TokenizerSpec = PreTrainedTokenizerBase | str | Path

# LLM base-class arguments, passed on to LlamaIndex as they are.
_BASE_ARGUMENTS = frozenset(
    {
        "system_prompt",
        "messages_to_prompt",
        "completion_to_prompt",
        "query_wrapper_prompt",
        "callback_manager",
        "pydantic_program_mode",
        "output_parser",
    }
)
# Old names, kept for one release with a DeprecationWarning: old -> new.
_RENAMED = {"target": "model", "draft": "draft_model", "config": "rapid_config"}
R = TypeVar("R", CompletionResponse, ChatResponse)


class RapidLLM(StructuredByGrammar, FunctionCallingLLM):
    """A LlamaIndex LLM that decodes with RAPID (retrieval-augmented speculative decoding).

    Pass a ready `engine`, or the models to load on first use: `model` (the target),
    `draft_model` (None: self-speculation), `tokenizer`, with `device`, `dtype`, `draft_device`,
    `draft_precision`, `target_precision`, `model_kwargs`, `draft_model_kwargs`,
    `tokenizer_kwargs`, `compile_draft` (`RapidEngine`'s); with neither, the embedded
    SmolLM2-135M-Instruct is used. Generation settings are fields of their own
    (`max_new_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `eta`,
    `gamma`, `seed`, `stop`), `rapid_config` holds any other `RapidConfig` field, and
    `generate_kwargs` takes transformers `generate()` options as `HuggingFaceLLM` does
    (`{"top_k": 50, "temperature": 0.7, "do_sample": True}`). `HuggingFaceLLM`'s
    `model_name`, `tokenizer_name`, `context_window`, `device_map` and `is_chat_model` keep
    their meanings. Unknown arguments raise `RapidConfigError`; nothing loads at construction.

    A plain-string prompt goes to a model with a chat template as one user turn (with
    `system_prompt` as the system turn), which is how instruct models are asked to answer;
    `raw_completion=True`, or a `completion_to_prompt` of your own, sends text as it is. A
    `messages_to_prompt` of your own likewise wins over the chat template.

    `retriever` feeds the draft: a LlamaIndex retriever or index (wrapped in
    `RapidRetrieverAdapter`) or any `ContextRetriever`; without one the engine retrieves from
    the prompt itself. `query_extractor` finds the question in finished template text
    (LlamaIndex's QA / refine templates by default). Each response carries the run's
    `RapidStats` (``raw["rapid_stats"]`` and ``additional_kwargs["rapid_stats"]``, as dicts).

    Tools (`chat_with_tools`, `FunctionAgent`) reach the engine as OpenAI specs, and decoding
    is constrained to valid calls (docs/algorithm.md section 11); `structured_predict` and
    `as_structured_llm` are constrained to the output class's JSON schema (section 10).
    `logprobs=True` fills the responses' `logprobs` (section 12); a reasoning model's section
    is a `ThinkingBlock` (section 13); streamed responses carry the calls as far as written.
    """

    model_name: str = Field(description="The target model's name (metadata, tracing).")
    context_window: int | None = Field(
        default=None, description="Window reported to LlamaIndex; None: the model's own."
    )
    max_new_tokens: int | None = Field(default=None, description="Most tokens per call.")
    is_chat_model: bool | None = Field(
        default=None, description="Reported chat-model flag; None: whether a chat template exists."
    )
    mode: Mode = Field(default="rapid", description="rapid | sd | lc | rag (see RapidEngine).")
    timeout: float | None = Field(default=None, description="Seconds a call may take.")
    raw_completion: bool = Field(
        default=False, description="Send completion prompts without the chat template."
    )
    generate_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="transformers generate() options (HuggingFaceLLM's)."
    )
    rapid_config: dict[str, Any] = Field(
        default_factory=dict, description="Other RapidConfig fields for every call."
    )

    _handle: EngineHandle = PrivateAttr()
    _overrides: dict[str, Any] = PrivateAttr()
    _retriever: ContextRetriever | None = PrivateAttr(default=None)
    _query_extractor: Callable[[str], str | None] = PrivateAttr()
    _own_formatting: frozenset[str] = PrivateAttr()

    def __init__(
        self,
        model: ModelSpec | None = None,
        draft_model: ModelSpec | None = None,
        tokenizer: TokenizerSpec | None = None,
        *,
        engine: RapidEngine | None = None,
        retriever: ContextRetriever | BaseRetriever | BaseIndex | None = None,
        query_extractor: QueryExtractorLike | None = None,
        mode: str = "rapid",
        timeout: float | None = None,
        raw_completion: bool = False,
        device: str | torch.device | None = None,
        draft_device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        draft_precision: str | None = None,
        target_precision: str | None = None,
        model_kwargs: dict[str, Any] | None = None,
        draft_model_kwargs: dict[str, Any] | None = None,
        tokenizer_kwargs: dict[str, Any] | None = None,
        compile_draft: bool | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        eta: float | None = None,
        gamma: int | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        rapid_config: dict[str, Any] | RapidConfig | None = None,
        model_name: str | None = None,
        tokenizer_name: str | None = None,
        context_window: int | None = None,
        generate_kwargs: dict[str, Any] | None = None,
        device_map: str | dict[str, Any] | None = None,
        stopping_ids: list[int] | None = None,
        is_chat_model: bool | None = None,
        tokenizer_outputs_to_remove: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        # Checked here, before pydantic and before any weights load, so that bad values raise
        # the package's own errors at construction rather than on the first call.
        del tokenizer_outputs_to_remove  # only input_ids reach the model: nothing to remove
        old, config_arguments = _sort_arguments(kwargs)
        _check_values(mode, timeout, context_window, stopping_ids)
        given = locals()  # the loading options are this signature's parameters of the same name
        loading = {name: given[name] for name in LOADING_FIELDS}
        loading.update(
            model=_hf_name(_renamed(old, "target", model), model_name, "model_name"),
            draft_model=_renamed(old, "draft", draft_model),
            tokenizer=_hf_name(tokenizer, tokenizer_name, "tokenizer_name"),
            model_kwargs=with_device_map(model_kwargs, device_map),
            draft_model_kwargs=draft_model_kwargs or {},
            tokenizer_kwargs=tokenizer_kwargs or {},
        )
        handle = EngineHandle(engine, loading)
        rapid_config = merge_overrides(
            ("arguments", config_arguments),
            (
                "rapid_config",
                config_overrides(_renamed(old, "config", rapid_config), "rapid_config"),
            ),
        )
        fields = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "repetition_penalty": repetition_penalty,
            "eta": eta,
            "gamma": gamma,
            "seed": seed,
            "stop": stop,
        }
        overrides = merge_overrides(
            ("fields", {k: v for k, v in fields.items() if v is not None}),
            ("rapid_config", rapid_config),
            (
                "generate_kwargs",
                translate_generate_kwargs(generate_kwargs or {}, "generate_kwargs"),
            ),
        )
        # The ignore: mypy types pydantic's __init__ with the base class's fields only.
        super().__init__(  # type: ignore[call-arg]
            model_name=model_name or handle.label,
            context_window=context_window,
            max_new_tokens=max_new_tokens,
            is_chat_model=is_chat_model,
            mode=mode,
            timeout=timeout,
            raw_completion=raw_completion,
            generate_kwargs=generate_kwargs or {},
            rapid_config=rapid_config,
            query_wrapper_prompt=_template(kwargs.pop("query_wrapper_prompt", None)),
            **kwargs,
        )
        self._own_formatting = frozenset(
            name for name in ("messages_to_prompt", "completion_to_prompt") if kwargs.get(name)
        )
        self._handle = handle
        self._overrides = overrides
        self._retriever = as_context_retriever(retriever)
        self._query_extractor = as_query_extractor(query_extractor)

    @classmethod
    def class_name(cls) -> str:
        return "RapidLLM"

    def get_engine(self) -> RapidEngine:
        """The `RapidEngine`, built (models loaded) on first use, once."""
        return self._handle.get()

    @property
    def engine(self) -> RapidEngine:
        """Deprecated: `get_engine()`, as in the LangChain adapter."""
        deprecated("engine", "get_engine()", "RapidLLM")
        return self.get_engine()

    @property
    def retriever(self) -> ContextRetriever | None:
        """What feeds the draft's short context (None: the engine retrieves from the prompt)."""
        return self._retriever

    @property
    def metadata(self) -> LLMMetadata:
        """Window, output size, chat flags and name, with no weights loaded: the window comes
        from the model's config, the chat flag from its tokenizer; values given win. Tools
        need the chat template (the engine renders them through it), so the function-calling
        flag is whether the tokenizer has one and no `messages_to_prompt` of yours replaces it."""
        window = self._handle.context_window()
        if self.context_window is not None:
            if self.context_window > window:
                warnings.warn(
                    f"context_window={self.context_window} is larger than the model's window "
                    f"({window}); reporting {window}",
                    stacklevel=2,
                )
            window = min(window, self.context_window)
        built = self._handle.built
        base = built.config if built is not None else RapidConfig()
        template = has_chat_template(self._handle.tokenizer())
        return LLMMetadata(
            context_window=window,
            num_output=base.replace(**self._overrides).max_new_tokens,
            is_chat_model=template if self.is_chat_model is None else self.is_chat_model,
            is_function_calling_model=template and "messages_to_prompt" not in self._own_formatting,
            model_name=self.model_name,
        )

    # -- completion ---------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return _last(self._stream_complete(prompt, formatted, kwargs))

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

    def _stream_complete(
        self, prompt: str, formatted: bool, kwargs: dict[str, Any]
    ) -> CompletionResponseGen:
        engine_prompt = self._completion_prompt(prompt, formatted)
        for step in self._stream(engine_prompt, self._call_args(engine_prompt, kwargs)):
            yield CompletionResponse(
                text=step.text, delta=step.delta, logprobs=step.logprobs, **_report(step)
            )

    def _completion_prompt(self, prompt: str, formatted: bool) -> str | list[dict[str, str]]:
        """What the engine reads for a completion prompt, as `HuggingFaceLLM` builds it:
        the query wrapper, then a `completion_to_prompt` of the user's (text as it is);
        otherwise one user turn (after `system_prompt`) when the tokenizer has a chat template
        and `raw_completion` is off, else the text (after `system_prompt`)."""
        if not isinstance(prompt, str):
            raise RapidInputError(f"the prompt must be a string, got {type(prompt).__name__}")
        if not formatted and self.query_wrapper_prompt is not None:
            prompt = self.query_wrapper_prompt.format(query_str=prompt)
        if "completion_to_prompt" in self._own_formatting:
            assert self.completion_to_prompt is not None  # the user's own
            return prompt if formatted else self.completion_to_prompt(prompt)
        system = self.system_prompt if self.system_prompt and not formatted else None
        tokenizer = self.get_engine().tokenizer
        return completion_prompt(prompt, tokenizer, self.raw_completion, system)

    # -- chat ------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _last(self._stream_chat(messages, kwargs))

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

    def _stream_chat(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> ChatResponseGen:
        """Chat responses, each the answer so far (reasoning, text, tool calls as far as
        their fragments have come); the last one's calls are the engine's parsed calls (a
        call cut off by the token limit is none, docs/algorithm.md section 11)."""
        prompt = self._chat_prompt(messages)
        for step in self._stream(prompt, self._call_args(prompt, kwargs)):
            out = step.output
            calls = step.calls if out is None else out.tool_calls
            message = assistant_message(step.text, calls, step.reasoning)
            yield ChatResponse(
                message=message, delta=step.delta, logprobs=step.logprobs, **_report(step)
            )

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> list[dict[str, Any]] | str:
        """OpenAI-shaped messages for the chat template (`messages.to_engine_messages`); text
        from a `messages_to_prompt` of the user's, or flattened by LlamaIndex's default when
        the tokenizer has no template, which cannot carry tool calls or results."""
        check_messages(messages)
        if "messages_to_prompt" in self._own_formatting or not has_chat_template(
            self.get_engine().tokenizer
        ):
            if has_tool_turns(messages):
                raise RapidInputError(
                    "tool calls and tool results need the tokenizer's chat template, which "
                    "a messages_to_prompt of your own (or a tokenizer without one) replaces"
                )
            assert self.messages_to_prompt is not None  # the user's, or LlamaIndex's default
            return self.messages_to_prompt(messages)
        return to_engine_messages(messages)

    # -- tools -------------------------------------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """`chat()` arguments of `chat_with_tools` and its variants: the history (not changed)
        and `user_msg`, the tools as OpenAI specs, and the tool choice: `tool_choice` as given
        (OpenAI's values or a tool's name), else "required" when `tool_required`, else the
        engine's "auto". Without `allow_parallel_tool_calls` the grammar allows one call, so
        decoding ends after it."""
        specs = [tool.metadata.to_openai_tool(skip_length_check=True) for tool in tools]
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
        if user_msg is not None:
            messages.append(user_msg)
        if tool_choice is None and tool_required:
            tool_choice = "required"
        return {
            "messages": messages,
            "tools": specs or None,
            "tool_choice": tool_choice,
            "parallel_tool_calls": allow_parallel_tool_calls,
            **kwargs,
        }

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The response's tool calls; none raises `RapidInputError` when
        `error_on_no_tool_call` (else an empty list)."""
        return tool_selections(response, error_on_no_tool_call)

    # -- shared --------------------------------------------------------------------------

    def _call_args(self, prompt: str | list[dict[str, Any]], kwargs: dict[str, Any]) -> CallOptions:
        """The options of one call: mode, retriever, the extracted query, overrides.

        Per-call options are RapidConfig fields or transformers generate() names, plus the
        `CallOptions` names (`mode`, `retriever`, `query`, `draft_prompt`, `grammar`, `tools`,
        `tool_choice`, `parallel_tool_calls`). A query given per call, or a `query_fn` in the
        configuration, wins over extraction.
        """
        call = dict(kwargs)
        engine_args = {k: call.pop(k) for k in CALL_NAMES if k in call}
        args: dict[str, Any] = {
            "mode": self.mode,
            **self._overrides,
            **translate_generate_kwargs(call, "the call's options"),
            **engine_args,
        }
        if self._retriever is not None:
            args.setdefault("retriever", self._retriever)
        if "retriever" in engine_args:
            args["retriever"] = as_context_retriever(engine_args["retriever"])
        if "query" in args or args.get("query_fn", self.get_engine().config.query_fn) is not None:
            return CallOptions.of(args)
        query = self._query_extractor(_last_user_text(prompt))
        return CallOptions.of({**args, "query": query} if query else args)

    def _stream(self, prompt: str | list[dict[str, Any]], options: CallOptions) -> Iterator[_Step]:
        """One `_Step` per engine step that released anything (text, reasoning, log
        probabilities, tool-call fragments), then a last, empty one with the output.

        The stats exist only once generation has ended, so they ride on a last, empty delta
        (as usage does in other providers' streams). Closing early frees the engine's caches;
        a call past `timeout` raises `RapidTimeoutError`. Calls made at the same time (several
        coroutines' `acomplete` / `achat`, threads) decode together in the engine's batch
        (`batcher.batched_stream`); each gets the answer it gets alone.
        """
        run = self._handle.stream(prompt, options, self.timeout)
        step = _Step()
        for delta in run.deltas():
            if delta.releases():
                step = step.after(delta)
                yield step
        out = run.output
        logprobs = None if out.logprobs is None else step.logprobs or []
        yield _Step(step.text, "", logprobs, out.reasoning, step.calls, "", out)


class _Step(NamedTuple):
    """What a streamed response carries: the text so far and this step's part of it, the
    log probabilities so far (None when none were asked for, or none yet), the reasoning so
    far (None: none yet) and this step's part of it, the tool calls as far as their
    fragments have come, and the `RapidOutput` on the last step only."""

    text: str = ""
    delta: str = ""
    logprobs: list[list[LogProb]] | None = None
    reasoning: str | None = None
    calls: tuple[StreamedCall, ...] = ()
    thinking_delta: str = ""
    output: RapidOutput | None = None

    def after(self, delta: Delta) -> _Step:
        """The next step: this one with `delta` added."""
        logprobs = (self.logprobs or []) + as_logprobs(delta.logprobs)
        reasoning = (self.reasoning or "") + delta.reasoning
        return _Step(
            self.text + delta.text,
            delta.text,
            logprobs or None,
            reasoning or None,
            with_fragments(self.calls, delta.tool_calls),
            delta.reasoning,
        )


def as_logprobs(entries: Sequence[TokenLogprob]) -> list[list[LogProb]]:
    """LlamaIndex's `logprobs`: per token, the emitted token first, then its `top_logprobs`
    alternatives (most likely first), each with its bytes; -inf floored as in the server's
    JSON (docs/algorithm.md section 12)."""
    tokens = [openai_token(e) for e in entries]
    return [
        [_logprob(t), *(_logprob(alternative) for alternative in t["top_logprobs"])] for t in tokens
    ]


def _logprob(token: dict[str, Any]) -> LogProb:
    return LogProb(token=token["token"], logprob=token["logprob"], bytes=token["bytes"])


def _renamed(old: dict[str, Any], name: str, value: Any) -> Any:
    """The value given under an old name (with a DeprecationWarning), or under the new one."""
    if name not in old:
        return value
    deprecated(name, _RENAMED[name], "RapidLLM")
    if value is not None:
        raise RapidConfigError(_RENAMED[name], f"given twice, also as `{name}`")
    return old[name]


def _hf_name(value: Any, name: str | None, field: str) -> Any:
    """`HuggingFaceLLM`'s model_name / tokenizer_name: what to load when no object is given."""
    if name is None or not isinstance(value, str | None):
        return value  # no name, or a loaded object that the name only labels
    if value is not None and value != name:
        raise RapidConfigError(field, f"names {name!r}, but {value!r} was given too; give one")
    return name


def _sort_arguments(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Pop the old names and the `RapidConfig` fields (given as arguments of their own) out of
    `kwargs`, which keeps LlamaIndex's base-class arguments; any other name raises."""
    old = {name: kwargs.pop(name) for name in list(kwargs) if name in _RENAMED}
    config = {name: kwargs.pop(name) for name in list(kwargs) if name in FIELD_NAMES}
    unknown = sorted(set(kwargs) - _BASE_ARGUMENTS)
    if unknown:
        raise RapidConfigError(
            unknown[0], "unknown argument of RapidLLM (docs/migration.md lists them)"
        )
    return old, config


def _check_values(
    mode: str, timeout: float | None, context_window: int | None, stopping_ids: list[int] | None
) -> None:
    """The checks of RapidLLM's own arguments (the rest are checked where they are used)."""
    check_mode(mode)
    if timeout is not None and not timeout > 0:
        raise RapidConfigError("timeout", f"must be a number of seconds > 0, got {timeout!r}")
    if context_window is not None and not context_window > 0:
        raise RapidConfigError("context_window", f"must be > 0, got {context_window!r}")
    if stopping_ids:
        raise RapidConfigError(
            "stopping_ids",
            "token-id stops are not supported: give stop strings (stop=[...]); "
            "the model's end-of-sequence and end-of-turn tokens always end generation",
        )


def _template(query_wrapper: str | PromptTemplate | None) -> PromptTemplate | None:
    """`query_wrapper_prompt` as a template (HuggingFaceLLM takes a string too)."""
    return PromptTemplate(query_wrapper) if isinstance(query_wrapper, str) else query_wrapper


def _last_user_text(prompt: str | list[dict[str, Any]]) -> str:
    """The text a template filled: the prompt itself, or the last user message."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")


def _report(step: _Step) -> dict[str, Any]:
    """`raw` and `additional_kwargs` of a response: this step's reasoning as
    `thinking_delta` (llama-index-llms-ollama's and -openai's key, which agents stream), and
    on the last one usage (for token counters), stats and the whole `reasoning_content`."""
    out = step.output
    if out is None:
        return (
            {"additional_kwargs": {"thinking_delta": step.thinking_delta}}
            if step.thinking_delta
            else {}
        )
    stats = out.stats.to_dict()
    usage = {"prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.token_ids)}
    raw: dict[str, Any] = {"finish_reason": out.finish_reason, "usage": usage, "rapid_stats": stats}
    if out.logprobs is not None:  # OpenAI's chat shape, which keeps p_hat_logprob if asked
        raw["logprobs"] = openai_chat_logprobs(out.logprobs)
    extra = {"reasoning_content": out.reasoning} if out.reasoning is not None else {}
    return {"raw": raw, "additional_kwargs": {**usage, "rapid_stats": stats, **extra}}


def _last(responses: Iterator[R]) -> R:
    """The last response of a stream, as the non-streaming call returns it (no delta)."""
    last = None
    for last in responses:  # noqa: B007 (the loop runs the stream to its end)
        pass
    assert last is not None  # a stream ends with the response that carries the stats
    return last.model_copy(update={"delta": None})


async def _final(responses: AsyncGenerator[R, None]) -> R:
    """The last response of an async stream, as the non-streaming call returns it."""
    last = None
    async with contextlib.aclosing(responses) as items:  # cancelled: the worker stops now
        async for response in items:
            last = response
    assert last is not None
    return last.model_copy(update={"delta": None})
