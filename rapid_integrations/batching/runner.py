"""Continuous batching: many calls on one engine, their forward passes packed together.

Each call runs the engine's own loop (`RapidEngine._decode`, `engine.speculate`): a
generator that yields every forward pass it needs as a `kv.Feed` and is sent back the logits.
Alone, each feed is a forward pass of its own (`RapidEngine.generate`); here, a `step` runs the
feeds of every running call on one model as one pass over a packed row (`kv.feed_packed`, the
varlen layout of `kv.PackedCache`):

* draft passes first: while any call is drafting, a step runs only draft passes (one per
  draft model), so the draft model drafts for all calls together, each at its own depth;
* then one verify pass: once every call has its drafts, one target pass reads every call's
  pending token and drafts (ragged: each its own gamma, positions and KV length). Each call's
  verdict, rollback and schedule (its settle phase) follow on its own rows only.

A call joins with `submit` (planned then: bad input raises there) and is prefilled one chunk
(`prefill_chunk_size`) per pass of its model: its target's chunks ride the verify passes, its
draft's the draft passes, so a newcomer stalls the running calls by at most one chunk a step.
It leaves when it finishes (`outputs`), fails (`errors`) or is cancelled (`cancel`); its caches
go with it. A runner is driven by one thread.
Every call keeps its own seed, caches and constraints, so its output is the one it would have
alone (with eta = 0 greedy, token for token: tests/test_batch.py), whatever else runs.
"""

from __future__ import annotations

import itertools
import time
import traceback
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from rapid_integrations.config import Mode
from rapid_integrations.engine.call_options import CallOptions
from rapid_integrations.errors import RapidConfigError
from rapid_integrations.output.outputs import Delta, Deltas, RapidOutput
from rapid_integrations.runtime.kv import Feed, Forwards, feed_packed, new_cache, packing_refusal
from rapid_integrations.runtime.threads import follow_load
from rapid_integrations.spec_decode.batch_caps import BatchCosts, BatchSeat
from rapid_integrations.tokens import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rapid_integrations.engine.rapid_engine import RapidEngine


@dataclass
class _Call:
    """A running call: its loop, the pass it waits for and its place in the batch (its
    schedule, and the cap on its gamma)."""

    steps: Forwards[RapidOutput]
    seat: BatchSeat
    feed: Feed | None = None


class BatchRunner:
    """Runs calls on `engine` side by side, one packed forward pass per model and step.

    `submit` a call (the arguments of `RapidEngine.generate`), `step` until `running` is
    empty, read `outputs[id]` (or `errors[id]`); `take_deltas(id)` streams a call's deltas.
    Both models must run `attention.rapid_attention` (SDPA models do, `use_rapid_attention`)
    with full-attention layers only.

    With `costs` (a `batch_caps.BatchCosts`; `Batcher.over` gives one), speculation adapts to
    load (docs/algorithm.md section 14.2): every step is timed into it, and before each draft
    phase the runner caps the gamma of every greedy or unseeded call at the cap it picks:
    `cap` is the latest (None: none), `caps` counts the verify steps each cap preceded. A
    seeded sampled or a shaped call (grammar, penalty) drafts as its schedule asks
    (`BatchSeat.cappable`), and so does every call without costs. Either way each call's
    output is its `generate` output (an unseeded call's: in law).
    """

    def __init__(self, engine: RapidEngine, costs: BatchCosts | None = None) -> None:
        for role, model in (("target", engine.target), ("draft", engine.draft)):
            _check_packable(model, role)
        self.costs = costs
        self.cap: int | None = None
        self.caps: Counter[int | None] = Counter()
        self._engine = engine
        self._calls: dict[int, _Call] = {}
        self._deltas: dict[int, Deltas] = {}  # committed, not yet taken
        self._ids = itertools.count()
        self.outputs: dict[int, RapidOutput] = {}
        self.errors: dict[int, Exception] = {}

    @property
    def running(self) -> list[int]:
        """The ids of the calls still decoding."""
        return list(self._calls)

    def submit(
        self,
        prompt: Prompt,
        draft_prompt: Prompt | None = None,
        mode: Mode | None = None,
        *,
        options: CallOptions | None = None,
        **overrides: Any,
    ) -> int:
        """Plan a call now (bad input raises here); its prefill runs in the next steps, a
        chunk a step, and then it decodes. Returns its id."""
        call_id = next(self._ids)
        deltas = Deltas()
        resolved = CallOptions.for_call(options, draft_prompt, mode, overrides)
        seat = BatchSeat(cap=self.cap)  # a newcomer's first draft phase is capped too
        steps = self._engine.decoding(prompt, resolved, deltas.append, seat)
        self._calls[call_id], self._deltas[call_id] = _Call(steps, seat), deltas
        self._advance(call_id, None)
        return call_id

    @torch.inference_mode()
    def step(self) -> int:
        """One packed forward pass per model: every drafting call's draft pass, or, once no
        call drafts, every call's verify pass; each call then runs on to its next pass.
        Returns the tokens the step's passes read (prefill chunks, pending tokens, drafts).
        Before a verify pass, whose logits start the calls' next draft phases, the cap on
        their gamma is set (docs/algorithm.md section 14.2); the step's seconds, settle phases
        included (where the device is waited for), go to `costs`."""
        follow_load()  # threads.py: fewer threads while other processes are busy
        start = time.perf_counter()
        waiting = {i: c.feed for i, c in self._calls.items() if c.feed is not None}
        drafting = {i: f for i, f in waiting.items() if f.draft}
        stepped = drafting or waiting
        if not stepped:
            return 0
        tokens = sum(_width(f) for f in stepped.values())  # before the passes take them
        if self.costs and not drafting:
            self._cap_drafts(self.costs)
        for group in _by_model(stepped):
            logits = _packed([waiting[i] for i in group])
            # A failed pass: its error is thrown into each call it read.
            sent: Sequence[torch.Tensor | Exception] = (
                [logits] * len(group) if isinstance(logits, Exception) else logits
            )
            for i, rows in zip(group, sent, strict=True):
                self._advance(i, rows)
        if self.costs:
            self.costs.record(bool(drafting), tokens, time.perf_counter() - start)
        return tokens

    def cancel(self, call_id: int) -> None:
        """Stop a running call; its caches are freed and the others run on unchanged."""
        call = self._calls.pop(call_id, None)
        if call is not None:
            call.steps.close()
            self._deltas.pop(call_id, None)

    def run(self) -> None:
        """Step until every call has finished."""
        while self._calls:
            self.step()

    def take_deltas(self, call_id: int) -> list[Delta]:
        """The deltas a call committed since the last take; a finished call's last ones are
        kept until taken, a cancelled or failed call's are dropped with it."""
        taken = self._deltas.get(call_id, Deltas()).take()
        if call_id not in self._calls:
            self._deltas.pop(call_id, None)
        return taken

    def _cap_drafts(self, costs: BatchCosts) -> None:
        """Cap every call's next draft phase at the cap `costs` picks from each call's gamma
        and acceptance curve (docs/algorithm.md section 14.2)."""
        seats = [c.seat for c in self._calls.values()]
        # A seeded sampled or a shaped call is not capped (`BatchSeat.cappable`); the cap is
        # chosen as though it were, which only matters in a batch that mixes them with others.
        wants = [(s.schedule.gamma, s.schedule.costs) if s.schedule else (0, None) for s in seats]
        self.cap = costs.cap(wants)
        self.caps[self.cap] += 1
        for seat in seats:
            seat.cap = self.cap  # obeyed where the seat is cappable (`BatchSeat.limit`)

    @torch.inference_mode()
    def _advance(self, call_id: int, logits: torch.Tensor | Exception | None) -> None:
        """Send a call its pass's logits [rows, V] (None: start it; an exception: its pass
        failed) and run it to its next pass; record its output when it finishes, its error
        when it fails."""
        outcome = _resume(self._calls[call_id], logits)
        if isinstance(outcome, Feed):
            self._calls[call_id].feed = outcome
        elif isinstance(outcome, RapidOutput):
            self.outputs[call_id] = outcome
            del self._calls[call_id]
        else:
            self._fail(call_id, outcome)

    def _fail(self, call_id: int, exc: Exception) -> None:
        """Keep a failed call's error and drop the call. The error's frames are cleared, or
        it would keep the call's caches alive for as long as `errors` holds it."""
        traceback.clear_frames(exc.__traceback__)
        self.errors[call_id] = exc
        self.cancel(call_id)


