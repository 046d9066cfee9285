"""The `magicdec` bench method (bench/magicdec.py): the target drafting for itself over the
attention sinks and recent window of its prompt, verified at eta 0, writes lc's greedy text."""

from __future__ import annotations

import random

import pytest

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.bench.magicdec import SINKS, WINDOW, self_drafting, streaming_ids
from rapid_integrations.bench.methods import Method, measure_engine
from rapid_integrations.bench.probe import ForwardProbe
from rapid_integrations.tokens import encode_prompt
from tests.tiny import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


def test_the_streaming_selection_keeps_the_sinks_and_the_recent_window():
    ids = list(range(1000))
    kept = streaming_ids(ids)
    assert kept == [*range(SINKS), *range(1000 - WINDOW, 1000)] and len(kept) == 528
    assert streaming_ids(ids[:528]) == ids[:528]  # fits: the whole prompt
    assert streaming_ids([7, 8, 9, 10, 11], sinks=1, window=2) == [7, 10, 11]


@pytest.fixture(scope="module")
def engine(tok, draft):
    """A tiny target with room for a prompt longer than sinks + window, and a separate draft
    (which magicdec must not use)."""
    target = tiny_llama(len(tok), seed=1, window=2048)
    config = RapidConfig(max_new_tokens=40, ignore_eos=True, temperature=0.0)
    return RapidEngine(target, draft, tokenizer=tok, config=config)


def test_magicdec_writes_the_targets_greedy_tokens(engine, tok):
    rng = random.Random(0)
    prompt = "".join(rng.choice("abcdefghijkl .") for _ in range(900))
    ids = encode_prompt(prompt, tok, engine.vocab_size)
    assert len(ids) > SINKS + WINDOW
    separate: list[int] = []
    hook = engine.draft.register_forward_hook(lambda *_: separate.append(1))
    with ForwardProbe([engine.target, engine.draft]) as probe:
        lc = measure_engine(engine, Method("lc"), prompt, None, probe, temperature=0.0)
        magic = measure_engine(engine, Method.of("magicdec"), prompt, None, probe, temperature=0.0)
    hook.remove()
    assert not separate  # the draft is the target itself: the separate draft never ran
    assert magic.new_tokens == lc.new_tokens == 40
    assert magic.answer == lc.answer  # eta 0: token for token
    stats = magic.engine_stats
    assert stats is not None and stats["mode"] == "rapid" and stats["eta"] == 0.0
    assert magic.draft_context_tokens == SINKS + WINDOW and magic.drafted_tokens > 0
    assert stats["lookup_drafted_tokens"] == 0  # its own drafts only, no copies
    twin = self_drafting(engine)
    assert twin.draft is engine.target and twin is self_drafting(engine)
    assert twin.prefix_cache is engine.prefix_cache
