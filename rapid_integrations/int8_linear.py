"""Weight-only int8 Linear layers on torch's own CPU kernel (`draft_precision="int8-weight"`).

torchao's weight-only int8 tensor casts the whole int8 weight back to the activations' dtype
at every call and multiplies in that dtype (fast once `torch.compile` fuses the two, which a
draft decoding one token at a time does not get): on the 2-core CPU its draft step was 1.15x
the bf16 one. `torch._weight_int8pack_mm` reads the int8 weight directly: 0.56-0.61x for a
one-token forward, 0.73x over a decoding run's draft forwards, which also read several tokens
when they vet copies (docs/performance.md). It has a CPU kernel only, so other devices keep
torchao's tensor.
"""

from __future__ import annotations

import torch

INT8_MAX = 127


def has_int8_kernel(device: torch.device) -> bool:
    """Whether this torch has its weight-only int8 matmul for `device`'s type (a torch too
    old to have the operator has none)."""
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS"}.get(device.type)
    try:
        return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
            "aten::_weight_int8pack_mm", key
        )
    except RuntimeError:  # "operator ... does not exist"
        return False


class Int8WeightLinear(torch.nn.Module):
    """y = x W^T + b with W stored as int8 and one scale per output channel (symmetric:
    W ~ scale[:, None] * weight, |weight| <= 127); x and y keep their dtype.

    weight: [out_features, in_features] int8; scale: [out_features] in the source Linear's
    dtype; bias: [out_features] or None.
    """

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
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight"


def int8_weight_only(model: torch.nn.Module) -> None:
    """Replace every `torch.nn.Linear` of `model` with an `Int8WeightLinear`, in place (a
    head tied to the input embeddings gets its own int8 copy; the embeddings keep theirs)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, Int8WeightLinear(child))
