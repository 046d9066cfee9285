"""`draft_precision="int8-weight"` / `"int4-weight"` on torch's CPU kernels, and
`"bf16-weight"` for a float32 model (`weight_only.py`)."""

from __future__ import annotations

import copy

import pytest
import torch

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.errors import RapidConfigError
from rapid_integrations.models.weight_only import (
    HALF_ROWS,
    INT4_KERNEL,
    INT8_KERNEL,
    Bf16WeightLinear,
    Int4WeightLinear,
    Int8WeightLinear,
    has_kernel,
    int4_weight_only,
    int8_weight_only,
)
from tests.test_engine_exact import random_prompts
from tests.tiny import reference_greedy, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


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


@pytest.mark.parametrize("op", [INT8_KERNEL, INT4_KERNEL])
def test_kernel_exists_on_cpu_only_where_torch_has_one(monkeypatch, op):
    assert has_kernel(op, torch.device("cpu"))
    assert not has_kernel(op, torch.device("meta"))

    def missing(op: str, key: str) -> bool:
        raise RuntimeError(f"operator {op} does not exist")

    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", missing)
    assert not has_kernel(op, torch.device("cpu"))  # a torch without the operator


@pytest.mark.parametrize(
    ("precision", "module", "kernel", "kept"),
    [
        ("int8-weight", Int8WeightLinear, True, 0.8),
        ("int8-weight", Int8WeightLinear, False, 0.8),
        # One group a row at this width, on random weights: 0.26 measured (1 of 320 if the
        # scales and offsets are swapped).
        ("int4-weight", Int4WeightLinear, True, 0.2),
        ("bf16-weight", Bf16WeightLinear, True, 0.8),
    ],
    ids=["int8-torch-kernel", "int8-torchao", "int4-torch-kernel", "bf16-weight"],
)
def test_weight_only_draft_keeps_the_targets_greedy_tokens(
    tok, monkeypatch, precision, module, kernel, kept
):
    """On the CPU a weight-only draft runs on torch's kernel; int8 without one (as on CUDA)
    on torchao's tensor. Either way only the target's verdict decides the output, and the
    draft still agrees with it often enough to be accepted."""
    if not kernel:
        monkeypatch.setattr("rapid_integrations.models.weight_only.has_kernel", lambda op, d: False)
    t = tiny_llama(len(tok), seed=31, dtype=torch.float32, scale=0.5)
    cfg = RapidConfig(eta=0.0, max_new_tokens=16, ignore_eos=True, gamma=4)
    engine = RapidEngine(t, tokenizer=tok, config=cfg, draft_precision=precision)
    uses_kernel = any(isinstance(m, module) for m in engine.draft.modules())
    assert uses_kernel is kernel
    accepted = drafted = 0
    for prompt, _ in random_prompts(6, seed=31):
        out = engine.generate(prompt, prompt)
        assert out.token_ids == reference_greedy(t, tok.encode(prompt), 16, len(tok))
        accepted, drafted = accepted + out.stats.accepted_tokens, drafted + out.stats.drafted_tokens
    assert accepted > kept * drafted


