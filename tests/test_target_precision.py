"""`target_precision="int4-weight"`: the engine verifies with an int4 copy of the target, and
follows that copy's own greedy decoding (docs/performance.md, "An int4 target")."""

from __future__ import annotations

import pytest
import torch

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.bench.runner import BenchSettings
from rapid_integrations.cli import build_parser
from rapid_integrations.errors import RapidConfigError
from rapid_integrations.models.weight_only import GROUP, Int4WeightLinear
from tests.test_engine_exact import random_prompts
from tests.tiny import reference_greedy, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


def _int4_layers(model: torch.nn.Module) -> int:
    return sum(isinstance(m, Int4WeightLinear) for m in model.modules())


@pytest.mark.parametrize("mode", ["lc", "sd", "rapid"])
def test_an_int4_target_decodes_as_its_own_greedy_decoding(tok, mode):
    """eta 0, greedy: every mode emits the int4 copy's own greedy tokens (a no-cache loop over
    `engine.target`), not the float model's; the self-draft is that copy, not a second one."""
    t = tiny_llama(len(tok), seed=41, dtype=torch.float32, scale=0.5)
    cfg = RapidConfig(eta=0.0, max_new_tokens=16, ignore_eos=True, gamma=4)
    engine = RapidEngine(t, tokenizer=tok, config=cfg, target_precision="int4-weight")
    assert engine.target_precision == "int4-weight" and engine.draft_precision == "none"
    assert engine.draft is engine.target and _int4_layers(engine.target) == 2 * 7
    assert _int4_layers(t) == 0  # the model given is left as it was
    differs = False
    for prompt, draft_prompt in random_prompts(6, seed=41):
        ids = tok.encode(prompt)
        out = engine.generate(prompt, draft_prompt, mode=mode)
        assert out.token_ids == reference_greedy(engine.target, ids, 16, len(tok))
        differs |= out.token_ids != reference_greedy(t, ids, 16, len(tok))
    assert differs  # the int4 copy is another model: the test would not see a float target


def test_an_int4_target_with_a_separate_draft_keeps_that_draft(tok):
    t = tiny_llama(len(tok), seed=41, dtype=torch.float32, scale=0.5)
    d = tiny_llama(len(tok), seed=42, dtype=torch.float32, scale=0.5)
    cfg = RapidConfig(eta=0.0, max_new_tokens=12, ignore_eos=True, gamma=3)
    engine = RapidEngine(t, d, tokenizer=tok, config=cfg, target_precision="int4-weight")
    assert engine.draft is d and _int4_layers(engine.target) > 0
    for prompt, draft_prompt in random_prompts(3, seed=43):
        out = engine.generate(prompt, draft_prompt)
        assert out.token_ids == reference_greedy(engine.target, tok.encode(prompt), 12, len(tok))


def test_auto_and_none_verify_with_the_target_as_loaded(tok):
    t = tiny_llama(len(tok), seed=41, dtype=torch.bfloat16)
    for precision in ("auto", None, "none"):
        engine = RapidEngine(t, tokenizer=tok, target_precision=precision)
        assert engine.target is t and engine.target_precision == "none"
        assert engine.draft_precision == "int4-weight"  # the draft's own "auto" is unchanged


def _q4_1_weight(rows: int, cols: int) -> torch.Tensor:
    """A [rows, cols] float32 weight as a Q4_1 GGUF ships it, de-quantized as transformers
    loads it: gguf's own Q4_1 blocks (a scale d and a min m per 32 weights, w = d q + m)."""
    gguf = pytest.importorskip("gguf")
    rng = torch.Generator().manual_seed(5)
    source = torch.randn(rows, cols, generator=rng) * torch.rand(rows, 1, generator=rng)
    source[2, :GROUP] = 0.25  # a constant block: d = 0
    kind = gguf.GGMLQuantizationType.Q4_1
    blocks = gguf.quants.quantize(source.numpy(), kind)
    return torch.from_numpy(gguf.quants.dequantize(blocks, kind)).float()


