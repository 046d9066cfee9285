"""Weight-only int8 and int4 Linear layers on torch's own CPU kernels
(`draft_precision="int8-weight"` and `"int4-weight"`), and bf16 weights for a float32 model
(`"bf16-weight"`); activations keep their dtype.

torchao's weight-only int8 tensor casts the whole int8 weight back to the activations' dtype
at every call and multiplies in that dtype (fast once `torch.compile` fuses the two, which a
draft decoding one token at a time does not get): its draft step was slower than the bf16
one. `torch._weight_int8pack_mm` reads the int8 weight directly: cheaper than bf16 for
one-token forwards, not for the several tokens read when vetting copies (both measured in
docs/performance.md, "Why these defaults" and "int4 groups of 32"). It has a CPU kernel only,
so other devices keep torchao's tensor.

`torch._weight_int4pack_mm_for_cpu` reads 4-bit codes in groups of `GROUP` input channels,
each group with its own scale and offset. On SmolLM2-135M that is both cheaper and closer to
bf16 than per-channel int8 (top-1 agreement over the 1,854-token bench prompt 0.982 against
0.966, the head kept in both; forward times in docs/performance.md, "int4 groups of 32: the
default draft on the CPU"): a row's int8 scale is set by its largest weight, a group's only by
its own 32. The output head stays in the model's dtype: it is the tied input embedding, and in
int4 it cut agreement to 0.88. torchao 0.18 has no CPU int4 path, so int4 runs where torch has
this kernel only.

A float32 model's one-token forward is bound by reading its weights, and torch's float32
product of one row reads them slowly on the CPU (MKL's, 11 GB/s here) where its bf16 product
of a few rows reads half the bytes at twice the rate (`Bf16WeightLinear`: docs/performance.md,
"A bf16-weight draft for a float32 model").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

INT8_MAX = 127
INT4_CODES = 16  # 4-bit codes 0..15; the kernel reads code c as scale * (c - 8) + offset
GROUP = 32  # input channels per int4 scale and offset (group 64 cut agreement to 0.73)
INT4_ROWS = 16  # the int4 packing needs output channels in multiples of this
INT8_KERNEL, INT4_KERNEL = "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu"
NATIVE_BF16 = "AVX512" in torch.backends.cpu.get_cpu_capability() and any(
    getattr(torch.cpu, probe, lambda: False)()  # private probes: absent in some versions
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
)
"""The CPU computes in bf16 natively (AVX512-BF16 or AMX) at the capability torch's kernels
are dispatched to, which `ATEN_CPU_CAPABILITY=avx2` lowers below the hardware's."""
HALF_ROWS = 16
"""Rows up to which a `Bf16WeightLinear` runs torch's bf16 kernel on a CPU without native
bf16 (AVX2), where that kernel runs a dot product per row: 47-100 us a row for a 1536 x 576
weight, against 300-750 us for float32's product of 1 to 33 rows plus the weight's conversion
to float32, so longer passes convert (a prefill chunk of 256 rows: 3.4 against 11.8 ms).
With native bf16 the bf16 kernel is the fastest at every width (256 rows: 1.2 ms)."""


def has_kernel(op: str, device: torch.device) -> bool:
    """Whether this torch has operator `op` (`INT8_KERNEL` or `INT4_KERNEL`) for `device`'s
    type (a torch too old to have the operator has none)."""
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS"}.get(device.type)
    try:
        return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    except RuntimeError:  # "operator ... does not exist"
        return False


