"""`Request`: one call while it decodes, and the verbs its loop uses (after vLLM's `Request`).

The engine plans a call (`Plan`: which model decodes which ids, under which config), prefills
its caches, then holds everything the call's passes read and update in one `Request`: the
target's cache, the proposer, the gamma schedule, the sampler, the output sections, the logit
shaping and the call's place in a batch. `step.speculate` runs one pass over it; `commit`
takes the pass's tokens; `output` ends the call.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from rapid_integrations.config import RapidConfig
from rapid_integrations.output.logprobs import LogprobScorer
from rapid_integrations.output.outputs import Delta, FinishReason, RapidOutput, RapidStats
from rapid_integrations.runtime.kv import KVState
from rapid_integrations.sample.grounding import Grounding
from rapid_integrations.spec_decode.batch_caps import BatchSeat
from rapid_integrations.spec_decode.drafting import Proposer
from rapid_integrations.spec_decode.schedule import GammaSchedule
from rapid_integrations.structured_output.constraints import Constraints
from rapid_integrations.structured_output.sections import Gate, Sections
from rapid_integrations.structured_output.tools import Tools

if TYPE_CHECKING:
    from rapid_integrations.retrieval.following import Following
    from rapid_integrations.structured_output.grammar import Grammar


@dataclass(frozen=True)
class Plan:
    """Which model decodes which ids for one call: `main` reads `ids` (the target, or the
    draft in `rag` mode) within its `window`; `draft_ids` are the draft's (None: no draft)."""

    main: PreTrainedModel
    ids: list[int]
    window: int
    draft_ids: list[int] | None
    cfg: RapidConfig
    grammar: Grammar | None = None
    tools: Tools | None = None
    gate: Gate | None = None  # the reasoning section (docs/algorithm.md section 13)
    # C^S read from the target's cache (a retriever named in `CACHE_RETRIEVERS`): the plan
    # with the draft's ids, made from the target's state once its prefill is done; None: known
    # now.
    after_prefill: Callable[[KVState], Plan] | None = None
    # C^S that follows the answer (retriever "following"): its chunks and scores, chosen
    # again as the answer unfolds (`RapidEngine._follow`); None: C^S is fixed.
    following: Following | None = None


@dataclass
class Request:
    """One call while it decodes: what each of its passes reads and updates.

    `target` is the deciding model's cache; `proposer` drafts (None: the target alone);
    `schedule` says how many drafts to ask for and learns from every pass; `gen` draws the
    verdict's samples. `limit` is how many tokens the call may emit and `eos` the ids that end
    it; `sections` turns committed tokens into text, reasoning and tool calls. `end_ids` are
    the end guard's ids (None: no guard); `constraints` shape the target's logits
    (docs/algorithm.md section 9; None: raw logits), `draft_constraints` the draft's; `scorer`
    scores each pass's committed tokens (section 12; None: no log probabilities). `seat` is the
    call's place in a batch, whose cap bounds gamma (section 14.2; alone, none); `grounding`
    picks the rows the verdict leans on (`eta_rule="grounded"`, section 2.3; None: all);
    `draft` is the draft's sequence, which a C^S that follows the answer rebuilds (section
    2.13; None: no draft model). `start` is the perf_counter second the call was made; `emit`
    gets each committed delta.
    """

    plan: Plan
    stats: RapidStats
    start: float
    emit: Callable[[Delta], None]
    limit: int
    eos: frozenset[int]
    target: KVState
    gen: torch.Generator
    schedule: GammaSchedule
    sections: Sections
    proposer: Proposer | None = None
    end_ids: torch.Tensor | None = None
    constraints: Constraints | None = None
    draft_constraints: Constraints | None = None
    scorer: LogprobScorer | None = None
    seat: BatchSeat = field(default_factory=BatchSeat)
    grounding: Grounding | None = None
    draft: KVState | None = None

    def __post_init__(self) -> None:
        self.seat.schedule = self.schedule if self.proposer else None
        # Capped where no output is promised under one gamma: a greedy call's is the same
        # under any, an unseeded sampled call's draws were never repeatable (section 14.2).
        self.seat.cappable = self.constraints is None and (self.cfg.greedy or self.cfg.seed is None)

    @property
    def cfg(self) -> RapidConfig:
        return self.plan.cfg

    def budget(self) -> int:
        """How many tokens the next pass may commit: up to the token limit, and up to the end
        of the thinking budget (docs/algorithm.md section 13); drafting never proposes past it."""
        left = self.limit - len(self.sections.ids)
        room = self.sections.room()
        return left if room is None else min(left, room)

    def forced(self) -> list[int]:
        """Tokens to commit that no model chose, asked before each pass: the end marker of a
        spent thinking budget (section 13); [] for none. They are a step of their own."""
        return self.sections.forced(self.limit - len(self.sections.ids))

    def commit(self, committed: list[int]) -> FinishReason | None:
        """Commit one pass's tokens in order, each delta to `emit`, up to the one that ends
        generation; returns why it ends (None: it goes on)."""
        for token in committed:
            self.stats.time_to_first_token = (
                self.stats.time_to_first_token or time.perf_counter() - self.start
            )
            before = len(self.sections.ids)
            delta, finish = self._push(token)
            scored = self.scorer.commit(len(self.sections.ids) > before) if self.scorer else ()
            delta = dataclasses.replace(delta, logprobs=scored)
            if delta.releases():
                self.emit(delta)
            if finish:
                return finish
        return None

    def output(self, finish: FinishReason) -> RapidOutput:
        """The call's output once it has ended, its counters filled in."""
        self._count()
        calls = self.sections.calls.calls if self.sections.calls else []
        return RapidOutput(
            self.sections.text,
            self.sections.ids,
            "tool_calls" if calls and finish == "eos" else finish,
            self.stats.finalize(),
            len(self.plan.ids),
            calls,
            self.scorer.kept if self.scorer else None,
            self.sections.reasoning,
        )

    def _push(self, token: int) -> tuple[Delta, FinishReason | None]:
        """Commit one token; return what it releases and why generation ends, if it does."""
        sections = self.sections
        if token in self.eos:
            return sections.finish(), "eos"
        delta = sections.push(token)
        if sections.stopped:
            return _joined(delta, sections.finish()), "stop"
        if len(sections.ids) >= self.limit:
            return _joined(delta, sections.finish()), "length"
        return delta, None

    def _count(self) -> None:
        """The call's token, forward-pass and grammar counters."""
        stats, proposer = self.stats, self.proposer
        stats.new_tokens = len(self.sections.ids)
        stats.reasoning_tokens = self.sections.reasoning_tokens
        stats.target_forward_passes = self.target.forward_passes
        stats.target_forward_seconds = self.target.forward_seconds
        shaping = (self.constraints, self.draft_constraints)
        stats.grammar_seconds = sum(c.seconds for c in shaping if c)
        if self.plan.following:
            stats.follow_updates = self.plan.following.updates
            stats.follow_seconds = self.plan.following.seconds
        if proposer:
            counters = proposer.counters
            stats.draft_forward_passes = counters.forward_passes
            stats.draft_forward_seconds = counters.forward_seconds
            stats.lookup_offered_tokens = counters.lookup_offered
            stats.lookup_drafted_tokens = counters.lookup_drafted
            stats.lookup_accepted_tokens = counters.lookup_accepted


def _joined(first: Delta, second: Delta) -> Delta:
    """Two steps' releases as one (`Sections` deltas: no log probabilities)."""
    return Delta(
        first.text + second.text,
        reasoning=first.reasoning + second.reasoning,
        tool_calls=first.tool_calls + second.tool_calls,
    )
