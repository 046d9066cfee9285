"""Prefix KV reuse: identical outputs, real reuse, byte budget, and safety under threads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.prefix_cache import PrefixCache
from tests.tiny import reference_greedy

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
    store.store(target, [1, 2, 3], [(buf[..., :3, :], buf[..., :3, :])], 1 << 20)
    store.store(target, [1, 2, 3, 4, 5], [(buf[..., :5, :], buf[..., :5, :])], 1 << 20)
    assert len(store) == 1
    n, kv = store.lookup(target, [1, 2, 3, 9])
    assert n == 3 and kv[0][0].shape[-2] == 3
    assert store.lookup(object(), [1, 2]) == (0, [])  # other models never share KV


def test_concurrent_calls_match_sequential_ones(engine):
    prompts = [(DOC + q, "def " + q) for q in QUESTIONS * 3]
    sequential = [engine.generate(p, d, prefix_cache_bytes=0).token_ids for p, d in prompts]
    engine.prefix_cache.clear()
    with ThreadPoolExecutor(max_workers=4) as pool:
        parallel = list(pool.map(lambda pd: engine.generate(*pd).token_ids, prompts))
    assert parallel == sequential