class Int8WeightLinear(torch.nn.Module):
    """y = x W^T + b with W stored as int8 and one scale per output channel (symmetric:
    W ~ scale[:, None] * weight, |weight| <= 127); x and y keep their dtype.

    weight: [out_features, in_features] int8; scale: [out_features] in the source Linear's
    dtype; bias: [out_features] or None.
    """

    weight: torch.Tensor  # buffers, declared for the type checker
    scale: torch.Tensor

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        source = linear.weight.detach()
        full = source.float()
        scale = full.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
        weight = torch.round(full / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", scale.to(source.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        rows = x.reshape(-1, self.in_features)
        y = torch._weight_int8pack_mm(rows, self.weight, self.scale.to(x.dtype))
        return _finish(y, x, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight"


class Int4WeightLinear(torch.nn.Module):
    """y = x W^T + b with W stored as 4-bit codes, one scale and offset per `GROUP` input
    channels of a row (asymmetric: a group's lowest weight is code 0, its highest code 15,
    W ~ scale * (code - 8) + offset); x and y keep their dtype.

    weight: torch's int4 packing of the [out_features, in_features] codes (uint8, two codes a
    byte); scale_and_offset: [in_features / GROUP, out_features, 2] in the source Linear's
    dtype; bias: [out_features] or None.
    """

    weight: torch.Tensor  # buffers, declared for the type checker
    scale_and_offset: torch.Tensor

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        source = linear.weight.detach()
        rows, cols = source.shape
        groups = source.float().reshape(rows, cols // GROUP, GROUP)
        low = groups.amin(dim=2, keepdim=True)
        span = groups.amax(dim=2, keepdim=True) - low
        scale = span.clamp(min=torch.finfo(torch.float32).tiny) / (INT4_CODES - 1)
        codes = torch.round((groups - low) / scale).clamp(0, INT4_CODES - 1)
        offset = low + scale * (INT4_CODES // 2)  # code c: scale * (c - 8) + offset
        packed = torch._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).reshape(rows, cols), 1
        )
        scale_and_offset = torch.cat([scale, offset], dim=2).transpose(0, 1).contiguous()
        self.register_buffer("weight", packed)
        self.register_buffer("scale_and_offset", scale_and_offset.to(source.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features = cols, rows

    @staticmethod
    def fits(linear: torch.nn.Linear) -> bool:
        """Whether the kernel takes `linear`'s shape: whole groups, rows in packs of 16."""
        return linear.in_features % GROUP == 0 and linear.out_features % INT4_ROWS == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        rows = x.reshape(-1, self.in_features)
        groups = self.scale_and_offset.to(x.dtype)
        y = torch._weight_int4pack_mm_for_cpu(rows, self.weight, GROUP, groups)
        return _finish(y, x, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 weight in groups of {GROUP}"
        )


class Bf16WeightLinear(torch.nn.Module):
    """y = x W^T + b for a float32 Linear, with x, W and the product rounded to bf16 as a
    bf16 model's are (sums in float32), y returned in x's dtype. Torch's bf16 kernel runs
    every pass where the CPU has native bf16 and passes of up to `HALF_ROWS` rows elsewhere;
    longer ones there multiply the same bf16 values in float32, so a prompt read in one pass
    or in several gives the same values but where float32 sums in another order round to the
    next bf16 step (docs/algorithm.md section 8). A compiled graph (`compiled.py`, decode
    passes only) always runs the bf16 kernel, as a shape test in it would become a guard.

    weight: [out_features, in_features] bf16; bias: [out_features] or None (shared).
    """

    weight: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        rounded = x.to(torch.bfloat16)
        # Compiling first: the width test is not traced (no guard on it).
        if torch.compiler.is_compiling() or NATIVE_BF16 or self._few(x):
            y = torch.nn.functional.linear(rounded, self.weight)
        else:
            y = torch.nn.functional.linear(rounded.float(), self.weight.float())
        y = y.to(torch.bfloat16).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _few(self, x: torch.Tensor) -> bool:
        """Whether x [..., in_features] has at most `HALF_ROWS` rows."""
        return x.numel() <= HALF_ROWS * self.in_features

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bf16 weight, bf16 kernel up to {HALF_ROWS} rows"
        )


def _finish(
    y: torch.Tensor, x: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """The kernel's [rows, out_features] product in x's leading shape, plus the bias."""
    y = y.reshape(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


def _swap(
    model: torch.nn.Module, quantize: Callable[[torch.nn.Linear], torch.nn.Module | None]
) -> None:
    """Replace each `torch.nn.Linear` of `model` in place with `quantize(linear)` where that
    is not None."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and (swapped := quantize(child)) is not None:
                setattr(parent, name, swapped)


def int8_weight_only(model: torch.nn.Module) -> None:
    """Replace every `torch.nn.Linear` of `model` with an `Int8WeightLinear`, in place (a
    head tied to the input embeddings gets its own int8 copy; the embeddings keep theirs)."""
    _swap(model, Int8WeightLinear)


def int4_weight_only(model: torch.nn.Module, head: torch.nn.Module | None) -> None:
    """Replace every `torch.nn.Linear` of `model` but `head` (the output head, kept in its
    dtype) with an `Int4WeightLinear`, in place; a Linear whose shape the kernel does not
    take (`Int4WeightLinear.fits`) keeps its dtype too."""
    _swap(
        model,
        lambda linear: (
            Int4WeightLinear(linear)
            if linear is not head and Int4WeightLinear.fits(linear)
            else None
        ),
    )


def bf16_weight_only(model: torch.nn.Module) -> None:
    """Replace every `torch.nn.Linear` of `model` with a `Bf16WeightLinear`, in place (a head
    tied to the input embeddings gets its own bf16 copy; the embeddings keep theirs)."""
    _swap(model, Bf16WeightLinear)
