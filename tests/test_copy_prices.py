"""Which of the lookup's copies the draft reads (docs/algorithm.md section 2.10): a copy is
offered while the chance it is kept, with every copy before it, pays for the seconds it adds
to the draft's forward pass; a lookup not offered is learned from the draft's own pick."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.kv import direct
from rapid_integrations.schedule import CopyPrices, RunCurve
from tests.test_engine_adaptive import (
    curve_by_hand,
    offering,
    repetitive_prompts,
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


def priced(pass_ms: dict[int, float], runs: list[tuple[int, int]]) -> CopyPrices:
    """Prices after draft passes of each width (tokens: ms, three of each) and `runs`."""
    prices = CopyPrices(10, priced=True)
    for _ in range(3):
        for tokens, ms in pass_ms.items():
            prices.timed(tokens, ms / 1000)
    for offered, kept in runs:
        prices.learn(offered, kept)
    return prices


@pytest.mark.parametrize("per_token_ms", [1.0, 5.0, 12.0])
def test_a_copy_is_offered_while_its_chance_pays_for_the_token_it_adds(per_token_ms):
    """A one-token pass takes 20 ms and each token more `per_token_ms`: copy j is worth
    offering while the chance that copies 0..j are all kept (the curve by hand) times 20 ms
    is at least `per_token_ms`."""
    prices = priced({1: 20.0, 11: 20.0 + 10 * per_token_ms}, RUNS)
    chances, _ = curve_by_hand([(offered, 0, kept) for offered, kept in RUNS], 10)
    want = int((chances * 20.0 >= per_token_ms).sum())
    assert prices.worth(10) == want
    assert prices.worth(3) == min(3, want)
    assert {1.0: 10, 5.0: 8, 12.0: 3}[per_token_ms] == want  # the three regimes differ


def test_every_copy_is_offered_unpriced_or_before_the_line_has_a_slope():
    lossy = [(10, 0)] * 20  # no copy ever kept
    assert priced({1: 20.0, 11: 120.0}, lossy).worth(7) == 0
    unpriced = CopyPrices(10, priced=False)
    unpriced.timed(1, 0.020)
    unpriced.timed(11, 0.120)
    unpriced.learn(10, 0)
    assert unpriced.worth(7) == 7
    assert priced({1: 20.0}, lossy).worth(7) == 7  # one width: no slope yet
    assert priced({}, lossy).worth(7) == 7  # no pass at all


def test_copies_that_cost_a_whole_pass_each_are_never_offered():
    """Seconds in proportion to the tokens read: a copy costs what it could save."""
    assert priced({1: 10.0, 11: 110.0}, [(10, 10)] * 20).worth(10) == 0


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
        x, _ = direct(proposer.propose(4, 8, offering([first, own[2]], own[:1])))
        # Forward passes: the pending token, then one per pick (the last one's bonus row).
        assert x.tolist() == own[:4] and proposer.state.forward_passes == 5
        assert proposer.copies == 0 and learned == []
        proposer.commit(4, 4, torch.tensor([5]))
        assert learned == [(1, kept)]


def slowed_per_token(model: torch.nn.Module, ms: float, flat_ms: float, monkeypatch) -> None:
    """Every forward pass of `model` takes `flat_ms` plus `ms` per token it reads longer."""
    forward = model.forward

    def slow(*args, **kwargs):
        time.sleep((flat_ms + ms * kwargs["input_ids"].shape[-1]) / 1000)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", slow)


@pytest.mark.slow
def test_a_draft_whose_pass_grows_with_its_tokens_reads_fewer_copies(tok, target, monkeypatch):
    """The target's own copy drafts, on prompts whose pieces repeat: where a token costs as
    much as a pass, the draft reads and keeps far fewer of the copies the lookup finds than
    where a pass costs the same at any width (measured: 114 against 380 read, 2 against 28
    kept; it still reads some before its passes differ in width); the output is the target's
    greedy decoding either way."""
    draft = copy.deepcopy(target)
    engine = RapidEngine(target, draft, tokenizer=tok, config=RapidConfig(eta=0.0))
    read, kept = {}, {}
    for name, ms, flat_ms in [("flat", 0.0, 10.0), ("per token", 10.0, 0.0)]:
        read[name] = kept[name] = 0
        with monkeypatch.context() as patch:
            slowed_per_token(draft, ms, flat_ms, patch)
            for prompt, draft_prompt in repetitive_prompts(4, seed=3):
                out = engine.generate(prompt, draft_prompt, max_new_tokens=40, ignore_eos=True)
                assert greedy_mismatches(target, tok.encode(prompt), out.token_ids, len(tok)) == []
                read[name] += out.stats.lookup_offered_tokens
                kept[name] += out.stats.lookup_drafted_tokens
    assert read["flat"] > 2 * read["per token"] and kept["flat"] > 3 * kept["per token"]


def test_a_seeded_sampled_call_repeats_whatever_its_passes_cost(tok, target, monkeypatch):
    """Which copies are priced worth reading follows the wall time, and in a sampled call the
    copies read consume draws: a seeded call reads every copy offered, so it repeats draw for
    draw on a draft whose passes cost the same at any width and on one whose every token costs
    a pass."""
    draft = copy.deepcopy(target)
    config = RapidConfig(eta=2.0, temperature=1.0, seed=7)
    engine = RapidEngine(target, draft, tokenizer=tok, config=config)
    prompt, draft_prompt = repetitive_prompts(1, seed=3)[0]
    outs = []
    for ms, flat_ms in [(0.0, 10.0), (10.0, 0.0)]:
        with monkeypatch.context() as patch:
            slowed_per_token(draft, ms, flat_ms, patch)
            outs.append(engine.generate(prompt, draft_prompt, max_new_tokens=40, ignore_eos=True))
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].stats.lookup_offered_tokens == outs[1].stats.lookup_offered_tokens > 0
