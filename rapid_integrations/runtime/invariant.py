"""Deterministic decoding (`RapidConfig.deterministic`): a token's logits that do not depend on
how its forward pass was cut, nor on the thread count.

The engine reads a token in passes of many shapes: a prefill chunk (its first rows, or only its
last after a cached prefix), a decode step, a verify block of 1 + k drafts (k set by acceptance,
the lookup's measured copy price, a measured schedule, a batch's cap), a packed pass with other
calls, on as many threads as the load leaves free (threads.py). Float sums taken in another
order round differently, and in bf16 one rounding step can turn a greedy near-tie the other
way, so on the default path one question can get two answers (docs/algorithm.md section 8).
What moves with the pass's shape, measured on torch 2.13's CPU kernels (oneDNN, AMX bf16,
SmolLM2-135M's weights):

* bf16 `linear` (oneDNN): a row's result is the same at any count of 1 to 32 rows and any
  thread count (1 to 4 tried); past 32 rows oneDNN picks among kernels by the row count and the
  thread count, and 1 element in about 17,000 rounds the other way (a row of a 12-row chunk
  against the same row in a 588-row chunk changed a layer's keys downstream). At one thread, a
  product of a fixed row count gives every row the same result wherever it sits.
  So a pass of generated tokens (decode, verify, drafts) multiplies at most `SMALL_ROWS` rows
  at a time, on any threads, and a prefill pass multiplies its rows padded to pieces of exactly
  `PIECE_ROWS` rows, each on one thread (`_linear`). The two kinds never share a pass, so a
  token is always read by the same kind: a prompt token by a prefill pass, the last prompt token
  and every later one by decode passes. Weight-only int4 and int8 products (torch's own kernels,
  the default draft copy) are row- and thread-invariant as they are and are left alone.
* The flash attention kernel (`scaled_dot_product_attention`): a query row's result depends
  on the key count (the kernel cuts keys into blocks of `KEY_BLOCK`, and the last block's
  length changes its sums) and on whether its block of query rows holds only 1 or 2 rows
  (another code path), not on the other rows, their count, their mask, or the thread count.
  So every block attends to its sequence's keys padded to a multiple of `KEY_BLOCK` (views of
  the call's buffer, which is allocated that long and zeroed; the padding is masked), with its
  rows padded so that no query block holds fewer than `MIN_BLOCK_ROWS` (`attention`), the
  query heads that share a KV head folded into the row axis (as `attention._folded` does).
* What the default path adds on top is not canonical and is left out: keys split into runs by
  the thread count (`attention._runs`), a shared prefix attended apart and merged by
  log-sum-exp (`attention._merged`). A deterministic sequence copies a cached prefix into its
  own buffer and reads its KV as one tensor.

Elementwise and row-wise operations (norms, activations, rotary embeddings) compute each row
alone. float32 is not covered: MKL's float32 product of a row changes with the number of rows
multiplied (1 against 2, and most counts against each other), so `prepare` refuses a float32
model, and a model on another device. What was measured is a property of these kernels on
this CPU kind (thread counts past 4 untried); tests/test_deterministic.py checks it end to
end.
"""

from __future__ import annotations

import ctypes
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

from rapid_integrations.errors import RapidConfigError

KEY_BLOCK = 512
"""Keys per block of torch's CPU flash kernel (from 512 keys on): every deterministic block
reads its sequence's keys padded to a multiple of this."""
MIN_BLOCK_ROWS = 3
"""Fewest query rows a block of the flash kernel may hold: a block of 1 row (bf16), or of 1
or 2 rows (float32), runs another path whose sums differ."""
SMALL_ROWS = 32
"""Most rows a deterministic decode pass multiplies at once: oneDNN's bf16 rows are the same
from 1 to 32 rows, on any thread count."""
PIECE_ROWS = 256
"""Rows of each single-threaded product of a deterministic prefill pass (the last piece padded
with zero rows). A 1024-row chunk through SmolLM2's weights, one thread a piece against oneDNN
on the whole chunk with 2 threads (quiet machine): 576 x 1536 2.11 against 1.77 ms, 1536 x 576
2.04 against 1.53, 576 x 576 0.83 against 0.56; pieces of 128 rows 2.83, 2.75, 1.08; of 512
rows 1.71, 1.95, 0.70, but a short prefill (the tail after a cached prefix) pays for 512."""
DTYPES = (torch.bfloat16,)
"""Model dtypes whose products are row-invariant on the CPU (measured; module docstring)."""

