"""Loading real targets as Hugging Face users do: `model_kwargs` / `draft_model_kwargs` to
`from_pretrained`, tokenizers given as paths, models that place themselves (device-mapped or
quantized) never moved, every argument checked before any weights load, and a model's
context window read from its config alone."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from rapid_integrations import ModelNotFoundError, RapidConfigError, RapidEngine
from rapid_integrations.models.loading import context_window_of, places_itself
from tests.tiny import char_tokenizer, reference_greedy, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

PROMPT = "abc. bad cab. a deal"
WINDOW = 512  # tests.tiny's window
F64 = {"dtype": torch.float64}  # the saved models' own dtype: exact against the reference


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory):
    """A saved one-layer draft, without a tokenizer (as draft folders often are)."""
    path = tmp_path_factory.mktemp("tiny-draft")
    tiny_llama(len(char_tokenizer()), seed=2, layers=1).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def expected():
    """The target's own greedy continuation of PROMPT (no cache, float64)."""
    tok = char_tokenizer()
    ids = tok(PROMPT)["input_ids"]
    return reference_greedy(tiny_llama(len(tok), seed=1), ids, 12, len(tok))


def greedy(engine: RapidEngine, mode: str = "rapid", **overrides) -> list[int]:
    ids = engine.tokenizer(PROMPT)["input_ids"]
    config = {"max_new_tokens": 12, "ignore_eos": True, "eta": 0.0, **overrides}
    return engine.generate(ids, ids[-6:], mode=mode, **config).token_ids


# ---- model_kwargs reach from_pretrained ------------------------------------------------------


def test_device_map_cpu_loads_in_place_and_decodes_exactly(tiny_model_dir, draft_folder, expected):
    engine = RapidEngine(
        str(tiny_model_dir),
        str(draft_folder),
        model_kwargs={"device_map": "cpu", **F64},
        draft_model_kwargs={"device_map": "cpu", "torch_dtype": torch.float64},
    )
    for model in (engine.target, engine.draft):
        assert model.device == torch.device("cpu") and model.dtype == torch.float64
    assert engine.draft is not engine.target
    assert greedy(engine, "sd") == greedy(engine, "lc") == expected


def test_attn_implementation_eager_is_used_and_agrees_with_sdpa(tiny_model_dir, expected):
    eager = RapidEngine(tiny_model_dir, model_kwargs={"attn_implementation": "eager", **F64})
    assert eager.target.config._attn_implementation == "eager"  # not switched to rapid's
    sdpa = RapidEngine(tiny_model_dir, model_kwargs=F64)
    assert sdpa.target.config._attn_implementation != "eager"
    for mode in ("lc", "sd", "rapid"):
        assert greedy(eager, mode) == greedy(sdpa, mode) == expected


def test_from_pretrained_receives_every_model_kwarg(tiny_model_dir, monkeypatch):
    seen = {}
    real = AutoModelForCausalLM.from_pretrained

    def spy(source, **kwargs):
        seen.update(kwargs)
        return real(source, dtype=kwargs["dtype"])

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    given = {"revision": "main", "trust_remote_code": False, "attn_implementation": "eager"}
    RapidEngine(tiny_model_dir, model_kwargs=given, dtype="float32")
    assert seen == {**given, "dtype": torch.float32}


# ---- tokenizers given as paths ---------------------------------------------------------------


def test_tokenizer_given_as_a_path_is_loaded_with_tokenizer_kwargs(tiny_model_dir, expected):
    model = tiny_llama(len(char_tokenizer()), seed=1)
    engine = RapidEngine(
        model, tokenizer=str(tiny_model_dir), tokenizer_kwargs={"model_max_length": 77}
    )
    assert engine.tokenizer.model_max_length == 77
    assert greedy(engine, "lc") == expected
    saved = RapidEngine(tiny_model_dir, model_kwargs=F64, tokenizer_kwargs={"model_max_length": 55})
    assert saved.tokenizer.model_max_length == 55  # the tiny_model_dir's own tokenizer, same kwargs
    with pytest.raises(ModelNotFoundError, match="tokenizer"):
        RapidEngine(model, tokenizer=str(tiny_model_dir / "missing"))
    with pytest.raises(RapidConfigError, match="tokenizer_kwargs"):  # nothing to apply them to
        RapidEngine(model, tokenizer=char_tokenizer(), tokenizer_kwargs={"model_max_length": 9})