def _int4_grid(weight: torch.Tensor) -> torch.Tensor:
    """weight [rows, cols] rounded, in float64, to the nearest of 16 evenly spaced values
    from each 32-column group's lowest weight to its highest."""
    rows, cols = weight.shape
    groups = weight.double().reshape(rows, cols // 32, 32)
    low, high = groups.amin(2, keepdim=True), groups.amax(2, keepdim=True)
    step = (high - low) / 15
    codes = torch.where(step > 0, torch.round((groups - low) / step), 0.0)
    return (low + codes * step).reshape(rows, cols)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_int4_forward_is_x_times_the_groupwise_rounded_weight(dtype, bias):
    """Each weight rounds to the 16-value grid of its own group of 32 inputs (computed here),
    so an outlier coarsens only its group: x W^T + b against float64, in fp32 and bf16, for
    a [batch, tokens, features] input; an all-zero row stays 0 (no NaN)."""
    linear = _linear(48, 96, dtype, bias)
    q = Int4WeightLinear(linear)
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = q(x)
    expected = x.double() @ _int4_grid(linear.weight.detach()).T
    expected = expected + (linear.bias.double() if bias else 0)
    assert y.shape == (2, 5, 48) and y.dtype == dtype and not torch.isnan(y).any()
    tolerance = 1e-4 if dtype == torch.float32 else 6e-2
    assert torch.allclose(y.double(), expected, atol=tolerance, rtol=tolerance)
    # Read the stored weight back through the kernel: row 5's other groups keep fine steps.
    full = copy.deepcopy(linear).float()
    stored = (Int4WeightLinear(full)(torch.eye(96)) - (full.bias if bias else 0)).T.detach()
    assert torch.allclose(stored.double(), _int4_grid(linear.weight.detach().float()), atol=1e-5)
    assert (stored[3] == 0).all()


def test_int4_swap_keeps_the_head_and_the_shapes_the_kernel_does_not_take():
    model = tiny_llama(300, seed=3, dtype=torch.float32)
    head = model.get_output_embeddings()
    body = sum(type(m) is torch.nn.Linear for m in model.modules()) - 1
    int4_weight_only(model, head)
    assert sum(isinstance(m, Int4WeightLinear) for m in model.modules()) == body
    assert model.get_output_embeddings() is head and type(head) is torch.nn.Linear
    odd = torch.nn.Sequential(
        torch.nn.Linear(32, 16), torch.nn.Linear(16, 32), torch.nn.Linear(64, 24)
    )
    int4_weight_only(odd, None)
    assert [type(m).__name__ for m in odd] == ["Int4WeightLinear", "Linear", "Linear"]


def test_int4_weight_without_the_kernel_is_refused_with_what_to_do(tok, monkeypatch):
    monkeypatch.setattr("rapid_integrations.models.weight_only.has_kernel", lambda op, d: False)
    t = tiny_llama(len(tok), seed=31, dtype=torch.float32)
    with pytest.raises(RapidConfigError, match=r"CPU only.*quantization_config"):
        RapidEngine(t, tokenizer=tok, draft_precision="int4-weight")


def test_auto_drafts_in_int4_for_a_bf16_self_draft_on_the_cpu_sharing_what_it_keeps(tok):
    """The default: an int4 copy that shares the target's embeddings and head (no second
    copy of them in memory) and leaves the target's own Linears as they were."""
    t = tiny_llama(len(tok), seed=31, dtype=torch.bfloat16, scale=0.5)
    for precision in ("auto", None):
        engine = RapidEngine(t, tokenizer=tok, draft_precision=precision)
        assert engine.draft_precision == "int4-weight"
        assert any(isinstance(m, Int4WeightLinear) for m in engine.draft.modules())
        assert not any(isinstance(m, Int4WeightLinear) for m in t.modules())
        for weights in ("get_input_embeddings", "get_output_embeddings"):
            assert getattr(engine.draft, weights)().weight is getattr(t, weights)().weight


def test_auto_keeps_the_draft_as_loaded_where_no_copy_was_measured(tok, monkeypatch):
    fp32 = tiny_llama(len(tok), seed=31, dtype=torch.float32)
    bf16 = tiny_llama(len(tok), seed=31, dtype=torch.bfloat16)
    other = tiny_llama(len(tok), seed=32, dtype=torch.bfloat16)
    other32 = tiny_llama(len(tok), seed=32, dtype=torch.float32)
    assert RapidEngine(bf16, other, tokenizer=tok).draft is other  # a separate draft
    assert RapidEngine(fp32, other32, tokenizer=tok).draft is other32
    assert RapidEngine(bf16, tokenizer=tok, draft_precision="none").draft is bf16
    assert RapidEngine(fp32, tokenizer=tok, draft_precision="none").draft is fp32
    monkeypatch.setattr("rapid_integrations.models.weight_only.has_kernel", lambda op, d: False)
    assert RapidEngine(bf16, tokenizer=tok).draft is bf16  # no int4 kernel: no error either


def _products(x: torch.Tensor, linear: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """x W^T + b in float64: from x and W as they are, and from both rounded to bf16 with the
    product rounded to bf16 too (as a bf16 model's Linear gives it)."""
    w = linear.weight.detach()
    bias = linear.bias.detach().double() if linear.bias is not None else 0
    rounded = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T
    return x.double() @ w.double().T + bias, rounded.to(torch.bfloat16).double() + bias


def _near(y: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within one bf16 step (2^-8 relative): float32 sums in another order may round a
    product to the next bf16 value."""
    return bool(((y.double() - expected).abs() <= 2**-8 * expected.abs() + 1e-6).all())


def _kernel_dtypes(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtypes `torch.nn.functional.linear` is called with from now on."""
    seen: list[torch.dtype] = []
    linear = torch.nn.functional.linear

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(x.dtype)
        return linear(x, *args)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    return seen


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_weight_is_the_bf16_product_from_the_kernel_each_cpu_runs_fastest(
    monkeypatch, native, bias
):
    """Every width gives the bf16-rounded product (x, W and x W^T in bf16, float32 sums),
    far from the float32 one. Without native bf16 passes of up to `HALF_ROWS` rows (over all
    leading axes) run torch's bf16 kernel and longer ones multiply in float32; with it every
    pass runs the bf16 kernel."""
    monkeypatch.setattr("rapid_integrations.models.weight_only.NATIVE_BF16", native)
    linear = _linear(48, 64, torch.float32, bias)
    half = Bf16WeightLinear(linear)
    assert half.weight.dtype == torch.bfloat16 and half.bias is linear.bias
    dtypes = _kernel_dtypes(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    for shape in [(1, 1, 64), (2, 8, 64), (1, 17, 64), (3, 40, 64)]:
        x = torch.randn(shape, generator=gen)
        y = half(x)
        exact, in_bf16 = _products(x, linear)
        assert y.shape == (*shape[:-1], 48) and y.dtype == torch.float32
        assert _near(y, in_bf16) and (y.double() - exact).abs().max() > 1e-3
    bf16, fp32 = torch.bfloat16, torch.float32
    assert dtypes == ([bf16] * 4 if native else [bf16, bf16, fp32, fp32])
    assert HALF_ROWS == 16  # the shapes above straddle it


@pytest.mark.parametrize("native", [False, True])
def test_bf16_weight_gives_a_prompt_read_at_once_the_values_read_a_token_at_a_time(
    monkeypatch, native
):
    """With or without the prefix cache a prompt's tokens are read in passes of other widths:
    the kernels differ in their sums' order only, so nearly every value is equal and none is
    more than one bf16 step apart (docs/algorithm.md section 8)."""
    monkeypatch.setattr("rapid_integrations.models.weight_only.NATIVE_BF16", native)
    half = Bf16WeightLinear(_linear(48, 64, torch.float32))
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    whole, apart = half(x), torch.cat([half(row[None]) for row in x])
    assert _near(whole, apart.double())
    assert (whole == apart).float().mean() > 0.99


def test_bf16_weight_runs_the_bf16_kernel_in_a_compiled_graph_whatever_its_rows(monkeypatch):
    """A compiled graph holds no shape test (`compiled.py` checks only lengths per pass): one
    graph serves 2 to 19 rows (a second would be a recompile, an error here), each the bf16
    product."""
    monkeypatch.setattr("rapid_integrations.models.weight_only.NATIVE_BF16", False)
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    linear = _linear(48, 64, torch.float32, True)
    compiled = torch.compile(Bf16WeightLinear(linear), dynamic=True, fullgraph=True)
    for rows in (2, HALF_ROWS + 3):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        assert _near(compiled(x), _products(x, linear)[1])


def test_auto_drafts_a_float32_self_draft_from_bf16_weights_sharing_the_rest(tok):
    """On the CPU a float32 self-draft's default copy holds every Linear weight in bf16 and
    shares the target's other weights (embeddings, norms); the target keeps its Linears."""
    t = tiny_llama(len(tok), seed=31, dtype=torch.float32)
    engine = RapidEngine(t, tokenizer=tok)
    assert engine.draft_precision == "bf16-weight" and engine.draft is not t
    linears = [m for m in t.modules() if isinstance(m, torch.nn.Linear)]
    halves = [m for m in engine.draft.modules() if isinstance(m, Bf16WeightLinear)]
    assert len(halves) == len(linears) and not any(
        isinstance(m, torch.nn.Linear) for m in engine.draft.modules()
    )
    kept = {id(p) for p in t.parameters()} - {id(m.weight) for m in linears}
    assert {id(p) for p in engine.draft.parameters()} == kept


def test_bf16_weight_on_a_model_not_in_float32_is_refused(tok):
    bf16 = tiny_llama(len(tok), seed=31, dtype=torch.bfloat16)
    with pytest.raises(RapidConfigError, match=r"draft_precision.*float32 model.*bfloat16"):
        RapidEngine(bf16, tokenizer=tok, draft_precision="bf16-weight")