FOLD_QUERIES = 64
"""Longest block whose query heads are folded into the row axis (`attention`)."""
_SDPA_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)
"""`scaled_dot_product_attention(enable_gqa=...)` exists (torch 2.5)."""

Kind = Literal["prefill", "decode"]


def padded_keys(length: int) -> int:
    """`length` keys rounded up to a multiple of `KEY_BLOCK`."""
    return -(-length // KEY_BLOCK) * KEY_BLOCK


def _query_block(rows: int) -> int:
    # torch's CPU flash kernel cuts the query rows into blocks of this many
    # (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp: qSplitSize).
    return 256 if rows >= 768 else 64 if rows >= 192 else 32


def padded_rows(rows: int) -> int:
    """The fewest query rows >= `rows` whose last query block holds none or at least
    `MIN_BLOCK_ROWS` rows."""
    while 0 < rows % _query_block(rows) < MIN_BLOCK_ROWS:
        rows += 1
    return rows


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    length: int,
    scale: float,
    masks: dict[tuple[int, int, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Query [1, Hq, t, d] at positions length - t .. length - 1 of a sequence whose keys
    and values [1, Hkv, L, d] hold its `length` tokens first (L = `padded_keys(length)`; the
    rest finite, never seen); returns [1, t, Hq, d], each row as any other block would
    compute it (module docstring). `masks` keeps the boolean masks for the pass's other
    layers (one per sequence and pass: `kv.PackedCache.masks`).

    A block of up to `FOLD_QUERIES` queries folds the query heads that share a KV head into
    the row axis (one mask row per folded row); a longer one (a prefill chunk) keeps its heads
    and reads the grouped KV through the kernel's own grouped-query path, whose mask is a third
    of the folded one's (SmolLM2, a 1,024-token chunk over 5K keys: 28 ms a layer, where the
    folded call's mask made the layer's attention 9.3 against 6.0 s of the whole prefill).
    Either way each row meets the same kernel blocks (tested)."""
    _, heads, t, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[-2]
    groups = heads // kv_heads
    fold = t <= FOLD_QUERIES or not _SDPA_GQA
    rows = groups * t if fold else t
    total = padded_rows(rows)
    shape = (length, rows, keys)
    mask = None if masks is None else masks.get(shape)
    if mask is None:
        # Row r is the query at position length - t + (r mod t); a padded row sees the first
        # key (any key will do: its output is dropped).
        positions = torch.arange(length - t, length, device=query.device).repeat(rows // t)
        positions = torch.cat([positions, positions.new_zeros(total - rows)])
        mask = (torch.arange(keys, device=query.device)[None, :] <= positions[:, None])[None, None]
        if masks is not None:
            masks[shape] = mask
    block = query.reshape(1, kv_heads, rows, dim) if fold else query
    if total > rows:
        block = torch.cat([block, block.new_zeros(1, block.shape[1], total - rows, dim)], dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(
        block, key, value, attn_mask=mask, scale=scale, **({} if fold else {"enable_gqa": True})
    )[:, :, :rows]
    return out.reshape(1, heads, t, dim).transpose(1, 2).contiguous()


def prepare(model: torch.nn.Module, role: str, refusal: str | None) -> None:
    """Ready `model` (the call's `role`) for deterministic passes: its bf16 linear layers
    wrapped (`_linear`, once). `RapidConfigError` (field "deterministic") unless it can decode
    deterministically here: a bf16 model on the CPU whose passes can run packed (`refusal`:
    `kv.packing_refusal`'s reason, None when they can)."""
    param = next(model.parameters(), None)
    dtype = None if param is None else param.dtype
    device = None if param is None else param.device
    if device is None or device.type != "cpu":
        why = f"runs on the CPU's kernels only; the {role} is on {device}"
    elif dtype not in DTYPES:
        why = (
            f"needs a bf16 model; the {role} is {dtype} (float32 products on the CPU round "
            "differently with the number of rows multiplied)"
        )
    elif refusal is not None:
        why = f"needs the {role}'s passes packable: {refusal}"
    elif _OMP is None:
        why = "needs OpenMP's omp_set_num_threads (torch's CPU build) to run one thread"
    else:
        _wrap_linears(model)
        return
    raise RapidConfigError("deterministic", why)


def _openmp() -> ctypes.CDLL | None:
    # torch's OpenMP runtime, loaded with torch: its per-thread thread count, which oneDNN's
    # products read, set without torch.set_num_threads (whose count the load follower owns).
    try:
        runtime = ctypes.CDLL(None)
        runtime.omp_set_num_threads.argtypes = [ctypes.c_int]
        runtime.omp_get_max_threads.restype = ctypes.c_int
    except (AttributeError, OSError):
        return None
    return runtime


_OMP = _openmp()
_local = threading.local()  # .kind: the kind of deterministic pass this thread runs (or None)


@contextmanager
def pass_of(kind: Kind | None) -> Iterator[None]:
    """While it is open, this thread's forward pass is a deterministic one of `kind` (None:
    not deterministic): the linear layers `prepare` wrapped multiply as `_linear` says."""
    before = getattr(_local, "kind", None)
    _local.kind = kind
    try:
        yield
    finally:
        _local.kind = before


def _wrap_linears(model: torch.nn.Module) -> None:
    """Wrap the forward of every bf16 `torch.nn.Linear` of `model` once, for good; outside a
    deterministic pass the wrapper runs the layer as it was."""
    for module in model.modules():
        if (
            type(module) is torch.nn.Linear
            and module.weight.dtype in DTYPES
            and not getattr(module, "_rapid_invariant", False)
        ):
            # A method bound to the module: a deep copy of the model rebinds it to the copy.
            module.forward = types.MethodType(_linear, module)  # type: ignore[method-assign]
            object.__setattr__(module, "_rapid_invariant", True)  # a flag, not a submodule


def _linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A wrapped layer's forward (`_wrap_linears`): as it was outside a deterministic pass; in
    a decode pass on at most `SMALL_ROWS` rows at a time; in a prefill pass on pieces of exactly
    `PIECE_ROWS` rows, each on one thread (module docstring)."""
    kind = getattr(_local, "kind", None)
    plain = torch.nn.Linear.forward
    if kind is None or (kind == "decode" and x.shape[-2] <= SMALL_ROWS):
        return plain(self, x)
    rows = x.reshape(-1, x.shape[-1])
    if kind == "decode":
        out = torch.cat([plain(self, part) for part in rows.split(SMALL_ROWS)])
    else:
        count = rows.shape[0]
        padded = -(-count // PIECE_ROWS) * PIECE_ROWS
        if padded > count:
            rows = torch.cat([rows, rows.new_zeros(padded - count, rows.shape[1])])
        assert _OMP is not None  # checked by `prepare`, which wrapped this layer
        threads = _OMP.omp_get_max_threads()
        _OMP.omp_set_num_threads(1)  # this thread's OpenMP count only
        try:
            out = torch.cat([plain(self, part) for part in rows.split(PIECE_ROWS)])[:count]
        finally:
            _OMP.omp_set_num_threads(threads)
    return out.reshape(*x.shape[:-1], out.shape[-1])
