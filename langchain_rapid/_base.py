"""What `ChatRapid` and `RapidLLM` share: fields, the lazy engine, per-call parameters, runs.

Both classes adapt one `RapidEngine` call, `engine.stream(prompt, options=CallOptions(...))`,
and differ only in how they wrap its text deltas (message chunks or generation chunks). Every
decoding decision stays in the engine, and the engine's lazy build in `EngineHandle`; this
module only maps LangChain's vocabulary onto them (the names both adapters share are in
`rapid_integrations.adapters.params` and docs/migration.md).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from typing_extensions import Self

from rapid_integrations import RapidError
from rapid_integrations.adapters.aio import (
    aiter_in_thread as aiter_in_thread,  # for chat_models, llms
)
from rapid_integrations.adapters.handle import EngineHandle
from rapid_integrations.adapters.params import (
    SAMPLING_FIELDS,
    deprecated,
    merge_overrides,
    retriever_identity,
    translate_generate_kwargs,
    with_device_map,
)
from rapid_integrations.adapters.timeouts import (
    RapidTimeoutError as RapidTimeoutError,  # re-exported
)
from rapid_integrations.adapters.timeouts import TimedRun
from rapid_integrations.config import FIELD_NAMES, Mode, check_mode
from rapid_integrations.engine.args import LOADING_FIELDS
from rapid_integrations.engine.call_options import CallOptions

from .retrievers import as_context_retriever

if TYPE_CHECKING:
    from typing import TypeAlias

    from langchain_core.language_models import LangSmithParams
    from langchain_core.messages.ai import UsageMetadata
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.vectorstores import VectorStore
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rapid_integrations import RapidEngine, RapidOutput
    from rapid_integrations.retrieval import ContextRetriever
    from rapid_integrations.tokens import Prompt

    ModelSpec: TypeAlias = str | os.PathLike[str] | PreTrainedModel
    TokenizerSpec: TypeAlias = str | os.PathLike[str] | PreTrainedTokenizerBase
    EngineSpec: TypeAlias = RapidEngine
    RetrieverSpec: TypeAlias = BaseRetriever | VectorStore | ContextRetriever
else:
    # Precise for type checkers, Any for pydantic at run time: importing this package must not
    # load torch or transformers (construction stays cheap; weights load on first use).
    ModelSpec = TokenizerSpec = EngineSpec = RetrieverSpec = Any

# Fields of this class that carry a RapidConfig value, under the engine's name for it.
_CONFIG_FIELDS = {
    **{name: name for name in SAMPLING_FIELDS},
    "max_tokens": "max_new_tokens",
    "seed": "seed",
}
# HuggingFacePipeline.from_model_id's `device`: an accelerator index, -1 for the CPU.
_CPU_INDEX = -1


class RapidParams(BaseModel):
    """Fields and engine plumbing shared by the LangChain chat model and LLM."""

    model: ModelSpec | None = None
    """Target model: a local folder, a `.gguf` file, a hub id or a transformers model object.
    None uses the embedded SmolLM2-135M-Instruct. Loaded on first use, not at construction."""

    draft_model: ModelSpec | None = None
    """Draft model, in the same forms as `model`. None is self-speculation: the target object
    also drafts, reading only the short retrieved context."""

    tokenizer: TokenizerSpec | None = None
    """Tokenizer shared by target and draft: an object, or a folder / hub id loaded with
    `tokenizer_kwargs`; None finds it next to the target model."""

    engine: EngineSpec | None = Field(default=None, exclude=True)
    """A ready `RapidEngine` to use instead of loading `model`; several instances may share one."""

    retriever: RetrieverSpec | None = Field(default=None, exclude=True)
    """Source of the draft's short context C^S: a LangChain `BaseRetriever` or `VectorStore`
    (wrapped in `RapidRetrieverAdapter`), any `ContextRetriever`, or None for the engine's
    built-in retriever over the prompt."""

    mode: Mode = "rapid"
    """`rapid` (retrieval-augmented speculation), `sd` (plain speculative decoding, draft on the
    full prompt), `lc` (target alone) or `rag` (draft alone on the retrieved context)."""

    temperature: float | None = None
    """Sampling temperature; 0 is greedy. None keeps the engine's setting (greedy by default)."""

    max_tokens: int | None = None
    """Most tokens to generate; None keeps the engine's `max_new_tokens`."""

    top_p: float | None = None
    """Nucleus sampling mass; None keeps the engine's setting."""

    top_k: int | None = None
    """Sample among the k most likely tokens only (0: off); applied to target and draft alike."""

    min_p: float | None = None
    """Drop tokens less likely than min_p times the most likely one (0: off)."""

    repetition_penalty: float | None = None
    """transformers' repetition penalty (1: off), applied to target and draft alike."""

    eta: float | None = None
    """RAPID transfer strength toward the draft (0: output follows the target exactly)."""

    gamma: int | None = None
    """Draft tokens proposed per target verification pass."""

    seed: int | None = None
    """Random seed of sampling; None draws a fresh seed per call (reported in the stats)."""

    stop: list[str] | None = None
    """Stop strings; the text ends before the first one. A per-call `stop` replaces these."""

    timeout: float | None = Field(default=None, gt=0)
    """Seconds a call may take; checked as tokens are committed, so a long prefill is not cut
    short. On expiry generation stops and `RapidTimeoutError` is raised."""

    max_retries: int = Field(default=0, ge=0)
    """Accepted so code written for hosted models runs unchanged. A local engine has no
    transient failures (network, rate limits) worth retrying, so calls are made once."""

    streaming: bool = False
    """Generate through the streaming path even for `invoke`, so callbacks see every token."""

    device: str | None = None
    """Device to load `model` on (default: CUDA when available, else CPU)."""

    draft_device: str | None = None
    """Device of a separate `draft_model` (default: `device`)."""

    dtype: str | None = None
    """Weight dtype when loading: "float32", "bfloat16", ... (default: per device)."""

    draft_precision: str | None = None
    """Draft with a cheaper copy: "bfloat16", "float16", "int8-weight", "int4-weight" (CPU) or
    "int8"; outputs stay exact. Unset ("auto"): an int4 copy of a bf16 self-draft on a CPU,
    else the draft as loaded ("none")."""

    target_precision: str | None = None
    """Verify with a copy of the target: "int4-weight" (CPU, bf16), 4-bit weights in groups
    of 32, a slightly different model whose own output is then followed (a self-draft shares
    it). Unset ("auto") or "none": the target as loaded."""

    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the target's `from_pretrained`: device_map (incl. "auto"),
    quantization_config, attn_implementation, trust_remote_code, revision, ..."""

    draft_model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the draft's `from_pretrained`."""

    compile_draft: bool | None = None
    """Run the draft's decode passes through torch.compile: faster drafting on a CPU, the
    graphs built when the engine loads (1-2 minutes for SmolLM2 on 2 cores); outputs
    unchanged at eta = 0. Unset: False."""

    tokenizer_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of `AutoTokenizer.from_pretrained`."""

    rapid_config: dict[str, Any] = Field(default_factory=dict)
    """Any other `RapidConfig` fields for every call: residual, tail_guard, truncation,
    retrieval_budget, prefill_chunk_size, ... They may also be given as constructor arguments
    of their own (`ChatRapid(truncation="head_tail")`), which land here."""

    _engine_handle: EngineHandle | None = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        """Our own checks raise the package's errors (`RapidConfigError` naming the field),
        not pydantic's `ValidationError` around them, in both adapters alike."""
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise _own_error(error) or error from None

    @model_validator(mode="before")
    @classmethod
    def _gather_config(cls, data: Any) -> Any:
        """`rapid_config` from its old name (kept for one release with a DeprecationWarning)
        and from `RapidConfig` fields given as arguments of their own; a field given twice
        raises `RapidConfigError`."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "rapid_kwargs" in data:
            deprecated("rapid_kwargs", "rapid_config", cls.__name__)
            data["rapid_config"] = {**data.pop("rapid_kwargs"), **data.get("rapid_config", {})}
        own = {k: data.pop(k) for k in list(data) if k in FIELD_NAMES - set(cls.model_fields)}
        if own:
            given = data.get("rapid_config") or {}
            data["rapid_config"] = merge_overrides(("arguments", own), ("rapid_config", given))
        return data

    @field_validator("mode", mode="before")
    @classmethod
    def _check_mode(cls, value: object) -> object:
        check_mode(value)  # the package's RapidConfigError, not pydantic's message
        return value

    @field_validator("retriever", mode="before")
    @classmethod
    def _adapt_retriever(cls, value: RetrieverSpec | None) -> ContextRetriever | None:
        return None if value is None else as_context_retriever(value)

    @model_validator(mode="after")
    def _check_params(self) -> Self:
        """Reject contradictions and invalid values at construction (no weights load)."""
        # Made now, in one thread (so concurrent first calls share it), and its checks run.
        self._engine_handle = self._handle
        self._config_overrides()
        return self

    @property
    def _handle(self) -> EngineHandle:
        """The engine handle, made on first use: at construction (LangChain's own validators,
        such as the model profile's, may come first)."""
        if self._engine_handle is None:
            loading = {name: getattr(self, name) for name in LOADING_FIELDS}
            self._engine_handle = EngineHandle(self.engine, loading)
        return self._engine_handle

    @classmethod
    def from_model_id(
        cls,
        model_id: str,
        task: str = "text-generation",
        backend: str = "default",
        device: int | str | None = None,
        device_map: str | dict[str, Any] | None = None,
        model_kwargs: dict[str, Any] | None = None,
        pipeline_kwargs: dict[str, Any] | None = None,
        batch_size: int | None = None,
        **kwargs: Any,
    ) -> Self:
        """Build from a model id with `HuggingFacePipeline.from_model_id`'s meanings.

        `device` is an accelerator index (-1: CPU) or a device name; `device_map` and
        `model_kwargs` go to `from_pretrained`; `pipeline_kwargs` are transformers generation
        options (max_new_tokens, temperature, top_k, top_p, do_sample, repetition_penalty...).
        `ChatHuggingFace.from_model_id`'s generation keywords (max_tokens, temperature, top_p,
        top_k, repetition_penalty, do_sample) are accepted directly too; other `kwargs` are
        this class's fields. Loads nothing until the first call.
        """
        from rapid_integrations import RapidConfigError

        if task != "text-generation":
            raise RapidConfigError(
                "task", f"RAPID runs causal LMs: only 'text-generation', got {task!r}"
            )
        if backend not in ("default", "pipeline"):
            raise RapidConfigError(
                "backend", f"only the transformers backend is supported, got {backend!r}"
            )
        if batch_size is not None:
            raise RapidConfigError(
                "batch_size",
                "calls made together (batch(), concurrent invoke/ainvoke) are decoded in "
                "one batch on the engine; there is no batch size to set",
            )
        if device_map is not None and device is not None:
            raise RapidConfigError("device_map", "give either device or device_map, not both")
        loading = with_device_map(model_kwargs, device_map)
        generation = dict(pipeline_kwargs or {})
        for key in ("temperature", "top_p", "top_k", "repetition_penalty", "do_sample"):
            if key in kwargs and key not in generation:
                generation[key] = kwargs.pop(key)
        if "max_tokens" in kwargs:
            generation.setdefault("max_new_tokens", kwargs.pop("max_tokens"))
        settings = translate_generate_kwargs(generation, "pipeline_kwargs")
        fields = _split_config({_field_of(name): value for name, value in settings.items()})
        fields["rapid_config"] = {
            **fields.get("rapid_config", {}),
            **kwargs.pop("rapid_config", {}),
        }
        return cls(
            model=model_id, device=_device_name(device), model_kwargs=loading, **fields, **kwargs
        )

    @property
    def model_label(self) -> str:
        """The model's name for metadata and tracing; known without loading any weights."""
        return self._handle.label

    def get_engine(self) -> RapidEngine:
        """The engine, loading the weights on first use (once, even under concurrent calls)."""
        return self._handle.get()

    def get_token_ids(self, text: str) -> list[int]:
        """The model's own token ids for `text` (its tokenizer, not GPT-2's); loads the
        tokenizer alone if the engine is not loaded yet."""
        return list(self._handle.tokenizer().encode(text, add_special_tokens=False))

    def _config_overrides(self) -> dict[str, Any]:
        """RapidConfig values set on this instance, under the engine's field names."""
        named = {
            engine_name: getattr(self, name)
            for name, engine_name in _CONFIG_FIELDS.items()
            if getattr(self, name) is not None
        }
        dedicated = {*_CONFIG_FIELDS, *_CONFIG_FIELDS.values(), "stop"}
        clashes = sorted(set(self.rapid_config) & dedicated)
        if clashes:
            from rapid_integrations import RapidConfigError

            raise RapidConfigError(clashes[0], "set it through the field of the same name")
        return merge_overrides(("fields", named), ("rapid_config", self.rapid_config))

    def _start(self, prompt: Prompt, stop: list[str] | None, kwargs: dict[str, Any]) -> TimedRun:
        """Begin one engine call, in the engine's batch: calls made at the same time (`batch`,
        concurrent `invoke`s and `ainvoke`s) decode together (`batcher.batched_stream`). Per-call `kwargs` override the instance: `max_tokens`, the
        `CallOptions` names (`mode`, `draft_prompt`, `retriever`, `query`, tools, ...) and any
        RapidConfig field by name; unknown names raise `RapidConfigError`."""
        call = dict(kwargs)
        call.pop("stream", None)  # LangChain's own streaming switch, not a generation setting
        if "max_tokens" in call:
            call["max_new_tokens"] = call.pop("max_tokens")
        retriever = call.pop("retriever", self.retriever)
        if retriever is not None:
            call["retriever"] = as_context_retriever(retriever)
        stop = self.stop if stop is None else stop
        if stop is not None:
            call["stop"] = tuple(stop)
        options = CallOptions.of({"mode": self.mode, **self._config_overrides(), **call})
        return self._handle.stream(prompt, options, self.timeout)

    def _usage(self, output: RapidOutput) -> UsageMetadata:
        """Real token counts: the target's prompt, of which the prefix cache served
        `input_token_details["cache_read"]` (where ChatOpenAI and ChatAnthropic report their
        prompt caches), and the committed tokens, of which a reasoning section's (markers
        included) in `output_token_details`, as ChatOpenAI reports a reasoning model's."""
        generated = len(output.token_ids)
        # The ignore: at python_version 3.10 mypy reads langchain-core's `typing.NotRequired`
        # (3.11+) as nothing, so the optional token-detail keys look required.
        usage: UsageMetadata = {  # type: ignore[typeddict-item]
            "input_tokens": output.prompt_tokens,
            "output_tokens": generated,
            "total_tokens": output.prompt_tokens + generated,
            "input_token_details": {"cache_read": output.stats.cached_prefix_tokens},
        }
        if output.stats.reasoning_tokens:
            usage["output_token_details"] = {"reasoning": output.stats.reasoning_tokens}
        return usage

    def _response_metadata(self, output: RapidOutput) -> dict[str, Any]:
        """model_name, finish_reason ("eos" | "stop" | "length") and the run's RapidStats."""
        return {
            "model_name": self.model_label,
            "finish_reason": output.finish_reason,
            "rapid_stats": output.stats.to_dict(),
        }

    def _ls_params(
        self, model_type: Literal["chat", "llm"], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> LangSmithParams:
        """LangSmith tracing parameters; per-call values win over the instance's."""
        params: LangSmithParams = {
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
        models = (
            {"model": self.model_label, "engine": f"RapidEngine@{id(self.engine):x}"}
            if self.engine is not None
            else self._handle.spec.identity()
        )
        return {
            **models,
            "mode": self.mode,
            "retriever": retriever_identity(self.retriever),
            "stop": self.stop,
            **self._config_overrides(),
        }


def _own_error(error: ValidationError) -> RapidError | None:
    """The package's own error that a validator raised, if pydantic wrapped one."""
    for detail in error.errors():
        cause = (detail.get("ctx") or {}).get("error")
        if isinstance(cause, RapidError):
            return cause
    return None


def _field_of(config_name: str) -> str:
    """The field of these classes that holds a RapidConfig field."""
    return "max_tokens" if config_name == "max_new_tokens" else config_name


def _split_config(settings: dict[str, Any]) -> dict[str, Any]:
    """Translated settings as constructor arguments: own fields, the rest in rapid_config."""
    own = {k: v for k, v in settings.items() if k in _CONFIG_FIELDS or k == "stop"}
    rest = {k: v for k, v in settings.items() if k not in own}
    if "stop" in own:
        own["stop"] = list(own["stop"]) if not isinstance(own["stop"], str) else [own["stop"]]
    return {**own, **({"rapid_config": rest} if rest else {})}


def _device_name(device: int | str | None) -> str | None:
    """HuggingFacePipeline's device index (-1: CPU, n: accelerator n) as a device name."""
    if device is None or isinstance(device, str):
        return device
    if device == _CPU_INDEX:
        return "cpu"
    from rapid_integrations import RapidConfigError

    if device < 0:
        raise RapidConfigError("device", f"an index must be -1 (CPU) or >= 0, got {device}")
    import torch

    kind = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if kind is None:
        raise RapidConfigError("device", f"accelerator {device} asked for, but none is available")
    return f"{kind.type}:{device}"
