"""Prefix KV reuse: identical outputs, real reuse, byte budget, and safety under threads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.runtime.prefix_cache import PrefixCache, weights_version
from tests.tiny import reference_greedy, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

DOC = "abc def ghi jkl. " * 12
QUESTIONS = ["what is a.", "and b.", "what is c d.", "ok."]


@pytest.fixture
def engine(tok, target, draft):
    cfg = RapidConfig(eta=0.0, max_new_tokens=16, ignore_eos=True, gamma=4)
    return RapidEngine(target, draft, tokenizer=tok, config=cfg)


def test_second_question_reuses_the_document_and_matches_greedy(engine, target, tok):
    for i, q in enumerate(QUESTIONS):
        out = engine.generate(DOC + q, "ghi " + q)
        want = reference_greedy(target, tok.encode(DOC + q), 16, len(tok))
        assert out.token_ids == want
        if i == 0:
            assert out.stats.cached_prefix_tokens == 0
        else:
            assert out.stats.cached_prefix_tokens >= len(tok.encode(DOC))
            assert out.stats.draft_cached_prefix_tokens >= len(tok.encode("ghi "))


def test_same_prompt_twice_is_identical_and_fully_cached(engine, tok):
    first = engine.generate(DOC + "x.", "abc", max_new_tokens=30)
    again = engine.generate(DOC + "x.", "abc", max_new_tokens=30)
    assert again.token_ids == first.token_ids
    assert again.stats.cached_prefix_tokens == len(tok.encode(DOC + "x.")) - 1


def test_sampling_is_identical_with_and_without_reuse(engine):
    kw = {"temperature": 1.0, "eta": 2.0, "seed": 3}
    engine.generate(DOC + "warm.", "abc", **kw)
    cached = engine.generate(DOC + "q.", "abc", **kw)
    fresh = engine.generate(DOC + "q.", "abc", prefix_cache_bytes=0, **kw)
    assert cached.stats.cached_prefix_tokens > 0 and fresh.stats.cached_prefix_tokens == 0
    assert cached.token_ids == fresh.token_ids


def test_budget_bounds_memory_and_zero_disables(engine):
    engine.generate(DOC + "a.", "abc")
    one_entry = engine.prefix_cache.nbytes
    assert one_entry > 0
    engine.generate("jkl " * 40, "x", prefix_cache_bytes=one_entry * 3 // 2)
    assert engine.prefix_cache.nbytes <= one_entry * 3 // 2
    out = engine.generate(DOC + "b.", "abc", prefix_cache_bytes=0)
    assert out.stats.cached_prefix_tokens == 0


def test_entries_covered_by_a_longer_prompt_are_dropped(target):
    store = PrefixCache()
    buf = torch.zeros(1, 1, 8, 2)
    store.store(target, [1, 2, 3], [[(buf[..., :3, :], buf[..., :3, :])]], 1 << 20)
    store.store(target, [1, 2, 3, 4, 5], [[(buf[..., :5, :], buf[..., :5, :])]], 1 << 20)
    assert len(store) == 1
    n, parts = store.lookup(target, [1, 2, 3, 9])
    assert n == 3 and len(parts) == 1 and parts[0][0][0].shape[-2] == 3
    assert store.lookup(torch.nn.Linear(1, 1), [1, 2]) == (0, [])  # other models never share KV


def test_forgetting_the_draft_keeps_the_targets_prompt(engine, tok):
    """The bench's draft_cold: the draft reads its prompt afresh, the target reuses its own."""
    first = engine.generate(DOC + "x.", "ghi x.")
    assert first.stats.draft_cached_prefix_tokens == 0
    engine.prefix_cache.forget(engine.draft)
    again = engine.generate(DOC + "x.", "ghi x.")
    assert again.stats.draft_cached_prefix_tokens == 0
    assert again.stats.cached_prefix_tokens == len(tok.encode(DOC + "x.")) - 1
    assert again.token_ids == first.token_ids
    warm = engine.generate(DOC + "x.", "ghi x.")
    assert warm.stats.draft_cached_prefix_tokens == len(tok.encode("ghi x.")) - 1


def test_concurrent_calls_match_sequential_ones(engine):
    prompts = [(DOC + q, "def " + q) for q in QUESTIONS * 3]
    sequential = [engine.generate(p, d, prefix_cache_bytes=0).token_ids for p, d in prompts]
    engine.prefix_cache.clear()
    with ThreadPoolExecutor(max_workers=4) as pool:
        parallel = list(pool.map(lambda pd: engine.generate(*pd).token_ids, prompts))
    assert parallel == sequential


def test_weights_changed_in_place_or_converted_never_serve_stale_kv(tok):
    """The store keys on the weights (docs/algorithm.md section 2.8 needs exact KV): after an
    in-place change, a `load_state_dict` or a `.to(dtype)`, the next call prefills afresh and
    equals a run without any prefix cache."""
    model = tiny_llama(len(tok), seed=1)  # its own copy: the session fixtures stay untouched
    engine = RapidEngine(
        model, tokenizer=tok, config=RapidConfig(eta=0.0, max_new_tokens=16, ignore_eos=True)
    )
    prompt = DOC + "what is a."

    def call_after(change) -> None:
        engine.generate(prompt, mode="lc")  # stores the prompt's KV with the current weights
        with torch.no_grad():
            change()
        out = engine.generate(prompt, mode="lc")
        fresh = engine.generate(prompt, mode="lc", prefix_cache_bytes=0)
        assert (
            out.token_ids
            == fresh.token_ids
            == reference_greedy(model, tok.encode(prompt), 16, len(tok))
        )
        assert out.stats.cached_prefix_tokens == 0
        assert engine.generate(prompt, mode="lc").stats.cached_prefix_tokens > 0  # reuse is back

    before = reference_greedy(model, tok.encode(prompt), 16, len(tok))
    call_after(lambda: model.model.layers[0].self_attn.k_proj.weight.mul_(-1.5))
    assert reference_greedy(model, tok.encode(prompt), 16, len(tok)) != before  # KV did change
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.layers.0.self_attn.v_proj.weight"].mul_(2.0)
    call_after(lambda: model.load_state_dict(state))
    call_after(lambda: model.to(torch.float32))


def test_weights_version_tracks_every_kind_of_change(tok):
    model = tiny_llama(len(tok), seed=3)
    v0 = weights_version(model)
    assert weights_version(model) == v0  # reading the weights changes nothing
    with torch.inference_mode():
        model.lm_head.weight.add_(0.0)  # even a write of the same values, even in inference mode
    v1 = weights_version(model)
    assert v1 != v0
    model.to(torch.float64)  # already float64: the same tensors
    assert weights_version(model) == v1
    model.to(torch.float32)
    assert weights_version(model) != v1
