"""docs/algorithm.md sections 2.9 and 2.10 on tiny random models: adaptive drafting and the
lookup proposer change how many drafts each pass gets and who makes them, never the output's
law: eta = 0 greedy is the target's own greedy decoding, eta = 0 sampling follows p, and at
eta > 0 the draft vets copies, so a copied position follows a model draft's law."""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest
import torch

from rapid_integrations import RapidConfig, RapidConfigError, RapidEngine
from rapid_integrations.runtime.kv import KVState, direct
from rapid_integrations.spec_decode.drafting import LookupProposer, ModelProposer
from rapid_integrations.spec_decode.schedule import GammaSchedule, PassRecord
from tests import oracle
from tests.seeded import position_counts
from tests.test_engine_distribution import assert_follows
from tests.test_engine_exact import random_prompts
from tests.tiny import greedy_mismatches, next_token_probs, reference_greedy

SETTINGS = [
    {"draft_confidence_threshold": 0.5},
    {"draft_confidence_threshold": 0.9, "gamma": 12},
    {"adaptive_gamma": True, "gamma": 1, "gamma_max": 6},
    {"adaptive_gamma": True, "gamma": 8, "gamma_max": 12, "draft_confidence_threshold": 0.3},
    {"lookup_ngram": 2},
    {"lookup_ngram": 3, "adaptive_gamma": True, "draft_confidence_threshold": 0.6},
    {"adaptive_gamma": "measured", "gamma_max": 10, "speculate_min_context": "auto"},
]


# Tiny models, thousands of small calls: two torch threads only add synchronization, which
# on a busy machine made one sampling test here take 450 s instead of 5 (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def repetitive_prompts(n: int, seed: int) -> list[tuple[str, str]]:
    """Prompts whose pieces repeat, so that n-gram lookups find matches."""
    return [(prompt * 3, draft * 2) for prompt, draft in random_prompts(n, seed)]


@pytest.mark.parametrize(
    "options", SETTINGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items())
)
@pytest.mark.parametrize("kind", ["self", "separate"])
def test_eta0_greedy_equals_target_greedy(engines, target, tok, options, kind, monkeypatch):
    engine = engines[kind]
    drafted = lookup = 0
    offered = spy_on_copies(monkeypatch)
    for i, (prompt, draft_prompt) in enumerate(repetitive_prompts(6, seed=len(options))):
        mode = "sd" if i % 3 == 2 else "rapid"
        out = engine.generate(prompt, draft_prompt, mode=mode, **options)
        # The target's greedy decoding without a cache, in one pass (tests/tiny.py).
        wrong = greedy_mismatches(target, tok.encode(prompt), out.token_ids, len(tok))
        assert wrong == [] and len(out.token_ids) == 24, (kind, options, mode, prompt)
        s = out.stats
        assert s.accepted_tokens + s.target_forward_passes == s.new_tokens == 24
        # One draft forward pass per token the model picked (and, in a pass that ends on
        # copies, the one that read them): copied drafts cost none of their own.
        picked = s.drafted_tokens - s.lookup_drafted_tokens
        assert picked <= s.draft_forward_passes <= picked + s.target_forward_passes
        drafted, lookup = drafted + s.drafted_tokens, lookup + s.lookup_drafted_tokens
    if options.get("lookup_ngram"):
        assert sum(offered) > 0 and lookup < drafted  # copies offered; the model drafted
        assert lookup > 0 or kind == "separate"  # the random draft may keep none


def spy_on_copies(monkeypatch) -> list[int]:
    """How many copies each lookup offered, appended as the engine looks them up."""
    real, offered = LookupProposer.find, []

    def find(self, drafts, room):
        found = real(self, drafts, room)
        offered.append(len(found))
        return found

    monkeypatch.setattr(LookupProposer, "find", find)
    return offered


def test_adaptive_gamma_grows_on_full_acceptance(tok, target):
    """The target drafting for itself on its own prompt is always accepted: gamma climbs by 2
    per pass to gamma_max, so 30 tokens take fewer passes than at the starting gamma."""
    engine = RapidEngine(
        target, tokenizer=tok, config=RapidConfig(eta=0.0, max_new_tokens=30, ignore_eos=True)
    )
    fixed = engine.generate("abc abc", mode="sd", gamma=2).stats
    grown = engine.generate("abc abc", mode="sd", gamma=2, adaptive_gamma=True, gamma_max=10).stats
    assert fixed.target_forward_passes == 10  # 3 tokens per pass
    # gamma 2, 4, 6, 8, 10: 3 + 5 + 7 + 9 = 24 tokens in 4 passes, then 6 more in one.
    assert grown.target_forward_passes == 5


