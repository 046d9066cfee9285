"""Speculation that adapts to load (rapid_integrations/batching/runner.py, schedule.py `BatchCosts`,
docs/algorithm.md section 14.2): the cap on gamma a batch picks from its measured pass costs,
on known costs and on the tiny float32 models of tests/test_batch.py. Under a binding cap
every call's eta = 0 greedy output stays its own unbatched output, and so does eta > 0's
(argmax p_hat: a pass without drafts still gets the draft's q, section 2.7)."""

from __future__ import annotations

import pytest

from rapid_integrations import BatchRunner, RapidConfig, RapidEngine
from rapid_integrations.spec_decode.batch_caps import BatchCosts, PassLine
from rapid_integrations.spec_decode.schedule import GammaSchedule, PassCosts, PassRecord
from tests import test_batch
from tests.test_batch import CALLS, alone, submit

pair, engines = test_batch.pair, test_batch.engines  # the tiny models' fixtures

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


class FixedLine:
    """A known pass cost, a + b T seconds, that measurements do not move."""

    def __init__(self, offset: float, slope: float) -> None:
        self.offset, self.slope = offset, slope

    @property
    def measured(self) -> bool:
        return True

    def record(self, tokens: int, seconds: float) -> None:
        pass

    def seconds(self, tokens: float) -> float:
        return self.offset + self.slope * tokens


def known(verify: tuple[float, float], draft: tuple[float, float] = (0.0, 0.0)) -> BatchCosts:
    """Costs of known lines (offset, slope) for the verify and the draft passes."""
    return BatchCosts(FixedLine(*verify), FixedLine(*draft))


COMPUTE_BOUND = (0.0, 1.0)  # every token a verify pass reads costs the same
MEMORY_BOUND = (1.0, 0.0)  # a verify pass costs the same whatever it reads

# eta 0 and eta 5 (greedy argmax p_hat), lookup on and off, gammas 1 to 9; each prompt
# prefilled in one pass, so that after it a verify pass reads only pending tokens and drafts.
MIX = [
    CALLS[0],
    CALLS[1],
    CALLS[2],
    ("ab " * 13 + "l", "ab", {"gamma": 6, "lookup_tokens": 4}),
    CALLS[7],
    CALLS[8],
]


def run_traced(engine: RapidEngine, runner: BatchRunner, calls: list[tuple]):
    """Decode `calls` (all joining at once) on `runner`; returns their token ids and, per
    target pass, (the cap set before it, the calls it read, the tokens it read)."""
    ids = [submit(runner, call) for call in calls]
    widths: list[int] = []
    hook = engine.target.register_forward_hook(
        lambda _m, _a, kw, _o: widths.append(kw["input_ids"].shape[-1]), with_kwargs=True
    )
    passes, cap = [], None
    try:
        while runner.running:
            running, before = len(runner.running), len(widths)
            runner.step()
            if len(widths) > before:  # a verify step: it sets the cap of the next draft phase
                passes.append((cap, running, widths[-1]))
                cap = runner.cap
    finally:
        hook.remove()
    assert not runner.errors
    return [runner.outputs[i].token_ids for i in ids], passes


def test_a_compute_bound_batch_stops_drafting_and_each_output_stays_its_own(engines):
    """Every token of a verify pass costs as much as a plain step's: drafting cannot pay, so
    the cap is 0 while two calls run, the verify pass after it reads one token per call, and
    every call decodes as it would alone."""
    engine = engines["separate"]
    runner = BatchRunner(engine, known(COMPUTE_BOUND))
    got, passes = run_traced(engine, runner, MIX)
    assert got == [alone(engine, call) for call in MIX]
    capped = [(n, width) for cap, n, width in passes if cap == 0]
    assert len(capped) > 5
    assert all(width == n for n, width in capped)  # no drafts, no copies


def test_a_memory_bound_batch_drafts_as_each_call_asks(engines):
    """A verify pass that costs the same whatever it reads, with free drafts: no cap binds,
    and each call drafts as it would alone."""
    engine = engines["separate"]
    runner = BatchRunner(engine, known(MEMORY_BOUND))
    got, passes = run_traced(engine, runner, MIX)
    assert got == [alone(engine, call) for call in MIX]
    assert set(runner.caps) == {None}
    assert max(width for _, _, width in passes[1:]) > len(MIX) * 2  # drafts were read


def test_a_call_alone_is_never_capped(engines):
    """The batch of one is `generate`: its schedule alone says how many drafts it asks for,
    however costly the measured verify pass."""
    engine = engines["separate"]
    runner = BatchRunner(engine, known(COMPUTE_BOUND))
    got, _ = run_traced(engine, runner, [CALLS[2]])
    assert got == [alone(engine, CALLS[2])]
    assert set(runner.caps) == {None}


def test_measured_costs_cap_and_the_outputs_stay_each_calls_own(engines):
    """With the runner's own measured lines (no known costs), whatever cap they pick, every
    eta = 0 and eta = 5 greedy output is the call's own; both lines rest on passes."""
    engine = engines["self"]
    runner = BatchRunner(engine, BatchCosts())
    got, _ = run_traced(engine, runner, MIX)
    assert got == [alone(engine, call) for call in MIX]
    assert runner.costs is not None
    assert runner.costs.verify.measured and runner.costs.draft.measured
    assert sum(runner.caps.values()) > 5  # a cap was picked before every verify pass


