"""The proposer role: a draft model that proposes gamma tokens and learns what was kept.

Two methods, after transformers' candidate generators: `propose` and `commit`. A proposer may
return fewer drafts than asked (docs/algorithm.md section 2.9): the loop verifies what it got.
`LookupProposer` offers copies (section 2.10); `LookupFirst` has the model vet them as it
drafts.
`GammaSchedule` says how many drafts to ask for next.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from .config import RapidConfig
from .constraints import Constraints
from .kv import KVState
from .sampling import check_finite, log_probs

Find = Callable[[list[int], int], list[int]]
"""Copies continuing the sequence and the given drafts, at most n ids ([] if none):
`LookupProposer.find`."""


class Proposer(Protocol):
    @property
    def copies(self) -> int:
        """How many drafts of the last proposal were copies the draft kept (the gamma
        schedule prices them apart from the model's picks)."""
        ...

    def propose(self, gamma: int, room: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft k tokens, 0 <= k <= max(gamma, room): ids [k] and the draft model's
        distributions q at their positions, [k, V], or [k + 1, V] with a row one past them
        (None when the verdict does not need q, see `needs_q`). A model drafts at most
        `gamma` (0: none); copies, which cost no draft step, may run to `room`."""
        ...

    def commit(self, accepted: int, gamma: int, token: torch.Tensor) -> None:
        """The target kept the first `accepted` of the `gamma` drafts, then emitted `token` [1]."""
        ...

    def q_here(self) -> torch.Tensor | None:
        """No drafts, only the draft model's q [1, V] at the next position (None with eta = 0):
        a pass with no room for drafts still follows p_hat (docs/algorithm.md section 2.7)."""
        ...


class ModelProposer:
    """Drafts with a causal LM over its own (short) prompt and KV cache."""

    def __init__(
        self,
        state: KVState,
        config: RapidConfig,
        generator: torch.Generator,
        constraints: Constraints | None = None,
        end_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.state = state
        self._constraints = constraints
        # Ids that end the call: nothing drafted after one can be emitted (kept, it ends the
        # call; rejected, the drafts after it go too), so drafting stops there.
        self._end_ids = end_ids
        self._end_tensor = torch.tensor(
            sorted(end_ids), dtype=torch.long, device=state.pending.device
        )
        self._cfg = config
        self._gen = generator
        self._need_q = needs_q(config)
        # eta > 0: the draft reads x_k too, so the bonus row has q and follows p_hat
        # (docs/algorithm.md section 2.7); a grammar's bonus row keeps p.
        self.reads_ahead = config.eta > 0 and constraints is None
        self._x = state.pending[:0]  # [k] the last proposal
        self._fed = 0  # how many of its tokens the draft has read (x_k only if reads_ahead)
        self.copied_at: list[int] = []  # which drafts of the last proposal were copies

    @property
    def copies(self) -> int:
        return len(self.copied_at)

    def propose(
        self, gamma: int, room: int = 0, find: Find | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ids x [k] (int64) and q [k, V] (None unless needed; [k + 1, V] with eta > 0,
        a row for the bonus position too, unless x_k ends the call). The model picks at most
        `gamma` of them: fewer when the confidence threshold or an end id stops drafting.

        With `find`, each forward pass of the draft also reads the copies `find` offers after
        the drafts so far and keeps a prefix of them as drafts (`_read`, docs/algorithm.md
        section 2.10): at most `lookup_tokens` copies a proposal, and `copied_at` says which.
        k <= max(gamma, room)."""
        self.copied_at = []
        if gamma == 0 and find is None:
            self._x, self._fed = self._x[:0], 0
            return self._x, None
        xs: list[torch.Tensor] = []  # drafts [1] ...
        qs: list[torch.Tensor] = []  # ... their q [V]
        picked: list[torch.Tensor] = []  # the logits [V] of each model pick
        tail = self._x[:0]  # what the draft reads next: its pending tokens, then the last pick
        limit = max(gamma, room)
        while True:
            logits, unkept = self._read(tail, xs, qs, limit, find)
            if len(picked) >= gamma or len(xs) >= limit or self._ended(xs):
                read_all = True  # nothing left to pick: the bonus row is `logits`
                break
            tail, q = self._pick(self._shaped(logits), unkept)
            if self._constraints is not None:
                self._constraints.advance(tail)
            xs.append(tail)
            qs.append(q)
            picked.append(logits)
            more = len(picked) < gamma and len(xs) < limit
            # One sync per draft step, as the confidence threshold's: a draft past an end id
            # would cost a whole draft step.
            if not (more and self._confident(logits, tail, q) and not self._ends(tail)):
                read_all = False
                break
        return self._finish(xs, qs, picked, logits if read_all else None)

    def _read(
        self,
        tail: torch.Tensor,
        xs: list[torch.Tensor],
        qs: list[torch.Tensor],
        limit: int,
        find: Find | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward pass of the draft over `tail` ([t] ids) and the copies `find` offers
        after the drafts xs (up to `limit` drafts in all). Copy i is kept with probability
        q_i(x_i), a one-hot proposal's acceptance (greedy: while each is q's argmax, the
        draft's own pick), and the kept prefix joins xs and qs, so every draft is distributed
        as q, as if the draft had drafted it. Returns the draft's logits [V] past xs and the
        first copy it did not keep ([1]; None if none): the next pick comes from q without
        it, so it follows q too."""
        n = min(limit - len(xs), self._cfg.lookup_tokens - self.copies)
        found = find(torch.cat(xs).tolist() if xs else [], n) if find and n > 0 else []
        copies = torch.tensor(found, dtype=torch.long, device=tail.device)
        k = copies.numel()
        rows = self.state.feed(torch.cat([tail, copies]))[-(k + 1) :]  # [k + 1, V] logits
        if not k:
            return rows[0], None
        q = self._q(rows[:k]) if self._need_q else None  # [k, V]
        if q is None or self._cfg.greedy:
            keep = rows[:k].argmax(-1) == copies
        else:
            u = torch.rand(k, generator=self._gen, device=q.device)
            keep = u < q.gather(1, copies[:, None])[:, 0]
        # Kept up to the first copy not kept, or through the first end id (then drafting stops).
        keep[1:] &= ~torch.isin(copies[:-1], self._end_tensor)
        kept = int(keep.int().cumprod(0).sum())
        self.state.rollback(k - kept)
        self.copied_at += range(len(xs), len(xs) + kept)
        xs.extend(copies[:kept, None])  # [1] each
        qs.extend(q[:kept] if q is not None else [])
        return rows[kept], (copies[kept : kept + 1] if kept < k else None)

    def _finish(
        self,
        xs: list[torch.Tensor],
        qs: list[torch.Tensor],
        picked: list[torch.Tensor],
        past: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The proposal from drafts xs, their q rows and the model picks' logits; `past` [V]:
        the draft's logits past every draft (it has read them all), None when it has not
        read the last pick. With eta > 0 the bonus row's q comes from `past`, or from one more
        forward pass over the last pick (none after an end id: it is never emitted)."""
        self._x = torch.cat(xs) if xs else self._x[:0]
        self._fed = len(xs) - (past is None)
        if self.reads_ahead and not self._ended(xs):
            if past is None:
                past = self.state.feed(xs[-1])[-1]
                self._fed += 1
            qs.append(self._q(past[None])[0])
        if not self._need_q and picked:
            # log_probs checks the logits whenever q is computed; once per proposal here, as a
            # check per step would wait on the device between draft steps.
            check_finite(torch.stack(picked), "the draft model")
        return self._x, (torch.stack(qs) if self._need_q and qs else None)

    def _shaped(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] through the call's constraints (docs/algorithm.md section 9); the
        constraints then follow the pick."""
        if self._constraints is None:
            return logits
        return self._constraints.apply(logits[None], logits.new_empty(0, dtype=torch.long))[0]

    def _pick(
        self, logits: torch.Tensor, unkept: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token [1] from logits [V], with q [V] when needed. `unkept` [1]: a copy
        the draft did not keep (`_read`), so the token comes from q without it, q's residual
        after a one-hot proposal; greedy needs no change, as the argmax is not that copy."""
        if self._cfg.greedy:
            q = self._q(logits[None])[0] if self._need_q else None
            return logits.argmax(-1, keepdim=True), q
        q = self._q(logits[None])[0]
        rest = q if unkept is None else q.index_fill(0, unkept, 0.0)
        return torch.multinomial(rest, 1, generator=self._gen), q

    def _q(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's sampling distributions [k, V] from logits [k, V] (greedy: T = 1)."""
        cfg = self._cfg
        if cfg.greedy:
            return log_probs(logits, 0.0, 1.0).exp()
        return log_probs(logits, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p).exp()

    def _confident(self, logits: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None) -> bool:
        """Whether to draft past `x`: its draft probability reaches the confidence threshold
        (as transformers' ConfidenceCriteria: the low-confidence token itself is proposed)."""
        threshold = self._cfg.draft_confidence_threshold
        if threshold <= 0:
            return True
        probs = q if q is not None else torch.softmax(logits.float(), dim=-1)
        return bool(probs[x] >= threshold)

    def _ends(self, x: torch.Tensor) -> bool:
        """Whether the draft x [1] ends the call (no bonus row either: it is never emitted)."""
        return bool(self._end_ids) and int(x) in self._end_ids

    def _ended(self, xs: list[torch.Tensor]) -> bool:
        return bool(xs) and self._ends(xs[-1])

    def q_here(self) -> torch.Tensor | None:
        """See `Proposer.q_here`: the draft reads its pending tokens and drafts nothing."""
        self._x, self._fed, self.copied_at = self._x[:0], 0, []
        return self._q(self.state.feed()[-1:]) if self.reads_ahead else None

    def commit(self, accepted: int, gamma: int, token: torch.Tensor) -> None:
        """Roll the draft cache back to the kept drafts and queue `token` [1] (int64) after them."""
        if self._constraints is not None:
            self._constraints.settle(accepted, token)
        # The draft has read its pending tokens and x_1..x_fed of the last proposal.
        self.state.rollback(max(0, self._fed - accepted))
        self.state.append(torch.cat([self._x[self._fed : accepted], token.to(self._x.device)]))


def needs_q(config: RapidConfig) -> bool:
    """Whether the verdict needs draft distributions: all but greedy with eta = 0."""
    return not (config.greedy and config.eta == 0)


class PassCosts:
    """What a call's own passes measured (seconds), for `GammaSchedule`.

    plain_step: the first pass, the target alone reading one token; a draft forward pass's
    seconds and what a copy adds to it (`draft_costs`); the verify pass's seconds over the
    plain step as a line in its drafts (`verify_line`); the tokens and seconds of all drafting
    passes (`realized_speedup`); how many copies the draft kept per pick (docs/algorithm.md
    section 2.10); and the acceptance curve of recent drafts, copies included (they are
    distributed as the draft's own): for each draft index j, how often a pass reached its
    j-th draft and how often it was rejected there. Each verdict (a kept
    draft, or the rejection) and each copy weighs `DECAY` times less per later verdict.
    Acceptance comes in runs on real text (a pass is kept whole or cut early), which a single
    per-draft rate under-counts: at 8K, gamma 8 kept 113 of 119 drafts, 8.5 tokens a pass,
    where the rate's (1 - a^9) / (1 - a) says 7.0.
    """

    DECAY = 0.97
    """Weight lost per later verdict: acceptance follows the text being written, over about
    the last 1 / (1 - DECAY) = 33 drafts whatever gamma is (a decay per pass would remember
    fewer drafts at a small gamma, read a lower acceptance there and keep gamma small)."""

    MIN_SPREAD = 2.0
    """Drafts by which the passes' widths must spread (standard deviation) before the verify
    line gets an offset of its own: a line through passes of nearly one width is noise."""

    PRIOR_PASSES = 4.0
    """Pseudo-passes at the pooled rejection rate behind each draft index's own rate: one
    rejection among the few passes that reached an index (at 8K, draft 5 of 3 passes) would
    otherwise read as a rate near 1/3 there, and gamma would stay below it for the rest of the
    call, as no later pass reaches that index to correct it."""

    def __init__(self, gamma_max: int, lookup_tokens: int = 0) -> None:
        self.plain_step: float | None = None
        self._most_copies = lookup_tokens  # copies one proposal may hold
        self._passes, self._drafted, self._copied, self._draft_passes = 0, 0, 0, 0
        self._recent_copies, self._recent_picks = 0.0, 0.0  # decayed as the curve
        self._draft_seconds, self._verify_extra = 0.0, 0.0
        self._bare_seconds, self._bare_passes = 0.0, 0  # draft seconds, forwards without copies
        self._drafted_sq, self._cross = 0.0, 0.0  # sums of k^2 and k y (`verify_line`)
        self._emitted = 0  # tokens the drafting passes emitted
        size = gamma_max + lookup_tokens  # the most drafts a pass holds
        self._reached = [0.0] * size  # decayed passes that reached draft j
        self._rejected = [0.0] * size  # decayed passes that rejected draft j

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
        rejected = int(accepted < drafted)
        fade = self.DECAY ** (accepted + rejected)
        self._reached = [fade * r + (j < accepted + rejected) for j, r in enumerate(self._reached)]
        self._rejected = [
            fade * r + (j == accepted < drafted) for j, r in enumerate(self._rejected)
        ]
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
        of the chance that drafts 0..j are all kept (a fraction of a draft counts its
        share). Draft j is rejected at rate (rejections at j + w h) / (passes reaching j + w):
        w = `PRIOR_PASSES` pseudo-passes at the pooled rate h = (all rejections + 1/2) / (all
        verdicts + 1), which is what an index never reached gets."""
        pooled = (sum(self._rejected) + 0.5) / (sum(self._reached) + 1)
        w = self.PRIOR_PASSES
        tokens, kept = 1.0, 1.0
        for j in range(min(math.ceil(drafts), len(self._reached))):
            kept *= 1 - (self._rejected[j] + w * pooled) / (self._reached[j] + w)
            tokens += kept * min(1.0, drafts - j)
        return tokens

    def verify_line(self) -> tuple[float, float]:
        """(v, s) seconds: a verify pass of k drafts is expected to take the plain step + v +
        k s. The least-squares line through the drafting passes' (k, verify seconds - plain
        step); through 0 (v = 0) when their widths spread by less than `MIN_SPREAD` drafts or
        the line's v or s is negative (a verify pass that grows faster than linearly, as at
        32K). Why a line: a verify pass's cost jumps from 1 token to a few, then grows slowly
        (fp32 at 4K: 54, 90, 103, 138 ms for 1, 9, 17, 33 tokens), so a slope through 0 priced
        every draft beyond the first few at 2.5 times its cost and kept gamma short."""
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
        copies costs more (fp32 at 4K: 44-54 ms against 35 ms), which an average over all
        passes charged to every pick, and the measured gamma expected 0.9x where it ran
        1.05x."""
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
    little at best (2K on this CPU, about 1.1x) it hovers near 1 (traced: 0.99-1.07 over a
    call's last passes): a call stopped for good there that fixed gamma 8 ran 1.16x faster
    (`rapid bench --long`). Speculation expected to lose less than this runs on."""

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

    def update(
        self,
        asked: int,
        drafted: int,
        accepted: int,
        draft_seconds: float = 0.0,
        verify_seconds: float = 0.0,
        draft_passes: int | None = None,
        copied: int = 0,
    ) -> None:
        """After a pass that asked for `asked` model picks, got `drafted` drafts (`copied` of
        them copies the draft kept, section 2.10) and accepted `accepted` (emitting accepted +
        1 tokens), drafting for `draft_seconds` in `draft_passes` forward passes of the draft
        (default: one per pick) and verifying (the target pass and the verdict) for
        `verify_seconds` of wall time."""
        if self._timed:
            drafts, copies = (drafted, copied) if asked else (0, 0)
            self.costs.record(drafts, accepted, draft_seconds, verify_seconds, draft_passes, copies)
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


class LookupProposer:
    """Offers copies (docs/algorithm.md section 2.10): where the last n tokens of the
    sequence and the drafts so far occurred before (n = `ngram` down to 2), what followed
    their latest earlier occurrence. The draft model vets them (`ModelProposer._read`).

    `corpus`: ids searched besides the sequence itself (C^S); `sequence`: the target's ids so
    far (the prompt); committed tokens extend it. Lookups are O(ngram) dict probes.
    """

    def __init__(self, corpus: list[int], sequence: list[int], ngram: int) -> None:
        self._ngram = ngram
        self._tokens: list[int] = []
        # n-gram -> index of the token that followed its latest occurrence
        self._next: dict[tuple[int, ...], int] = {}
        self._start = 0  # where the current text begins: no n-gram spans two texts
        self._extend(corpus)
        self._start = len(self._tokens)
        self._extend(sequence)

    def _extend(self, ids: list[int]) -> None:
        for token in ids:
            i = len(self._tokens)
            for n in range(2, min(self._ngram, i - self._start) + 1):
                self._next[tuple(self._tokens[i - n : i])] = i
            self._tokens.append(token)

    def find(self, drafts: list[int], room: int) -> list[int]:
        """Up to `room` ids continuing the longest matched suffix of the sequence followed by
        `drafts` (ids not committed yet), [] if none."""
        n_max = min(self._ngram, len(self._tokens) - self._start + len(drafts))
        tail = (self._tokens[-self._ngram :] + drafts)[-self._ngram :]
        for n in range(n_max, 1, -1):
            at = self._next.get(tuple(tail[-n:]))
            if at is not None:
                return self._tokens[at : at + room]
        return []

    def extend(self, tokens: torch.Tensor) -> None:
        """Commit `tokens` ([k] ids) to the sequence."""
        self._extend(tokens.tolist())


class LookupFirst:
    """The composite proposer: the model drafts, and vets the lookup's copies as it goes
    (`ModelProposer.propose` with `find`, docs/algorithm.md section 2.10); what it keeps is
    distributed as its own drafts, so the lookup changes speed, never the output."""

    def __init__(self, lookup: LookupProposer, model: ModelProposer) -> None:
        self.lookup = lookup
        self.model = model
        self._x = torch.zeros(0, dtype=torch.long)  # the last proposal
        self.lookup_drafted = 0
        self.lookup_accepted = 0

    @property
    def state(self) -> KVState:
        return self.model.state

    @property
    def copies(self) -> int:
        return self.model.copies

    def propose(self, gamma: int, room: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        # After the payoff stop (gamma 0) copies stop too: the draft would read every token
        # emitted since it last read to vet them (fp32 2K: 77 ms a vetting pass against a
        # 43 ms target step; a call stopped from its first pass ran at 0.92x lc, and at
        # 0.99x without copies).
        find = self.lookup.find if gamma else None
        self._x, q = self.model.propose(gamma, room, find)
        return self._x, q

    def q_here(self) -> torch.Tensor | None:
        self._x = self._x[:0]
        return self.model.q_here()

    def commit(self, accepted: int, gamma: int, token: torch.Tensor) -> None:
        self.lookup_drafted += self.model.copies
        self.lookup_accepted += sum(i < accepted for i in self.model.copied_at)
        self.model.commit(accepted, gamma, token)
        self.lookup.extend(torch.cat([self._x[:accepted], token.to(self._x.device)]))
