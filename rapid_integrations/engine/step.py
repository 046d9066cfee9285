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
from rapid_integrations.spec_decode.drafting import Proposal
from rapid_integrations.spec_decode.schedule import PassRecord


@dataclass(frozen=True)
class _DraftPhase:
    """What the draft phase of a pass proposed.

    proposal: the drafts x [k] (k may be below `asked`, section 2.9), their q and the draft's
    work; asked: the picks the schedule asked for; start, drafted_at: perf_counter seconds at
    the pass's start and when drafting ended."""

    proposal: Proposal
    asked: int
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
    drafted = yield from _draft(request)
    logits = yield Feed(request.target, drafted.proposal.x)  # [k + 1, V]: the verify pass (2.2)
    return _settle(request, drafted, logits)


def _draft(request: Request) -> Forwards[_DraftPhase]:
    """The draft phase (docs/algorithm.md section 2.1): as many drafts as the schedule asks
    for and the budget leaves room for; none, with the draft's q at the one position decided,
    when there is no room (2.7)."""
    start = time.perf_counter()
    proposer, schedule, cap = request.proposer, request.schedule, request.seat.limit
    left = max(0, request.budget() - 1) if proposer and schedule.drafting else 0
    asked = min(schedule.gamma, left, left if cap is None else cap)
    # A batch's cap of 0 (section 14.2) leaves a pass without drafts, as one without room: the
    # draft gives only its q. A stopped call's proposal is empty, without q.
    proposal = Proposal(request.target.pending[:0], None)
    if proposer and not schedule.stopped:
        proposal = yield from proposer.propose(asked, left)
    return _DraftPhase(proposal, asked, start, time.perf_counter())


def _settle(request: Request, drafted: _DraftPhase, logits: torch.Tensor) -> list[int]:
    """The settle phase, given the verify pass's logits [k + 1, V]: the verdict (sections
    2.3-2.7), both caches and both constraints rolled back to the kept drafts and the emitted
    token (2.8), the schedule taught (2.9); returns the committed tokens."""
    x, q, proposer = drafted.proposal.x, drafted.proposal.q, request.proposer
    gamma = x.numel()  # a proposer may stop early (docs/algorithm.md section 2.9)
    z = request.constraints.apply(logits, x) if request.constraints else logits
    lean = request.grounding.rows(x, q) if request.grounding and q is not None else None
    n, token = verdict(z, x, q, request.cfg, request.gen, request.end_ids, lean)
    committed = x[:n].tolist() + token.tolist()
    if request.scorer:
        request.scorer.score(logits, z, q, request.end_ids, committed, lean)
    if request.grounding:
        request.grounding.commit(committed)
        request.stats.grounded_rows += 0 if lean is None else int(lean[: n + 1].sum())
    request.target.rollback(gamma - n)
    request.target.append(token)
    if request.constraints:
        request.constraints.settle(n, token)
    if proposer:
        proposer.commit(n, token)
    done = PassRecord(
        drafted.asked,
        gamma,
        n,
        draft_seconds=drafted.drafted_at - drafted.start,
        verify_seconds=time.perf_counter() - drafted.drafted_at,
        draft_passes=drafted.proposal.passes,
        copied=drafted.proposal.copies,
    )
    request.schedule.update(done)
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
    if request.grounding:
        request.grounding.commit(tokens)
    if request.proposer:
        request.proposer.commit(0, ids)