def _read_back(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] float32 through an int4 copy and the kernel, in float32."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return Int4WeightLinear(linear)(torch.eye(weight.shape[1])).T.detach()


def test_int4_codes_of_q4_1_weights_give_back_those_weights_exactly():
    """On weights de-quantized from Q4_1 blocks the int4 copy's per-32 (min, max) grid is the
    blocks' own: read back through the kernel in float32, every weight is bit-identical."""
    weight = _q4_1_weight(48, 4 * GROUP)
    assert torch.equal(_read_back(weight), weight)


@pytest.mark.slow
def test_the_embedded_models_int4_copy_holds_its_gguf_weights_exactly():
    """The cached float32 weights of the embedded model (de-quantized from its Q4_1 GGUF) come
    back bit for bit from the int4 copy, in the first and last layers' every Linear."""
    from safetensors.torch import load_file

    from rapid_integrations.models.loading import ensure_default_model

    weights = load_file(ensure_default_model() / "model.safetensors")
    layers = ("model.layers.0.", f"model.layers.{sum('q_proj' in n for n in weights) - 1}.")
    names = [n for n in weights if n.startswith(layers) and n.endswith("proj.weight")]
    assert len(names) == 14
    for name in names:
        assert torch.equal(_read_back(weights[name].float()), weights[name]), name


def test_bad_target_precisions_are_refused_before_loading(tok):
    t = tiny_llama(len(tok), seed=41, dtype=torch.float32)
    with pytest.raises(RapidConfigError, match=r"target_precision: must be .*'int4-weight'"):
        RapidEngine(t, tokenizer=tok, target_precision="int8-weight")
    with pytest.raises(RapidConfigError, match="target_precision"):
        RapidEngine.from_default(target_precision="int4")  # checked before the model loads
    with pytest.raises(RapidConfigError, match=r"draft_precision: .*target itself"):
        RapidEngine(t, tokenizer=tok, target_precision="int4-weight", draft_precision="int8")
    with pytest.raises(RapidConfigError, match=r"target_precision: .*device-mapped"):
        RapidEngine(
            "some/model", model_kwargs={"device_map": "auto"}, target_precision="int4-weight"
        )
    with pytest.raises(RapidConfigError, match="target_precision"):
        BenchSettings(target_precision="int8")


def test_int4_target_without_the_kernel_is_refused_with_what_to_do(tok, monkeypatch):
    monkeypatch.setattr("rapid_integrations.models.weight_only.has_kernel", lambda op, d: False)
    t = tiny_llama(len(tok), seed=41, dtype=torch.float32)
    with pytest.raises(RapidConfigError, match=r"target_precision: .*CPU only"):
        RapidEngine(t, tokenizer=tok, target_precision="int4-weight")


def test_bench_flag_takes_the_engines_choices():
    args = build_parser().parse_args(["bench", "--target-precision", "int4-weight"])
    assert args.target_precision == "int4-weight"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--target-precision", "int8"])


@pytest.mark.parametrize(
    ("dtype", "capability", "warned"),
    [
        (torch.float32, "AVX2", True),
        (torch.float32, "AVX512", False),
        (torch.bfloat16, "AVX2", False),
    ],
)
def test_an_int4_copy_of_a_float32_model_warns_where_the_kernel_is_slow(
    tok, monkeypatch, caplog, dtype, capability, warned
):
    """torch's int4 CPU kernel has a fast path for bfloat16 activations only where the CPU
    lacks AVX-512: a float32 int4 copy there is warned about, naming the option and the fix."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    t = tiny_llama(len(tok), seed=41, dtype=dtype)
    with caplog.at_level("WARNING", logger="rapid_integrations.models.loading"):
        RapidEngine(t, tokenizer=tok, target_precision="int4-weight")
    said = [r.getMessage() for r in caplog.records if r.name == "rapid_integrations.models.loading"]
    assert bool(said) == warned
    assert all("target_precision='int4-weight'" in m and "bfloat16" in m for m in said)
