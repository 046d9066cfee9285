"""Prefill speed: the engine's chunked prefill by chunk size, transformers' own prefill, and
the compute bound (`rapid bench --prefill`).

The bound is the prompt's forward FLOPs over the matmul rate measured here:
2 x (non-embedding parameters) x tokens for the weights, plus 2 x layers x hidden x tokens^2
for causal attention (QK^T and AV, each half of a tokens x tokens product per layer).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import PreTrainedModel

from rapid_integrations.runtime.kv import KVState

if TYPE_CHECKING:
    from rapid_integrations.engine.rapid_engine import RapidEngine

MATMUL_SIZE = 2048
MATMUL_REPEATS = 5


@torch.inference_mode()
def matmul_flops_per_second(dtype: torch.dtype, device: torch.device) -> float:
    """Best rate of `MATMUL_REPEATS` square matmuls of `MATMUL_SIZE` in `dtype` (FLOP/s)."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device).to(dtype)
    best = float("inf")
    for _ in range(MATMUL_REPEATS):
        start = time.perf_counter()
        (a @ a).sum().item()  # .item() waits for the device
        best = min(best, time.perf_counter() - start)
    return 2 * MATMUL_SIZE**3 / best


def prefill_flops(model: PreTrainedModel, tokens: int) -> float:
    """Forward FLOPs of a `tokens`-token prompt (weights and causal attention)."""
    cfg = model.config
    embedding = cast(torch.nn.Embedding, model.get_input_embeddings()).weight.numel()
    body = sum(p.numel() for p in model.parameters()) - embedding
    # The output head runs on one row per chunk: count the body, not the head.
    return 2.0 * body * tokens + 2.0 * cfg.num_hidden_layers * cfg.hidden_size * tokens**2


@torch.inference_mode()
def engine_prefill_seconds(model: PreTrainedModel, ids: list[int], vocab: int, chunk: int) -> float:
    """Seconds of the engine's prefill (`KVState.start`, no prefix reuse) in `chunk`-token
    pieces."""
    start = time.perf_counter()
    KVState.start(model, ids, vocab, chunk, capacity=len(ids) + 1)
    return time.perf_counter() - start


@torch.inference_mode()
def transformers_prefill_seconds(model: PreTrainedModel, ids: list[int]) -> float:
    """Seconds of one transformers forward over the prompt into its own cache, one logit row
    (what `generate` does before its first token)."""
    x = torch.tensor([ids[:-1]], device=model.device)
    start = time.perf_counter()
    model(input_ids=x, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def chunk_sizes_to_try(
    rows: list[dict[str, Any]], sizes: tuple[int, ...], default: int
) -> list[int]:
    """Every size of `sizes` at the first length (no `rows` yet); after that, the engine's
    default and the fastest size measured so far (a long prefill is minutes on a CPU)."""
    engine_rows = [r for r in rows if r["method"] == "engine"]
    if not engine_rows:
        return sorted(set(sizes))
    best = min(engine_rows, key=lambda r: r["seconds"] / r["context_tokens"])
    return sorted({default, best["chunk"]})


def prefill_rows(
    engine: RapidEngine, ids: list[int], context_label: int, chunks: list[int], rate: float
) -> list[dict[str, Any]]:
    """Prefill of `ids` by the engine's target at each chunk size and by transformers: seconds,
    tokens/s, and the share of the compute bound at `rate` FLOP/s it reaches."""
    bound = prefill_flops(engine.target, len(ids) - 1) / rate
    rows = []
    for chunk in [*chunks, None]:
        seconds = (
            engine_prefill_seconds(engine.target, ids, engine.vocab_size, chunk)
            if chunk
            else transformers_prefill_seconds(engine.target, ids)
        )
        rows.append(
            {
                "context_label": context_label,
                "context_tokens": len(ids),
                "method": "engine" if chunk else "transformers",
                "chunk": chunk,
                "seconds": seconds,
                "tokens_per_second": (len(ids) - 1) / seconds,
                "bound_seconds": bound,
                "fraction_of_bound": bound / seconds,
            }
        )
    return rows
