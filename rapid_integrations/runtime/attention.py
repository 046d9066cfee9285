"""Attention for decode and verify passes: a few queries over a long grouped-query KV cache.

transformers' SDPA path handles several queries with grouped-query attention (GQA) by
`repeat_kv`, copying the whole cache to every query head on every verify pass (at 8K tokens,
~1 GB of writes per pass for SmolLM2 in fp32). Here the query heads that share a KV head are
folded into the query-length axis instead, so the cache is read in place:
    query [1, Hq, q, d] -> [1, Hkv, (Hq / Hkv) * q, d],  mask [1, 1, q, kv] tiled to match.
On a CPU without native bf16 (AVX2), PyTorch's flash kernel is slow in bf16/fp16 for few
queries (3.6 ms a layer for one query at 8K: docs/performance.md, "Why these defaults"), so
the scores are two matmuls with an fp32 softmax there. Where the CPU has native bf16
(AVX512-BF16 or AMX) a bf16 block goes to the flash kernel: the cache is a view of a longer
buffer, which the matmuls copy whole on every pass (at 8K, 1 query 1.0 against 0.76 ms a
layer, a 9-token verify 4.2 against 1.9) and the flash kernel reads in place.
On the CPU a long block's keys are also split into runs read as one batch of the flash kernel
and merged by their log-sum-exp (`_flash_partial`, flash-decoding's split): the kernel
parallelizes over batch and heads, so one sequence's 3 KV heads on 2 threads left a thread
idle a third of the time. A decode block splits from 2 x `MIN_RUN_KEYS` keys, a verify block
from `MIN_SPLIT_VERIFY_KEYS`, its own masked keys a part of their own.
A masked prefill chunk on the CPU (every chunk after the first) goes to PyTorch's
SDPA with `enable_gqa`, whose flash kernel also reads the grouped KV in place where
transformers' SDPA function would `repeat_kv` the whole cache for it (`_gqa_prefill`).
Anything else goes to transformers' own SDPA function unchanged.

A packed forward pass of several sequences (`kv.PackedCache`, the varlen layout) passes its
layout as the `rapid_layout` keyword: each segment's queries attend to their own sequence's
KV, each under its own causal mask (`_varlen`). A sequence that reads a shared prefix (one
stored copy of a document's KV for every call on it, docs/algorithm.md section 14.1) has its
KV in two parts, the prefix and its own tokens; a decode or verify block attends to each part
and merges the two by their log-sum-exp (`_merged`), so no per-step copy of the prefix is
made. The segments of a pass that read the same prefix attend to it together, their queries
stacked (`_shared_partials`): the prefix is read once per layer and pass, not once per
sequence (the cascade split of SGLang and FlashInfer). A sequence that decodes
deterministically (`RapidConfig.deterministic`) always runs packed, and its segment attends in
one call whose shape does not depend on the pass (`invariant.attention`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils.import_utils import is_torch_greater_or_equal

from rapid_integrations.models.weight_only import NATIVE_BF16
from rapid_integrations.runtime import invariant

NAME = "rapid_decode"
LAYOUT = "rapid_layout"
"""The forward keyword that carries a packed pass's layout (`kv.PackedCache`) to attention."""