def test_gamma_schedule_follows_the_heuristic():
    schedule = GammaSchedule(RapidConfig(gamma=4, adaptive_gamma=True, gamma_max=7))
    steps = [(4, 4, 4), (6, 6, 6), (7, 7, 2), (6, 3, 3), (6, 6, 0), (5, 5, 0)]
    seen = []
    for asked, drafted, accepted in steps:
        assert schedule.gamma == asked
        schedule.update(PassRecord(asked, drafted, accepted))
        seen.append(schedule.gamma)
    # +2 (capped at 7), -1 on a rejection, unchanged when the drafter stopped early.
    assert seen == [6, 7, 6, 6, 5, 4]
    # Copies the draft kept come on top of the picks asked for (section 2.10): all 4 picks
    # and 3 copies kept is a pass that drafted all it asked for; 3 picks and 1 copy is not.
    for picks, copies, grown in [(4, 3, 6), (3, 1, 4)]:
        copying = GammaSchedule(RapidConfig(gamma=4, adaptive_gamma=True, gamma_max=7))
        copying.update(PassRecord(4, picks + copies, picks + copies, copied=copies))
        assert copying.gamma == grown
    fixed = GammaSchedule(RapidConfig(gamma=4))
    fixed.update(PassRecord(4, 4, 4))
    assert fixed.gamma == 4
    floor = GammaSchedule(RapidConfig(gamma=1, adaptive_gamma=True))
    floor.update(PassRecord(1, 1, 0))
    assert floor.gamma == 1


def curve_by_hand(passes: list[tuple[int, int, int]], size: int) -> tuple[np.ndarray, float]:
    """The acceptance curve and copies per pick of `passes` ((drafted, copied, accepted) each,
    oldest first), written out from docs/algorithm.md 2.9: each verdict and copy weighs 0.97
    less per later verdict; draft j is rejected at rate (rejections at j + 4 h) / (passes
    reaching j + 4), h = (rejections + 1/2) / (verdicts + 1). Returns the chance that drafts
    0..j are all kept, for each j < size."""
    reached, rejected = np.zeros(size), np.zeros(size)
    copies = picks = 0.0
    for drafted, copied, accepted in passes:
        missed = accepted < drafted
        fade = 0.97 ** (accepted + missed)
        reached, rejected = reached * fade, rejected * fade
        copies, picks = copies * fade + copied, picks * fade + drafted - copied
        reached[: accepted + missed] += 1
        if missed:
            rejected[accepted] += 1
    pooled = (rejected.sum() + 0.5) / (reached.sum() + 1)
    return np.cumprod(1 - (rejected + 4 * pooled) / (reached + 4)), copies / picks


def best_gamma_by_hand(
    passes: list[tuple[int, int, int]],
    per_draft: float,
    plain: float,
    gamma_max: int,
    slope: float = 0.0,
    most_copies: int = 0,
    offset: float = 0.0,
) -> int:
    """argmax over g of E(D) / (plain + g x per_draft + offset + D x slope), D = g + min(c g,
    most_copies) drafts with c the copies per pick, E from `curve_by_hand` (a fraction of a
    draft counts its share of the next one)."""
    survive, per_pick = curve_by_hand(passes, gamma_max + most_copies)

    def rate(g: int) -> float:
        drafts = g + min(g * per_pick, most_copies)
        whole = int(drafts)
        part = (drafts - whole) * survive[whole] if drafts > whole else 0.0
        tokens = 1 + survive[:whole].sum() + part
        return tokens / (plain + g * per_draft + offset + drafts * slope)

    return max(range(1, gamma_max + 1), key=rate)


@pytest.mark.parametrize(
    ("draft_step", "verify_extra", "accepted", "want_small"),
    [(0.001, 0.0, 4, False), (0.05, 0.01, 1, True), (0.004, 0.002, 3, False)],
)
def test_measured_gamma_maximizes_expected_tokens_per_second(
    draft_step, verify_extra, accepted, want_small
):
    """Passes of 4 drafts with `accepted` kept each: after every pass gamma is the argmax of
    expected tokens per second from the decayed acceptance curve and the measured costs
    (plain step 0.1 s)."""
    schedule = GammaSchedule(RapidConfig(gamma=4, adaptive_gamma="measured", gamma_max=20))
    assert schedule.gamma == 0  # the timed plain step comes first
    schedule.update(PassRecord(0, 0, 0, 0.0, 0.1))
    passes = []
    for _ in range(6):
        schedule.update(
            PassRecord(schedule.gamma, 4, accepted, 4 * draft_step, 0.1 + 4 * verify_extra)
        )
        passes.append((4, 0, accepted))
        want = best_gamma_by_hand(passes, draft_step + verify_extra, 0.1, 20)
        assert schedule.gamma == want
    assert (schedule.gamma <= 2) is want_small


@pytest.mark.parametrize("copied", [0, 2, 6])
def test_measured_gamma_counts_the_copies_a_pick_brings(copied):
    """Passes of 3 picks and `copied` copies the draft kept (section 2.10), cut at draft 4
    when they hold more: copies cost the verify slope but no draft step, so each pick is worth 1 + copies / 3
    drafts and gamma follows the hand-computed argmax, where copies move it."""
    cfg = RapidConfig(gamma=3, adaptive_gamma="measured", gamma_max=24, lookup_tokens=10)
    schedule = GammaSchedule(cfg)
    schedule.update(PassRecord(0, 0, 0, 0.0, 0.1))
    passes, moved = [], False
    for _ in range(5):
        drafted = 3 + copied
        schedule.update(
            PassRecord(3, drafted, min(4, drafted), 3 * 0.02, 0.1 + drafted * 0.002, 3, copied)
        )
        passes.append((drafted, copied, min(4, drafted)))
        assert schedule.gamma == best_gamma_by_hand(passes, 0.02, 0.1, 24, 0.002, 10)
        # Priced as if a pass held its picks only, gamma would differ: copies moved it.
        moved |= schedule.gamma != best_gamma_by_hand(passes, 0.02, 0.1, 24, 0.002, 0)
    assert moved is bool(copied)


