"""Which of the lookup's copies the draft reads (docs/algorithm.md section 2.10): a copy is
read while the chance it is kept, with every copy before it, reaches the draft's token price
(what a token adds to a forward pass, measured once per engine); a lookup not read is learned
from the draft's own pick."""

from __future__ import annotations

import copy

import pytest
import torch

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.runtime.kv import direct
from rapid_integrations.spec_decode.copy_prices import CopyPrices
from rapid_integrations.spec_decode.drafting import token_price
from rapid_integrations.spec_decode.schedule import RunCurve
from tests.test_engine_adaptive import (
    curve_by_hand,
    offering,
    repetitive_prompts,
    slowed,
    vetting,
)
from tests.tiny import greedy_mismatches, reference_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

RUNS = [(10, 3), (10, 10), (4, 0), (10, 2), (1, 1), (10, 5), (6, 6), (10, 3)]
"""(offered, kept) of a few lookups, oldest first."""


def test_the_run_curve_is_the_law_written_out_by_hand():
    curve = RunCurve(10)
    for offered, kept in RUNS:
        curve.learn(offered, kept)
    chances, _ = curve_by_hand([(offered, 0, kept) for offered, kept in RUNS], 10)
    assert curve.kept_chances(10) == pytest.approx(chances.tolist())
    assert curve.kept_chances(4) == pytest.approx(chances[:4].tolist())


def priced(price: float | None, runs: list[tuple[int, int]]) -> CopyPrices:
    """Prices at the draft's token `price` after the lookups `runs`."""
    prices = CopyPrices(10, price)
    for offered, kept in runs:
        prices.learn(offered, kept)
    return prices


@pytest.mark.parametrize(("price", "read"), [(0.06, 10), (0.25, 8), (0.6, 3)])
def test_a_copy_is_read_while_its_chance_reaches_the_token_price(price, read):
    """Copy j is worth reading while the chance that copies 0..j are all kept (the curve by
    hand) is at least the price: three prices, three counts."""
    chances, _ = curve_by_hand([(offered, 0, kept) for offered, kept in RUNS], 10)
    assert int((chances >= price).sum()) == read
    assert priced(price, RUNS).worth(10) == read
    assert priced(price, RUNS).worth(3) == min(3, read)


def test_every_copy_is_read_unpriced_or_below_the_free_price():
    lossy = [(10, 0)] * 20  # no copy ever kept
    assert priced(CopyPrices.FREE * 1.2, lossy).worth(7) == 0
    assert priced(CopyPrices.FREE * 0.8, lossy).worth(7) == 7
    assert priced(None, lossy).worth(7) == 7


def test_copies_priced_at_a_whole_pass_are_never_read():
    """A token that costs a whole pass costs what a kept copy could save."""
    assert priced(1.0, [(10, 10)] * 20).worth(10) == 0


def test_a_lookup_not_offered_is_learned_from_the_draft_own_pick(draft, tok, monkeypatch):
    """With no copy worth offering, the draft drafts alone (one forward pass per pick, the
    greedy drafts its own) and, at commit, learns each lookup it did not offer as a run of one
    copy, kept iff the draft's pick there is that copy."""
    monkeypatch.setattr(CopyPrices, "worth", lambda self, room: 0)
    learned: list[tuple[int, int]] = []
    monkeypatch.setattr(CopyPrices, "learn", lambda self, o, k: learned.append((o, k)))
    ids = tok.encode("b")
    own = reference_greedy(draft, ids, 6, len(tok))
    for first, kept in [(own[1], 1), ((own[1] + 1) % len(tok), 0)]:
        learned.clear()
        proposer = vetting(draft, tok, 0.0, torch.Generator())
        x = direct(proposer.propose(4, 8, offering([first, own[2]], own[:1]))).x
        # Forward passes: the pending token, then one per pick (the last one's bonus row).
        assert x.tolist() == own[:4] and proposer.state.forward_passes == 5
        assert not proposer.copied_at and learned == []
        proposer.commit(4, torch.tensor([5]))
        assert learned == [(1, kept)]


@pytest.mark.parametrize(
    ("ms", "flat_ms", "low", "high"), [(30.0, 0.0, 0.8, 1.0), (0.0, 100.0, 0.0, 0.01)]
)
def test_the_token_price_is_what_a_token_adds_over_a_one_token_pass(
    draft, tok, ms, flat_ms, low, high, monkeypatch
):
    """A pass slowed by `ms` per token and `flat_ms` a pass (the tiny model's own time, about
    a millisecond, on top): the price is (t_9 - t_1) / (8 t_1), about ms / (flat_ms + ms + 1).
    The slowdowns are long enough that a sleep's jitter (0.1 ms or so) stays far inside the
    bounds: slowed by 10 ms a pass, a price measured 0.011 once in 15."""
    slowed(draft, flat_ms / 1000, monkeypatch, per_token=ms / 1000)
    price = token_price(draft, len(tok), None)
    assert price is not None and low <= price <= high


def engine_priced_at(target, tok, ms: float, flat_ms: float, config, monkeypatch) -> RapidEngine:
    """An engine whose draft, the target's own copy, was slowed while the engine measured its
    token price (and runs at full speed after)."""
    draft = copy.deepcopy(target)
    with monkeypatch.context() as patch:
        slowed(draft, flat_ms / 1000, patch, per_token=ms / 1000)
        return RapidEngine(target, draft, tokenizer=tok, config=config)


def test_a_draft_priced_per_token_reads_fewer_copies(tok, target, monkeypatch):
    """On prompts whose pieces repeat, a draft whose token costs about a pass (price 0.9)
    reads and keeps far fewer of the copies the lookup finds than one priced below `FREE`,
    which reads them all (measured: none read, against 909 read and 31 kept); the output is
    the target's greedy decoding either way, and two calls on one engine read the same
    copies (the price is the engine's)."""
    read, kept = {}, {}
    for name, ms, flat_ms in [("flat", 0.0, 10.0), ("per token", 10.0, 0.0)]:
        engine = engine_priced_at(target, tok, ms, flat_ms, RapidConfig(eta=0.0), monkeypatch)
        read[name] = kept[name] = 0
        for prompt, draft_prompt in repetitive_prompts(4, seed=3):
            outs = [
                engine.generate(prompt, draft_prompt, max_new_tokens=40, ignore_eos=True)
                for _ in range(2)
            ]
            assert outs[0].stats.lookup_offered_tokens == outs[1].stats.lookup_offered_tokens
            out = outs[0]
            assert greedy_mismatches(target, tok.encode(prompt), out.token_ids, len(tok)) == []
            read[name] += out.stats.lookup_offered_tokens
            kept[name] += out.stats.lookup_drafted_tokens
    assert read["flat"] > 3 * read["per token"] and kept["flat"] > 3 * kept["per token"]


def test_a_seeded_sampled_call_repeats_whatever_the_engine_token_price(tok, target, monkeypatch):
    """Copies read consume a sampled call's draws, and the price is measured per engine: a
    seeded call reads every copy offered, so it repeats draw for draw on an engine whose draft
    was priced per token and on one priced per pass."""
    config = RapidConfig(eta=2.0, temperature=1.0, seed=7)
    prompt, draft_prompt = repetitive_prompts(1, seed=3)[0]
    outs = [
        engine_priced_at(target, tok, ms, flat_ms, config, monkeypatch).generate(
            prompt, draft_prompt, max_new_tokens=40, ignore_eos=True
        )
        for ms, flat_ms in [(0.0, 10.0), (10.0, 0.0)]
    ]
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].stats.lookup_offered_tokens == outs[1].stats.lookup_offered_tokens > 0
