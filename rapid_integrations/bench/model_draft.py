"""The decode speedup a model draft would give at its measured acceptance, from measured step
costs at one context length.

Standard speculative decoding expectation (Leviathan et al. 2023): with a per-token acceptance
rate a, a pass that drafts gamma tokens emits on average

    E(gamma) = (1 - a^(gamma + 1)) / (1 - a)          (gamma + 1 when a = 1)

tokens and costs gamma draft steps plus one verify pass of gamma + 1 tokens, against one
target decode step per token without speculation:

    speedup(gamma) = target_step * E(gamma) / (gamma * draft_step + verify(gamma + 1)).

The model-draft speedup is the best speedup over gamma in [0, max_gamma] (gamma = 0, the target alone, is
1: the engine can always fall back to it). `kv.pass_seconds` times the passes with a few
forward passes at the run's own context length.

It is not a ceiling: RAPID passes it with lookup copies, which cost no draft step,
and with an adaptive gamma, whose acceptance differs from the fixed gamma's. The bounds no
drafter can pass are in `bench/bounds.py` (docs/algorithm.md section 2.12).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


def expected_tokens(acceptance: float, gamma: int) -> float:
    """Mean tokens one pass emits at a per-draft acceptance rate: accepted drafts plus the
    token the target adds, (1 - a^(gamma + 1)) / (1 - a) (Leviathan et al. 2023)."""
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1.0 - acceptance ** (gamma + 1)) / (1.0 - acceptance)


VERIFY_TOKENS = (2, 5, 9, 17, 33)
"""Verify pass sizes timed (gamma + 1 for gamma 1, 4, 8, 16, 32)."""


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one forward pass at one context length.

    target_step: the target reading 1 token; draft_step: the draft reading 1 token on its own
    context; verify: (tokens, seconds) of target passes reading several tokens, by size.
    """

    target_step: float
    draft_step: float
    verify: tuple[tuple[int, float], ...]

    def verify_seconds(self, tokens: int) -> float:
        """A target pass reading `tokens` tokens: piecewise linear through (1, target_step)
        and the measured sizes; past the largest, the last segment's slope (at least 0)."""
        points = sorted({1: self.target_step, **dict(self.verify)}.items())
        for (k0, s0), (k1, s1) in itertools.pairwise(points):
            if tokens <= k1:
                return s0 + (s1 - s0) * (tokens - k0) / (k1 - k0)
        if len(points) == 1:
            return self.target_step
        (k0, s0), (k1, s1) = points[-2:]
        return s1 + max(0.0, (s1 - s0) / (k1 - k0)) * (tokens - k1)


def speedup(costs: StepCosts, acceptance: float, gamma: int) -> float:
    """Expected decode speedup over the target alone at this gamma (1 at gamma 0)."""
    if gamma == 0:
        return 1.0
    seconds = gamma * costs.draft_step + costs.verify_seconds(gamma + 1)
    return costs.target_step * expected_tokens(acceptance, gamma) / seconds


def best_model_draft(costs: StepCosts, acceptance: float, max_gamma: int = 32) -> tuple[float, int]:
    """(best speedup, the gamma that gives it) over gamma in [0, max_gamma]."""
    best = max(range(max_gamma + 1), key=lambda g: (speedup(costs, acceptance, g), -g))
    return speedup(costs, acceptance, best), best