def verify_line_by_hand(widths: list[int], extra: list[float]) -> tuple[float, float]:
    """docs/algorithm.md 2.9: numpy's least-squares line through (drafts, verify seconds over
    the plain step), unless the widths' standard deviation is below 2 or the line's offset or
    slope is negative; then the slope through 0."""
    if np.std(widths) >= 2:
        slope, offset = np.polyfit(widths, extra, 1)
        if min(slope, offset) >= 0:
            return offset, slope
    return 0.0, sum(extra) / sum(widths)


@pytest.mark.parametrize("curve", ["jump", "convex"])
def test_measured_gamma_prices_a_verify_pass_by_its_line(curve):
    """Passes of 4 picks and 0-8 copies whose verify pass costs 30 ms + 2 ms a draft over
    the plain step (fp32 4K's shape: a jump, then a slow climb) or 0.5 ms x drafts^2 (a
    line's offset would be negative: priced through 0). After every pass the line and gamma
    equal the hand-computed ones; with the jump, once the widths spread, gamma is longer than
    a slope through 0 would make it."""
    cfg = RapidConfig(gamma=4, adaptive_gamma="measured", gamma_max=24, lookup_tokens=10)
    schedule = GammaSchedule(cfg)
    schedule.update(PassRecord(0, 0, 0, 0.0, 0.05))
    passes, widths, extra, longer = [], [], [], False
    for copied in [0, 2, 4, 8, 1, 6, 3, 8]:
        drafted = 4 + copied
        cost = 0.03 + 0.002 * drafted if curve == "jump" else 0.0005 * drafted**2
        schedule.update(PassRecord(4, drafted, drafted - 1, 4 * 0.02, 0.05 + cost, 4, copied))
        passes.append((drafted, copied, drafted - 1))
        widths.append(drafted)
        extra.append(cost)
        offset, slope = verify_line_by_hand(widths, extra)
        assert schedule.costs.verify_line() == pytest.approx((offset, slope), abs=1e-9)
        want = best_gamma_by_hand(passes, 0.02, 0.05, 24, slope, 10, offset)
        assert schedule.gamma == want
        through_zero = best_gamma_by_hand(passes, 0.02, 0.05, 24, sum(extra) / sum(widths), 10)
        longer |= want > through_zero
    assert longer is (curve == "jump")


def test_acceptance_in_runs_reads_longer_than_one_rate_says():
    """Passes cut at draft 6 of 8 or kept whole: the curve says the first 6 drafts are nearly
    always kept, so E(8) is above the single-rate formula's at the same pooled rate."""
    from rapid_integrations.bench.model_draft import expected_tokens

    costs = GammaSchedule(RapidConfig(adaptive_gamma="measured", gamma_max=8)).costs
    costs.record(0, 0, 0.0, 0.1)
    kept = [8, 6, 8, 8, 6, 8] * 3
    for accepted in kept:
        costs.record(8, accepted, 0.01, 0.1)
    survive, _ = curve_by_hand([(8, 0, accepted) for accepted in kept], 8)
    assert costs.expected_tokens(8) == pytest.approx(1 + survive.sum())
    assert costs.expected_tokens(7.5) == pytest.approx(1 + survive[:7].sum() + survive[7] / 2)
    rate = (6 * 6 + 12 * 8) / (6 * 7 + 12 * 8)  # kept over verdicts: 0.957, E(8) = 7.6
    assert costs.expected_tokens(8) > expected_tokens(rate, 8) + 0.25
    assert costs.expected_tokens(6) > 6.4  # 1 + six drafts kept about 98% of the time each


def test_measured_gamma_shrinks_for_a_slow_draft_and_grows_for_a_slow_target(
    tok, target, monkeypatch
):
    """The target's copy drafts (every draft accepted). Its steps slowed 30 ms against a tiny
    target: one draft per pass pays best. The target slowed instead: gamma climbs to
    gamma_max and the call needs a few passes. Both stay the target's greedy output."""
    prompt, n = "abcdefghijkl" * 2, 30
    want = reference_greedy(target, tok.encode(prompt), n, len(tok))
    # The lookup off: copies would add drafts that cost no draft step (section 2.10).
    options = {"adaptive_gamma": "measured", "gamma_max": 12, "ignore_eos": True, "lookup_ngram": 0}
    for slow, most_passes in [("draft", None), ("target", 6)]:
        draft = copy.deepcopy(target)
        engine = RapidEngine(
            target, draft, tokenizer=tok, config=RapidConfig(eta=0.0, max_new_tokens=n, gamma=4)
        )
        with monkeypatch.context() as patch:
            slowed(draft if slow == "draft" else target, 0.03, patch)
            out = engine.generate(prompt, prompt, **options)
        assert out.token_ids == want
        passes = out.stats.target_forward_passes
        if most_passes:
            assert passes <= most_passes
        else:  # the plain step, one pass of 4 drafts, then one draft a pass
            assert out.stats.drafted_tokens == 4 + (passes - 2)


