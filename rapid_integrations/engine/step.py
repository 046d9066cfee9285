"""One pass of speculative decoding over a `Request`: draft, verify, settle.

`speculate` is gpt-fast-sized: the proposer drafts gamma tokens on its short context, the
target reads them in one pass, `verify.verdict` keeps a prefix plus one token, and both KV
caches are rolled back to what was kept (docs/algorithm.md section 2). The verify pass is
yielded as a `Feed`, which its driver runs alone or packed with other calls' (section 14).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rapid_integrations.engine.request import Request
from rapid_integrations.runtime.kv import Feed, Forwards
from rapid_integrations.sample.verify import verdict


@dataclass(frozen=True)
class _Proposal:
    """What the draft phase of a pass proposed.

    x: [k] int64 drafts (k may be below `asked`, section 2.9); q: the draft's distributions
    [k, V] or [k + 1, V] (a bonus row), None when the verdict needs none; asked: the picks the
    schedule asked for; copies: drafts that were the lookup's copies (section 2.10); forwards:
    the draft's forward-pass count before the pass; start, drafted_at: perf_counter seconds
    at the pass's start and when drafting ended."""

    x: torch.Tensor
    q: torch.Tensor | None
    asked: int
    copies: int
    forwards: int
    start: float
    drafted_at: float


def speculate(request: Request) -> Forwards[list[int]]:
    """One pass of the loop: the tokens it commits (accepted drafts, then one more; or the
    forced tokens of `request.forced()`, as a pass of their own). The draft phase (`_draft`) and
    the settle phase (`_settle`) are every sequence's, alone or in a batch; between them the
    verify pass is yielded as a `Feed`, which its driver runs alone or packed with others'."""
    forced = request.forced()
    if forced:
        yield from _force(request, forced)
        return forced
    proposal = yield from _draft(request)
    logits = yield Feed(request.target, proposal.x)  # [k + 1, V]: the verify pass (2.2)
    return _settle(request, proposal, logits)


def _draft(request: Request) -> Forwards[_Proposal]:
    """The draft phase (docs/algorithm.md section 2.1): as many drafts as the schedule asks
    for and the budget leaves room for; none, with the draft's q at the one position decided,
    when there is no room (2.7)."""
    start = time.perf_counter()
    proposer, schedule, cap = request.proposer, request.schedule, request.seat.limit
    left = request.budget() - 1 if proposer and schedule.drafting else 0
    asked = min(schedule.gamma, left, left if cap is None else cap)
    forwards = proposer.state.forward_passes if proposer else 0
    x, q = request.target.pending[:0], None  # a plain step: q too, unless drafting stopped (2.7)
    # A batch's cap of 0 (section 14.2) leaves a pass without drafts, as one without room: the
    # draft gives only its q. A stopped call's proposal is empty, without q.
    if proposer and left > 0 and (asked or schedule.stopped):
        x, q = yield from proposer.propose(asked, left)
    elif proposer and not schedule.stopped:
        q = yield from proposer.q_here()
    copies = proposer.copies if proposer and left > 0 else 0
    return _Proposal(x, q, asked, copies, forwards, start, time.perf_counter())


def _settle(request: Request, proposal: _Proposal, logits: torch.Tensor) -> list[int]:
    """The settle phase, given the verify pass's logits [k + 1, V]: the verdict (sections
    2.3-2.7), both caches and both constraints rolled back to the kept drafts and the emitted
    token (2.8), the schedule taught (2.9); returns the committed tokens."""
    x, q, proposer = proposal.x, proposal.q, request.proposer
    gamma = x.numel()  # a proposer may stop early (docs/algorithm.md section 2.9)
    z = request.constraints.apply(logits, x) if request.constraints else logits
    n, token = verdict(z, x, q, request.cfg, request.gen, request.end_ids)
    committed = x[:n].tolist() + token.tolist()
    if request.scorer:
        request.scorer.score(logits, z, q, request.end_ids, committed)
    request.target.rollback(gamma - n)
    request.target.append(token)
    if request.constraints:
        request.constraints.settle(n, token)
    if proposer:
        proposer.commit(n, gamma, token)
    seconds = (
        proposal.drafted_at - proposal.start,
        time.perf_counter() - proposal.drafted_at,
    )
    forwards = proposer.state.forward_passes - proposal.forwards if proposer else 0
    request.schedule.update(proposal.asked, gamma, n, *seconds, forwards, proposal.copies)
    request.stats.speculation_stopped = request.schedule.stopped
    request.stats.drafted_tokens += gamma
    request.stats.accepted_tokens += n
    return committed


def _force(request: Request, tokens: list[int]) -> Forwards[None]:
    """Commit `tokens` into both caches and both constraints (docs/algorithm.md section 13).
    The target reads them now, but for the last, so that the next pass starts as every pass
    does, from one pending token; the rows read (the pending token's and the forced ones')
    give each forced token the target's raw log probability."""
    target = request.target
    ids = torch.tensor(tokens, dtype=torch.long, device=target.pending.device)
    logits = yield Feed(target, ids[:-1])  # [len(tokens), V]: row i predicts tokens[i]
    target.append(ids[-1:])
    if request.constraints:
        request.constraints.settle(0, ids)
    if request.scorer:
        request.scorer.score(logits, logits, None, None, tokens)
    if request.proposer:
        request.proposer.force(ids)
