"""A compiled draft (`RapidEngine(compile_draft=True)`, rapid_integrations/runtime/compiled.py) on tiny
float64 models: every call decodes as the eager engine does, token for token and draft for
draft, every draft decode pass the graphs hold for runs the graphs built with the engine
(the others run the model itself), and nothing a call or the process does later makes torch
recompile them."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

from rapid_integrations import RapidConfig, RapidConfigError, RapidEngine, generate_batch
from rapid_integrations.bench.models import tiny_pair
from rapid_integrations.bench.probe import ForwardProbe
from rapid_integrations.bench.runner import forward_modules
from rapid_integrations.runtime import compiled
from rapid_integrations.runtime.attention import use_rapid_attention
from rapid_integrations.runtime.kv import KVState, cache_param, pass_seconds
from tests.tiny import char_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # compiles: ~20 s

# (prompt, draft prompt, options): gammas 1 to 8, lookup on and off, eta 0 and 5, greedy and
# sampled, a prompt longer than a prefill chunk, and a draft-only mode.
CALLS = [
    ("abc def gh abc def", "abc def", {"gamma": 4}),
    ("hello. ab cd ab cd ab", "ab cd", {"gamma": 8, "lookup_ngram": 0}),
    ("k", "k", {"gamma": 1}),
    ("jkl jkl abc abc a", "abc", {"gamma": 3, "eta": 5.0, "prefill_chunk_size": 3}),
    ("a.b.c.d.e.f", "d.e", {"gamma": 5, "eta": 5.0, "temperature": 0.9, "seed": 3}),
    ("lkj ihg fed", "fed", {"gamma": 2, "temperature": 1.1, "seed": 7, "mode": "sd"}),
]
STATS = ("drafted_tokens", "accepted_tokens", "draft_forward_passes", "target_forward_passes")


@pytest.fixture(scope="module")
def pairs():
    """(compiled, eager) engines on one float64 pair, the small model the large one truncated
    (so drafts are partly accepted), for a separate draft and for self-speculation; "graphs":
    how many graphs dynamo had built once they were (no call may add one); "breaks": the graph
    breaks building them met."""
    torch._dynamo.utils.counters.clear()
    tok = char_tokenizer()
    small, large = tiny_pair(len(tok), 512, seed=5, dtype=torch.float64)
    cfg = RapidConfig(eta=0.0, max_new_tokens=24, ignore_eos=True)
    built = {}
    for kind, draft in (("separate", small), ("self", None)):
        fast, eager = (
            RapidEngine(large, draft, tokenizer=tok, config=cfg, compile_draft=flag)
            for flag in (True, False)
        )
        # Each engine measures its draft's token price (0.08-0.14 here, docs/algorithm.md
        # section 2.10), and prices either side of a copy's chance read other copies: one price
        # for both, so that their passes can be compared one for one.
        fast.draft_token_price = eager.draft_token_price
        built[kind] = (fast, eager)
    built["graphs"] = graphs()
    built["breaks"] = dict(torch._dynamo.utils.counters["graph_break"])
    return built


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def run(engine: RapidEngine, call: tuple, **more) -> tuple[list[int], tuple[int, ...]]:
    prompt, draft_prompt, options = call
    out = engine.generate(prompt, draft_prompt, **options, **more)
    return out.token_ids, tuple(getattr(out.stats, name) for name in STATS)


@pytest.mark.parametrize("kind", ["separate", "self"])
def test_a_compileddraft_decodes_as_the_eager_one(pairs, kind):
    fast, eager = pairs[kind]
    for call in CALLS:
        assert run(fast, call) == run(eager, call), call


def test_each_draft_pass_is_one_whole_graph(pairs):
    """dynamo traced every draft pass whole: one graph for a pass of one token and one for
    passes of several, per compiled draft. A graph break (a host decision in the attention,
    say) runs a pass as pieces, each behind its own guard check: SmolLM2's took 26 against
    13 ms when the attention read the thread count."""
    assert pairs["breaks"] == {}
    assert pairs["graphs"] == 4


def ran_graphs(decode: compiled.CompiledDecode, monkeypatch) -> list[tuple[int, int, bool]]:
    """(cache length, width, whether a graph ran it) of each pass `decode` runs from now; a
    pass a graph runs must pass all its guards, which `graph_for` checks once per cache."""
    seen: list[tuple[int, int, bool]] = []
    chosen = decode.graph_for

    def recorded(input_ids, cache, keep):
        graph = chosen(input_ids, cache, keep)
        seen.append((cache.layers[0].length, input_ids.shape[1], graph is not None))
        assert graph is None or graph.guard_check(input_ids.clone(), cache)
        return graph

    monkeypatch.setattr(decode, "graph_for", recorded)
    return seen


def test_every_draft_decode_pass_runs_the_built_graphs_and_nothing_recompiles(pairs, monkeypatch):
    fast, _ = pairs["separate"]
    assert fast.draft_decode is not None
    seen = ran_graphs(fast.draft_decode, monkeypatch)
    stored = {"prefix_cache_bytes": 1 << 20}
    for call in [*CALLS, CALLS[0], CALLS[1]]:  # the repeats read their prompts' stored prefix
        start = len(seen)
        out = fast.generate(call[0], call[1], **call[2], **stored)
        # A one-token draft prompt has nothing to prefill: its first pass allocates the cache.
        first_eager = len(call[1]) == 1
        assert len(seen) - start == out.stats.draft_forward_passes - first_eager > 0
    assert out.stats.draft_cached_prefix_tokens > 0  # copied in, so still the compiled path
    assert max(width for _, width, _ in seen) > 1  # passes of one token and of several ran
    # Every pass on a cache of at least MIN_LENGTH tokens ran a graph (its guards held), and
    # none on a shorter one (the graphs hold from that length only).
    assert [ran for *_, ran in seen] == [n >= compiled.MIN_LENGTH for n, *_ in seen]
    assert any(n < compiled.MIN_LENGTH for n, *_ in seen)  # "k" drafts from one token
    # transformers registers every model class it builds in a dict each forward reads; a
    # class built now (a retriever's embedder, say) must not rebuild the draft's graphs.
    BertModel(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2))
    fast.generate(*CALLS[0][:2], **CALLS[0][2])
    assert graphs() == pairs["graphs"]
    assert all(ran for n, *_, ran in seen[-3:])


@torch.inference_mode()
def test_a_pass_the_graphs_do_not_hold_for_runs_the_model_itself(pairs, monkeypatch):
    """No guard is checked as a graph runs: `graph_for` sends a pass the graphs were not built
    for to the model, so does a call with an argument the graphs do not take, and a cache
    whose tensors fail the graph's guards (another dtype here) never reaches them."""
    fast, _ = pairs["separate"]
    decode = fast.draft_decode
    model = decode.model
    ids = torch.arange(4)[None]
    state = KVState.start(model, list(range(10)), fast.vocab_size, 4, 16, decode=decode)
    state.feed()
    assert state.cache.layers[0].length == 10
    assert decode.graph_for(ids[:, :1], state.cache, 0) is decode.graphs[False]
    assert decode.graph_for(ids, state.cache, 0) is decode.graphs[True]
    assert decode.graph_for(ids, state.cache, 1) is None  # keeps one logit row
    assert decode.graph_for(ids[:, :0], state.cache, 0) is None  # no token
    assert decode.graph_for(torch.arange(7)[None], state.cache, 0) is None  # 17 > 16 tokens
    seen = ran_graphs(decode, monkeypatch)
    twin = KVState.start(model, list(range(10)), fast.vocab_size, 4, 16)  # eager
    twin.feed()
    param = cache_param(type(model))
    positions = torch.arange(20, 24)[None]  # an argument the graphs do not take: the model's
    got = decode(ids, position_ids=positions, **{param: state.cache}).logits
    want = model(input_ids=ids, position_ids=positions, **{param: twin.cache}).logits
    # The same up to the rounding of the pending token's KV, which the graph computed.
    assert torch.allclose(got, want, rtol=0, atol=1e-9)
    assert seen == []
    other = KVState.start(model, list(range(10)), fast.vocab_size, 4, 16, decode=decode)
    for layer in other.cache.layers:  # float32 buffers where the graphs read float64
        layer._k, layer._v = layer._k.float(), layer._v.float()
    assert decode.graph_for(ids, other.cache, 0) is None
    assert decode.checked[other.cache] == {True: False}