@pytest.mark.parametrize(("threshold", "proposed"), [(0.0, 6), (1.0, 1)])
def test_draft_stops_after_a_token_below_the_confidence_threshold(tok, draft, threshold, proposed):
    """Threshold 1 is never reached by a spread-out q: the first draft is proposed and drafting
    stops (as transformers' ConfidenceCriteria, the doubtful token itself is kept); the cache
    then follows the verdict as after a full proposal."""
    from rapid_integrations.runtime.kv import KVState, direct
    from rapid_integrations.spec_decode.drafting import ModelProposer

    cfg = RapidConfig(eta=0.0, draft_confidence_threshold=threshold)
    prompt = tok.encode("abc hij kl")
    state = KVState.start(draft, prompt, len(tok), chunk=4, capacity=len(prompt) + 20)
    proposer = ModelProposer(state, cfg, torch.Generator())
    x = direct(proposer.propose(6)).x
    want = reference_greedy(draft, prompt, 6, len(tok))
    assert x.tolist() == want[:proposed] and state.forward_passes == proposed
    token = torch.tensor([3])
    proposer.commit(len(x), token)
    context = prompt + x.tolist() + [3]
    assert direct(proposer.propose(1)).x.tolist() == reference_greedy(draft, context, 1, len(tok))


def test_lookup_proposes_the_latest_continuation_of_the_longest_suffix():
    lookup = LookupProposer(corpus=[5, 6, 7, 8], sequence=[1, 2, 3, 9, 2, 3], ngram=3)
    assert lookup.find([], 4) == [9, 2, 3]  # (2, 3) was followed by 9 in the sequence
    lookup.extend(torch.tensor([4]))  # sequence ... 2 3 4: (3, 4) never occurred before
    assert lookup.find([], 4) == []
    lookup.extend(torch.tensor([5, 6]))  # (5, 6) occurred in the corpus, followed by 7, 8
    assert lookup.find([], 2) == [7, 8]
    lookup.extend(torch.tensor([1, 2, 3]))  # (1, 2, 3) matches the start of the sequence
    assert lookup.find([], 3) == [9, 2, 3]
    # Drafts not committed extend the suffix: ... 2 3 + (9, 2) matches (3, 9, 2), then 3 4 ...
    assert lookup.find([9, 2], 4) == [3, 4, 5, 6]
    assert lookup.find([4], 2) == [5, 6] and lookup.find([8], 2) == []


def test_lookup_never_matches_across_the_seam_of_corpus_and_sequence():
    lookup = LookupProposer(corpus=[1, 2], sequence=[3, 4, 1, 2], ngram=2)
    # (2, 3) spans the seam and must not exist; (1, 2) at the corpus end has no continuation.
    assert lookup.find([], 3) == []


def test_speculation_below_min_context_is_target_alone(engines, target, tok):
    engine = engines["separate"]
    short, long_ = "abc", "abcdefghijkl" * 2
    out = engine.generate(short, "ab", speculate_min_context=10)
    assert out.stats.mode == "lc" and out.stats.drafted_tokens == 0
    assert out.token_ids == reference_greedy(target, tok.encode(short), 24, len(tok))
    on = engine.generate(long_, "ab", speculate_min_context=10)
    assert on.stats.mode == "rapid" and on.stats.drafted_tokens > 0


def test_auto_payoff_stops_drafting_only_when_it_loses():
    """One plain step of 10 ms is 100 tok/s. Four drafting passes emitting 1 token in 50 ms
    each (20 tok/s) lose: gamma is 0 from then on. Passes emitting 5 tokens in 20 ms
    (250 tok/s) win: gamma stays."""
    cfg = RapidConfig(gamma=4, speculate_min_context="auto")
    for emitted, seconds, stops in [(1, 0.05, True), (5, 0.02, False)]:
        schedule = GammaSchedule(cfg)
        assert schedule.gamma == 0  # the timed plain step comes first
        schedule.update(PassRecord(0, 0, 0, 0.0, 0.01))
        for _ in range(GammaSchedule.PAYOFF_PASSES - 1):
            assert schedule.gamma == 4
            schedule.update(PassRecord(4, 4, emitted - 1, seconds))
        assert schedule.gamma == 4 and not schedule.stopped  # not judged before 4 passes
        schedule.update(PassRecord(4, 4, emitted - 1, seconds))
        assert schedule.stopped is stops
        assert schedule.gamma == (0 if stops else 4)


def test_auto_payoff_needs_a_losing_streak(monkeypatch):
    """A pass not expected to lose ends the streak: drafting stops only after PAYOFF_PASSES
    passes in a row expected below 0.95x plain steps (a short bad stretch of text does not
    end it, nor does a pass expected at 0.97x: within what the estimate can tell). Every
    pass emits 3 tokens in 100 ms, 0.3x the plain steps' 100 tok/s."""
    schedule = GammaSchedule(RapidConfig(gamma=4, speculate_min_context="auto"))
    schedule.update(PassRecord(0, 0, 0, 0.0, 0.01))
    expected = iter([0.9, 0.9, 0.9, 0.97, 0.9, 0.9, 0.9, 0.9])
    monkeypatch.setattr(schedule.costs, "speedup", lambda gamma: next(expected))
    for _ in range(7):
        schedule.update(PassRecord(4, 4, 2, 0.05, 0.05))
        assert not schedule.stopped and schedule.gamma == 4
    schedule.update(PassRecord(4, 4, 2, 0.05, 0.05))
    assert schedule.stopped and schedule.gamma == 0


