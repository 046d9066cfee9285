"""Gamma under a batch (docs/algorithm.md section 14.2): what a batch's packed passes measured
and the cap on every call's gamma picked from it (`BatchCosts`), shown to each call through its
`BatchSeat`. A call alone has a seat with no cap: its own schedule decides (`schedule.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rapid_integrations.spec_decode.schedule import GammaSchedule, PassCosts


@dataclass
class BatchSeat:
    """A call's place in a batch (`batch.BatchRunner`, docs/algorithm.md section 14.2): its
    loop shows the batch its schedule, and the batch caps the gamma of its next draft phase.

    schedule: the call's, once it decodes with a proposer (None before, or with none); cap:
    the most drafts its model may pick next (0: a pass without drafts; None: no cap, as alone);
    cappable: whether the batch may cap it. A greedy call is (its output is the same under
    any gamma), and so is a sampled call without a seed (a cap keeps its law, and its draws
    were never to be repeated), unless a grammar or penalty shapes its logits (a bonus row
    follows p there); a seeded sampled call is not: it repeats its own `generate` output draw
    for draw only at its own gamma.
    """

    schedule: GammaSchedule | None = None
    cap: int | None = None
    cappable: bool = True

    @property
    def limit(self) -> int | None:
        """The cap the call's next draft phase obeys: `cap` where `cappable`, else None."""
        return self.cap if self.cappable else None


class Line(Protocol):
    """Seconds of a forward pass as a function of the tokens it reads (`PassLine`)."""

    def record(self, tokens: int, seconds: float) -> None:
        """A pass that read `tokens` tokens took `seconds`."""
        ...

    @property
    def measured(self) -> bool:
        """Whether `seconds` rests on any pass."""
        ...

    def seconds(self, tokens: float) -> float:
        """Expected seconds of a pass of `tokens` tokens."""
        ...


class PassLine:
    """Seconds of a packed forward pass as a line in the tokens it reads, t(T) = a + b T: the
    least-squares line through recent passes, each weighing `DECAY` times less per later pass.
    Flat (b = 0, the mean) while the passes' widths spread by less than `PassCosts.MIN_SPREAD`
    tokens or the slope is negative (noise about a flat cost); through 0 (a = 0) when the
    offset is negative (a pass that grows faster than linearly)."""

    DECAY = 0.97
    """About the last 33 passes count: the calls' KV lengths, and so the costs, move."""

    def __init__(self) -> None:
        # Decayed sums of 1, T, T^2, seconds and T seconds.
        self._n, self._t, self._tt, self._y, self._ty = 0.0, 0.0, 0.0, 0.0, 0.0

    def record(self, tokens: int, seconds: float) -> None:
        d = self.DECAY
        self._n, self._t = d * self._n + 1, d * self._t + tokens
        self._tt, self._y = d * self._tt + tokens**2, d * self._y + seconds
        self._ty = d * self._ty + tokens * seconds

    @property
    def measured(self) -> bool:
        return self._n > 0

    def seconds(self, tokens: float) -> float:
        """a + b `tokens` (0.0 before any pass)."""
        if not self._n:
            return 0.0
        t, y = self._t / self._n, self._y / self._n
        spread = self._tt / self._n - t**2
        slope = (self._ty / self._n - t * y) / spread if spread >= PassCosts.MIN_SPREAD**2 else 0.0
        if slope <= 0:
            return y
        offset = y - slope * t
        return offset + slope * tokens if offset >= 0 else y / t * tokens


class BatchCosts:
    """What a batch's packed passes measured (seconds as a line in their tokens, one line for
    the target's verify passes, one for the draft's passes) and the cap on gamma it picks from
    them (docs/algorithm.md section 14.2). `verify` / `draft`: lines to start from (tests give
    known ones)."""

    def __init__(self, verify: Line | None = None, draft: Line | None = None) -> None:
        self.verify = verify or PassLine()
        self.draft = draft or PassLine()

    def record(self, draft: bool, tokens: int, seconds: float) -> None:
        """A packed pass (a draft pass if `draft`) read `tokens` tokens in `seconds`."""
        (self.draft if draft else self.verify).record(tokens, seconds)

    def cap(self, calls: Sequence[tuple[int, PassCosts | None]]) -> int | None:
        """The cap G on every call's gamma for the next draft phase (0: no drafting), or None
        when it would not bind: the G in [0, max gamma] with the most expected tokens per
        second, `rate`. `calls`: each running call's gamma (0: it drafts nothing) and its
        costs (None when it drafts nothing). None for fewer than two calls: a call alone is
        its own schedule's (section 2.9), and `generate` is the batch of one; None too until
        both lines rest on passes."""
        top = max((g for g, _ in calls), default=0)
        if len(calls) < 2 or not top or not (self.verify.measured and self.draft.measured):
            return None
        # Ties go to the larger G: drafting as asked, as alone.
        best = max(range(top, -1, -1), key=lambda g: self.rate(calls, g))
        return None if best == top else best

    def rate(self, calls: Sequence[tuple[int, PassCosts | None]], cap: int) -> float:
        """Expected tokens per second of a step (draft phase and verify pass) with every
        gamma capped at `cap`: sum_i E_i(D_i) / (sum_j d(n_j) + t(sum_i (1 + D_i))), with
        D_i the drafts call i is expected to hold at gamma g_i = min(gamma_i, cap)
        (`PassCosts.expected_drafts`), E_i its expected tokens (`expected_tokens`; 1 at
        g_i = 0), t the verify line, d the draft line and n_j the calls still picking at
        depth j < max g_i (one token each per draft pass)."""
        picks = [min(g, cap) for g, _ in calls]
        drafts = [
            c.expected_drafts(g) if c else 0.0 for g, (_, c) in zip(picks, calls, strict=True)
        ]
        tokens = sum(
            c.expected_tokens(d) if c else 1.0 for d, (_, c) in zip(drafts, calls, strict=True)
        )
        drafting = sum(self.draft.seconds(sum(g > j for g in picks)) for j in range(max(picks)))
        return tokens / (drafting + self.verify.seconds(len(calls) + sum(drafts)))
