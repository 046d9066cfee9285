"""What the LangChain and LlamaIndex adapters share: one vocabulary, loading, and HF names.

Both adapters name things the same way (docs/migration.md holds the table): `model`,
`draft_model`, `tokenizer`, `engine`, `get_engine()`, `timeout`, the loading options of
`LoadSpec`, and the generation settings of `SAMPLING_FIELDS`. Users coming from Hugging Face's
integrations keep their own words too: `translate_generate_kwargs` maps transformers'
`generate()` / pipeline options onto `RapidConfig`, and refuses the ones RAPID cannot honour
rather than dropping them. Framework-free: no LangChain or LlamaIndex import here.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rapid_integrations.config import FIELD_NAMES, RapidConfig
from rapid_integrations.engine.args import EngineArgs
from rapid_integrations.errors import RapidConfigError, RapidInputError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rapid_integrations.engine.rapid_engine import RapidEngine

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""How the embedded default model is reported (its converted folder path says nothing useful)."""

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "eta", "gamma")
"""RapidConfig fields that are constructor fields of both adapters under the same name (with
`seed` and `stop`, and the adapter's own name for `max_new_tokens`)."""

# transformers generate() / pipeline options with a RapidConfig counterpart of another name.
_HF_RENAMED = {"stop_strings": "stop"}
# transformers generate() / pipeline options RAPID cannot honour, and why (refused, never dropped).
_HF_REFUSED = {
    "num_beams": "beam search is not speculative decoding; RAPID decodes one sequence",
    "num_beam_groups": "beam search is not speculative decoding; RAPID decodes one sequence",
    "num_return_sequences": "RAPID returns one sequence per call; call it several times",
    "max_length": "it counts the prompt too; use max_new_tokens",
    "min_new_tokens": "RAPID has no minimum length; it stops at end of sequence",
    "min_length": "RAPID has no minimum length; it stops at end of sequence",
    "typical_p": "only top_k, top_p and min_p filter the distributions",
    "epsilon_cutoff": "only top_k, top_p and min_p filter the distributions",
    "eta_cutoff": "only top_k, top_p and min_p filter the distributions (RAPID's eta is "
    "another thing: the transfer strength)",
    "no_repeat_ngram_size": "not applied by RAPID; use repetition_penalty",
    "encoder_repetition_penalty": "RAPID runs decoder-only causal LMs",
    "length_penalty": "only used by beam search, which RAPID does not do",
    "penalty_alpha": "contrastive search is not speculative decoding",
    "bad_words_ids": "token bans are not supported; a grammar constrains output instead",
    "force_words_ids": "constrained beam search is not supported",
    "logits_processor": "RAPID applies its own filters identically to target and draft",
    "stopping_criteria": "use stop strings",
    "streamer": "stream through the framework's own streaming methods",
    "prefix_allowed_tokens_fn": "not supported; a grammar constrains output instead",
    "use_cache": "RAPID always decodes with KV caches",
    "pad_token_id": "RAPID pads nothing (one sequence per call)",
    "output_scores": "RAPID returns text and token ids, not scores",
    "return_dict_in_generate": "RAPID returns text and token ids, not a generate() dict",
    "guidance_scale": "classifier-free guidance is not supported",
}


def translate_generate_kwargs(kwargs: Mapping[str, Any], name: str) -> dict[str, Any]:
    """transformers `generate()` / pipeline options -> `RapidConfig` overrides.

    Same-named options (`max_new_tokens`, `temperature`, `top_p`, `top_k`, `min_p`,
    `repetition_penalty`) carry over, as do RapidConfig fields (`eta`, `gamma`, ...).
    `do_sample=False` means greedy (temperature 0), `do_sample=True` samples at the given
    temperature (1.0, transformers' default, when none is given). `return_full_text=False` is
    what RAPID always does. Anything else raises `RapidConfigError` naming the option; `name`
    is the argument that held them (e.g. "generate_kwargs"), for the message. Values are
    checked where all of a call's settings meet (`merge_overrides`, the engine's call): a
    check across fields (`top_logprobs` needs `logprobs`) cannot be made on a part of them.
    """
    out: dict[str, Any] = {}
    options = dict(kwargs)
    do_sample = options.pop("do_sample", None)
    if options.pop("return_full_text", False):
        raise RapidConfigError(
            "return_full_text", "RAPID returns the generated text only (return_full_text=False)"
        )
    for key, value in options.items():
        if key in _HF_REFUSED:
            raise RapidConfigError(key, f"not supported in {name}: {_HF_REFUSED[key]}")
        target = _HF_RENAMED.get(key, key)
        if target not in FIELD_NAMES:
            raise RapidConfigError(
                key,
                f"unknown option in {name}; it takes transformers generate() options "
                "RAPID can honour (docs/migration.md) and RapidConfig fields",
            )
        out[target] = value
    if do_sample is not None:
        out["temperature"] = _temperature(bool(do_sample), out.get("temperature"))
    return out


