"""The gamma schedule (docs/algorithm.md section 2.9): how many drafts the proposer is asked
for on each pass, and, for a measured schedule, the cost model it is chosen by.

`GammaSchedule` is the rule (fixed, transformers' heuristic, or measured, and the payoff
stop of `speculate_min_context="auto"`); `PassCosts` is what a call's own passes measured
(seconds and the acceptance curve), `RunCurve` the law of that curve. `ScheduleMemory`
(schedule_memory.py) carries a measured schedule from one call to the next; in a batch,
`batch_caps.BatchCosts` caps every call's gamma; `copy_prices.CopyPrices` prices the lookup's
copies with a `RunCurve` of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rapid_integrations.config import RapidConfig


@dataclass(frozen=True)
class PassRecord:
    """What one pass of the loop did, as the schedule learns from it (`GammaSchedule.update`).

    asked: model picks the schedule asked for; drafted: drafts proposed (`copied` of them
    copies the draft kept, section 2.10); accepted: drafts the verdict kept (the pass emitted
    accepted + 1 tokens); draft_seconds, verify_seconds: wall seconds drafting, and verifying
    (the target pass and the verdict); draft_passes: the draft's forward passes (None: one per
    pick).
    """

    asked: int
    drafted: int
    accepted: int
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_passes: int | None = None
    copied: int = 0


class RunCurve:
    """How far runs of proposed tokens are kept, index by index: for each index j, how often
    a recent run reached its j-th token and how often it was cut there (a pass's drafts, cut
    at the verdict's rejection; a lookup's copies, cut at the first the draft does not keep).
    Each verdict (a kept token, or the cut) weighs `DECAY` times less per later verdict.
    Tokens come in runs on real text (a pass is kept whole or cut early), which a single
    per-token rate under-counts: at 8K, gamma 8 kept 113 of 119 drafts, 8.5 tokens a pass,
    where the rate's (1 - a^9) / (1 - a) says 7.0.
    """

    DECAY = 0.97
    """Weight lost per later verdict: acceptance follows the text being written, over about
    the last 1 / (1 - DECAY) = 33 tokens whatever the runs' lengths are (a decay per run would
    remember fewer tokens at a small gamma, read a lower acceptance there and keep gamma
    small)."""

    PRIOR_PASSES = 4.0
    """Pseudo-runs at the pooled cut rate behind each index's own rate: one cut among the few
    runs that reached an index (at 8K, draft 5 of 3 passes) would otherwise read as a rate
    near 1/3 there, and gamma would stay below it for the rest of the call, as no later pass
    reaches that index to correct it."""

    def __init__(self, size: int) -> None:
        self._reached = [0.0] * size  # decayed runs that reached token j
        self._cut = [0.0] * size  # decayed runs cut at token j

    def learn(self, proposed: int, kept: int) -> float:
        """A run of `proposed` tokens whose first `kept` were kept; returns the fade its
        verdicts gave the older ones."""
        cut = int(kept < proposed)
        fade = self.DECAY ** (kept + cut)
        self._reached = [fade * r + (j < kept + cut) for j, r in enumerate(self._reached)]
        self._cut = [fade * r + (j == kept < proposed) for j, r in enumerate(self._cut)]
        return fade

    def kept_chances(self, n: int) -> list[float]:
        """For j < n (at most the curve's size): the chance that tokens 0..j of a run are all
        kept. Token j is cut at rate (cuts at j + w h) / (runs reaching j + w): w =
        `PRIOR_PASSES` pseudo-runs at the pooled rate h = (all cuts + 1/2) / (all verdicts +
        1), which is what an index never reached gets."""
        pooled = (sum(self._cut) + 0.5) / (sum(self._reached) + 1)
        w = self.PRIOR_PASSES
        chances, kept = [], 1.0
        for j in range(min(n, len(self._reached))):
            kept *= 1 - (self._cut[j] + w * pooled) / (self._reached[j] + w)
            chances.append(kept)
        return chances


class PassCosts:
    """What a call's own passes measured (seconds), for `GammaSchedule`.

    plain_step: the first pass, the target alone reading one token; a draft forward pass's
    seconds and what a copy adds to it (`draft_costs`); the verify pass's seconds over the
    plain step as a line in its drafts (`verify_line`); the tokens and seconds of all drafting
    passes (`realized_speedup`); how many copies the draft kept per pick (docs/algorithm.md
    section 2.10); and the acceptance curve of recent drafts, copies included (they are
    distributed as the draft's own): a `RunCurve` over the passes' drafts. Each copy weighs
    `RunCurve.DECAY` times less per later verdict, as the curve's verdicts do.
    """

    MIN_SPREAD = 2.0
    """Drafts by which the passes' widths must spread (standard deviation) before the verify
    line gets an offset of its own: a line through passes of nearly one width is noise."""

    def __init__(self, gamma_max: int, lookup_tokens: int = 0) -> None:
        self.plain_step: float | None = None
        self._most_copies = lookup_tokens  # copies one proposal may hold
        self._passes, self._drafted, self._copied, self._draft_passes = 0, 0, 0, 0
        self._recent_copies, self._recent_picks = 0.0, 0.0  # decayed as the curve
        self._draft_seconds, self._verify_extra = 0.0, 0.0
        self._bare_seconds, self._bare_passes = 0.0, 0  # draft seconds, forwards without copies
        self._drafted_sq, self._cross = 0.0, 0.0  # sums of k^2 and k y (`verify_line`)
        self._emitted = 0  # tokens the drafting passes emitted
        self._curve = RunCurve(gamma_max + lookup_tokens)  # the most drafts a pass holds

    def record(
        self,
        drafted: int,
        accepted: int,
        draft_seconds: float,
        verify_seconds: float,
        draft_passes: int | None = None,
        copied: int = 0,
    ) -> None:
        """A pass that drafted `drafted` tokens (0: the plain step), `copied` of them copies
        the draft kept, and kept `accepted`, in `draft_passes` forward passes of the draft
        (default: one per pick)."""
        if self.plain_step is None or not drafted:
            # A plain step's draft seconds (the q of section 2.7) are not the target's.
            self.plain_step = self.plain_step or verify_seconds
            return
        self._passes += 1
        self._drafted += drafted
        self._copied += copied
        forwards = drafted - copied if draft_passes is None else draft_passes
        self._draft_passes += forwards
        self._draft_seconds += draft_seconds
        if not copied:
            self._bare_seconds += draft_seconds
            self._bare_passes += forwards
        self._verify_extra += verify_seconds - self.plain_step
        self._drafted_sq += drafted**2
        self._cross += drafted * (verify_seconds - self.plain_step)
        self._emitted += accepted + 1
        self.learn(drafted, accepted, copied)

    def learn(self, drafted: int, accepted: int, copied: int = 0) -> None:
        """The acceptance curve and the copies per pick learn a drafting pass's verdict:
        `drafted` drafts (`copied` of them copies), the first `accepted` kept."""
        fade = self._curve.learn(drafted, accepted)
        self._recent_copies = fade * self._recent_copies + copied
        self._recent_picks = fade * self._recent_picks + drafted - copied

    def expected_drafts(self, gamma: int) -> float:
        """Drafts a pass of `gamma` picks is expected to hold: the picks, and per pick the
        copies recent picks brought (each pick is followed by a lookup), at most the copies
        one proposal may hold."""
        per_pick = self._recent_copies / max(1.0, self._recent_picks)
        return gamma + min(gamma * per_pick, self._most_copies)

    def expected_tokens(self, drafts: float) -> float:
        """Tokens a pass of `drafts` drafts is expected to emit: 1 + the sum over j < drafts
        of the chance that drafts 0..j are all kept (`RunCurve.kept_chances`; a fraction of a
        draft counts its share)."""
        chances = self._curve.kept_chances(math.ceil(drafts))
        return 1.0 + sum(kept * min(1.0, drafts - j) for j, kept in enumerate(chances))

    def verify_line(self) -> tuple[float, float]:
        """(v, s) seconds: a verify pass of k drafts is expected to take the plain step + v +
        k s. The least-squares line through the drafting passes' (k, verify seconds - plain
        step); through 0 (v = 0) when their widths spread by less than `MIN_SPREAD` drafts or
        the line's v or s is negative (a verify pass that grows faster than linearly, as at
        32K). Why a line: a verify pass's cost jumps from 1 token to a few, then grows slowly,
        so a slope through 0 priced every draft beyond the first few above its cost and kept
        gamma short (measured in docs/performance.md, "Why these defaults")."""
        n, k, y = self._passes, self._drafted, self._verify_extra
        spread = self._drafted_sq / n - (k / n) ** 2
        through_zero = (0.0, max(0.0, y) / k)
        if spread < self.MIN_SPREAD**2:
            return through_zero
        slope = (self._cross / n - k * y / n**2) / spread
        offset = (y - slope * k) / n
        return through_zero if min(offset, slope) < 0 else (offset, slope)

    def draft_costs(self) -> tuple[float, float]:
        """(f, c) seconds: a draft forward pass, timed in passes without copies (all passes
        before there is one), and what each copy adds to the forward pass that reads it: the
        draft seconds beyond f per forward pass, over the copies. A forward pass that reads
        copies costs more, which an average over all passes charged to every pick, and the
        measured gamma expected less than it ran (docs/performance.md, "Why these defaults")."""
        total = self._draft_seconds / max(1, self._draft_passes)
        forward = self._bare_seconds / self._bare_passes if self._bare_passes else total
        beyond = max(0.0, self._draft_seconds - forward * self._draft_passes)
        return forward, beyond / self._copied if self._copied else 0.0

    def pass_seconds(self, gamma: int) -> float:
        """Expected seconds of a pass of `gamma` picks: the plain step, per pick a draft
        forward pass and per expected copy its share of one (`draft_costs`), the verify
        pass's line in its drafts (copies too, `verify_line`), and the draft forward passes a
        pass makes beyond its picks (the bonus row's, docs/algorithm.md section 2.7)."""
        assert self.plain_step is not None and self._drafted
        forward, per_copy = self.draft_costs()
        offset, slope = self.verify_line()
        picks = self._drafted - self._copied
        extra = max(0, self._draft_passes - picks) / self._passes
        drafts = self.expected_drafts(gamma)
        draft = (gamma + extra) * forward + (drafts - gamma) * per_copy
        return self.plain_step + draft + offset + drafts * slope

    def speedup(self, gamma: int) -> float:
        """Expected tokens per second of passes of `gamma` picks, over the plain step's."""
        assert self.plain_step is not None
        tokens = self.expected_tokens(self.expected_drafts(gamma))
        return tokens * self.plain_step / self.pass_seconds(gamma)

    def realized_speedup(self) -> float:
        """Tokens per second the drafting passes emitted, over the plain step's (1.0 before
        any): what speculation has paid so far, whatever the model expects next."""
        assert self.plain_step is not None
        seconds = self._draft_seconds + self._verify_extra + self._passes * self.plain_step
        return self._emitted * self.plain_step / seconds if self._passes else 1.0

    def best_gamma(self, gamma_max: int) -> int:
        """The gamma in [1, gamma_max] with the most expected tokens per second."""
        return max(range(1, gamma_max + 1), key=self.speedup)


class GammaSchedule:
    """How many drafts to ask for on the next pass (docs/algorithm.md section 2.9).

    `adaptive_gamma`: False, fixed `gamma`; True, transformers' heuristic: +2 after a pass
    that drafted and accepted all it asked for, -1 after a rejection, within [1, gamma_max]
    (a pass whose drafter stopped early and was accepted whole leaves it unchanged);
    "measured", after every drafting pass the gamma of `PassCosts.best_gamma`.

    With `speculate_min_context="auto"` or a measured gamma the first pass is a plain target
    step (no drafts), timed. With "auto", after `PAYOFF_PASSES` model-drafting passes the call
    stops drafting (gamma 0 for good: plain target steps, no copies) once, after each of its last
    `PAYOFF_PASSES` drafting passes, the gamma it would draft next was expected to emit fewer
    tokens per second than plain steps (`PassCosts.speedup` below `LOSING_SPEEDUP`), and the
    drafting passes so far did too (`PassCosts.realized_speedup`): speculation that loses on
    this device at this length costs a few passes, not the whole call, and a bad stretch of
    text after passes that paid does not end it.
    """

    PAYOFF_PASSES = 4
    """Drafting passes in a row expected to lose before drafting stops: one pass's tokens
    vary too much."""

    LOSING_SPEEDUP = 0.95
    """A pass is expected to lose below this speedup over plain steps, not below 1: the
    expectation rests on one timed plain step and a few passes, and where speculation gains
    little at best it hovers near 1: with 1 as the bar a call stopped for good where fixed
    gamma 8 ran faster (measured in docs/performance.md, "Why these defaults"). Speculation
    expected to lose less than this runs on."""

    def __init__(self, config: RapidConfig) -> None:
        self._rule = config.adaptive_gamma
        self._max = config.gamma_max
        self._gamma = min(config.gamma, self._max) if self._rule else config.gamma
        self._auto = config.speculate_min_context == "auto"
        self._timed = self._auto or self._rule == "measured"
        self.costs = PassCosts(self._max, config.lookup_tokens if config.lookup_ngram else 0)
        self._losing = 0  # model-drafting passes in a row expected to lose
        self.stopped = False  # speculation measured slower than the target alone

    @property
    def measures(self) -> bool:
        """Whether passes are timed: what a later call may start from (`ScheduleMemory`)."""
        return self._timed

    @property
    def drafting(self) -> bool:
        """False while the plain step is still to be timed: that pass proposes nothing."""
        return not (self._timed and self.costs.plain_step is None)

    @property
    def gamma(self) -> int:
        """Drafts the model may propose next (0: none; copies may still be proposed)."""
        return 0 if self.stopped or not self.drafting else self._gamma

    def update(self, done: PassRecord) -> None:
        """Learn from the pass `done` and choose the next gamma."""
        asked, drafted, accepted, copied = done.asked, done.drafted, done.accepted, done.copied
        if self._timed:
            drafts, copies = (drafted, copied) if asked else (0, 0)
            self.costs.record(
                drafts,
                accepted,
                done.draft_seconds,
                done.verify_seconds,
                done.draft_passes,
                copies,
            )
        elif asked and drafted:
            # Untimed, only the curve: a batch's cap reads it (docs/algorithm.md section 14.2).
            self.costs.learn(drafted, accepted, copied)
        if not (asked and drafted):
            return
        if self._rule == "measured":
            self._gamma = self.costs.best_gamma(self._max)
        elif self._rule and accepted < drafted:
            self._gamma = max(1, self._gamma - 1)
        elif self._rule and drafted - copied == asked:
            self._gamma = min(self._max, self._gamma + 2)
        # A pass expected to lose lengthens the losing streak; one expected to pay ends it.
        losing = self._auto and self.costs.speedup(self._gamma) < self.LOSING_SPEEDUP
        self._losing = self._losing + 1 if losing else 0
        streak = self._losing >= self.PAYOFF_PASSES
        self.stopped = streak and self.costs.realized_speedup() < self.LOSING_SPEEDUP
