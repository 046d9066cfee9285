"""docs/algorithm.md section 4 on the whole engine: emitted tokens against their analytic laws.

The vocabulary (26 tokens) is small enough to enumerate, so the law of the first emitted token
is computed exactly from no-cache forward passes and compared by a chi-square test to the
engine's output over many seeds (fixed seeds: the test is deterministic).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.sampling import log_probs, one_step_law, p_hat
from tests.tiny import next_token_probs

PROMPT, DRAFT_PROMPT = "kab", "ab"
N = 1200


def first_tokens(engine: RapidEngine, n: int = N, position: int = 0, **overrides) -> np.ndarray:
    counts = np.zeros(len(engine.tokenizer))
    for seed in range(n):
        out = engine.generate(PROMPT, DRAFT_PROMPT, seed=seed, ignore_eos=True, **overrides)
        counts[out.token_ids[position]] += 1
    return counts


def assert_follows(counts: np.ndarray, law: np.ndarray) -> None:
    keep = law * counts.sum() >= 5
    expected = law[keep] / law[keep].sum() * counts[keep].sum()
    result = chisquare(counts[keep], expected)
    assert result.pvalue > 1e-3, (result, counts, law * counts.sum())


def draft_q(draft, tok, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    with torch.inference_mode():
        logits = draft(input_ids=torch.tensor([tok.encode(DRAFT_PROMPT)])).logits[
            0, -1:, : len(tok)
        ]
    return log_probs(logits, temperature, top_p).exp()[0]


@pytest.fixture(scope="module")
def engine(tok, target, draft):
    return RapidEngine(target, draft, tokenizer=tok, config=RapidConfig(eta=0.0, temperature=1.0))


@pytest.mark.parametrize("gamma", [1, 3])
def test_eta0_sampling_first_token_follows_p(engine, target, tok, gamma):
    counts = first_tokens(engine, gamma=gamma, max_new_tokens=gamma + 1)
    assert_follows(counts, next_token_probs(target, tok.encode(PROMPT), len(tok)).numpy())


@pytest.mark.parametrize("gamma", [1, 3])
def test_eta0_sampling_second_token_follows_p(engine, target, tok, gamma):
    """Marginal of token 2: sum_x1 p(x1) p(x2 | x1). With gamma = 1 it is the bonus token
    whenever the first draft is accepted; with gamma = 3 it is a verified draft position."""
    ids = tok.encode(PROMPT)
    p1 = next_token_probs(target, ids, len(tok))
    law = sum(p1[a] * next_token_probs(target, [*ids, a], len(tok)) for a in range(len(tok)))
    counts = first_tokens(engine, position=1, gamma=gamma, max_new_tokens=gamma + 1)
    assert_follows(counts, law.numpy())


def test_eta0_temperature_and_top_p_follow_filtered_p(engine, target, tok):
    logits = torch.log(next_token_probs(target, tok.encode(PROMPT), len(tok)))
    law = log_probs(logits[None], 1.5, 0.8).exp()[0].numpy()
    counts = first_tokens(engine, gamma=2, max_new_tokens=3, temperature=1.5, top_p=0.8)
    assert 4 <= (law > 0).sum() < len(law)  # the nucleus really cuts, yet leaves a choice
    assert counts[law == 0].sum() == 0  # nothing outside the nucleus, ever
    assert_follows(counts, law)


@pytest.mark.parametrize("rule", ["paper", "exact"])
@pytest.mark.parametrize("guard", ["paper", "draft"])
def test_eta_positive_first_token_follows_one_step_law(engine, target, draft, tok, rule, guard):
    eta = 3.0
    p = next_token_probs(target, tok.encode(PROMPT), len(tok))
    q = draft_q(draft, tok).double()
    ph = p_hat(torch.log(p)[None], q[None], eta, guard)[0]
    law = one_step_law(p, ph, q, rule)
    if rule == "exact":
        np.testing.assert_allclose(law, ph, atol=1e-9)  # the exact residual yields p_hat itself
    counts = first_tokens(
        engine, gamma=2, max_new_tokens=3, eta=eta, residual=rule, tail_guard=guard
    )
    assert_follows(counts, law.numpy())


def test_eta_positive_exact_residual_is_detectably_not_p(engine, target, tok):
    """Power check: the test above would notice an engine that ignored eta (law p instead)."""
    p = next_token_probs(target, tok.encode(PROMPT), len(tok)).numpy()
    counts = first_tokens(engine, gamma=2, max_new_tokens=3, eta=3.0, residual="exact")
    keep = p * counts.sum() >= 5
    assert chisquare(counts[keep], p[keep] / p[keep].sum() * counts[keep].sum()).pvalue < 1e-3