class PackedLayout(Protocol):
    """What attention reads of a packed pass (`kv.PackedCache` is one)."""

    bounds: list[tuple[int, int]]  # segment i's (start, end) in the packed row

    def kv(self, layer_idx: int, segment: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Sequence `segment`'s keys and values at `layer_idx`, as consecutive parts
        [1, Hkv, tokens, d]: a shared prefix where it reads one, then its own (last)."""
        ...

    def padded(self, layer_idx: int, segment: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where sequence `segment` decodes deterministically, its keys and values at
        `layer_idx` padded to `invariant.padded_keys` of its length (views of its buffer);
        None where it does not."""
        ...

    @property
    def masks(self) -> dict[tuple[int, int, int], torch.Tensor]:
        """The pass's deterministic masks, made by the first layer and kept for the others
        (`invariant.attention`)."""
        ...


MAX_FOLDED_QUERIES = 64  # decode and verify blocks; longer blocks are prefill
MIN_RUN_KEYS = 512  # the CPU flash kernel's own key block: shorter runs only add merges
MIN_SPLIT_VERIFY_KEYS = 16384
"""Keys a masked (verify) block needs before its keys are split (`_chunkable`): splitting
adds a masked part and a merge a layer, which at 8K on 2 threads cost what the split saved
(a 10-token verify 111 against 108 ms a pass) and at 32K are far outweighed (282 against
345 ms)."""
_SDPA_GQA = is_torch_greater_or_equal("2.5")  # scaled_dot_product_attention(enable_gqa=...)


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
    if attention_mask is not None and _gqa_prefillable(
        query, key, value, attention_mask, dropout, kwargs
    ):
        return _gqa_prefill(query, key, value, attention_mask, scaling), None
    if not _foldable(query, key, value, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    return _folded(query, [(key, value, attention_mask)], scaling), None


def _foldable(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> bool:
    """Whether `_folded` computes this block exactly: one sequence, a decode or verify block
    (prefill and anything unusual go to transformers' SDPA function)."""
    plain = query.shape[0] == 1 and _plain(dropout, kwargs)
    causal_prefill = attention_mask is None and query.shape[2] > 1
    return (
        plain
        and not causal_prefill
        and query.shape[2] <= MAX_FOLDED_QUERIES
        and key.shape[-1] == value.shape[-1]
    )


def _plain(dropout: float, kwargs: dict[str, Any]) -> bool:
    """No dropout, soft-capping, position bias or attention sinks: plain softmax attention,
    what `_folded` and `_gqa_prefill` compute."""
    return (
        dropout == 0.0
        and not kwargs.get("softcap")
        and "position_bias" not in kwargs
        and kwargs.get("s_aux") is None
        and kwargs.get("sinks") is None
    )


def _gqa_prefillable(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    dropout: float,
    kwargs: dict[str, Any],
) -> bool:
    """Whether `_gqa_prefill` computes this block exactly: a prefill chunk on the CPU under a
    boolean mask, no dropout, soft-capping, bias or sinks. (On CUDA, SDPA with both a mask
    and GQA falls back to its math kernel, so transformers' function keeps those blocks.)"""
    return (
        _SDPA_GQA
        and query.device.type == "cpu"
        and query.shape[2] > MAX_FOLDED_QUERIES
        and attention_mask.dtype == torch.bool
        and _plain(dropout, kwargs)
        and key.shape[-1] == value.shape[-1]
        and query.shape[1] % key.shape[1] == 0
    )


def _gqa_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Query [b, Hq, q, d] against keys and values [b, Hkv, kv, d] under a boolean mask
    [b or 1, 1, q, kv]; returns [b, q, Hq, d]. At 64K tokens this reads the cache without the
    Hq / Hkv copy and takes about half the time (docs/performance.md, "Why these defaults")."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=_scale(scaling, query.shape[-1]), enable_gqa=True
    )
    return out.transpose(1, 2).contiguous()


Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""Keys, values [1, Hkv, kv_i, d] and a mask [1, 1, q, kv_i] (or [1, 1, 1, kv_i]; None: every
key seen) of one part of a sequence's KV."""


Partial = tuple[torch.Tensor, torch.Tensor]
"""One part's attention for folded queries: its softmax-weighted values [1, Hkv, n, d] and
the log-sum-exp of its scores [1, Hkv, n, 1] (float32 or wider: float64 models stay exact)."""


def _folded(
    query: torch.Tensor,
    parts: list[Part],
    scaling: float | None,
    before: Sequence[Partial] = (),
) -> torch.Tensor:
    """Query [1, Hq, q, d] against the concatenation of `parts` (consecutive, in order),
    the query heads that share a KV head folded into the query axis; returns [1, q, Hq, d].
    Several parts (a shared prefix, then the sequence's own tokens: section 14.1) are
    attended part by part and merged (`_merged`), never concatenated; `before` are parts
    ahead of `parts` already attended (`_shared_partials`), in the folded layout."""
    _, heads, q_len, dim = query.shape
    kv_heads = parts[0][0].shape[1]
    groups = heads // kv_heads
    folded = _fold(query, kv_heads)
    tiled = [(key, value, _tiled(mask, groups, q_len)) for key, value, mask in parts]
    scale = _scale(scaling, dim)
    chunked = len(parts) == 1 and not before and _chunkable(query, *parts[0], q_len)
    if chunked:
        tiled = _seen_first(*tiled[0], q_len)
    if chunked or before or len(tiled) > 1:
        partials = [*before, *(_partial(folded, *part, scale) for part in tiled)]
        out = _merged(partials, parts[-1][1].dtype)
    elif _matmuls_faster(query):
        out = _matmul_attention(folded, *tiled[0], scale)
    else:
        key, value, mask = tiled[0]
        padded, mask = _padded(folded, mask)
        out = torch.nn.functional.scaled_dot_product_attention(
            padded, key, value, attn_mask=mask, scale=scale
        )[..., : folded.shape[2], :]
    return out.reshape(1, heads, q_len, dim).transpose(1, 2).contiguous()


def _matmuls_faster(query: torch.Tensor) -> bool:
    """Whether two matmuls beat the flash kernel for this block (module docstring): half
    precision on a CPU, unless it is bf16 on a CPU with native bf16."""
    half = query.dtype in (torch.bfloat16, torch.float16)
    native = NATIVE_BF16 and query.dtype == torch.bfloat16
    return query.device.type == "cpu" and half and not native


def _chunkable(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    q_len: int,
) -> bool:
    """Whether a block [1, Hq, q_len, d] goes to the flash kernel with its keys [1, Hkv, kv, d]
    split into runs (`_flash_partial`): on the CPU, keys enough for more than one run, and
    every key but the block's own q_len seen by every query (`_seen_first`), in a masked
    block `MIN_SPLIT_VERIFY_KEYS` of them. Never in a compiled pass (`compiled.py`): the thread
    count and the mask's check are host decisions that would break its graph."""
    seen = key.shape[-2] - (0 if mask is None else q_len)
    return (
        not torch.compiler.is_compiling()
        and query.device.type == "cpu"
        and _FLASH_CPU is not None
        and not _matmuls_faster(query)
        and _runs(key.shape[1], seen) > 1
        and (mask is None or (seen >= MIN_SPLIT_VERIFY_KEYS and bool(mask[..., :seen].all())))
    )


def _seen_first(
    key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, q_len: int
) -> list[Part]:
    """One part as two (a `_chunkable` one): the keys every query sees, unmasked, then the
    block's own q_len keys under their mask columns (None: one part, every key seen)."""
    if mask is None:
        return [(key, value, None)]
    seen = key.shape[-2] - q_len
    return [
        (key[..., :seen, :], value[..., :seen, :], None),
        (key[..., seen:, :], value[..., seen:, :], mask[..., seen:]),
    ]


def _runs(kv_heads: int, keys: int) -> int:
    """Runs of equal length to cut `keys` keys into so that every torch thread gets as many
    (run, KV head) items of the flash kernel as the others: it parallelizes over batch and
    heads (a decode block's few queries make one query block), so SmolLM2's 3 KV heads on 2
    threads leave one thread idle a third of the time. Runs are no shorter than
    `MIN_RUN_KEYS`."""
    threads = torch.get_num_threads()
    return max(1, min(threads // math.gcd(threads, kv_heads), keys // MIN_RUN_KEYS))


def _fold(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Query [1, Hq, q, d] as [1, Hkv, (Hq / Hkv) * q, d]: each KV head's query heads in a
    row along the query axis."""
    _, heads, q_len, dim = query.shape
    return query.reshape(1, kv_heads, heads // kv_heads * q_len, dim)


def _scale(scaling: float | None, dim: int) -> float:
    return scaling if scaling is not None else dim**-0.5


def _tiled(mask: torch.Tensor | None, groups: int, q_len: int) -> torch.Tensor | None:
    """A mask [1, 1, q or 1, kv] repeated for each folded query head: [1, 1, groups * q, kv]."""
    if mask is None:
        return None
    mask = mask.expand(1, 1, q_len, -1)
    return (
        mask[:, :, None]
        .expand(1, 1, groups, q_len, mask.shape[-1])
        .reshape(1, 1, groups * q_len, -1)
    )


def _varlen(
    module: torch.nn.Module,
    query: torch.Tensor,
    layout: PackedLayout,
    dropout: float,
    scaling: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a packed row: query [1, Hq, T_total, d], segment i (`layout.bounds`)
    against its own sequence's keys and values (`layout.kv`: a shared prefix [1, Hkv, P_i, d]
    where it reads one, then its own [1, Hkv, kv_i, d], new tokens last); returns
    [1, T_total, Hq, d]. Segment i's t_i queries sit at the last t_i positions of its own KV:
    query j sees every shared key and own keys 0 .. kv_i - t_i + j, the mask transformers'
    `sdpa_mask` builds for one sequence (none for one query, as there), so each segment
    computes what its sequence's own forward pass would. A shared prefix is attended apart
    and merged (section 14.1), by every decode and verify block on it at once
    (`_shared_partials`), except under a long (prefill) block, which reads the prefix and its
    own KV concatenated, once per layer and block."""
    outputs = []
    kvs = [layout.kv(module.layer_idx, i) for i in range(len(layout.bounds))]  # type: ignore[arg-type]
    blocks = [query[:, :, start:end] for start, end in layout.bounds]
    masks = [_own_mask(block, kv) for block, kv in zip(blocks, kvs, strict=True)]
    joint = {
        i: kv[:-1]
        for i, (block, kv, mask) in enumerate(zip(blocks, kvs, masks, strict=True))
        if len(kv) > 1 and _foldable(block, *kv[-1], mask[1], dropout, kwargs)
    }  # decode and verify blocks on a shared prefix: it is attended for all at once
    before = _shared_partials({i: blocks[i] for i in joint}, joint, scaling)
    for segment, block in enumerate(blocks):
        padded = layout.padded(module.layer_idx, segment)  # type: ignore[arg-type]
        if padded is not None:  # deterministic: the canonical kernel call (invariant.py)
            length = sum(k.shape[-2] for k, _ in kvs[segment])
            scale = _scale(scaling, block.shape[-1])
            outputs.append(invariant.attention(block, *padded, length, scale, layout.masks))
            continue
        *shared, (key, value) = kvs[segment]
        mask, own_mask = masks[segment]
        if segment in before:
            out = _folded(block, [(key, value, own_mask)], scaling, before[segment])
        else:
            if shared:  # a prefill block: read the prefix and its own KV joined, once
                key = torch.cat([*(k for k, _ in shared), key], dim=-2)
                value = torch.cat([*(v for _, v in shared), value], dim=-2)
            out, _ = rapid_attention(module, block, key, value, mask, dropout, scaling, **kwargs)
        outputs.append(out)  # [1, t, Hq, d]
    return torch.cat(outputs, dim=1), None


def _own_mask(
    block: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A segment's causal mask over its whole KV [1, 1, t, kv] (`_causal`, `parts` joined)
    and its columns over its own part (the last), for its block [1, Hq, t, d]."""
    key = parts[-1][0]
    kv = sum(k.shape[-2] for k, _ in parts)
    mask = _causal(block.shape[2], kv, key)
    return mask, None if mask is None else mask[..., kv - key.shape[-2] :]


def _shared_partials(
    blocks: dict[int, torch.Tensor],
    shared: dict[int, list[tuple[torch.Tensor, torch.Tensor]]],
    scaling: float | None,
) -> dict[int, list[Partial]]:
    """Each segment's partials over its shared prefix parts (`_partial`, in the folded
    layout), for decode and verify blocks [1, Hq, t_i, d] (`blocks`, by segment) whose
    `shared` parts [1, Hkv, P, d] are the same tensors: their folded queries are stacked and
    attend to each part at once, so a prefix that n sequences read is read once, in one
    matrix product of n times the rows. Every query sees every prefix key (no mask)."""
    groups: dict[tuple[tuple[int, int, int], ...], list[int]] = {}
    for i, parts in shared.items():
        same = tuple((k.data_ptr(), k.shape[-2], v.data_ptr()) for k, v in parts)
        groups.setdefault(same, []).append(i)
    partials: dict[int, list[Partial]] = {i: [] for i in shared}
    for members in groups.values():
        kv_heads = shared[members[0]][0][0].shape[1]
        folded = [_fold(blocks[i], kv_heads) for i in members]  # [1, Hkv, n_i, d] each
        sizes = [f.shape[2] for f in folded]
        stacked = torch.cat(folded, dim=2)  # [1, Hkv, sum n_i, d]
        scale = _scale(scaling, stacked.shape[-1])
        for key, value in shared[members[0]]:
            out, lse = _partial(stacked, key, value, None, scale)
            for i, o, s in zip(members, out.split(sizes, 2), lse.split(sizes, 2), strict=True):
                partials[i].append((o, s))
    return partials


def _causal(t: int, kv: int, like: torch.Tensor) -> torch.Tensor | None:
    """The mask [1, 1, t, kv] of t new queries at the last t of kv positions (None for one
    query: it sees every key)."""
    if t == 1:
        return None
    seen = torch.arange(kv, device=like.device)[None, :]  # [1, kv]
    last = torch.arange(kv - t, kv, device=like.device)[:, None]  # [t, 1]
    return (seen <= last)[None, None]


def _scores(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Scaled scores [.., q, kv] in float32 or wider (float64 stays), masked positions -inf (a
    float mask is added)."""
    wide = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query, key.transpose(-1, -2)).to(wide) * scale
    if mask is None:
        return scores
    return scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask


def _matmul_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    return torch.matmul(
        torch.softmax(_scores(query, key, mask, scale), dim=-1).to(value.dtype), value
    )


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""PyTorch's CPU flash attention, which also returns the log-sum-exp [B, H, n] (float32 for
bf16 and float32 inputs, float64 for float64) that merging parts needs; None where absent."""


def _partial(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> Partial:
    """Folded queries [1, Hkv, n, d] against one part's keys and values [1, Hkv, kv_i, d]
    under its mask [1, 1, n, kv_i] (None: every key seen); the part must leave each query
    some key (the own part always holds the query's own token). Returns the part's output
    [1, Hkv, n, d] and log-sum-exp of scores [1, Hkv, n, 1], in float32 or wider."""
    if query.device.type != "cpu" or _FLASH_CPU is None:
        return _scores_partial(query, (key, value, mask), scale)
    # The fused kernel reads the scores once, where `_scores_partial` passes over the whole
    # [n, kv_i] score matrix five times: a 19-token verify on an 8K prefix spent most of its
    # time there (fp32 2.7x, bf16 on AVX2 40x slower than fused, 3 heads of 57 rows); a
    # verify block's masked 10 keys take 35 against 116 us.
    if mask is None:
        return _flash_partial(query, key, value, scale)
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(~mask, float("-inf"))
    out, lse = _flash(query, key, value, mask.to(query.dtype), scale)
    return out.to(lse.dtype), lse.unsqueeze(-1)


def _flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash kernel on query [b, H, n, d] against keys and values [b, H, kv, d]
    under an additive mask [b or 1, 1, n, kv] (None: every key seen), a lone query row padded
    (`_padded`): output [b, H, n, d] and log-sum-exp [b, H, n]."""
    assert _FLASH_CPU is not None  # its callers check
    padded, mask = _padded(query, mask)
    out, lse = _FLASH_CPU(padded, key, value, 0.0, False, attn_mask=mask, scale=scale)
    n = query.shape[2]
    return out[:, :, :n], lse[:, :, :n]


def _lone_row(rows: int) -> bool:
    """Whether PyTorch's CPU flash kernel would leave a block of one query row: it cuts the
    rows into blocks (32, from 192 rows 64, from 768 rows 256), and a block of one row takes
    longer than a block of two (at 8K keys, one query 1.42 against 0.46 ms, 33 rows 3.34
    against 2.36 for 34: docs/performance.md, "Why these defaults")."""
    block = 256 if rows >= 768 else 64 if rows >= 192 else 32
    return rows % block == 1


def _padded(
    query: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """query [b, H, n, d] and its mask [.., n, kv] (None: every key seen) on the CPU with a
    zero row appended, and a mask row that sees every key, where the flash kernel would leave
    a lone row (`_lone_row`); else as they are. The caller keeps the first n rows of the
    output: each query row's attention is its own (to the kernel's rounding, which may move
    with its blocks: tested)."""
    # Never in a compiled pass (`compiled.py`): the rows' check would guard its graph, which
    # a pass of another width would then recompile.
    rows = query.shape[2]
    if torch.compiler.is_compiling() or query.device.type != "cpu" or not _lone_row(rows):
        return query, mask
    query = torch.cat([query, query.new_zeros(*query.shape[:2], 1, query.shape[3])], dim=2)
    if mask is None:
        return query, mask
    seen = torch.ones_like if mask.dtype == torch.bool else torch.zeros_like
    return query, torch.cat([mask, seen(mask[..., :1, :])], dim=-2)


def _scores_partial(query: torch.Tensor, part: Part, scale: float) -> Partial:
    """`_partial` of `part` (keys, values, mask) through the whole score matrix: off the CPU,
    and for the few keys a split leaves over (`_flash_partial`)."""
    key, value, mask = part
    scores = _scores(query, key, mask, scale)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse).to(value.dtype), value).to(lse.dtype), lse


def _flash_partial(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> Partial:
    """`_partial` of an unmasked part through the flash kernel, its keys cut into `_runs`
    runs read as one batch (flash-decoding's split of the keys, so that every thread has
    work: on 2 threads a decode pass of SmolLM2 in int4 took 45.8 against 50.3 ms at 8K and
    126 against 149 ms at 32K), the few keys left over one more part (`_scores_partial`);
    merged as `_combined`. Shapes as `_partial`'s."""
    keys = key.shape[-2]
    runs = _runs(key.shape[1], keys)
    length = keys // runs
    cut = runs * length

    def batched(x: torch.Tensor) -> torch.Tensor:  # [1, Hkv, kv, d] -> [runs, Hkv, length, d]
        return x[0, :, :cut].unflatten(1, (runs, length)).transpose(0, 1)

    out, lse = _flash(
        query.expand(runs, -1, -1, -1), batched(key), batched(value), None, scale
    )  # out [runs, Hkv, n, d], lse [runs, Hkv, n]
    partials = list(zip(out.to(lse.dtype).split(1), lse.unsqueeze(-1).split(1), strict=True))
    if cut < keys:
        partials.append(
            _scores_partial(query, (key[..., cut:, :], value[..., cut:, :], None), scale)
        )
    return _combined(partials)


def _combined(partials: list[Partial]) -> Partial:
    """The partial of the concatenation of the parts `partials` came from (the cascade /
    shared-prefix split of SGLang and FlashInfer): the whole softmax puts mass
    exp(l_i - logsumexp_j l_j) on part i, so the output is sum_i o_i exp(l_i - logsumexp_j
    l_j) and the log-sum-exp logsumexp_j l_j, up to float rounding."""
    if len(partials) == 1:
        return partials[0]
    sums = torch.stack([lse for _, lse in partials])  # [parts, 1, Hkv, n, 1]
    weights = torch.softmax(sums, dim=0)
    out = (weights * torch.stack([out for out, _ in partials])).sum(dim=0)
    return out, torch.logsumexp(sums, dim=0)


def _merged(partials: list[Partial], dtype: torch.dtype) -> torch.Tensor:
    """Attention over the concatenation of the parts `partials` came from (`_combined`):
    output [1, Hkv, n, d] in `dtype` (the values')."""
    return _combined(partials)[0].to(dtype)


def use_rapid_attention(model: PreTrainedModel) -> None:
    """Switch a transformers model that uses SDPA to this attention (other kernels are kept)."""
    AttentionInterface.register(NAME, rapid_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(NAME)
