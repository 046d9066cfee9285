"""Shared prefixes (docs/algorithm.md section 14.1): calls on one stored prompt prefix read one
copy of its KV, attending to it and to their own tokens apart and merging the two; their
outputs are those of today's copy path and of a fresh call, token for token (float32 tiny
models, eta = 0 greedy), alone, in a batch and joining at different steps."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from rapid_integrations import BatchRunner, RapidConfig, RapidEngine, generate_batch
from rapid_integrations.runtime import kv
from rapid_integrations.runtime.kv import KVState, SharedPrefixLayer, held_bytes
from rapid_integrations.runtime.prefix_cache import PrefixCache
from tests.test_kv_layouts import mistral
from tests.tiny import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

DOC = "abc def ghi jkl. lkj ihg fed cba. " * 3
QUESTIONS = ["what is a.", "and b.", "what is c d.", "ok.", "jkl ihg."]
OTHERS = ["hello. ab cd ab cd ab", "fed cba fed"]  # no common prefix with DOC


@pytest.fixture(scope="module")
def engine(tok):
    target = tiny_llama(len(tok), seed=11, dtype=torch.float32, scale=0.5)
    draft = tiny_llama(len(tok), seed=12, layers=1, dtype=torch.float32, scale=0.5)
    cfg = RapidConfig(eta=0.0, max_new_tokens=12, ignore_eos=True)
    return RapidEngine(target, draft, tokenizer=tok, config=cfg)


@pytest.fixture
def cold(engine):
    """The engine with an empty prefix cache, emptied again afterwards."""
    engine.prefix_cache.clear()
    yield engine
    engine.prefix_cache.clear()


def force_copying(monkeypatch: pytest.MonkeyPatch) -> None:
    """Today's copy path: no model may share a prefix, so a reused one is copied."""
    monkeypatch.setattr(kv, "packing_refusal", lambda model, layers: "copy")


@pytest.fixture
def copying(monkeypatch):
    force_copying(monkeypatch)


def fresh(engine: RapidEngine, prompt: str, **options) -> list[int]:
    return engine.generate(prompt, "ghi", prefix_cache_bytes=0, **options).token_ids


def shared_storages(engine: RapidEngine) -> set[int]:
    """The buffers the prefix cache's target entries read their first part from."""
    entries = engine.prefix_cache._entries.values()
    return {
        e.parts[0][0][0].untyped_storage().data_ptr() for e in entries if e.model() is engine.target
    }


@pytest.mark.parametrize(
    ("gamma", "lookup"), [(1, True), (2, False), (3, True), (4, False), (5, True)]
)
def test_single_calls_on_a_shared_prefix_equal_fresh_ones(cold, gamma, lookup):
    options = {"gamma": gamma, "logprobs": True, **({} if lookup else {"lookup_ngram": 0})}
    for q in QUESTIONS[:3]:
        out = cold.generate(DOC + q, "ghi", **options)
        want = cold.generate(DOC + q, "ghi", prefix_cache_bytes=0, **options)
        assert out.token_ids == want.token_ids
        got = [e.logprob for e in out.logprobs]
        assert np.allclose(got, [e.logprob for e in want.logprobs], rtol=0, atol=1e-4)
        assert (out.stats.cached_prefix_tokens >= len(DOC)) == (q != QUESTIONS[0])
    assert len(shared_storages(cold)) == 1  # every entry reads the first call's buffer


def test_a_next_turn_shares_the_document_and_copies_its_own_earlier_turn(cold):
    """The second call's entry has two parts (the first call's document, its own question);
    its next turn shares the first part and copies the common tokens of the second."""
    cold.generate(DOC + QUESTIONS[0], "ghi")
    cold.generate(DOC + QUESTIONS[1], "ghi")
    follow_up = DOC + QUESTIONS[1] + " abc " + QUESTIONS[2]
    out = cold.generate(follow_up, "ghi", gamma=3)
    assert out.stats.cached_prefix_tokens == len(DOC + QUESTIONS[1]) - 1  # its stored head
    assert out.token_ids == fresh(cold, follow_up, gamma=3)
    assert len(shared_storages(cold)) == 1


def test_the_split_equals_the_copy_path(engine, monkeypatch):
    prompts = [DOC + q for q in QUESTIONS]
    engine.prefix_cache.clear()
    shared = [engine.generate(p, "ghi", gamma=3).token_ids for p in prompts]
    force_copying(monkeypatch)
    engine.prefix_cache.clear()
    assert [engine.generate(p, "ghi", gamma=3).token_ids for p in prompts] == shared
    engine.prefix_cache.clear()