def test_auto_payoff_needs_the_drafting_so_far_to_have_lost(monkeypatch):
    """8 passes emit 5 tokens in 20 ms (2.5x the plain steps' 100 tok/s), then passes emit 1
    in 50 ms, each expected to lose. Drafting stops at the first of them after which the
    drafting passes so far emitted below 0.95x: (40 + k) tokens in 0.16 + 0.05 k seconds is
    0.95 x 100 tok/s at k = 6.6, so at k = 7."""
    schedule = GammaSchedule(RapidConfig(gamma=4, speculate_min_context="auto"))
    schedule.update(PassRecord(0, 0, 0, 0.0, 0.01))
    for _ in range(8):
        schedule.update(PassRecord(4, 4, 4, 0.01, 0.01))
    monkeypatch.setattr(schedule.costs, "speedup", lambda gamma: 0.5)
    for k in range(1, 8):
        schedule.update(PassRecord(4, 4, 0, 0.04, 0.01))
        assert schedule.stopped is (k == 7)


def test_pass_seconds_count_draft_passes_beyond_the_drafts():
    """Passes of 4 drafts in 5 draft forward passes (the bonus row's, section 2.7): a draft
    forward costs 10 ms, so a pass of g drafts costs the plain step, g x (10 ms + the verify
    slope) and one more forward."""
    costs = GammaSchedule(RapidConfig(adaptive_gamma="measured", gamma_max=8)).costs
    costs.record(0, 0, 0.0, 0.060)
    for _ in range(3):
        costs.record(4, 4, 0.050, 0.060 + 4 * 0.002, draft_passes=5)
    for g in (1, 4, 8):
        assert costs.pass_seconds(g) == pytest.approx(0.060 + g * (0.010 + 0.002) + 0.010)


def test_the_schedule_times_passes_with_copies(engines, monkeypatch):
    """Every pass, with copies or without, reaches the gamma schedule with the copies the
    draft kept in it (section 2.9), each kept copy counted once."""
    real, seen = GammaSchedule.update, []

    def update(self, done):
        seen.append(done.copied)
        real(self, done)

    monkeypatch.setattr(GammaSchedule, "update", update)
    copied = 0
    for prompt, draft_prompt in repetitive_prompts(3, seed=2):
        seen.clear()
        out = engines["self"].generate(prompt, draft_prompt, lookup_ngram=2, max_new_tokens=60)
        assert len(seen) == out.stats.target_forward_passes
        assert sum(seen) == out.stats.lookup_drafted_tokens
        copied += sum(seen)
    assert copied > 0


def test_pass_seconds_price_copies_at_the_verify_slope_while_every_pass_has_copies():
    """Passes of 4 picks and 4 copies the draft kept, in 5 draft forward passes: a pass of g
    picks is expected to hold g + min(g, 10) drafts (one copy per pick, at most
    lookup_tokens), each costing the 2 ms verify slope, and g + 1 forwards of 10 ms (with no
    pass free of copies there is nothing to tell a copy's share of a forward from a pick's)."""
    cfg = RapidConfig(adaptive_gamma="measured", gamma_max=16, lookup_tokens=10)
    costs = GammaSchedule(cfg).costs
    costs.record(0, 0, 0.0, 0.060)
    for _ in range(3):
        costs.record(8, 8, 0.050, 0.060 + 8 * 0.002, draft_passes=5, copied=4)
    for g, drafts in [(1, 2), (4, 8), (16, 26)]:
        assert costs.expected_drafts(g) == pytest.approx(drafts)
        assert costs.pass_seconds(g) == pytest.approx(0.060 + (g + 1) * 0.010 + drafts * 0.002)


def test_a_copy_costs_what_it_adds_to_the_draft_pass_that_reads_it():
    """Passes of 4 picks in 5 draft forward passes: 50 ms without copies (10 ms a forward),
    70 ms with 4 copies the draft kept (5 ms a copy). A pass of g picks is expected to cost
    g + 1 forwards of 10 ms, 5 ms per expected copy (`expected_drafts` - g: about 2 per 4
    picks, as recent passes weigh more), and the 2 ms verify slope per draft; an average
    forward (12 ms) would charge copies to picks."""
    cfg = RapidConfig(adaptive_gamma="measured", gamma_max=16, lookup_tokens=10)
    costs = GammaSchedule(cfg).costs
    costs.record(0, 0, 0.0, 0.060)
    for copied in [0, 4, 0, 4]:
        drafted = 4 + copied
        costs.record(drafted, drafted, 0.050 + copied * 0.005, 0.060 + drafted * 0.002, 5, copied)
    assert costs.draft_costs() == pytest.approx((0.010, 0.005))
    for g in (1, 4, 12):
        copies = costs.expected_drafts(g) - g
        assert 0.4 * g < copies < 0.6 * g
        want = 0.060 + (g + 1) * 0.010 + copies * 0.005 + (g + copies) * 0.002
        assert costs.pass_seconds(g) == pytest.approx(want)


