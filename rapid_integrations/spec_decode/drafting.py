"""The proposer role: a draft model that proposes gamma tokens and learns what was kept.

A small strategy interface, after transformers' candidate generators (`get_candidates`,
`update_candidate_strategy`): `Proposer.propose` drafts, `Proposer.commit` learns the verdict
(and the tokens forced after it), and `Proposer.counters` counts the call's work for its stats;
the loop (`engine.speculate`) sees nothing else. Terms, as in docs/algorithm.md section 2:

* draft: a token the proposer offers for the target to verify; gamma: how many the model may
  pick on a pass (`schedule.GammaSchedule` says how many), k: how many it offered;
* q: the draft model's sampling distribution at a position, [V] over the vocabulary;
* copy: a draft taken from the lookup (section 2.10) rather than picked by the model;
* bonus row: the position past the last draft, where the target emits one more token.

A proposer may return fewer drafts than asked (section 2.9): the loop verifies what it got.
Drafting and reading ahead are `kv.Forwards` generators: they yield each forward pass of the
draft model as a `kv.Feed`, so one loop serves a sequence alone (`kv.direct`) and in a batch,
whose draft passes run packed together (`batch.BatchRunner`).
`ModelProposer` drafts with a model; `LookupProposer` offers copies; `LookupFirst` has the
model vet them as it drafts, reading those its token price (`token_price`, measured once per
engine) says pay (`copy_prices.CopyPrices`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from rapid_integrations.config import RapidConfig
from rapid_integrations.runtime.kv import Feed, Forwards, KVState, pass_seconds
from rapid_integrations.sample.sampling import check_finite, log_probs
from rapid_integrations.spec_decode.copy_prices import CopyPrices
from rapid_integrations.structured_output.constraints import Constraints

Find = Callable[[list[int], int], list[int]]
"""Copies continuing the sequence and the given drafts, at most n ids ([] if none):
`LookupProposer.find`."""


@dataclass(frozen=True)
class Proposal:
    """What one `Proposer.propose` offered.

    x: [k] int64 drafts; q: the draft model's distributions at their positions, [k, V], or
    [k + 1, V] with the bonus row (None when the verdict needs no q, see `needs_q`); copies:
    how many of x were the lookup's copies the draft kept (the gamma schedule prices them apart
    from the model's picks); passes: the draft's forward passes the proposal ran.
    """

    x: torch.Tensor
    q: torch.Tensor | None
    copies: int = 0
    passes: int = 0


@dataclass(frozen=True)
class DraftCounters:
    """A call's drafting work so far, for its stats: the draft's forward passes and their
    wall seconds, and the lookup's copies offered (read by the draft to vet them), drafted
    (of them, those it kept) and accepted (of those, the ones the target kept); 0 without a
    lookup (`stats.lookup_offered_tokens`)."""

    forward_passes: int
    forward_seconds: float
    lookup_offered: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0


class Proposer(Protocol):
    """What the loop asks of a drafting strategy (`engine.speculate`)."""

    def propose(self, gamma: int, room: int = 0) -> Forwards[Proposal]:
        """Draft k tokens, 0 <= k <= max(gamma, room). A model drafts at most `gamma`;
        copies, which cost no draft step, may run to `room`. gamma 0: no drafts, only the
        draft model's q [1, V] at the next position (None with eta = 0): a pass with no room
        for drafts still follows p_hat (docs/algorithm.md section 2.7)."""
        ...

    def commit(self, accepted: int, tokens: torch.Tensor) -> None:
        """The target kept the first `accepted` drafts of the last proposal, then `tokens`
        [m] follow: the token it emitted, or tokens forced by no model (accepted 0,
        docs/algorithm.md section 13)."""
        ...

    @property
    def counters(self) -> DraftCounters:
        """The call's drafting work so far."""
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
        token_price: float | None = None,
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
        self._copies_offered, self._copies_drafted, self._copies_accepted = 0, 0, 0  # per call
        # Copies are priced at the draft's `token_price` (None: off the CPU, every copy read)
        # only where the output is the same whatever the draft reads: a greedy call's. A
        # sampled call's copies read consume draws, and its seed, given or drawn and reported
        # (`stats.seed`), must repeat it draw for draw on any engine: the price is measured
        # under the machine's load, so a priced call's replay could read other copies.
        priced = config.greedy
        self._prices = CopyPrices(config.lookup_tokens, token_price if priced else None)
        # (position, copy) of the last proposal's lookups not offered, for `_prices`
        self._unoffered: list[tuple[int, int]] = []

    @property
    def counters(self) -> DraftCounters:
        return DraftCounters(
            self.state.forward_passes,
            self.state.forward_seconds,
            self._copies_offered,
            self._copies_drafted,
            self._copies_accepted,
        )

    def propose(self, gamma: int, room: int = 0, find: Find | None = None) -> Forwards[Proposal]:
        """Draft ids x [k] (int64) and q [k, V] (None unless needed; [k + 1, V] with eta > 0,
        a row for the bonus position too, unless x_k ends the call). The model picks at most
        `gamma` of them: fewer when the confidence threshold or an end id stops drafting.

        With `find`, each forward pass of the draft also reads the copies `find` offers after
        the drafts so far and keeps a prefix of them as drafts (`_read`, docs/algorithm.md
        section 2.10): at most `lookup_tokens` copies a proposal, and `copied_at` says which.
        k <= max(gamma, room). gamma 0 without `find`: `Proposer.propose`'s q alone."""
        passes = self.state.forward_passes
        self._x, self._fed, self.copied_at = self._x[:0], 0, []
        if gamma == 0 and find is None:
            q = yield from self._q_here()
            return Proposal(self._x, q, 0, self.state.forward_passes - passes)
        xs: list[torch.Tensor] = []  # drafts [1] ...
        qs: list[torch.Tensor] = []  # ... their q [V]
        picked: list[torch.Tensor] = []  # the logits [V] of each model pick
        tail = self._x[:0]  # what the draft reads next: its pending tokens, then the last pick
        limit = max(gamma, room)
        while True:
            logits, unkept = yield from self._read(tail, xs, qs, limit, find)
            if len(picked) >= gamma or len(xs) >= limit or self._ended(xs):
                read_all = True  # nothing left to pick: the bonus row is `logits`
                break
            tail, q = self._pick(self._shaped(logits), unkept)
            if self._constraints is not None:
                self._constraints.advance(tail)
            xs.append(tail)
            if q is not None:  # None when the verdict needs no q: then qs is never read
                qs.append(q)
            picked.append(logits)
            more = len(picked) < gamma and len(xs) < limit
            # One sync per draft step, as the confidence threshold's: a draft past an end id
            # would cost a whole draft step.
            if not (more and self._confident(logits, tail, q) and not self._ends(tail)):
                read_all = False
                break
        q = yield from self._finish(xs, qs, picked, logits if read_all else None)
        return Proposal(self._x, q, len(self.copied_at), self.state.forward_passes - passes)

    def _read(
        self,
        tail: torch.Tensor,
        xs: list[torch.Tensor],
        qs: list[torch.Tensor],
        limit: int,
        find: Find | None,
    ) -> Forwards[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward pass of the draft over `tail` ([t] ids) and the copies `find` offers
        after the drafts xs (up to `limit` drafts in all, as many as `CopyPrices.worth`; a
        lookup not offered is remembered in `_unoffered`). Copy i is kept with probability
        q_i(x_i), a one-hot proposal's acceptance (greedy: while each is q's argmax, the
        draft's own pick), and the kept prefix joins xs and qs, so every draft is distributed
        as q, as if the draft had drafted it. Returns the draft's logits [V] past xs and the
        first copy it did not keep ([1]; None if none): the next pick comes from q without
        it, so it follows q too."""
        room = min(limit - len(xs), self._cfg.lookup_tokens - len(self.copied_at))
        offer, found = 0, []
        if find and room > 0:  # one copy at least: what the draft's pick is learned against
            offer = self._prices.worth(room)
            found = find(torch.cat(xs).tolist() if xs else [], max(offer, 1))
        if found and not offer:
            self._unoffered.append((len(xs), found[0]))
        copies = torch.tensor(found[:offer], dtype=torch.long, device=tail.device)
        k = copies.numel()
        rows = (yield self._feed(torch.cat([tail, copies])))[-(k + 1) :]  # [k + 1, V] logits
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
        self._prices.learn(k, kept)
        self._copies_offered += k
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
    ) -> Forwards[torch.Tensor | None]:
        """The proposal's q from drafts xs (kept as `_x`), their q rows and the model picks'
        logits; `past` [V]:
        the draft's logits past every draft (it has read them all), None when it has not
        read the last pick. With eta > 0 the bonus row's q comes from `past`, or from one more
        forward pass over the last pick (none after an end id: it is never emitted)."""
        self._x = torch.cat(xs) if xs else self._x[:0]
        self._fed = len(xs) - (past is None)
        if self.reads_ahead and not self._ended(xs):
            if past is None:
                past = (yield self._feed(xs[-1]))[-1]
                self._fed += 1
            qs.append(self._q(past[None])[0])
        if not self._need_q and picked:
            # log_probs checks the logits whenever q is computed; once per proposal here, as a
            # check per step would wait on the device between draft steps.
            check_finite(torch.stack(picked), "the draft model")
        return torch.stack(qs) if self._need_q and qs else None

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
        """Whether to draft past `x` [1], picked from `logits` [V] (q [V] its distribution, or
        None): its draft probability reaches the confidence threshold (as transformers'
        ConfidenceCriteria: the low-confidence token itself is proposed)."""
        threshold = self._cfg.draft_confidence_threshold
        if threshold <= 0:
            return True
        probs = q if q is not None else torch.softmax(logits.float(), dim=-1)
        return bool(probs[x] >= threshold)

    def _ends(self, x: torch.Tensor) -> bool:
        """Whether the draft x [1] ends the call (no bonus row either: it is never emitted)."""
        return bool(self._end_ids) and int(x) in self._end_ids

    def _ended(self, xs: list[torch.Tensor]) -> bool:
        """Whether the last of the drafts xs ([1] each) ends the call."""
        return bool(xs) and self._ends(xs[-1])

    def _q_here(self) -> Forwards[torch.Tensor | None]:
        """The draft reads its pending tokens and drafts nothing: q [1, V] at the next
        position, None unless it reads ahead."""
        if not self.reads_ahead:
            return None
        return self._q((yield self._feed())[-1:])

    def _feed(self, tokens: torch.Tensor | None = None) -> Feed:
        """A forward pass of the draft over its pending tokens and `tokens` ([k] ids)."""
        return Feed(self.state, tokens, draft=True)

    def commit(self, accepted: int, tokens: torch.Tensor) -> None:
        """Roll the draft cache back to the kept drafts and queue `tokens` [m] (int64) after
        them; the proposal is then spent (forced tokens after it commit with accepted 0)."""
        if self._constraints is not None:
            self._constraints.settle(accepted, tokens)
        self._copies_drafted += len(self.copied_at)
        self._copies_accepted += sum(i < accepted for i in self.copied_at)
        self._learn_unoffered()
        # The draft has read its pending tokens and x_1..x_fed of the last proposal.
        self.state.rollback(max(0, self._fed - accepted))
        self.state.append(torch.cat([self._x[self._fed : accepted], tokens.to(self._x.device)]))
        self._x, self._fed, self.copied_at = self._x[:0], 0, []

    def _learn_unoffered(self) -> None:
        """Teach `_prices` the lookups the last proposal did not offer, each as a run of one
        copy: the draft's own pick at its position is the copy with the chance the draft
        would have kept it (greedy: iff it is the argmax; sampled: q(copy))."""
        picked = [(at, copy) for at, copy in self._unoffered if at < self._x.numel()]
        drafts = self._x[[at for at, _ in picked]].tolist() if picked else []
        for (_, copy), draft in zip(picked, drafts, strict=True):
            self._prices.learn(1, int(draft == copy))
        self._unoffered = []


PRICE_CONTEXT = 64
"""Tokens the draft has read when its token price is measured (`token_price`): a retrieved
C^S is short, and what a token adds to a pass changes little with it."""
PRICE_WIDTH = 9
"""The wide pass's tokens: one pick and the most copies of a typical vetting pass."""


def token_price(
    model: PreTrainedModel, vocab: int, decode: Callable[..., Any] | None
) -> float | None:
    """The draft's token price (docs/algorithm.md section 2.10): what a token adds to a
    forward pass, over a one-token pass's seconds, (t_w - t_1) / ((w - 1) t_1) for w =
    `PRICE_WIDTH`, each t the median of three passes (after one untimed) over `PRICE_CONTEXT`
    tokens, through `decode` (the compiled passes, or None for the model). None off the CPU,
    where a pass's seconds are its launch's until the next sync."""
    if model.device.type != "cpu":
        return None
    ids = [i % vocab for i in range(PRICE_CONTEXT + 1)]  # the context, then the pending token
    seconds = pass_seconds(
        model, ids, vocab, (1, PRICE_WIDTH), chunk=PRICE_CONTEXT, warmup=1, decode=decode
    )
    one, wide = seconds[1], seconds[PRICE_WIDTH]
    return max(0.0, (wide - one) / ((PRICE_WIDTH - 1) * one))


def needs_q(config: RapidConfig) -> bool:
    """Whether the verdict needs draft distributions: all but greedy with eta = 0."""
    return not (config.greedy and config.eta == 0)


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

    @property
    def counters(self) -> DraftCounters:
        return self.model.counters

    def propose(self, gamma: int, room: int = 0) -> Forwards[Proposal]:
        """See `Proposer.propose`."""
        # After the payoff stop (gamma 0) copies stop too: the draft would read every token
        # emitted since it last read to vet them, which costs more than a target step
        # (measured in docs/performance.md, "Why these defaults").
        find = self.lookup.find if gamma else None
        proposal = yield from self.model.propose(gamma, room, find)
        self._x = proposal.x
        return proposal

    def commit(self, accepted: int, tokens: torch.Tensor) -> None:
        """See `Proposer.commit`; the lookup's sequence grows by the kept drafts and `tokens`
        [m]."""
        self.model.commit(accepted, tokens)
        self.lookup.extend(torch.cat([self._x[:accepted], tokens.to(self._x.device)]))
        self._x = self._x[:0]