def test_batched_calls_sharing_a_prefix_beside_others_equal_fresh_ones(cold):
    cold.generate(DOC + "warm.", "ghi")  # stores the document's KV
    calls = [
        (DOC + QUESTIONS[0], {"gamma": 1}),
        (OTHERS[0], {"gamma": 4, "lookup_ngram": 0}),
        (DOC + QUESTIONS[1], {"gamma": 5, "lookup_ngram": 0}),
        (DOC + QUESTIONS[2], {"gamma": 2, "mode": "sd"}),
        (OTHERS[1], {"gamma": 3}),
        (DOC + QUESTIONS[3], {"gamma": 3, "prefill_chunk_size": 3}),
    ]
    runner = BatchRunner(cold)
    ids = [runner.submit(p, "ghi", **o) for p, o in calls]
    runner.run()
    for i, (prompt, options) in zip(ids, calls, strict=True):
        out = runner.outputs[i]
        assert out.token_ids == fresh(cold, prompt, **options), prompt
        assert (out.stats.cached_prefix_tokens >= len(DOC)) == prompt.startswith(DOC)
    assert len(shared_storages(cold)) == 1 + len(OTHERS)


def test_calls_joining_at_different_steps_share_and_match(cold):
    options = [{"gamma": g} if g % 2 else {"gamma": g, "lookup_ngram": 0} for g in (4, 1, 2, 3, 5)]
    runner = BatchRunner(cold)
    ids = []
    for q, o in zip(QUESTIONS, options, strict=True):
        ids.append(runner.submit(DOC + q, "ghi", **o))
        for _ in range(3):
            runner.step()
    runner.run()
    for i, q, o in zip(ids, QUESTIONS, options, strict=True):
        out = runner.outputs[i]
        assert out.token_ids == fresh(cold, DOC + q, **o)
        assert (out.stats.cached_prefix_tokens >= len(DOC)) == (q != QUESTIONS[0])


def test_one_shot_batch_after_a_first_call_shares(cold):
    prompts = [DOC + q for q in QUESTIONS]
    cold.generate(prompts[0], "ghi")
    outs = generate_batch(cold, prompts, draft_prompt="ghi", gamma=2)
    assert [o.token_ids for o in outs] == [fresh(cold, p, gamma=2) for p in prompts]
    assert all(o.stats.cached_prefix_tokens >= len(DOC) for o in outs)


def test_an_entry_evicted_while_calls_read_it_stays_alive(cold):
    cold.generate(DOC + "warm.", "ghi")
    runner = BatchRunner(cold)
    ids = [runner.submit(DOC + q, "ghi", gamma=3) for q in QUESTIONS[:3]]
    for _ in range(4):
        runner.step()
    cold.prefix_cache.clear()  # the calls' references keep the prefix's buffer
    gc.collect()
    runner.run()
    for i, q in zip(ids, QUESTIONS, strict=False):
        assert runner.outputs[i].token_ids == fresh(cold, DOC + q, gamma=3)


def _start(model, prompt: list[int], prefixes: PrefixCache, capacity: int = 200) -> KVState:
    """A sequence of `capacity` tokens prefilled in 16-token chunks, reusing from `prefixes`."""
    return KVState.start(model, prompt, model.config.vocab_size, 16, capacity, prefixes, 1 << 30)


def test_the_prefix_is_one_allocation_and_memory_does_not_grow_per_call(engine, tok):
    doc = tok.encode(DOC)
    prompts = [doc + tok.encode(q) for q in QUESTIONS]
    prefixes = PrefixCache()
    first, *others = [_start(engine.target, p, prefixes) for p in prompts]
    assert first.shared_tokens == 0
    for state in others:
        assert state.shared_tokens >= len(doc)
        for mine, theirs in zip(state.cache.layers, first.cache.layers, strict=True):
            assert isinstance(mine, SharedPrefixLayer)
            assert mine.prefix[0].data_ptr() == theirs.keys.data_ptr()  # read in place
            assert mine.prefix[1].data_ptr() == theirs.values.data_ptr()
            assert mine.capacity == 200 - state.shared_tokens  # sized for its own tokens
    one = held_bytes([first])
    per_token = one // 200
    assert held_bytes([first, *others]) == one + sum(
        per_token * (200 - s.shared_tokens) for s in others
    )
    # The prefix cache counts the first call's buffer once, though every entry views it.
    assert prefixes.nbytes == held_bytes([first, *others])


def test_copying_holds_a_copy_per_call(engine, tok, copying):
    prefixes = PrefixCache()
    states = [_start(engine.target, tok.encode(DOC + q), prefixes) for q in QUESTIONS]
    assert all(s.shared_tokens == 0 and s.reused_tokens >= len(DOC) for s in states[1:])
    assert held_bytes(states) == len(states) * held_bytes(states[:1])


