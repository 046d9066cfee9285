"""The proposer role: a draft model that proposes gamma tokens and learns what was kept.

A small strategy interface, after transformers' candidate generators (`get_candidates`,
`update_candidate_strategy`): `Proposer.propose` drafts, `Proposer.commit` learns the verdict;
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
model vet them as it drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from transformers import PreTrainedModel

from .config import RapidConfig
from .constraints import Constraints
from .kv import Feed, Forwards, KVState
from .sampling import check_finite, log_probs

Find = Callable[[list[int], int], list[int]]
"""Copies continuing the sequence and the given drafts, at most n ids ([] if none):
`LookupProposer.find`."""


class Proposer(Protocol):
    """What the loop asks of a drafting strategy (`engine.speculate`, `RapidEngine._run`)."""

    @property
    def state(self) -> KVState:
        """The draft model's cache: the loop reads its `forward_passes` and
        `forward_seconds` for the call's stats."""
        ...

    @property
    def copies(self) -> int:
        """How many drafts of the last proposal were copies the draft kept (the gamma
        schedule prices them apart from the model's picks)."""
        ...

    @property
    def lookup_counts(self) -> tuple[int, int]:
        """(drafted, accepted) over the call: copies the draft kept as drafts, and of them
        those the target kept ((0, 0) without a lookup; `stats.lookup_drafted_tokens`)."""
        ...

    def propose(
        self, gamma: int, room: int = 0
    ) -> Forwards[tuple[torch.Tensor, torch.Tensor | None]]:
        """Draft k tokens, 0 <= k <= max(gamma, room): ids [k] and the draft model's
        distributions q at their positions, [k, V], or [k + 1, V] with a row one past them
        (None when the verdict does not need q, see `needs_q`). A model drafts at most
        `gamma` (0: none); copies, which cost no draft step, may run to `room`."""
        ...

    def commit(self, accepted: int, gamma: int, token: torch.Tensor) -> None:
        """The target kept the first `accepted` of the `gamma` drafts, then emitted `token` [1]."""
        ...

    def q_here(self) -> Forwards[torch.Tensor | None]:
        """No drafts, only the draft model's q [1, V] at the next position (None with eta = 0):
        a pass with no room for drafts still follows p_hat (docs/algorithm.md section 2.7)."""
        ...

    def force(self, tokens: torch.Tensor) -> None:
        """After `commit`: `tokens` [k] follow, committed by no model (docs/algorithm.md
        section 13)."""
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
        head: DraftHead | None = None,
    ) -> None:
        self.state = state
        self._head = head if head is not None else DraftHead()
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
        self._picked, self._missed = 0, 0  # drafts of parted picks, and those not q's argmax
        # eta > 0: the draft reads x_k too, so the bonus row has q and follows p_hat
        # (docs/algorithm.md section 2.7); a grammar's bonus row keeps p.
        self.reads_ahead = config.eta > 0 and constraints is None
        self._x = state.pending[:0]  # [k] the last proposal
        self._fed = 0  # how many of its tokens the draft has read (x_k only if reads_ahead)
        self.copied_at: list[int] = []  # which drafts of the last proposal were copies
        self._copies_drafted, self._copies_accepted = 0, 0  # over the call: `lookup_counts`

    @property
    def copies(self) -> int:
        return len(self.copied_at)

    @property
    def _picks_only(self) -> bool:
        """Whether a pick reads only its argmax among the head's part (`DraftHead.picks`):
        greedy, unshaped, with a part; its q, which the verdict reads at eta > 0, waits for
        the proposal's end, headed for all its drafts at once (`_filled`)."""
        return self._cfg.greedy and self._constraints is None and self._head.parted

    @property
    def lookup_counts(self) -> tuple[int, int]:
        return self._copies_drafted, self._copies_accepted

    def propose(
        self, gamma: int, room: int = 0, find: Find | None = None
    ) -> Forwards[tuple[torch.Tensor, torch.Tensor | None]]:
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
        qs = _Qs()  # ... their q [V] (read only when the verdict needs q)
        picked: list[torch.Tensor] = []  # the row (logits [V] or hidden [d]) of each model pick
        tail = self._x[:0]  # what the draft reads next: its pending tokens, then the last pick
        limit = max(gamma, room)
        while True:
            row, unkept = yield from self._read(tail, xs, qs, limit, find)
            if len(picked) >= gamma or len(xs) >= limit or self._ended(xs):
                read_all = True  # nothing left to pick: the bonus row is `row`
                break
            tail, q = self._pick(row, unkept)
            if self._constraints is not None:
                self._constraints.advance(tail)
            xs.append(tail)
            qs.add(q, row)
            picked.append(row)
            more = len(picked) < gamma and len(xs) < limit
            # One sync per draft step, as the confidence threshold's: a draft past an end id
            # would cost a whole draft step.
            if not (more and self._confident(row, tail, q) and not self._ends(tail)):
                read_all = False
                break
        return (yield from self._finish(xs, qs, picked, row if read_all else None))

    def _read(
        self,
        tail: torch.Tensor,
        xs: list[torch.Tensor],
        qs: _Qs,
        limit: int,
        find: Find | None,
    ) -> Forwards[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward pass of the draft over `tail` ([t] ids) and the copies `find` offers
        after the drafts xs (up to `limit` drafts in all). Copy i is kept with probability
        q_i(x_i), a one-hot proposal's acceptance (greedy: while each is the draft's own
        pick, `DraftHead.picks`), and the kept prefix joins xs and qs, so every draft is
        distributed as the draft's picks, as if the draft had drafted it. Returns the draft's
        row (logits [V] or hidden [d]) past xs and the first copy it did not keep ([1]; None
        if none): the next pick comes from q without it, so it follows q too."""
        n = min(limit - len(xs), self._cfg.lookup_tokens - self.copies)
        found = find(torch.cat(xs).tolist() if xs else [], n) if find and n > 0 else []
        copies = torch.tensor(found, dtype=torch.long, device=tail.device)
        k = copies.numel()
        rows = (yield self._feed(torch.cat([tail, copies])))[-(k + 1) :]  # [k + 1, V or d]
        if not k:
            return rows[0], None
        q = None  # [k, V]: read at the proposal's end after parted picks (`_filled`)
        if self._picks_only:
            keep = self._head.picks(rows[:k]) == copies
        else:
            logits = self._head.logits(rows[:k])
            q = self._q(logits) if self._need_q else None
            if q is None or self._cfg.greedy:
                keep = logits.argmax(-1) == copies
            else:
                u = torch.rand(k, generator=self._gen, device=q.device)
                keep = u < q.gather(1, copies[:, None])[:, 0]
        # Kept up to the first copy not kept, or through the first end id (then drafting stops).
        keep[1:] &= ~torch.isin(copies[:-1], self._end_tensor)
        kept = int(keep.int().cumprod(0).sum())
        self.state.rollback(k - kept)
        self.copied_at += range(len(xs), len(xs) + kept)
        xs.extend(copies[:kept, None])  # [1] each
        for i in range(kept):
            qs.add(None if q is None else q[i], rows[i])
        return rows[kept], (copies[kept : kept + 1] if kept < k else None)

    def _finish(
        self,
        xs: list[torch.Tensor],
        qs: _Qs,
        picked: list[torch.Tensor],
        past: torch.Tensor | None,
    ) -> Forwards[tuple[torch.Tensor, torch.Tensor | None]]:
        """The proposal from drafts xs, their q and the model picks' rows; `past` [V or d]:
        the draft's row past every draft (it has read them all), None when it has not read
        the last pick. With eta > 0 the bonus row's q comes from `past`, or from one more
        forward pass over the last pick (none after an end id: it is never emitted)."""
        self._x = torch.cat(xs) if xs else self._x[:0]
        self._fed = len(xs) - (past is None)
        if self.reads_ahead and not self._ended(xs):
            if past is None:
                past = (yield self._feed(xs[-1]))[-1]
                self._fed += 1
            qs.add(None, past)
        if not self._need_q and picked:
            # log_probs checks the logits whenever q is computed; once per proposal here, as a
            # check per step would wait on the device between draft steps.
            check_finite(torch.stack(picked), "the draft model")
        return self._x, (self._filled(qs) if self._need_q and qs.rows else None)

    def _filled(self, qs: _Qs) -> torch.Tensor:
        """The drafts' q [n, V]: those read as they were picked, the rest from their rows,
        headed together (one read of the draft's head for the whole proposal)."""
        waiting = [i for i, q in enumerate(qs.qs) if q is None]
        if not waiting:
            return torch.stack(cast(list[torch.Tensor], qs.qs))
        rows = torch.stack([qs.rows[i] for i in waiting])
        for i, q in zip(waiting, self._q(self._head.logits(rows)), strict=True):
            qs.qs[i] = q
        q = torch.stack(cast(list[torch.Tensor], qs.qs))
        if self._head.parted:
            self._count_misses(q[: self._x.numel()])
        return q

    def _count_misses(self, q: torch.Tensor) -> None:
        """Count the proposal's drafts (q [k, V] theirs) that are not q's argmax: picks whose
        argmax lay outside the head's part. Past `MAX_MISSES` of the call's picks, the call
        picks among the whole vocabulary from its next proposal on (`DraftHead.whole`)."""
        self._picked += self._x.numel()
        self._missed += int((q.argmax(-1) != self._x).sum())
        if self._picked >= MIN_PICKS and self._missed > MAX_MISSES * self._picked:
            self._head = self._head.whole()

    def _shaped(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] through the call's constraints (docs/algorithm.md section 9); the
        constraints then follow the pick."""
        if self._constraints is None:
            return logits
        return self._constraints.apply(logits[None], logits.new_empty(0, dtype=torch.long))[0]

    def _pick(
        self, row: torch.Tensor, unkept: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token [1] from the draft's row (logits [V] or hidden [d]), with q [V]
        when needed now (`_picks_only`: later). `unkept` [1]: a copy the draft did not keep
        (`_read`), so the token comes from q without it, q's residual after a one-hot
        proposal; greedy needs no change, as its pick is not that copy."""
        if self._picks_only:
            return self._head.picks(row[None]), None
        logits = self._shaped(self._head.logits(row[None])[0])
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

    def _confident(self, row: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None) -> bool:
        """Whether to draft past `x` [1], picked from the draft's `row` (q [V] its
        distribution, or None): its draft probability reaches the confidence threshold (as
        transformers' ConfidenceCriteria: the low-confidence token itself is proposed)."""
        threshold = self._cfg.draft_confidence_threshold
        if threshold <= 0:
            return True
        probs = q if q is not None else torch.softmax(self._head.logits(row[None])[0].float(), -1)
        return bool(probs[x] >= threshold)

    def _ends(self, x: torch.Tensor) -> bool:
        """Whether the draft x [1] ends the call (no bonus row either: it is never emitted)."""
        return bool(self._end_ids) and int(x) in self._end_ids

    def _ended(self, xs: list[torch.Tensor]) -> bool:
        """Whether the last of the drafts xs ([1] each) ends the call."""
        return bool(xs) and self._ends(xs[-1])

    def q_here(self) -> Forwards[torch.Tensor | None]:
        """See `Proposer.q_here`: the draft reads its pending tokens and drafts nothing."""
        self._x, self._fed, self.copied_at = self._x[:0], 0, []
        if not self.reads_ahead:
            return None
        return self._q(self._head.logits((yield self._feed())[-1:]))

    def _feed(self, tokens: torch.Tensor | None = None) -> Feed:
        """A forward pass of the draft over its pending tokens and `tokens` ([k] ids)."""
        return Feed(self.state, tokens, draft=True)

    def commit(self, accepted: int, gamma: int, token: torch.Tensor) -> None:
        """Roll the draft cache back to the kept drafts and queue `token` [1] (int64) after them."""
        if self._constraints is not None:
            self._constraints.settle(accepted, token)
        self._copies_drafted += self.copies
        self._copies_accepted += sum(i < accepted for i in self.copied_at)
        # The draft has read its pending tokens and x_1..x_fed of the last proposal.
        self.state.rollback(max(0, self._fed - accepted))
        self.state.append(torch.cat([self._x[self._fed : accepted], token.to(self._x.device)]))

    def force(self, tokens: torch.Tensor) -> None:
        """See `Proposer.force`: queued after the committed tokens, through the constraints."""
        if self._constraints is not None:
            self._constraints.settle(0, tokens)
        self.state.append(tokens)


class DraftHead:
    """How the proposer reads a draft pass's rows: logits [n, V] as they are (no `head`), or
    the body's hidden states [n, d] (`KVState.hidden`) through the draft's output `head`.

    A greedy pick with nothing shaping it needs only the argmax (`picks`); with `pick_from`
    ([S] ids, ascending: `draft_pick_vocab`'s) it is taken among those S ids alone, the head's rows for them
    gathered once per call, so a pass reads S x d of the head, not V x d. The argmax of the
    whole head is that of the part whenever it lies in the part (ties go to the lower id in
    both), and a greedy verdict emits argmax p_hat whatever was drafted (docs/algorithm.md
    section 3): the part changes which drafts are offered, never the output. q, which the
    verdict reads at eta > 0, is always the whole head's (`logits`)."""

    def __init__(
        self,
        head: torch.nn.Module | None = None,
        vocab: int = 0,
        pick_from: torch.Tensor | None = None,
    ) -> None:
        self._head, self._vocab, self._ids = head, vocab, pick_from
        self._part: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if head is not None and pick_from is not None:
            bias = cast(torch.Tensor | None, head.bias)
            self._part = (
                cast(torch.Tensor, head.weight).index_select(0, pick_from),  # [S, d]
                None if bias is None else bias.index_select(0, pick_from),  # [S]
            )

    @classmethod
    def reading(
        cls, model: PreTrainedModel, vocab: int, first: int = 0, prompts: Sequence[int] = ()
    ) -> DraftHead:
        """The head of a draft whose passes send back hidden states: `model`'s output head,
        a greedy pick among the `first` ids and those of `prompts` (`first` 0: among all;
        so also where the head is no plain Linear, whose rows cannot be gathered). The first
        ids of a byte-level BPE vocabulary are its earliest merges, its commonest tokens, and
        a prompt's own ids are what the lookup copies (docs/performance.md, "Why these
        defaults")."""
        head = cast(torch.nn.Module, model.get_output_embeddings())
        if not first or type(head) is not torch.nn.Linear or vocab <= first:
            return cls(head, vocab)
        ids = set(range(first)).union(i for i in prompts if i < vocab)
        return cls(head, vocab, torch.tensor(sorted(ids), device=head.weight.device))

    @property
    def parted(self) -> bool:
        """Whether greedy picks are taken among a part of the vocabulary."""
        return self._part is not None

    def whole(self) -> DraftHead:
        """This head, its picks among the whole vocabulary."""
        return DraftHead(self._head, self._vocab)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """The draft's logits [n, V] at rows [n, V or d]."""
        return rows if self._head is None else self._head(rows)[..., : self._vocab]

    def picks(self, rows: torch.Tensor) -> torch.Tensor:
        """The greedy picks [n] (int64) at rows [n, V or d]: the argmax of the logits, over
        `pick_from` where the head has one."""
        if self._part is None or self._ids is None:
            return self.logits(rows).argmax(-1)
        return self._ids[torch.nn.functional.linear(rows, *self._part).argmax(-1)]


MAX_MISSES = 0.03
"""The share of a call's parted picks (`DraftHead.picks`) not q's argmax above which the call
picks among the whole vocabulary. A miss is a draft the verdict will likely reject, and the
drafts after it go with it: at 8K from int4 weights a pass over a part of 8,192 ids took 10.7
against 13.6 ms, 8 of them a proposal, so a part pays while misses stay under about 3% of
picks (docs/performance.md, "Why these defaults"); free text past a document missed 7-9%."""
MIN_PICKS = 32
"""Parted picks a call makes before its misses are weighed (`MAX_MISSES`)."""


@dataclass
class _Qs:
    """A proposal's drafts' q [V] (None: not read yet, `ModelProposer._filled`) and the draft
    rows they come from, in order, the bonus row last where it has one."""

    qs: list[torch.Tensor | None] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)

    def add(self, q: torch.Tensor | None, row: torch.Tensor) -> None:
        self.qs.append(q)
        self.rows.append(row)


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
    def state(self) -> KVState:
        return self.model.state

    @property
    def copies(self) -> int:
        return self.model.copies

    @property
    def lookup_counts(self) -> tuple[int, int]:
        return self.model.lookup_counts

    def propose(
        self, gamma: int, room: int = 0
    ) -> Forwards[tuple[torch.Tensor, torch.Tensor | None]]:
        """See `Proposer.propose`: ids [k] and q [k, V] or [k + 1, V] (or None)."""
        # After the payoff stop (gamma 0) copies stop too: the draft would read every token
        # emitted since it last read to vet them, which costs more than a target step
        # (measured in docs/performance.md, "Why these defaults").
        find = self.lookup.find if gamma else None
        self._x, q = yield from self.model.propose(gamma, room, find)
        return self._x, q

    def q_here(self) -> Forwards[torch.Tensor | None]:
        self._x = self._x[:0]
        return (yield from self.model.q_here())

    def commit(self, accepted: int, gamma: int, token: torch.Tensor) -> None:
        """See `Proposer.commit`; the lookup's sequence grows by the kept drafts and `token`
        [1]."""
        self.model.commit(accepted, gamma, token)
        self.lookup.extend(torch.cat([self._x[:accepted], token.to(self._x.device)]))

    def force(self, tokens: torch.Tensor) -> None:
        """See `Proposer.force`; the lookup's sequence grows by `tokens` too."""
        self.model.force(tokens)
        self.lookup.extend(tokens)