def test_without_costs_a_runner_never_caps(engines):
    """A runner given no costs drafts as each call asks, as before section 14.2: sampled
    calls keep their very draws (a cap would keep their law only)."""
    engine = engines["separate"]
    runner = BatchRunner(engine)
    calls = [(p, d, {**o, "temperature": 1.0, "seed": 3}) for p, d, o in MIX]
    got, passes = run_traced(engine, runner, calls)
    assert got == [alone(engine, call) for call in calls]
    assert not runner.caps and runner.cap is None
    assert max(width for _, _, width in passes[1:]) > len(MIX) * 2  # drafts were read


def test_a_seeded_sampled_call_is_never_capped_and_keeps_its_draws(engines):
    """In a batch capped at 0 (compute-bound costs) a seeded sampled call still drafts as its
    schedule asks, and every output, the sampled one's draws included, is the call's own
    unbatched output. (An unseeded one is capped: test_engine_distribution.py.)"""
    engine = engines["separate"]
    runner = BatchRunner(engine, known(COMPUTE_BOUND))
    sampled = ("ab " * 13 + "l", "ab", {"gamma": 6, "temperature": 1.0, "seed": 3})
    calls = [*MIX[:3], sampled]
    got, passes = run_traced(engine, runner, calls)
    assert got == [alone(engine, call) for call in calls]
    capped = [(n, width) for cap, n, width in passes if cap == 0 and n == len(calls)]
    assert any(width > n for n, width in capped)  # the sampled call's drafts (greedy: none)


@pytest.mark.parametrize(
    ("verify", "draft", "cap"),
    [
        ((1.0, 1.0), (0.0, 0.0), 0),
        ((4.0, 1.0), (0.0, 0.0), 1),
        ((10.0, 1.0), (0.0, 0.0), None),
        ((10.0, 1.0), (1.0, 0.0), 1),
    ],
)
def test_the_cap_has_the_most_expected_tokens_per_second(verify, draft, cap):
    """Two calls at gamma 2 that have learned nothing (every draft kept with chance 1/2:
    E = 1, 1.5, 1.75 tokens at gamma 0, 1, 2) on a verify line a + b T, T = 2, 4, 6 tokens,
    and d seconds per draft pass (gamma g: g passes): by hand, (a, b) = (1, 1) gives 2/3,
    3/5, 3.5/7 tokens a second, cap 0; (4, 1) gives 2/6, 3/8, 3.5/10, cap 1; (10, 1) gives
    2/12, 3/14, 3.5/16, no cap; and with d = 1, (10, 1) gives 3/15 against 3.5/18, cap 1."""
    calls = [(2, PassCosts(8)), (2, PassCosts(8))]
    assert known(verify, draft).cap(calls) == cap


def test_the_draft_phase_lasts_as_long_as_its_longest_proposal():
    """Gammas 2 and 1, d = 1 s per draft pass, verify 10 + T: by hand, cap 0 gives 2/12, cap
    1 gives 3/(1 + 14) = 0.2, gamma as asked 3.25/(2 + 15) = 0.191 (two draft passes, the
    second for one call), so the cap is 1."""
    calls = [(2, PassCosts(8)), (1, PassCosts(8))]
    assert known((10.0, 1.0), (1.0, 0.0)).cap(calls) == 1


def test_a_newcomer_drafts_under_the_batchs_cap(engines):
    """A call that joins a batch capped at 0 starts capped: its first verify pass (a prompt
    of one token: no prefill, it drafts at once) reads its pending token only."""
    engine = engines["separate"]
    runner = BatchRunner(engine, known(COMPUTE_BOUND))
    for call in MIX[:2]:
        submit(runner, call)
    while runner.cap != 0:
        runner.step()
    widths: list[int] = []
    hook = engine.target.register_forward_hook(
        lambda _m, _a, kw, _o: widths.append(kw["input_ids"].shape[-1]), with_kwargs=True
    )
    try:
        runner.submit("k", "k", gamma=9, lookup_ngram=0)
        while not widths:
            runner.step()
    finally:
        hook.remove()
    assert widths == [3]  # one pending token per call, no drafts


def test_an_untimed_schedule_learns_its_acceptance_curve():
    """A fixed gamma times nothing, but its curve learns every verdict: the cap reads it."""
    schedule = GammaSchedule(RapidConfig(gamma=4))
    before = schedule.costs.expected_tokens(4)
    schedule.update(PassRecord(4, 4, 4))
    assert schedule.costs.expected_tokens(4) > before


def test_no_cap_without_measurements_or_alone():
    calls = [(4, PassCosts(8)), (0, None)]
    assert BatchCosts().cap(calls) is None  # no pass measured yet
    assert known(COMPUTE_BOUND).cap(calls) == 0
    assert known(COMPUTE_BOUND).cap(calls[:1]) is None
    assert known(COMPUTE_BOUND).cap([(0, None), (0, None)]) is None


def test_the_pass_line_fits_measured_passes():
    """A least-squares line through recent passes; flat while their widths barely spread;
    through 0 when its offset would be negative."""
    line = PassLine()
    for tokens in (4, 9, 17, 33, 4, 9):
        line.record(tokens, 0.05 + 0.002 * tokens)
    assert line.seconds(20) == pytest.approx(0.09)
    flat = PassLine()
    for seconds in (0.1, 0.3):
        flat.record(8, seconds)
    assert flat.seconds(40) == pytest.approx(0.2, rel=0.02)  # the (decayed) mean
    steep = PassLine()
    for tokens in (10, 20, 30):
        steep.record(tokens, 0.01 * tokens - 0.05)
    assert steep.seconds(0) == 0.0
