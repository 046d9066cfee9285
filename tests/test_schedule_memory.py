"""docs/algorithm.md section 2.11: a measured schedule carries over to the engine's next call
at the same length. A length where drafting lost decodes like the target alone from the next
call on, and is measured afresh after 1, 2, 4, 8, 16, 16, ... calls; the output stays exact."""

from __future__ import annotations

import pytest

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.spec_decode.schedule import GammaSchedule, PassRecord
from rapid_integrations.spec_decode.schedule_memory import ScheduleMemory, schedule_key
from tests.test_engine_adaptive import slowed
from tests.tiny import reference_greedy

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

AUTO = RapidConfig(gamma=4, speculate_min_context="auto")
KEY = schedule_key("rapid", 2048, AUTO, False)


def measure(schedule: GammaSchedule, loses: bool) -> None:
    """A fresh call's passes: a 10 ms plain step, then 4 passes of 4 drafts that emit 1 token
    in 50 ms (20 tok/s: it loses, the call stops drafting) or 5 in 20 ms (250 tok/s)."""
    emitted, seconds = (1, 0.05) if loses else (5, 0.02)
    schedule.update(PassRecord(0, 0, 0, 0.0, 0.01))
    for _ in range(GammaSchedule.PAYOFF_PASSES):
        schedule.update(PassRecord(4, 4, emitted - 1, seconds))
    assert schedule.stopped is loses


def fresh_calls(memory: ScheduleMemory, verdicts: list[bool]) -> list[int]:
    """Run calls at KEY, the i-th fresh one measuring a loss if verdicts[i]; return which
    calls were fresh. A call that is not starts where the last one ended: no plain step to
    time, stopped if that one was."""
    fresh_at: list[int] = []
    for call in range(100):
        schedule, fresh = memory.start(KEY, AUTO)
        if fresh:
            if len(fresh_at) == len(verdicts):
                return fresh_at
            measure(schedule, verdicts[len(fresh_at)])
            fresh_at.append(call)
        else:
            assert schedule.drafting  # the plain step is remembered, not timed again
            assert schedule.gamma == (0 if verdicts[len(fresh_at) - 1] else 4)
        memory.keep(KEY, schedule, fresh)
    raise AssertionError("the memory never measured afresh")


def test_a_length_where_drafting_loses_is_retried_after_1_2_4_8_16_calls():
    assert fresh_calls(ScheduleMemory(), [True] * 8) == [0, 2, 5, 10, 19, 36, 53, 70]


def test_a_changed_verdict_is_trusted_for_one_call():
    """Lifetimes 1, 2, 4 while drafting loses; then it pays (1 call), pays again (2), and a
    loss is again trusted for 1 call only."""
    verdicts = [True, True, True, False, False, True, True]
    assert fresh_calls(ScheduleMemory(), verdicts) == [0, 2, 5, 10, 12, 15, 17]


def test_a_call_that_stops_drafting_stops_the_calls_after_it():
    """Drafting paid when measured (lifetime 2), then loses within the next call: the call
    after that starts stopped."""
    memory = ScheduleMemory()
    for expected in (True, False, True):
        schedule, fresh = memory.start(KEY, AUTO)
        assert fresh is expected
        if fresh:
            measure(schedule, loses=False)
        memory.keep(KEY, schedule, fresh)
    schedule, fresh = memory.start(KEY, AUTO)
    assert not fresh and schedule.gamma == 4
    for _ in range(20):  # passes that emit 1 token in 50 ms, until the call stops drafting
        schedule.update(PassRecord(4, 4, 0, 0.05))
    assert schedule.stopped
    memory.keep(KEY, schedule, fresh)
    schedule, fresh = memory.start(KEY, AUTO)
    assert not fresh and schedule.stopped and schedule.gamma == 0