def generate_batch(
    engine: RapidEngine,
    prompts: Sequence[Prompt],
    *,
    options: CallOptions | None = None,
    **overrides: Any,
) -> list[RapidOutput]:
    """`engine.generate` for each prompt, decoded together by a `BatchRunner`; each output is
    the one `generate` would give (docs/algorithm.md section 14). The first call that failed
    raises its error."""
    runner = BatchRunner(engine)
    ids = [runner.submit(prompt, options=options, **overrides) for prompt in prompts]
    runner.run()
    for i in ids:
        if i in runner.errors:
            raise runner.errors[i]
    return [runner.outputs[i] for i in ids]


def _resume(call: _Call, logits: torch.Tensor | Exception | None) -> Feed | RapidOutput | Exception:
    """Run a call's loop to its next pass (its `Feed`), its output, or its error (`logits` an
    exception: its pass's, thrown into the loop, which raises it as the engine's error). The
    error is returned, not raised, so that the frame that caught it has ended when `_fail`
    clears the error's frames (a running frame cannot be cleared, and would keep the call
    alive)."""
    try:
        if isinstance(logits, Exception):
            return call.steps.throw(logits)
        return next(call.steps) if logits is None else call.steps.send(logits)
    except StopIteration as done:
        return cast(RapidOutput, done.value)
    except Exception as exc:
        return exc


def _packed(feeds: list[Feed]) -> list[torch.Tensor] | Exception:
    """`kv.feed_packed` over `feeds`, or its error (returned as `_resume` returns one). A
    feed alone on its model runs as it does alone (`KVState.feed`): a call by itself in the
    batch pays no packing (position ids, the 4-D mask, per-segment attention) and gets
    exactly the logits `generate` gets."""
    try:
        if len(feeds) == 1:
            return [feeds[0].run()]
        return feed_packed(feeds)
    except Exception as exc:
        return exc


def _width(feed: Feed) -> int:
    """The tokens `feed`'s pass reads: its sequence's pending ones, then its own."""
    return feed.state.pending.numel() + (0 if feed.tokens is None else feed.tokens.numel())


def _by_model(feeds: dict[int, Feed]) -> Iterable[list[int]]:
    """The ids of `feeds` grouped by the model their pass runs on, in submission order."""
    groups: dict[int, list[int]] = {}
    for i, f in feeds.items():
        groups.setdefault(id(f.state.model), []).append(i)
    return groups.values()


def _check_packable(model: PreTrainedModel, role: str) -> None:
    """`RapidConfigError` unless a packed pass of `model` attends per segment
    (`kv.packing_refusal`)."""
    reason = packing_refusal(model, new_cache(model, 1, role).layers)
    if reason is not None:
        raise RapidConfigError(role, reason)