def _temperature(do_sample: bool, temperature: float | None) -> float:
    """transformers' meaning of do_sample, as RapidConfig's temperature (0 is greedy)."""
    if not do_sample:
        if temperature not in (None, 0, 0.0):
            raise RapidConfigError(
                "do_sample",
                f"do_sample=False is greedy decoding, so temperature={temperature} "
                "would be ignored; drop one of them",
            )
        return 0.0
    if temperature is None:
        return 1.0
    if temperature == 0:
        raise RapidConfigError("temperature", "must be > 0 with do_sample=True")
    return temperature


def merge_overrides(*sources: tuple[str, Mapping[str, Any]]) -> dict[str, Any]:
    """RapidConfig overrides from several named sources (a field set twice raises), validated.

    `sources` are (argument name, overrides) pairs, e.g. ("temperature", {...}) for the
    adapter's own fields and ("generate_kwargs", {...}) for translated HF options.
    """
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, overrides in sources:
        for key, value in overrides.items():
            if key in merged:
                raise RapidConfigError(
                    key, f"given twice (in {origin[key]} and in {source}); set it once"
                )
            merged[key], origin[key] = value, source
    RapidConfig().replace(**merged)
    return merged


def config_overrides(config: RapidConfig | Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    """A `RapidConfig` (its fields that differ from the defaults) or a mapping of its fields,
    as overrides; checked with the other settings by `merge_overrides` (see
    `translate_generate_kwargs`)."""
    if config is None:
        return {}
    if isinstance(config, RapidConfig):
        default = RapidConfig()
        return {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(default, f.name)
        }
    if not isinstance(config, Mapping):
        raise RapidConfigError(name, f"must be a dict of RapidConfig fields, got {config!r}")
    return dict(config)


def deprecated(old: str, new: str, owner: str) -> None:
    """Warn that `owner`'s argument `old` is now `new` (kept for one release)."""
    warnings.warn(
        f"{owner}: `{old}` is deprecated and will be removed in the next release; use `{new}`",
        DeprecationWarning,
        stacklevel=4,
    )


def check_engine_alone(engine: object, given: Mapping[str, object]) -> None:
    """An engine passed in brings its own models: any loading argument with it is an error."""
    clashing = sorted(k for k, v in given.items() if v is not None and v != {})
    if engine is not None and clashing:
        raise RapidConfigError(
            "engine",
            f"pass either a ready engine or the arguments to build one, not both "
            f"(got engine and {', '.join(clashing)})",
        )


def user_turn(prompt: str) -> list[dict[str, str]]:
    """A plain-string prompt as the one user turn of a chat (for instruct models, whose chat
    template is how they are told to answer)."""
    return [{"role": "user", "content": prompt}]


def completion_prompt(
    prompt: str, tokenizer: PreTrainedTokenizerBase, raw: bool, system: str | None = None
) -> str | list[dict[str, str]]:
    """What the engine reads for a completion prompt (both adapters' LLMs): one user turn,
    after a `system` turn if given, when the tokenizer has a chat template and `raw` is off;
    else the text, after `system` and a space."""
    if raw or not has_chat_template(tokenizer):
        return f"{system} {prompt}" if system else prompt
    head = [{"role": "system", "content": system}] if system else []
    return head + user_turn(prompt)


def with_device_map(
    model_kwargs: Mapping[str, Any] | None, device_map: str | dict[str, Any] | None
) -> dict[str, Any]:
    """Hugging Face's `device_map` argument, as the `model_kwargs` entry it is."""
    merged = dict(model_kwargs or {})
    if device_map is not None:
        if "device_map" in merged:
            raise RapidConfigError("device_map", "already given in model_kwargs")
        merged["device_map"] = device_map
    return merged


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class LoadSpec(EngineArgs):
    """How an adapter builds its `RapidEngine`: the engine's loading options (`EngineArgs`),
    checked at construction, before any weights load, and what a framework asks before the
    first call (the tokenizer, the context window, the model's name) answered without loading
    weights. compile_draft is not part of `identity`, as the thread count is not: at eta = 0
    it changes speed only, at eta > 0 the draft's q by rounding.
    """

    def __post_init__(self) -> None:
        if self.draft_model is None and self.draft_device is not None:
            raise RapidConfigError(
                "draft_device",
                "applies to a separate draft_model; under self-speculation the "
                "target drafts on its own device",
            )
        self.check()

    def build(self, tokenizer: PreTrainedTokenizerBase | None = None) -> RapidEngine:
        """Load the models (the embedded default when `model` is None) into an engine;
        `tokenizer` is the target's, when it was loaded already (for counting)."""
        from rapid_integrations.engine.rapid_engine import RapidEngine
        from rapid_integrations.models.loading import ensure_default_model

        model = ensure_default_model() if self.model is None else self.model
        options = self.options()
        if tokenizer is not None:
            options.pop("tokenizer_kwargs", None)  # they were applied when it was loaded
        return RapidEngine(model, self.draft_model, tokenizer or self.tokenizer, **options)

    @property
    def label(self) -> str:
        """The target's name for metadata and tracing, known without loading anything."""
        return DEFAULT_MODEL_NAME if self.model is None else model_name(self.model)

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """The target's tokenizer alone (no weights): for counting tokens and reading the chat
        template before the engine is built. Pass it to `build` to avoid a second load."""
        from rapid_integrations.models.loading import (
            TOKENIZER_SHARED_KWARGS,
            default_gguf_path,
            default_model_dir,
            load_tokenizer,
        )

        shared = {k: v for k, v in self.model_kwargs.items() if k in TOKENIZER_SHARED_KWARGS}
        kwargs = {**shared, **self.tokenizer_kwargs}
        source = self.tokenizer
        if source is None and self.model is None:
            source = default_model_dir()
            if not (source / "tokenizer_config.json").is_file():
                return _gguf_tokenizer(default_gguf_path())  # not converted yet
        elif source is None and not isinstance(self.model, (str, os.PathLike)):
            source = getattr(self.model, "name_or_path", "")  # a model object's folder
            if not source or not os.path.isdir(source):
                raise RapidInputError("no tokenizer found for the model object; pass tokenizer=")
        elif source is None:
            source = self.model
        if isinstance(source, (str, os.PathLike)) and os.fspath(source).endswith(".gguf"):
            return _gguf_tokenizer(os.fspath(source))
        tokenizer = load_tokenizer(source, kwargs)
        assert tokenizer is not None  # every branch above gave a source
        return tokenizer

    def context_window(self) -> int:
        """The target's window in tokens, read from its config without loading weights."""
        from rapid_integrations.models.loading import context_window_of

        return context_window_of(self.model, self.model_kwargs)

    def identity(self) -> dict[str, Any]:
        """What about the models changes a call's output: part of LLM cache keys."""
        return {
            "model": self.label,
            "draft_model": None if self.draft_model is None else model_name(self.draft_model),
            "dtype": None if self.dtype is None else str(self.dtype),
            "draft_precision": self.draft_precision,
            "target_precision": self.target_precision,
            "model_kwargs": _plain(self.model_kwargs),
            "draft_model_kwargs": _plain(self.draft_model_kwargs),
        }


def model_name(model: Any) -> str:
    """A model's name: the string it was given as, or a loaded model's `name_or_path`. A local
    path is named by its last part; the rest is the user's file layout, not the model."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    name = model if isinstance(model, str) else getattr(model, "name_or_path", "")
    name = name or type(model).__name__
    return os.path.basename(name.rstrip("/\\")) if os.path.isabs(name) else name


def retriever_identity(retriever: object) -> str | None:
    """A retriever's identity for cache keys: with eta > 0 the output depends on what the
    draft reads, so two retrievers must not share cached answers."""
    if retriever is None:
        return None
    wrapped = getattr(retriever, "retriever", retriever)  # the framework adapters' source
    return f"{type(wrapped).__qualname__}@{id(wrapped):x}"


def _gguf_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _plain(options: Mapping[str, Any]) -> dict[str, str]:
    """Loading options as strings (quantization configs and the like are not JSON)."""
    return {k: repr(v) for k, v in sorted(options.items())}