# ---- models that place themselves are never moved --------------------------------------------


class QuantizedStandIn(LlamaForCausalLM):
    """A model as bitsandbytes / torchao leave it: marked quantized, and `.to` refuses."""

    def to(self, *args, **kwargs):
        raise RuntimeError("a quantized model cannot be moved or cast")


def quantized_stand_in() -> QuantizedStandIn:
    real = tiny_llama(len(char_tokenizer()), seed=1)
    model = QuantizedStandIn(real.config)
    model.load_state_dict(real.state_dict())
    model.double().eval()  # `.double` is not `.to`: the stand-in is float64 like the reference
    model.hf_quantizer = object()
    return model


def test_a_quantized_model_is_never_moved(tiny_model_dir, expected, monkeypatch):
    assert places_itself(quantized_stand_in()) and not places_itself(tiny_llama(20, seed=1))
    monkeypatch.setattr(
        AutoModelForCausalLM, "from_pretrained", lambda *a, **k: quantized_stand_in()
    )
    loaded = RapidEngine(
        tiny_model_dir, model_kwargs={"quantization_config": {"load_in_8bit": True}}
    )
    given = RapidEngine(quantized_stand_in(), tokenizer=char_tokenizer())
    for engine in (loaded, given):
        assert greedy(engine, "sd") == expected
    with pytest.raises(RapidConfigError, match="draft_precision"):
        RapidEngine(quantized_stand_in(), tokenizer=char_tokenizer(), draft_precision="bfloat16")


def test_a_device_mapped_model_is_never_moved(tiny_model_dir, expected, monkeypatch):
    def dispatched(*args, **kwargs):
        model = quantized_stand_in()
        model.hf_quantizer = None
        model.hf_device_map = {"": "cpu"}
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", dispatched)
    engine = RapidEngine(tiny_model_dir, model_kwargs={"device_map": "auto"})
    assert greedy(engine, "sd") == expected


# ---- a model object is used where it is and as it is, and an ask to move it is refused --------


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("device", {"device": "cuda"}),
        ("device", {"device": "cuda:1"}),
        ("dtype", {"dtype": "bfloat16"}),
        ("draft_device", {"draft": "object", "draft_device": "meta"}),
        ("dtype", {"draft": "object", "dtype": torch.float64, "draft_dtype": torch.float32}),
    ],
)
def test_a_model_object_elsewhere_than_asked_is_refused(field, kwargs):
    """Without the check, device="cuda" with a CPU model object decoded on the CPU without a
    word (seen on a GPU machine: a "CUDA" exactness check that ran on the CPU)."""
    tok = char_tokenizer()
    kwargs = dict(kwargs)
    if kwargs.pop("draft", None):
        kwargs["draft"] = tiny_llama(len(tok), seed=2).to(kwargs.pop("draft_dtype", torch.float64))
    with pytest.raises(RapidConfigError) as err:
        RapidEngine(tiny_llama(len(tok), seed=1), tokenizer=tok, **kwargs)
    assert err.value.field == field


def test_a_model_object_where_asked_is_used():
    tok = char_tokenizer()
    model = tiny_llama(len(tok), seed=1)
    engine = RapidEngine(model, tokenizer=tok, device="cpu", dtype=torch.float64)
    assert engine.target is model
    # the draft inherits the target's device only as a default: a draft object stays put
    assert RapidEngine(model, tiny_llama(len(tok), seed=2), tokenizer=tok, device="cpu").draft


# ---- every argument is checked before any weights load ---------------------------------------


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the arguments were checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr("rapid_integrations.models.loading.ensure_default_model", refuse)


