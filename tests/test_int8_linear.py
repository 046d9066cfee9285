"""`draft_precision="int8-weight"` on torch's CPU int8 kernel (`int8_linear.py`)."""

from __future__ import annotations

import pytest
import torch

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.int8_linear import Int8WeightLinear, has_int8_kernel, int8_weight_only
from tests.test_engine_exact import random_prompts
from tests.tiny import reference_greedy, tiny_llama


def _linear(rows: int, cols: int, dtype: torch.dtype, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(rows + cols)
    linear = torch.nn.Linear(cols, rows, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight[3] = 0.0  # an all-zero row: its scale must not divide by zero
        linear.weight[5, 7] = 4.0  # an outlier sets its row's scale
    return linear


def test_weights_round_to_the_nearest_step_of_their_rows_scale():
    linear = _linear(64, 96, torch.float32)
    q = Int8WeightLinear(linear)
    w = linear.weight.detach().double()
    step = w.abs().amax(dim=1) / 127  # computed here, not read from the module
    assert q.weight.dtype == torch.int8 and q.weight.abs().max() <= 127
    assert torch.allclose(q.scale.double(), step, rtol=1e-6)
    error = (q.weight.double() * step[:, None] - w).abs()
    assert (error <= step[:, None] / 2 + 1e-7).all()
    assert q.weight[5, 7] == 127 and (q.weight[3] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_is_x_times_the_dequantized_weight(dtype, bias):
    """The kernel's product equals x (scale * weight)^T + b computed in float64, to the
    activations' precision, for a [batch, tokens, features] input."""
    linear = _linear(48, 64, dtype, bias)
    q = Int8WeightLinear(linear)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = q(x)
    w = q.weight.double() * q.scale.double()[:, None]
    expected = x.double() @ w.T + (linear.bias.double() if bias else 0)
    assert y.shape == (2, 5, 48) and y.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(y.double(), expected, atol=tolerance, rtol=tolerance)
    assert not torch.isnan(y).any()


def test_swap_replaces_every_linear_in_place_and_unties_the_head():
    """The head gets its own int8 copy; the input embeddings keep the shared weight."""
    model = tiny_llama(300, seed=3, dtype=torch.float32)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    embeddings = model.get_input_embeddings().weight.detach().clone()
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    int8_weight_only(model)
    assert sum(isinstance(m, Int8WeightLinear) for m in model.modules()) == linears
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8WeightLinear)
    assert torch.equal(model.get_input_embeddings().weight, embeddings)


def test_kernel_exists_on_cpu_only_where_torch_has_one(monkeypatch):
    assert has_int8_kernel(torch.device("cpu"))
    assert not has_int8_kernel(torch.device("meta"))

    def missing(op: str, key: str) -> bool:
        raise RuntimeError(f"operator {op} does not exist")

    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", missing)
    assert not has_int8_kernel(torch.device("cpu"))  # a torch without the operator


@pytest.mark.parametrize("kernel", [True, False], ids=["torch-kernel", "torchao"])
def test_int8_weight_draft_keeps_the_targets_greedy_tokens(tok, monkeypatch, kernel):
    """On the CPU the int8-weight draft runs on torch's kernel; without one (as on CUDA) on
    torchao's tensor. Either way only the target's verdict decides the output, and the draft
    still agrees with it often enough to be accepted."""
    if not kernel:
        monkeypatch.setattr("rapid_integrations.int8_linear.has_int8_kernel", lambda d: False)
    t = tiny_llama(len(tok), seed=31, dtype=torch.float32, scale=0.5)
    cfg = RapidConfig(eta=0.0, max_new_tokens=16, ignore_eos=True, gamma=4)
    engine = RapidEngine(t, tokenizer=tok, config=cfg, draft_precision="int8-weight")
    uses_kernel = any(isinstance(m, Int8WeightLinear) for m in engine.draft.modules())
    assert uses_kernel is kernel
    accepted = drafted = 0
    for prompt, _ in random_prompts(6, seed=31):
        out = engine.generate(prompt, prompt)
        assert out.token_ids == reference_greedy(t, tok.encode(prompt), 16, len(tok))
        accepted, drafted = accepted + out.stats.accepted_tokens, drafted + out.stats.drafted_tokens
    assert accepted > 0.8 * drafted