def slowed(
    model: torch.nn.Module, seconds: float, monkeypatch: pytest.MonkeyPatch, per_token: float = 0.0
) -> None:
    """Every forward pass of `model` takes `seconds` plus `per_token` seconds per token it
    reads longer (restored after the test)."""
    forward = model.forward

    def slow(*args, **kwargs):
        time.sleep(seconds + per_token * kwargs["input_ids"].shape[-1])
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", slow)


def test_auto_stops_a_draft_slower_than_the_target_and_stays_exact(tok, target, draft, monkeypatch):
    engine = RapidEngine(
        target, draft, tokenizer=tok, config=RapidConfig(eta=0.0, max_new_tokens=24)
    )
    slowed(draft, 0.02, monkeypatch)  # a draft step 10x+ a tiny target step
    prompt = "abcdefghijkl" * 2
    out = engine.generate(prompt, "abc", speculate_min_context="auto", ignore_eos=True)
    assert out.token_ids == reference_greedy(target, tok.encode(prompt), 24, len(tok))
    assert out.stats.speculation_stopped
    assert out.stats.drafted_tokens <= GammaSchedule.PAYOFF_PASSES * RapidConfig().gamma


def test_auto_keeps_a_draft_that_pays(tok, target, monkeypatch):
    """The target's own copy drafts (every draft accepted) while the target is slowed: a pass
    of 8 fast drafts and one slow verify emits 9 tokens for about one plain step's time."""
    engine = RapidEngine(
        target, copy.deepcopy(target), tokenizer=tok, config=RapidConfig(eta=0.0, gamma=8)
    )
    slowed(target, 0.02, monkeypatch)
    prompt = "abcdefghijkl" * 2
    out = engine.generate(
        prompt, prompt, speculate_min_context="auto", ignore_eos=True, max_new_tokens=40
    )
    # One (slowed) pass over the answer, not 40 (tests/tiny.greedy_mismatches).
    assert len(out.token_ids) == 40
    assert greedy_mismatches(target, tok.encode(prompt), out.token_ids, len(tok)) == []
    assert not out.stats.speculation_stopped
    assert out.stats.accepted_tokens >= 30


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("draft_confidence_threshold", 1.5),
        ("adaptive_gamma", 1),
        ("adaptive_gamma", "heuristic"),
        ("gamma_max", 0),
        ("gamma_max", 65),
        ("speculate_min_context", -1),
        ("speculate_min_context", "always"),
        ("lookup_ngram", 1),
        ("lookup_ngram", 9),
    ],
)
def test_bad_drafting_settings_name_their_field(field, value):
    with pytest.raises(RapidConfigError, match=field):
        RapidConfig(**{field: value})


# ---- sampling laws ------------------------------------------------------------------------

# "kab" then "cab": the suffix "ab" occurred before, followed by "c", so the lookup proposes
# "c" (and what followed it) with a one-hot q at the first emitted position.
PROMPT, DRAFT_PROMPT = "kabcab", "b"
N = 800


def emitted(engine: RapidEngine, positions: int = 1, **overrides) -> np.ndarray:
    """Counts [positions, V] of the token emitted at each of the first `positions` places over
    N seeds."""
    prompts = (PROMPT, DRAFT_PROMPT)
    return position_counts(engine, prompts, N, positions, ignore_eos=True, **overrides)


@pytest.fixture(scope="module")
def sampler(tok, target, draft):
    return RapidEngine(target, draft, tokenizer=tok, config=RapidConfig(eta=0.0, temperature=1.0))


ADAPTIVE = {"adaptive_gamma": True, "gamma": 2, "draft_confidence_threshold": 0.3}


def test_eta0_sampling_first_two_tokens_follow_p(sampler, target, tok):
    """Lookup drafts (one-hot q), a confidence stop and an adaptive gamma together."""
    ids = tok.encode(PROMPT)
    p1 = next_token_probs(target, ids, len(tok))
    p2 = sum(p1[a] * next_token_probs(target, [*ids, a], len(tok)) for a in range(len(tok)))
    first, second = emitted(sampler, 2, max_new_tokens=4, lookup_ngram=3, **ADAPTIVE)
    assert_follows(first, p1.numpy())
    assert_follows(second, p2.numpy())


def test_a_vetted_copy_follows_the_model_drafts_law(sampler, target, draft, tok):
    """eta = 4 with a copy "c" at the first position: the draft vets it (docs/algorithm.md
    section 2.10), so the emitted token follows the law of a model draft there (section 4,
    from p and the draft's own q; with the exact residual, p_hat), not p and not the law of
    the copy verified one-hot."""
    eta = 4.0
    rules = oracle.Rules(eta, residual="exact")
    p = next_token_probs(target, tok.encode(PROMPT), len(tok)).numpy()
    q = next_token_probs(draft, tok.encode(DRAFT_PROMPT), len(tok)).numpy()
    law = oracle.one_token_law(p, q, rules)
    onehot = np.eye(len(tok))[tok.encode("c")[0]]
    pulled = oracle.one_token_law(p, onehot, rules)
    assert oracle.total_variation(np.stack([law, law]), np.stack([p, pulled])).min() > 0.2
    overrides = {"eta": eta, "confidence_guard": False, "lookup_ngram": 2, "gamma": 2}
    (counts,) = emitted(sampler, max_new_tokens=3, residual="exact", **overrides)
    assert_follows(counts, law)