BAD_ENGINE_ARGUMENTS = [
    ("eta", {"config": {"eta": -1}}),
    ("config", {"config": "fast"}),
    ("draft_precision", {"draft_precision": "int4"}),
    ("dtype", {"dtype": "float8"}),
    ("model_kwargs", {"model_kwargs": "device_map=auto"}),
    ("model_kwargs", {"model_kwargs": {"device_map": "auto"}, "device": "cpu"}),
    ("model_kwargs", {"model_kwargs": {"dtype": "float32"}, "dtype": "float32"}),
    ("tokenizer_kwargs", {"tokenizer_kwargs": ["x"]}),
    ("draft_model_kwargs", {"draft_model_kwargs": {"revision": "main"}}),  # no draft to load
    (
        "draft_model_kwargs",
        {"draft": "d", "draft_model_kwargs": {"device_map": "auto"}, "draft_device": "cpu"},
    ),
    ("draft_precision", {"draft_precision": "int8", "model_kwargs": {"device_map": "auto"}}),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD_ENGINE_ARGUMENTS)
def test_engine_arguments_are_checked_before_loading(nothing_loads, field, kwargs):
    with pytest.raises(RapidConfigError) as err:
        RapidEngine("some/model", tokenizer="some/tokenizer", **kwargs)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("eta", {"eta": -1}),
        ("gamma", {"gamma": 0}),
        ("nonsense", {"nonsense": 1}),
        ("draft_precision", {"draft_precision": "int4"}),
        ("dtype", {"dtype": "float8"}),
        ("draft_model_kwargs", {"draft_model_kwargs": {"revision": "main"}}),
    ],
)
def test_from_default_checks_before_loading(nothing_loads, field, kwargs):
    with pytest.raises(RapidConfigError) as err:
        RapidEngine.from_default(**kwargs)
    assert err.value.field == field


# ---- the context window from the config alone ------------------------------------------------


def test_context_window_is_read_without_loading_weights(tiny_model_dir, nothing_loads):
    assert context_window_of(tiny_model_dir) == context_window_of(str(tiny_model_dir)) == WINDOW
    assert context_window_of(tiny_llama(20, seed=1, window=300)) == 300
    with pytest.raises(ModelNotFoundError):
        context_window_of(tiny_model_dir / "missing")
    with pytest.raises(ModelNotFoundError):
        context_window_of("no-such-org/no-such-model")  # offline: the hub is not reached


def test_context_window_of_the_embedded_default(nothing_loads):
    assert context_window_of(None) == 8192  # SmolLM2-135M-Instruct's declared window


# ---- on a GPU: the draft on another device, device maps with hooks ---------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def sampled(engine: RapidEngine, seed: int, **overrides) -> list[int]:
    ids = engine.tokenizer(PROMPT)["input_ids"]
    config = {"max_new_tokens": 12, "temperature": 1.0, "seed": seed, "eta": 5.0, **overrides}
    return engine.generate(ids, ids[-6:], mode="rapid", **config).token_ids


@cuda
@pytest.mark.parametrize(("device", "draft_device"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_cuda_draft_on_another_device(tiny_model_dir, draft_folder, expected, device, draft_device):
    engine = RapidEngine(
        str(tiny_model_dir),
        str(draft_folder),
        device=device,
        draft_device=draft_device,
        dtype=torch.float64,
    )
    assert (engine.target.device.type, engine.draft.device.type) == (device, draft_device)
    assert greedy(engine, "sd") == greedy(engine, "rapid") == expected
    assert len(greedy(engine, "rapid", eta=5.0)) == 12  # q crosses devices into p_hat
    # The end guard's ids and both generators live where their logits are.
    assert sampled(engine, 3, ignore_eos=False) == sampled(engine, 3, ignore_eos=False)
    assert all(0 <= t < engine.vocab_size for t in sampled(engine, 4, ignore_eos=True))


@cuda
def test_cuda_device_map_auto(tiny_model_dir, expected):
    engine = RapidEngine(str(tiny_model_dir), model_kwargs={"device_map": "auto", **F64})
    assert engine.target.device.type == "cuda"
    assert greedy(engine, "sd") == expected


@cuda
def test_cuda_offloaded_head_runs_where_its_hook_executes(tiny_model_dir, expected):
    from rapid_integrations.engine.rapid_engine import logits_device

    device_map = {"model": 0, "lm_head": "cpu"}  # the head is offloaded, executed on cuda:0
    engine = RapidEngine(str(tiny_model_dir), model_kwargs={"device_map": device_map, **F64})
    assert engine.target.hf_device_map == device_map
    assert logits_device(engine.target) == torch.device("cuda", 0)
    assert greedy(engine, "sd") == expected
    assert sampled(engine, 5) == sampled(engine, 5)
