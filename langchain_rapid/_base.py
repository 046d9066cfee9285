"""What `ChatRapid` and `RapidLLM` share: fields, the lazy engine, per-call parameters, runs.

Both classes adapt one `RapidEngine` call, `engine.stream(prompt, draft_prompt, mode, **overrides)`,
and differ only in how they wrap its text deltas (message chunks or generation chunks). Every
decoding decision stays in the engine; this module only maps LangChain's vocabulary onto it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator
from typing_extensions import Self

from rapid_integrations import RapidConfig, RapidError, RapidInputError
from rapid_integrations.aio import aiter_in_thread as aiter_in_thread  # for chat_models, llms

from .retrievers import as_context_retriever

if TYPE_CHECKING:
    from typing import TypeAlias

    from langchain_core.retrievers import BaseRetriever
    from langchain_core.vectorstores import VectorStore
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rapid_integrations import RapidEngine, RapidOutput, RapidStream
    from rapid_integrations.retrieval import ContextRetriever
    from rapid_integrations.tokens import Prompt

    ModelSpec: TypeAlias = str | os.PathLike[str] | PreTrainedModel
    TokenizerSpec: TypeAlias = PreTrainedTokenizerBase
    EngineSpec: TypeAlias = RapidEngine
    RetrieverSpec: TypeAlias = BaseRetriever | VectorStore | ContextRetriever
else:
    # Precise for type checkers, Any for pydantic at run time: importing this package must not
    # load torch or transformers (construction stays cheap; weights load on first use).
    ModelSpec = TokenizerSpec = EngineSpec = RetrieverSpec = Any

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""How the embedded default model is reported (its converted folder path says nothing useful)."""

# Fields of this class that carry a RapidConfig value, under the engine's name for it.
_CONFIG_FIELDS = {
    "temperature": "temperature",
    "max_tokens": "max_new_tokens",
    "top_p": "top_p",
    "eta": "eta",
    "gamma": "gamma",
    "seed": "seed",
}


class RapidTimeoutError(RapidError, TimeoutError):
    """A call ran longer than its `timeout`; generation was stopped and its caches freed."""