def test_packed_draft_passes_of_a_batch_decode_as_alone(pairs):
    fast, eager = pairs["separate"]
    prompts = [call[0] for call in CALLS[:4]]
    want = [eager.generate(p).token_ids for p in prompts]
    assert [out.token_ids for out in generate_batch(fast, prompts)] == want


@pytest.mark.parametrize("value", ["yes", 1])
def test_compile_draft_takes_only_a_bool_and_is_checked_before_loading(value):
    with pytest.raises(RapidConfigError) as caught:
        RapidEngine("/no/such/model", compile_draft=value)
    assert caught.value.field == "compile_draft"
    with pytest.raises(RapidConfigError, match="compile_draft"):
        RapidEngine.from_default(compile_draft=value)


def test_the_llamaindex_llm_checks_it_at_construction():
    from llamaindex_rapid import RapidLLM

    with pytest.raises(RapidConfigError, match="compile_draft"):
        RapidLLM(compile_draft="yes")


def test_a_model_torch_cannot_compile_is_refused_at_construction(monkeypatch):
    class Failing:
        def aot_compile(self, example):
            raise RuntimeError("no C++ compiler found")

    def failing(fn, **options):
        return Failing()

    monkeypatch.setattr(compiled.torch, "compile", failing)
    tok = char_tokenizer()
    small, large = tiny_pair(len(tok), 64, dtype=torch.float64)
    with pytest.raises(RapidConfigError, match=r"no C\+\+ compiler found") as caught:
        RapidEngine(large, small, tokenizer=tok, compile_draft=True)
    assert caught.value.field == "compile_draft"
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_the_bench_times_the_compiled_draft_passes(pairs):
    """The probe hooks the compiled module (its passes bypass the draft's hooks), and the
    model-draft step is timed through it."""
    fast, _ = pairs["separate"]
    seen = {}
    for name, modules in (("models", [fast.target, fast.draft]), ("all", forward_modules(fast))):
        with ForwardProbe(modules) as probe:
            out = fast.generate(*CALLS[0][:2], **CALLS[0][2])
        seen[name] = len(probe.calls)
    assert seen["all"] - seen["models"] == out.stats.draft_forward_passes > 0
    timed: list[int] = []

    def counted(input_ids, **kwargs):
        timed.append(input_ids.shape[1])
        return fast.draft_decode(input_ids, **kwargs)

    pass_seconds(
        fast.draft, list(range(1, 12)), fast.vocab_size, (1,), chunk=4, repeats=3, decode=counted
    )
    assert timed == [1, 1, 1]