def test_rollback_never_reaches_into_the_shared_prefix(engine, tok):
    prefixes = PrefixCache()
    _start(engine.target, tok.encode(DOC + "a."), prefixes)
    state = _start(engine.target, tok.encode(DOC + "b."), prefixes)
    layer = state.cache.layers[0]
    before = layer.prefix[0].clone()
    state.feed(torch.tensor(tok.encode("abc")))  # "." then "abc": own tokens
    own = layer.length
    state.rollback(own)
    assert state.cache.get_seq_length() == state.shared_tokens
    with pytest.raises(RuntimeError, match="shared prefix"):
        state.rollback(1)
    assert torch.equal(layer.prefix[0], before)


@pytest.mark.parametrize("kind", ["sliding-window", "eager attention"])
def test_models_that_cannot_share_copy_the_prefix_and_match(tok, kind):
    model = mistral(len(tok), 31) if kind == "sliding-window" else tiny_llama(len(tok), 31)
    if kind == "eager attention":
        model.set_attn_implementation("eager")
    engine = RapidEngine(model, tokenizer=tok, config=RapidConfig(eta=0.0, max_new_tokens=10))
    prefixes = PrefixCache()
    prompts = [tok.encode(DOC + q) for q in QUESTIONS[:2]]
    states = [_start(engine.target, p, prefixes) for p in prompts]
    assert states[1].reused_tokens >= len(DOC) and states[1].shared_tokens == 0
    engine.generate(DOC + QUESTIONS[0])
    out = engine.generate(DOC + QUESTIONS[1])
    assert out.stats.cached_prefix_tokens >= len(DOC)
    assert out.token_ids == engine.generate(DOC + QUESTIONS[1], prefix_cache_bytes=0).token_ids


def test_bf16_target_with_an_int4_draft_shares_like_the_copy_path(tok, monkeypatch):
    model = tiny_llama(len(tok), seed=31, dtype=torch.bfloat16, scale=0.5)
    engine = RapidEngine(model, tokenizer=tok, config=RapidConfig(eta=0.0, max_new_tokens=10))
    prompts = [DOC + q for q in QUESTIONS[:3]]
    shared = [engine.generate(p, "ghi", gamma=3) for p in prompts]
    assert all(o.stats.cached_prefix_tokens >= len(DOC) for o in shared[1:])
    assert len(shared_storages(engine)) == 1
    force_copying(monkeypatch)
    engine.prefix_cache.clear()
    assert [engine.generate(p, "ghi", gamma=3).token_ids for p in prompts] == [
        o.token_ids for o in shared
    ]


def test_an_int4_target_shares_and_decodes_as_a_fresh_call(tok):
    model = tiny_llama(len(tok), seed=41, dtype=torch.float32, scale=0.5)
    cfg = RapidConfig(eta=0.0, max_new_tokens=10, ignore_eos=True)
    engine = RapidEngine(model, tokenizer=tok, config=cfg, target_precision="int4-weight")
    for q in QUESTIONS[:3]:
        out = engine.generate(DOC + q, "ghi", gamma=4)
        assert out.token_ids == fresh(engine, DOC + q, gamma=4)
    assert out.stats.cached_prefix_tokens >= len(DOC)
    # The document's buffer, and the self-draft's own "ghi" prompt (the same int4 model).
    assert len(shared_storages(engine)) == 2


def test_lookup_cuts_a_two_part_entry_at_the_common_prefix(target):
    store = PrefixCache()
    a, b = torch.zeros(1, 1, 8, 2), torch.ones(1, 1, 8, 2)
    parts = [[(a[..., :3, :], a[..., :3, :])], [(b[..., :2, :], b[..., :2, :])]]
    store.store(target, [1, 2, 3, 4, 5], parts, 1 << 20)
    n, found = store.lookup(target, [1, 2, 3, 4, 9])
    assert n == 4 and [p[0][0].shape[-2] for p in found] == [3, 1]
    assert found[1][0][0].data_ptr() == b.data_ptr()  # views, not copies
    n, found = store.lookup(target, [1, 2, 7])
    assert n == 2 and [p[0][0].shape[-2] for p in found] == [2]
    store.store(target, [1, 2, 8], [[(a[..., :3, :], a[..., :3, :])]], 1 << 20)
    assert store.nbytes == a.untyped_storage().nbytes() + b.untyped_storage().nbytes()


def test_float64_logprobs_on_a_shared_prefix_equal_a_fresh_calls(engines):
    engine = engines["separate"]  # float64 tiny models (conftest)
    engine.generate(DOC + QUESTIONS[0], "ghi")
    out = engine.generate(DOC + QUESTIONS[1], "ghi", gamma=4, logprobs=True)
    want = engine.generate(DOC + QUESTIONS[1], "ghi", gamma=4, logprobs=True, prefix_cache_bytes=0)
    assert out.stats.cached_prefix_tokens >= len(DOC)
    assert out.token_ids == want.token_ids
    got = [e.logprob for e in out.logprobs]
    assert np.allclose(got, [e.logprob for e in want.logprobs], rtol=0, atol=1e-10)
