"""Attention for decode and verify passes: a few queries over a long grouped-query KV cache.

transformers' SDPA path handles several queries with grouped-query attention (GQA) by
`repeat_kv`, copying the whole cache to every query head on every verify pass (at 8K tokens,
~1 GB of writes per pass for SmolLM2 in fp32). Here the query heads that share a KV head are
folded into the query-length axis instead, so the cache is read in place:
    query [1, Hq, q, d] -> [1, Hkv, (Hq / Hkv) * q, d],  mask [1, 1, q, kv] tiled to match.
On CPU in bf16/fp16, PyTorch's flash kernel is slow for few queries (measured in
docs/performance.md, "Why these defaults"), so the scores are two matmuls with an fp32 softmax
instead. Long query blocks (prefill) and anything unusual go to transformers' own SDPA
function unchanged.

A packed forward pass of several sequences (`kv.PackedCache`, the varlen layout) passes its
layout as the `rapid_layout` keyword: each segment's queries attend to their own sequence's
KV, each under its own causal mask (`_varlen`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

if TYPE_CHECKING:
    from .kv import PackedCache

NAME = "rapid_decode"
LAYOUT = "rapid_layout"
"""The forward keyword that carries a packed pass's `kv.PackedCache` down to attention."""
MAX_FOLDED_QUERIES = 64  # decode and verify blocks; longer blocks are prefill


def rapid_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention with transformers' signature; returns output [b, q, Hq, d]."""
    layout = kwargs.pop(LAYOUT, None)
    if layout is not None:
        return _varlen(module, query, layout, dropout, scaling, **kwargs)
    batch, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    plain = (
        batch == 1
        and dropout == 0.0
        and not kwargs.get("softcap")
        and "position_bias" not in kwargs
    )
    causal_prefill = attention_mask is None and q_len > 1
    if (
        not plain
        or causal_prefill
        or q_len > MAX_FOLDED_QUERIES
        or key.shape[-1] != value.shape[-1]
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    folded = query.reshape(1, key.shape[1], groups * q_len, dim)
    mask = None
    if attention_mask is not None:
        mask = attention_mask.expand(1, 1, q_len, -1)
        mask = (
            mask[:, :, None]
            .expand(1, 1, groups, q_len, mask.shape[-1])
            .reshape(1, 1, groups * q_len, -1)
        )
    scale = scaling if scaling is not None else dim**-0.5
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16):
        out = _matmul_attention(folded, key, value, mask, scale)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            folded, key, value, attn_mask=mask, scale=scale
        )
    return out.reshape(1, heads, q_len, dim).transpose(1, 2).contiguous(), None


def _varlen(
    module: torch.nn.Module,
    query: torch.Tensor,
    layout: PackedCache,
    dropout: float,
    scaling: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a packed row: query [1, Hq, T_total, d], segment i (`layout.bounds`)
    against its own sequence's keys and values [1, Hkv, kv_i, d] (`layout.kv`), new tokens
    last; returns [1, T_total, Hq, d]. Segment i's t_i queries sit at the last t_i positions
    of its KV: query j sees keys 0 .. kv_i - t_i + j, the mask transformers' `sdpa_mask`
    builds for one sequence (none for one query, as there), so each segment computes what its
    sequence's own forward pass would."""
    outputs = []
    for segment, (start, end) in enumerate(layout.bounds):
        key, value = layout.kv(module.layer_idx, segment)  # type: ignore[arg-type]
        t, kv = end - start, key.shape[-2]
        mask = None
        if t > 1:
            seen = torch.arange(kv, device=key.device)[None, :]  # [1, kv]
            last = torch.arange(kv - t, kv, device=key.device)[:, None]  # [t, 1]
            mask = (seen <= last)[None, None]  # [1, 1, t, kv]
        out, _ = rapid_attention(
            module, query[:, :, start:end], key, value, mask, dropout, scaling, **kwargs
        )
        outputs.append(out)  # [1, t, Hq, d]
    return torch.cat(outputs, dim=1), None


def _matmul_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        )
    return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)


def use_rapid_attention(model: PreTrainedModel) -> None:
    """Switch a transformers model that uses SDPA to this attention (other kernels are kept)."""
    AttentionInterface.register(NAME, rapid_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(NAME)
