"""The proposer role: a draft model that proposes gamma tokens and learns what was kept.

Two methods, after transformers' candidate generators: `propose` and `commit`. A proposer may
return fewer drafts than asked (docs/algorithm.md section 2.9): the loop verifies what it got.
`LookupProposer` drafts by copying (section 2.10); `LookupFirst` puts it before the model.
`GammaSchedule` says how many drafts to ask for next.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .config import RapidConfig
from .constraints import Constraints
from .kv import KVState
from .sampling import check_finite, log_probs


class Proposer(Protocol):
    copied: bool
    """Whether the last proposal was copied, not drafted by a model (docs/algorithm.md
    section 2.10): the verdict then treats its proposal as one-hot (`verify.verdict`)."""

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

    copied = False

    def __init__(
        self,
        state: KVState,
        config: RapidConfig,
        generator: torch.Generator,
        constraints: Constraints | None = None,
    ) -> None:
        self.state = state
        self._constraints = constraints
        self._cfg = config
        self._gen = generator
        self._need_q = needs_q(config)
        # eta > 0: the draft reads x_k too, so the bonus row has q and follows p_hat
        # (docs/algorithm.md section 2.7); a grammar's bonus row keeps p. `LookupFirst` reads
        # it too: its copies need the same q (section 2.10).
        self.reads_ahead = config.eta > 0 and constraints is None
        self._x = state.pending[:0]  # [k] the last proposal
        self._fed = 0  # how many of its tokens the draft has read (x_k only if reads_ahead)

    def propose(self, gamma: int, room: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ids x [k] (int64) and q [k, V] (None unless needed; [k + 1, V] with eta > 0,
        a row for the bonus position too), k <= gamma: fewer when the confidence threshold
        stops drafting early. See `Proposer` (`room` is for copies)."""
        if gamma == 0:
            self._x, self._fed = self._x[:0], 0
            return self._x, None
        logits = self.state.feed()[-1]  # [V]
        xs, qs, rows = [], [], []
        for i in range(gamma):
            x, q = self._pick(self._shaped(logits))
            if self._constraints is not None:
                self._constraints.advance(x)
            xs.append(x)
            qs.append(q)
            rows.append(logits)
            if i + 1 < gamma and self._confident(logits, x, q):
                logits = self.state.feed(x)[-1]
            else:
                break
        self._x, self._fed = torch.cat(xs), len(xs) - 1
        if self.reads_ahead:
            qs.append(self._q(self.state.feed(xs[-1])[-1:])[0])
            self._fed += 1
        if not self._need_q:
            # log_probs checks the logits whenever q is computed; once per proposal here, as a
            # check per step would wait on the device between draft steps.
            check_finite(torch.stack(rows), "the draft model")
        return self._x, (torch.stack(qs) if self._need_q else None)

    def _shaped(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] through the call's constraints (docs/algorithm.md section 9); the
        constraints then follow the pick."""
        if self._constraints is None:
            return logits
        return self._constraints.apply(logits[None], logits.new_empty(0, dtype=torch.long))[0]

    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token [1] from logits [V], with q [V] when needed."""
        if self._cfg.greedy:
            q = self._q(logits[None])[0] if self._need_q else None
            return logits.argmax(-1, keepdim=True), q
        q = self._q(logits[None])[0]
        return torch.multinomial(q, 1, generator=self._gen), q

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

    def q_here(self) -> torch.Tensor | None:
        """See `Proposer.q_here`."""
        return self.guide(self._x[:0]) if self.reads_ahead else None

    def guide(self, x: torch.Tensor) -> torch.Tensor:
        """q [k + 1, V] at the positions of x [k] (copies) and one past them: the draft reads
        its pending tokens and x in one pass, and picks none of them."""
        rows = self.state.feed(x)[-(x.numel() + 1) :]  # [k + 1, V]
        self._x, self._fed = x, x.numel()
        return self._q(rows)

    def observe(self, tokens: torch.Tensor) -> None:
        """Commit `tokens` ([k] ids) that another proposer drafted: read on the next propose."""
        self.state.append(tokens)

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

    plain_step: the first pass, the target alone reading one token; per drafted token, the
    draft's seconds and what it adds to the verify pass; and the acceptance curve of recent
    drafts: for each draft index j, how often a pass reached its j-th draft and how often it
    was rejected there. Each verdict (a kept draft, or the rejection) weighs `DECAY` times less
    per later verdict. Acceptance comes in runs on real text (a pass is kept whole or cut
    early), which a single per-draft rate under-counts: at 8K, gamma 8 kept 113 of 119 drafts,
    8.5 tokens a pass, where the rate's (1 - a^9) / (1 - a) says 7.0.
    """

    DECAY = 0.97
    """Weight lost per later verdict: acceptance follows the text being written, over about
    the last 1 / (1 - DECAY) = 33 drafts whatever gamma is (a decay per pass would remember
    fewer drafts at a small gamma, read a lower acceptance there and keep gamma small)."""

    def __init__(self, gamma_max: int) -> None:
        self.plain_step: float | None = None
        self._passes, self._drafted, self._draft_passes = 0, 0, 0
        self._draft_seconds, self._verify_extra = 0.0, 0.0
        self._reached = [0.0] * gamma_max  # decayed passes that reached draft j
        self._rejected = [0.0] * gamma_max  # decayed passes that rejected draft j

    def record(
        self,
        drafted: int,
        accepted: int,
        draft_seconds: float,
        verify_seconds: float,
        draft_passes: int | None = None,
    ) -> None:
        """A pass that drafted `drafted` tokens (0: the plain step) and kept `accepted`, in
        `draft_passes` forward passes of the draft (default: one per draft)."""
        if self.plain_step is None or not drafted:
            # A plain step's draft seconds (the q of section 2.7) are not the target's.
            self.plain_step = self.plain_step or verify_seconds
            return
        self._passes += 1
        self._drafted += drafted
        self._draft_passes += drafted if draft_passes is None else draft_passes
        self._draft_seconds += draft_seconds
        self._verify_extra += verify_seconds - self.plain_step
        rejected = int(accepted < drafted)
        fade = self.DECAY ** (accepted + rejected)
        self._reached = [fade * r + (j < accepted + rejected) for j, r in enumerate(self._reached)]
        self._rejected = [
            fade * r + (j == accepted < drafted) for j, r in enumerate(self._rejected)
        ]

    def expected_tokens(self, gamma: int) -> float:
        """Tokens a pass of `gamma` drafts is expected to emit: 1 + the sum over j < gamma of
        the chance that drafts 0..j are all kept. Draft j is rejected at rate
        (rejections at j + h) / (passes reaching j + 1): one pseudo-pass at the pooled rate
        h = (all rejections + 1) / (all verdicts + 2), which is what an index never reached
        gets."""
        pooled = (sum(self._rejected) + 1) / (sum(self._reached) + 2)
        tokens, kept = 1.0, 1.0
        for reached, rejected in zip(self._reached[:gamma], self._rejected[:gamma], strict=True):
            kept *= 1 - (rejected + pooled) / (reached + 1)
            tokens += kept
        return tokens

    def pass_seconds(self, gamma: int) -> float:
        """Expected seconds of a pass of `gamma` drafts: the plain step, per draft a draft
        forward pass and the verify slope, and the draft forward passes a pass makes beyond
        its drafts (the bonus row's, docs/algorithm.md section 2.7)."""
        assert self.plain_step is not None and self._drafted
        forward = self._draft_seconds / max(1, self._draft_passes)
        slope = max(0.0, self._verify_extra) / self._drafted
        extra = max(0, self._draft_passes - self._drafted) / self._passes
        return self.plain_step + gamma * (forward + slope) + extra * forward

    def speedup(self, gamma: int) -> float:
        """Expected tokens per second of passes of `gamma` drafts, over the plain step's."""
        assert self.plain_step is not None
        return self.expected_tokens(gamma) * self.plain_step / self.pass_seconds(gamma)

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
    stops model drafting (gamma 0 for good; copies go on) once, after each of its last
    `PAYOFF_PASSES` drafting passes, the gamma it would draft next was expected to emit fewer
    tokens per second than plain steps (`PassCosts.speedup` below 1): speculation that loses
    on this device at this length costs a few passes, not the whole call, and a short bad
    stretch of text does not end it.
    """

    PAYOFF_PASSES = 4
    """Drafting passes in a row expected to lose before drafting stops: one pass's tokens
    vary too much."""

    def __init__(self, config: RapidConfig) -> None:
        self._rule = config.adaptive_gamma
        self._max = config.gamma_max
        self._gamma = min(config.gamma, self._max) if self._rule else config.gamma
        self._auto = config.speculate_min_context == "auto"
        self._timed = self._auto or self._rule == "measured"
        self.costs = PassCosts(self._max)
        self._losing = 0  # model-drafting passes in a row expected to lose
        self.stopped = False  # speculation measured slower than the target alone

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
    ) -> None:
        """After a pass that asked for `asked` drafts, got `drafted` and accepted `accepted`
        (emitting accepted + 1 tokens), drafting for `draft_seconds` in `draft_passes` forward
        passes of the draft (default: one per draft) and verifying (the target pass and the
        verdict) for `verify_seconds` of wall time."""
        if self._timed:
            drafts = drafted if asked else 0
            self.costs.record(drafts, accepted, draft_seconds, verify_seconds, draft_passes)
        if not (asked and drafted):
            return
        if self._rule == "measured":
            self._gamma = self.costs.best_gamma(self._max)
        elif self._rule and accepted < drafted:
            self._gamma = max(1, self._gamma - 1)
        elif self._rule and drafted == asked:
            self._gamma = min(self._max, self._gamma + 2)
        # A pass expected to lose lengthens the losing streak; one expected to pay ends it.
        losing = self._auto and self.costs.speedup(self._gamma) < 1
        self._losing = self._losing + 1 if losing else 0
        self.stopped = self._losing >= self.PAYOFF_PASSES


class LookupProposer:
    """Drafts by copying (docs/algorithm.md section 2.10): where the last n tokens of the
    sequence occurred before (n = `ngram` down to 2), propose what followed their latest
    earlier occurrence. Its proposal is one-hot on each proposed id.

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

    def find(self, room: int) -> list[int]:
        """Up to `room` ids continuing the sequence's longest matched suffix ([] if none)."""
        end = len(self._tokens)
        for n in range(self._ngram, 1, -1):
            if end - n < self._start:
                continue
            at = self._next.get(tuple(self._tokens[end - n :]))
            if at is not None:
                return self._tokens[at : at + room]
        return []

    def extend(self, tokens: torch.Tensor) -> None:
        """Commit `tokens` ([k] ids) to the sequence."""
        self._extend(tokens.tolist())


class LookupFirst:
    """The composite proposer: the lookup drafts where it finds a match, the model elsewhere.

    With eta > 0 the model reads each copied pass (`ModelProposer.guide`), so that every
    verdict has its q (docs/algorithm.md section 2.10). With eta = 0 the verdict needs none:
    the model's cache falls behind while the lookup drafts, and the tokens kept meanwhile are
    handed to it (`ModelProposer.observe`) and read on its next proposal.
    """

    def __init__(self, lookup: LookupProposer, model: ModelProposer) -> None:
        self.lookup = lookup
        self.model = model
        self._guided = model.reads_ahead
        self._x = torch.zeros(0, dtype=torch.long)  # the last proposal
        self.copied = False  # whether the lookup made the last proposal
        self.lookup_drafted = 0
        self.lookup_accepted = 0

    @property
    def state(self) -> KVState:
        return self.model.state

    def propose(self, gamma: int, room: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        found = self.lookup.find(room)
        self.copied = bool(found)
        if not found:
            self._x, q = self.model.propose(gamma)
            return self._x, q
        self._x = torch.tensor(found, dtype=torch.long, device=self.model.state.pending.device)
        return self._x, (self.model.guide(self._x) if self._guided else None)

    def q_here(self) -> torch.Tensor | None:
        self._x, self.copied = self._x[:0], False
        return self.model.q_here()

    def commit(self, accepted: int, gamma: int, token: torch.Tensor) -> None:
        kept = torch.cat([self._x[:accepted], token.to(self._x.device)])
        if self.copied:
            self.lookup_drafted += gamma
            self.lookup_accepted += accepted
        if self.copied and not self._guided:
            self.model.observe(kept)
        else:
            self.model.commit(accepted, gamma, token)
        self.lookup.extend(kept)
