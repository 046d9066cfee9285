"""Models the benchmark runs besides the embedded default as loaded by `RapidEngine`.

* `tiny_pair`: two random Llamas of different depth on the embedded tokenizer's vocabulary,
  for speed-only runs of downward (small draft) and upward (large draft) speculation;
* `load_rope_scaled`: a model (the embedded SmolLM2) with linear or YaRN RoPE scaling past
  its window, for speed-only runs at 16K to 64K tokens;
* `choose_dtype`: bfloat16 on CUDA; on CPU whichever of float32 and bfloat16 runs a prefill
  faster here (CPUs with AVX512-BF16 or AMX favour bfloat16, others float32).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

TINY_HIDDEN = 256
TINY_LAYERS = (2, 8)
"""Depths of the small and the large tiny model; the small one is the large one's first layers."""
TINY_BRANCH_SCALE = 0.004
"""Scale of the attention and MLP output projections. Random layers at full scale make two
models of different depth agree on ~1% of next tokens; at 0.004 the layers perturb the
embedding-dominated residual stream little, so greedy speculation between the two accepts
about 0.75-0.95 of drafted tokens, as with a trained pair. The cost of each step is unchanged."""
DTYPE_PROBE_TOKENS = 512


def tiny_pair(
    vocab_size: int, window: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(small, large) random Llamas with `vocab_size` logits and a `window`-token window.

    The small model is the large one truncated to its first layers (same embeddings, norm and
    head), so their next-token choices are related and speculation accepts tokens.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=TINY_HIDDEN,
        intermediate_size=3 * TINY_HIDDEN,
        num_hidden_layers=TINY_LAYERS[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=window,
        tie_word_embeddings=False,
    )
    large = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in large.model.layers:
            layer.self_attn.o_proj.weight.mul_(TINY_BRANCH_SCALE)
            layer.mlp.down_proj.weight.mul_(TINY_BRANCH_SCALE)
    small = LlamaForCausalLM(
        LlamaConfig(**{**config.to_dict(), "num_hidden_layers": TINY_LAYERS[0]})
    )
    small.load_state_dict(large.state_dict(), strict=False)  # the large model's extra layers
    return small.to(dtype).eval(), large.to(dtype).eval()  # type: ignore[arg-type]  # python/typeshed#10653


def load_rope_scaled(
    folder: str | Path,
    window: int,
    device: torch.device,
    dtype: torch.dtype,
    rope_type: str = "linear",
) -> tuple[PreTrainedModel, int]:
    """The model in `folder` with its window stretched to at least `window` tokens by RoPE
    scaling (transformers 5 `rope_parameters`: "linear", or "yarn" with the original window as
    `original_max_position_embeddings`); returns it and the integer factor."""
    config = AutoConfig.from_pretrained(folder)
    original = config.max_position_embeddings
    factor = max(1, math.ceil(window / original))
    scaling: dict[str, object] = {"rope_type": rope_type, "factor": factor}
    if rope_type == "yarn":
        scaling["original_max_position_embeddings"] = original
    config.rope_parameters = {**config.rope_parameters, **scaling}
    config.max_position_embeddings = original * factor
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype)
    return model.to(device).eval(), factor  # type: ignore[arg-type]  # python/typeshed#10653


def choose_dtype(
    model: PreTrainedModel, device: torch.device
) -> tuple[torch.dtype, dict[str, float]]:
    """Cast `model` to the faster dtype here and return it with the measured prefill seconds.

    CUDA: bfloat16 without measuring. CPU: a `DTYPE_PROBE_TOKENS`-token forward in float32
    and in bfloat16, alternating, best of three each (alternation keeps a burst of load from
    other processes from landing on one dtype only).
    """
    if device.type == "cuda":
        model.to(torch.bfloat16)  # type: ignore[arg-type]  # python/typeshed#10653
        return torch.bfloat16, {}
    ids = torch.randint(0, model.config.vocab_size, (1, DTYPE_PROBE_TOKENS), device=device)
    seconds = {"float32": float("inf"), "bfloat16": float("inf")}
    for name in ("float32", "bfloat16") * 3:
        model.to(getattr(torch, name))
        seconds[name] = min(seconds[name], _forward_seconds(model, ids))
    best = torch.float32 if seconds["float32"] <= seconds["bfloat16"] else torch.bfloat16
    model.to(best)  # type: ignore[arg-type]  # python/typeshed#10653
    return best, seconds


@torch.inference_mode()
def _forward_seconds(model: torch.nn.Module, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(input_ids=ids, logits_to_keep=1)
    return time.perf_counter() - start