def vetting(draft, tok, temperature: float, gen: torch.Generator) -> ModelProposer:
    """A fresh draft proposer at eta 2 after DRAFT_PROMPT."""
    ids = tok.encode(DRAFT_PROMPT)
    state = KVState.start(draft, ids, len(tok), chunk=4, capacity=len(ids) + 12)
    return ModelProposer(state, RapidConfig(eta=2.0, temperature=temperature), gen)


def offering(copies: list[int], after: list[int]):
    """A `find` that offers `copies` after the drafts `after`, and nothing elsewhere."""
    return lambda drafts, n: copies[:n] if drafts == after else []


@pytest.mark.parametrize("copy", ["e", "d"])
def test_vetting_a_copy_drafts_from_q(draft, tok, copy):
    """Sampled: the first draft of a vetted copy, kept or replaced, is distributed as the
    draft's own q there, whatever the copy (the likeliest, q = 0.23, and an unlikely one,
    0.015), so the verdict may treat it as drafted; the copy is kept with probability q(copy)."""
    q = next_token_probs(draft, tok.encode(DRAFT_PROMPT), len(tok)).numpy()
    copies = tok.encode(copy + "ab")
    gen = torch.Generator().manual_seed(0)
    counts, kept = np.zeros(len(tok)), 0
    for _ in range(N):
        proposer = vetting(draft, tok, 1.0, gen)
        proposal = direct(proposer.propose(2, 3, offering(copies, [])))
        x, rows = proposal.x, proposal.q
        assert rows.shape == (len(x) + 1, len(tok)) and len(x) <= 3
        counts[int(x[0])] += 1
        kept += proposer.copied_at[:1] == [0]
    assert_follows(counts, q)
    share = q[copies[0]]
    assert abs(kept / N - share) < 4 * (share * (1 - share) / N) ** 0.5 + 1 / N


def test_vetting_greedy_keeps_the_copies_the_draft_would_draft(draft, tok):
    """Greedy: copies offered after a pick are read with it in one forward pass and kept
    while each is the draft's argmax; from the first that is not, the draft picks again. So
    the proposal is the draft's own greedy drafting, in fewer forward passes."""
    proposer, ids = vetting(draft, tok, 0.0, torch.Generator()), tok.encode(DRAFT_PROMPT)
    own = reference_greedy(draft, ids, 8, len(tok))
    wrong = (own[3] + 1) % len(tok)
    proposal = direct(proposer.propose(3, 8, offering([own[1], own[2], wrong, own[4]], own[:1])))
    x, q = proposal.x, proposal.q
    # Forward passes: the pending token; own[0] with the copies; own[3]; the bonus row's.
    assert x.tolist() == own[:5] and len(q) == 6 and proposer.state.forward_passes == 4
    assert proposer.copied_at == [1, 2]
    proposer.commit(5, torch.tensor([5]))
    assert direct(proposer.propose(0)).q is not None  # a pass with no drafts: q alone
    assert not proposer.copied_at
    proposer.commit(0, torch.tensor([6]))
    assert direct(proposer.propose(1)).x.tolist() == reference_greedy(
        draft, [*ids, *own[:5], 5, 6], 1, len(tok)
    )


def test_copies_that_fill_the_room_end_the_proposal(draft, tok):
    """Copies kept up to the room end the proposal without another pick: the bonus row's q
    comes from the pass that read them, and the cache follows a verdict that keeps fewer."""
    proposer, ids = vetting(draft, tok, 0.0, torch.Generator()), tok.encode(DRAFT_PROMPT)
    own = reference_greedy(draft, ids, 3, len(tok))
    proposal = direct(proposer.propose(2, 3, offering(own[1:3], own[:1])))
    x, q = proposal.x, proposal.q
    assert x.tolist() == own and len(q) == 4 and proposer.state.forward_passes == 2
    proposer.commit(1, torch.tensor([5]))
    assert direct(proposer.propose(1)).x.tolist() == reference_greedy(
        draft, [*ids, own[0], 5], 1, len(tok)
    )


def test_drafting_stops_at_an_end_id(draft, tok):
    """Nothing drafted after an end id can be emitted: drafting stops at one, without the bonus
    row's forward pass past it (docs/algorithm.md section 2.7)."""
    ids = tok.encode(DRAFT_PROMPT)
    own = reference_greedy(draft, ids, 6, len(tok))
    state = KVState.start(draft, ids, len(tok), chunk=4, capacity=len(ids) + 8)
    proposer = ModelProposer(
        state, RapidConfig(eta=2.0), torch.Generator(), end_ids=frozenset(own[2:3])
    )
    proposal = direct(proposer.propose(6))
    x, q = proposal.x, proposal.q
    assert x.tolist() == own[:3] and len(q) == 3 and state.forward_passes == 3


