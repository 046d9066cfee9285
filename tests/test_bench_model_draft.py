"""The model-draft speedup of `rapid bench` (bench/model_draft.py) against hand-computed values."""

from __future__ import annotations

import pytest

from rapid_integrations.bench.model_draft import (
    StepCosts,
    best_model_draft,
    expected_tokens,
    speedup,
)
from rapid_integrations.bench.models import tiny_pair
from rapid_integrations.runtime.kv import pass_seconds

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


def flat(target: float, draft: float, verify: float) -> StepCosts:
    """A verify pass of any size >= 2 tokens costs `verify`."""
    return StepCosts(target, draft, ((2, verify), (33, verify)))


def test_expected_tokens_per_pass():
    assert expected_tokens(0.8, 3) == pytest.approx(2.952)  # 1 + .8 + .64 + .512
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 5) == 1.0


def test_verify_cost_is_interpolated_through_the_decode_step():
    costs = StepCosts(1.0, 0.1, ((5, 2.0), (9, 4.0)))
    assert costs.verify_seconds(1) == 1.0
    assert costs.verify_seconds(3) == pytest.approx(1.5)
    assert costs.verify_seconds(7) == pytest.approx(3.0)
    assert costs.verify_seconds(13) == pytest.approx(6.0)  # last slope, 0.5 s per token


def test_model_draft_by_hand():
    # t = 1, d = 0.1, verify 1.2, a = 0.8: speedup(g) = E(g) / (0.1 g + 1.2);
    # g = 5: 3.68928 / 1.7 = 2.1702, g = 6: 3.951424 / 1.8 = 2.19524, g = 7: 4.16114 / 1.9 = 2.1901.
    costs = flat(1.0, 0.1, 1.2)
    assert speedup(costs, 0.8, 5) == pytest.approx(2.170165, abs=1e-6)
    assert speedup(costs, 0.8, 7) == pytest.approx(2.190073, abs=1e-6)
    best, gamma = best_model_draft(costs, 0.8)
    assert gamma == 6 and best == pytest.approx(2.195236, abs=1e-6)


def test_model_draft_is_the_target_alone_when_drafting_cannot_pay():
    # a = 0.4, d = 0.5, verify 1: g = 1 gives 1.4 / 1.5 = 0.933 < 1, longer drafts less.
    assert best_model_draft(flat(1.0, 0.5, 1.0), 0.4) == (1.0, 0)
    assert speedup(flat(1.0, 0.5, 1.0), 0.4, 1) == pytest.approx(1.4 / 1.5)


def test_full_acceptance_grows_to_the_longest_draft():
    # a = 1, d = 0.25, verify (g + 1 tokens) = 1 + g / 32: speedup = (g + 1) / (0.25 g + 1 + g / 32),
    # increasing in g: at g = 32, 33 / 10 = 3.3.
    costs = StepCosts(1.0, 0.25, ((33, 2.0),))
    assert best_model_draft(costs, 1.0) == (pytest.approx(3.3), 32)
    assert best_model_draft(costs, 1.0, max_gamma=8) == (pytest.approx(9 / 3.25), 8)


def test_pass_seconds_times_every_size_within_the_prompts_capacity():
    """Each timed pass is rolled back: the state is sized for the prompt plus the largest pass,
    so a pass left in the cache would overflow it on the next repeat."""
    _, large = tiny_pair(vocab_size=300, window=256)
    sizes = (1, 2, 9)
    seconds = pass_seconds(large, list(range(1, 101)), 300, sizes, chunk=32, repeats=3)
    assert set(seconds) == set(sizes) and all(s > 0 for s in seconds.values())


def test_pass_seconds_runs_the_untimed_warmup_passes_before_the_timed_ones():
    """`warmup` passes of each size run first and are left out of its median: a slow first
    pass (a compiled graph's guard check) would otherwise weigh in it."""
    _, large = tiny_pair(vocab_size=300, window=256)
    widths: list[int] = []

    def counted(input_ids, **kwargs):
        widths.append(input_ids.shape[1])
        return large(input_ids, **kwargs)

    pass_seconds(
        large, list(range(1, 40)), 300, (1, 9), chunk=32, repeats=3, warmup=1, decode=counted
    )
    assert widths == [1] * 4 + [9] * 4