class RapidParams(BaseModel):
    """Fields and engine plumbing shared by the LangChain chat model and LLM."""

    model: ModelSpec | None = None
    """Target model: a local folder, a `.gguf` file, a hub id or a transformers model object.
    None uses the embedded SmolLM2-135M-Instruct. Loaded on first use, not at construction."""

    draft_model: ModelSpec | None = None
    """Draft model, in the same forms as `model`. None is self-speculation: the target object
    also drafts, reading only the short retrieved context."""

    tokenizer: TokenizerSpec | None = None
    """Tokenizer shared by target and draft; None finds it next to the target model."""

    engine: EngineSpec | None = Field(default=None, exclude=True)
    """A ready `RapidEngine` to use instead of loading `model`; several instances may share one."""

    retriever: RetrieverSpec | None = Field(default=None, exclude=True)
    """Source of the draft's short context C^S: a LangChain `BaseRetriever` or `VectorStore`
    (wrapped in `RapidRetrieverAdapter`), any `ContextRetriever`, or None for the engine's
    built-in retriever over the prompt."""

    mode: Literal["rapid", "sd", "lc", "rag"] = "rapid"
    """`rapid` (retrieval-augmented speculation), `sd` (plain speculative decoding, draft on the
    full prompt), `lc` (target alone) or `rag` (draft alone on the retrieved context)."""

    temperature: float | None = None
    """Sampling temperature; 0 is greedy. None keeps the engine's setting (greedy by default)."""

    max_tokens: int | None = None
    """Most tokens to generate; None keeps the engine's `max_new_tokens`."""

    top_p: float | None = None
    """Nucleus sampling mass; None keeps the engine's setting."""

    eta: float | None = None
    """RAPID transfer strength toward the draft (0: output follows the target exactly)."""

    gamma: int | None = None
    """Draft tokens proposed per target verification pass."""

    seed: int | None = None
    """Random seed of sampling; None draws a fresh seed per call (reported in the stats)."""

    stop: list[str] | None = None
    """Stop strings; the text ends before the first one. A per-call `stop` replaces these."""

    timeout: float | None = None
    """Seconds a call may take; checked as tokens are committed, so a long prefill is not cut
    short. On expiry generation stops and `RapidTimeoutError` is raised."""

    max_retries: int = Field(default=0, ge=0)
    """Accepted so code written for hosted models runs unchanged. A local engine has no
    transient failures (network, rate limits) worth retrying, so calls are made once."""

    streaming: bool = False
    """Generate through the streaming path even for `invoke`, so callbacks see every token."""

    device: str | None = None
    """Device to load `model` on (default: CUDA when available, else CPU)."""

    dtype: str | None = None
    """Weight dtype when loading `model`: "float32", "bfloat16", ... (default: per device)."""

    rapid_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Any other `RapidConfig` fields for every call: residual, tail_guard, truncation,
    retrieval_budget, prefill_chunk_size, ..."""

    _engine: RapidEngine | None = PrivateAttr(default=None)
    _engine_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @field_validator("retriever", mode="before")
    @classmethod
    def _adapt_retriever(cls, value: RetrieverSpec | None) -> ContextRetriever | None:
        return None if value is None else as_context_retriever(value)

    @model_validator(mode="after")
    def _check_params(self) -> Self:
        """Reject contradictions and invalid RapidConfig values at construction (no weights load)."""
        if self.engine is not None and self.model is not None:
            raise RapidInputError("pass either `engine` or `model`, not both")
        clashes = set(self.rapid_kwargs) & {*_CONFIG_FIELDS, *_CONFIG_FIELDS.values(), "stop"}
        if clashes:
            raise RapidInputError(f"set {sorted(clashes)} through the fields of the same name")
        RapidConfig().replace(**self._config_overrides())
        return self

    @property
    def model_label(self) -> str:
        """The model's name for metadata and tracing; known without loading any weights."""
        if self.model is not None:
            return _name_of(self.model)
        if self.engine is not None:
            return _name_of(self.engine.model_name)
        return DEFAULT_MODEL_NAME

    def get_engine(self) -> RapidEngine:
        """The engine, loading the weights on first use (once, even under concurrent calls)."""
        if self.engine is not None:
            return self.engine
        with self._engine_lock:
            if self._engine is None:
                self._engine = self._load_engine()
            return self._engine

    def _load_engine(self) -> RapidEngine:
        from rapid_integrations import RapidEngine

        if self.model is None:
            return RapidEngine.from_default(self.draft_model, device=self.device, dtype=self.dtype)
        return RapidEngine(
            self.model, self.draft_model, self.tokenizer, device=self.device, dtype=self.dtype
        )

    def _config_overrides(self) -> dict[str, Any]:
        """RapidConfig values set on this instance, under the engine's field names."""
        named = {
            engine_name: getattr(self, name)
            for name, engine_name in _CONFIG_FIELDS.items()
            if getattr(self, name) is not None
        }
        return {**self.rapid_kwargs, **named}

    def _start(self, prompt: Prompt, stop: list[str] | None, kwargs: dict[str, Any]) -> RapidRun:
        """Begin one engine call. Per-call `kwargs` override the instance: `mode`,
        `draft_prompt`, `retriever`, `query`, `max_tokens` and any RapidConfig field by name;
        unknown names raise `RapidConfigError`."""
        call = dict(kwargs)
        call.pop("stream", None)  # LangChain's own streaming switch, not a generation setting
        mode = call.pop("mode", self.mode)
        draft_prompt = call.pop("draft_prompt", None)
        if "max_tokens" in call:
            call["max_new_tokens"] = call.pop("max_tokens")
        retriever = call.pop("retriever", self.retriever)
        if retriever is not None:
            call["retriever"] = as_context_retriever(retriever)
        stop = self.stop if stop is None else stop
        if stop is not None:
            call["stop"] = tuple(stop)
        overrides = {**self._config_overrides(), **call}
        return RapidRun(
            self.get_engine().stream(prompt, draft_prompt, mode, **overrides), self.timeout
        )

    def _usage(self, output: RapidOutput) -> dict[str, int]:
        """Real token counts: the target's prompt and the committed tokens."""
        generated = len(output.token_ids)
        return {
            "input_tokens": output.prompt_tokens,
            "output_tokens": generated,
            "total_tokens": output.prompt_tokens + generated,
        }

    def _response_metadata(self, output: RapidOutput) -> dict[str, Any]:
        """model_name, finish_reason ("eos" | "stop" | "length") and the run's RapidStats."""
        return {
            "model_name": self.model_label,
            "finish_reason": output.finish_reason,
            "rapid_stats": output.stats.to_dict(),
        }

    def _ls_params(
        self, model_type: Literal["chat", "llm"], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """LangSmith tracing parameters; per-call values win over the instance's."""
        params: dict[str, Any] = {
            "ls_provider": "rapid",
            "ls_model_name": kwargs.get("model") or self.model_label,
            "ls_model_type": model_type,
            "ls_temperature": kwargs.get("temperature", self.temperature),
            "ls_max_tokens": kwargs.get("max_tokens", self.max_tokens),
        }
        stop = self.stop if stop is None else stop
        if stop:
            params["ls_stop"] = stop
        return params

    def _identifying(self) -> dict[str, Any]:
        """Everything that changes the output of a call; also the LLM cache key."""
        return {
            "model": self.model_label,
            "draft_model": None if self.draft_model is None else _name_of(self.draft_model),
            "mode": self.mode,
            "stop": self.stop,
            **self._config_overrides(),
        }


def _name_of(model: Any) -> str:
    """A model's name: the string it was given as, or a loaded model's `name_or_path`. A local
    path is named by its last part; the rest is the user's file layout, not the model."""
    name = model if isinstance(model, str) else getattr(model, "name_or_path", "")
    name = name or type(model).__name__
    return os.path.basename(name.rstrip("/\\")) if os.path.isabs(name) else name


class RapidRun:
    """One engine call as an iterator of committed text, bounded by a timeout.

    The engine's stream is closed when iteration ends for any reason (exhausted, timed out, or
    abandoned by the consumer), which frees its KV caches at once.
    """

    def __init__(self, stream: RapidStream, timeout: float | None) -> None:
        self._stream = stream
        self._timeout = timeout

    def __iter__(self) -> Iterator[str]:
        start = time.monotonic()
        with self._stream:
            for delta in self._stream:
                yield delta
                if self._timeout is not None and time.monotonic() - start > self._timeout:
                    raise RapidTimeoutError(f"generation took longer than {self._timeout} s")

    @property
    def output(self) -> RapidOutput:
        """The finished call's `RapidOutput` (available once iteration is complete)."""
        if self._stream.output is None:
            raise RuntimeError("the run has not finished")
        return self._stream.output