def test_copies_stop_at_an_end_id(draft, tok):
    """A kept copy that ends the call ends the proposal too: the copies after it are dropped
    from the draft's cache and no bonus row is read (docs/algorithm.md section 2.10)."""
    ids = tok.encode(DRAFT_PROMPT)
    own = reference_greedy(draft, ids, 4, len(tok))
    state = KVState.start(draft, ids, len(tok), chunk=4, capacity=len(ids) + 8)
    proposer = ModelProposer(
        state, RapidConfig(eta=2.0), torch.Generator(), end_ids=frozenset(own[2:3])
    )
    proposal = direct(proposer.propose(3, 6, offering(own[1:4], own[:1])))
    x, q = proposal.x, proposal.q
    # Forward passes: the pending token; own[0] with the copies. Then nothing past the end.
    assert x.tolist() == own[:3] and len(q) == 3 and state.forward_passes == 2
    assert proposer.copied_at == [1, 2]
    proposer.commit(1, torch.tensor([5]))
    assert direct(proposer.propose(1)).x.tolist() == reference_greedy(
        draft, [*ids, own[0], 5], 1, len(tok)
    )


def test_every_q_the_verdict_reads_is_the_drafts_own(engines, draft, tok, monkeypatch):
    """Greedy, eta = 3, copies and model drafts mixed: each q row the verdict reads (one row
    past the drafts too) equals the draft model's no-cache distribution after
    the draft prompt, the tokens emitted so far and the drafts before that row, so the draft
    cache follows every verdict and every vetted copy (docs/algorithm.md section 2.10)."""
    from rapid_integrations.engine import step as step_module

    seen = []

    def recording(z, x, q, cfg, gen, end_ids=None, lean=None):
        verdict = real(z, x, q, cfg, gen, end_ids, lean)
        seen.append((x.tolist(), q, verdict[0], int(verdict[1])))
        return verdict

    def read(self, tail, xs, qs, limit, find):  # a generator, as `_read` (kv.Forwards)
        before = len(self.copied_at)
        out = yield from real_read(self, tail, xs, qs, limit, find)
        kept.append(len(self.copied_at) - before)
        return out

    real, real_read, kept = step_module.verdict, ModelProposer._read, []
    monkeypatch.setattr(step_module, "verdict", recording)
    monkeypatch.setattr(ModelProposer, "_read", read)
    offered = spy_on_copies(monkeypatch)
    drafted = copies = 0
    for prompt, draft_prompt in repetitive_prompts(4, seed=7):
        seen.clear()
        out = engines["separate"].generate(prompt, draft_prompt, eta=3.0, lookup_ngram=2, gamma=3)
        emitted_ids = tok.encode(draft_prompt)
        for x, q, n, token in seen:
            assert len(x) == 0 or len(q) == len(x) + 1  # a plain last step has no drafts
            for row in range(len(q) if x else 0):
                want = next_token_probs(draft, emitted_ids + x[:row], len(tok))
                assert torch.allclose(q[row].double(), want, atol=1e-5), (x, row)
            emitted_ids += [*x[:n], token]
            drafted += bool(x)
        copies += out.stats.lookup_drafted_tokens
        assert out.stats.lookup_drafted_tokens == sum(kept)  # each kept copy counted once
        assert out.stats.lookup_accepted_tokens <= out.stats.lookup_drafted_tokens
        kept.clear()
    # Copies offered and kept, copies offered and replaced, and passes the model drafted.
    assert 0 < copies < sum(offered) and drafted > 3


def argmax_p_hat_decoding(target, draft, tok, prompt: str, draft_prompt: str, eta: float, n: int):
    """Greedy RAPID one token at a time, from no-cache forward passes and the oracle: every
    position emits argmax p_hat(p, q) (docs/algorithm.md sections 2.7 and 3, the paper's p_hat:
    no confidence guard, no end guard)."""
    rules = oracle.Rules(eta, temperature=0.0)
    ids, draft_ids, out = tok.encode(prompt), tok.encode(draft_prompt), []
    for _ in range(n):
        p = next_token_probs(target, ids + out, len(tok)).numpy()
        q = next_token_probs(draft, draft_ids + out, len(tok)).numpy()
        out.append(int(oracle.augmented(p[None], q[None], rules)[0].argmax()))
    return out


@pytest.mark.parametrize(
    "options",
    [
        {"gamma": 1},
        {"gamma": 5},
        {"gamma": 12, "draft_confidence_threshold": 0.5},
        {"adaptive_gamma": True, "gamma": 2, "gamma_max": 9},
        {"lookup_ngram": 2, "gamma": 3},
        {"lookup_ngram": 3, "gamma": 6, "lookup_tokens": 4},
        {"adaptive_gamma": "measured", "gamma_max": 8},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_eta_positive_greedy_is_argmax_p_hat_at_every_position(
    engines, target, draft, tok, options
):
    """With q at every row a pass decides (drafts, copies and the bonus row), greedy RAPID at
    eta > 0 is one sequence, whoever drafts and however many: argmax p_hat at each position,
    the plain steps' too (the measured gamma's timed first step, the last token with no room
    left for a draft)."""
    eta, differs = 3.0, 0
    for prompt, draft_prompt in repetitive_prompts(3, seed=11):
        want = argmax_p_hat_decoding(target, draft, tok, prompt, draft_prompt, eta, 24)
        out = engines["separate"].generate(
            prompt, draft_prompt, eta=eta, confidence_guard=False, **options
        )
        assert out.token_ids == want, (options, prompt)
        differs += want != reference_greedy(target, tok.encode(prompt), 24, len(tok))
    assert differs >= 2  # p_hat changes the text: the test tells RAPID from the target alone