def test_rapid_serve_builds_its_engine_with_a_compiled_draft_when_asked(served_model_dir):
    from rapid_integrations.cli import build_parser
    from rapid_integrations.serve.server import settings_from
    from tests.serve_fixtures import DTYPE

    def settings(*flags: str):
        argv = ["serve", "--model", str(served_model_dir), "--dtype", DTYPE, *flags]
        return settings_from(build_parser().parse_args(argv))

    assert settings().compile_draft is False
    engine = settings("--compile-draft").load_engine()
    assert isinstance(engine.draft_decode, compiled.CompiledDecode)
    assert engine.draft_decode.model is engine.draft


@torch.inference_mode()
def test_a_pass_the_flash_kernel_would_leave_a_lone_row_runs_the_built_graph(monkeypatch):
    """`attention._padded` pads a lone query row outside compiled passes only: inside one its
    check would become a guard on the pass's width, and an 11-token pass of a model with 3
    query heads per KV head (33 folded rows, a lone row in the kernel's blocks of 32) would
    fail the guards of the graph traced on 2 tokens and run eagerly (under dynamo's own
    guards it built another graph: the bench's first rapid call ran at 1.1 tok/s). Last in
    the module: it builds graphs of its own, which the tests above count (`pairs`)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    use_rapid_attention(model)
    decode = compiled.compile_decode(model, 16)
    seen = ran_graphs(decode, monkeypatch)
    state = KVState.start(model, list(range(16)) * 3, 16, 16, 100, decode=decode)
    state.feed()  # the pending prompt token
    for width in (11, 10, 1, 11):
        state.feed(torch.arange(width) % 16)
    assert [(width, ran) for _, width, ran in seen] == [(w, True) for w in (1, 11, 10, 1, 11)]