def test_a_measured_gamma_continues_where_the_last_call_ended():
    """The next call starts at the gamma and costs the last one ended with, on its own copy:
    two calls that run at once do not share one schedule."""
    cfg = RapidConfig(adaptive_gamma="measured", gamma=2, gamma_max=12, lookup_ngram=0)
    key = schedule_key("rapid", 4096, cfg, False)
    memory, measured = ScheduleMemory(), 0
    for _ in range(3):  # fresh, not, fresh with the same verdict: the next 2 are not fresh
        schedule, fresh = memory.start(key, cfg)
        if fresh:
            assert not schedule.drafting  # a fresh call times a plain step first
            schedule.update(PassRecord(0, 0, 0, 0.0, 0.05))
            for _ in range(3):  # a cheap draft whose drafts are all kept: gamma grows
                g = schedule.gamma
                schedule.update(PassRecord(g, g, g, 0.001 * g, 0.06))
            measured += 1
        memory.keep(key, schedule, fresh)
    assert measured == 2
    ended = schedule.gamma
    assert ended > 2
    (one, fresh_one), (two, fresh_two) = memory.start(key, cfg), memory.start(key, cfg)
    assert not fresh_one and not fresh_two and one is not two
    assert one.drafting and one.gamma == two.gamma == ended
    assert one.costs.plain_step == pytest.approx(0.05)
    one.update(PassRecord(1, 1, 0, 0.5, 0.5))  # a pass that loses badly, in one call only
    assert one.gamma < ended and two.gamma == ended
    assert memory.start(key, cfg)[1]  # the lifetime of 2 is spent


def test_calls_share_a_schedule_only_at_the_same_length_and_settings():
    assert schedule_key("rapid", 2200, AUTO, False) == KEY  # within a quarter octave
    others = [
        schedule_key("rapid", 4096, AUTO, False),
        schedule_key("rapid", 2500, AUTO, False),
        schedule_key("sd", 2048, AUTO, False),
        schedule_key("rapid", 2048, AUTO, True),
        schedule_key("rapid", 2048, AUTO.replace(gamma_max=16), False),
        schedule_key("rapid", 2048, AUTO.replace(lookup_ngram=0), False),
    ]
    assert KEY not in others and len(set(others)) == len(others)


def test_a_fixed_gamma_is_not_kept():
    memory = ScheduleMemory()
    cfg = RapidConfig(gamma=4)
    schedule, fresh = memory.start(KEY, cfg)
    assert fresh and schedule.drafting
    memory.keep(KEY, schedule, fresh)
    assert len(memory) == 0 and memory.start(KEY, cfg)[1]


def test_the_memory_holds_at_most_max_keys():
    memory = ScheduleMemory()
    for n in range(ScheduleMemory.MAX_KEYS + 1):
        key = schedule_key("rapid", 2**n, AUTO, False)
        schedule, fresh = memory.start(key, AUTO)
        memory.keep(key, schedule, fresh)
    assert len(memory) == ScheduleMemory.MAX_KEYS
    assert memory.start(schedule_key("rapid", 1, AUTO, False), AUTO)[1]  # the oldest went


def test_a_length_where_drafting_lost_decodes_like_the_target_from_the_next_call(
    tok, target, draft, monkeypatch
):
    """A draft 10x slower than the target: the first call stops drafting after a few passes;
    the next call at that length never runs the draft, not even to vet the copies its
    repetitive prompt offers (docs/algorithm.md section 2.10), one target pass a token, and is
    exact; a call 4x longer measures afresh."""
    cfg = RapidConfig(eta=0.0, max_new_tokens=24, speculate_min_context="auto", lookup_ngram=2)
    engine = RapidEngine(target, draft, tokenizer=tok, config=cfg)
    slowed(draft, 0.02, monkeypatch)
    outs = [engine.generate(p, "abc", ignore_eos=True) for p in ("abcdefghijkl" * 2, "mnop" * 6)]
    assert [o.stats.schedule_from_earlier_call for o in outs] == [False, True]
    assert outs[0].stats.speculation_stopped and outs[0].stats.drafted_tokens > 0
    assert outs[1].stats.speculation_stopped and outs[1].stats.drafted_tokens == 0
    assert outs[1].stats.target_forward_passes == 24 and outs[1].stats.draft_forward_passes == 0
    for prompt, out in zip(("abcdefghijkl" * 2, "mnop" * 6), outs, strict=True):
        assert out.token_ids == reference_greedy(target, tok.encode(prompt), 24, len(tok))
    longer = engine.generate("abcdefghijkl" * 8, "abc", ignore_eos=True)
    assert not longer.stats.schedule_from_earlier_call and longer.stats.drafted_tokens > 0
