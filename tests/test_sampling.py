"""The pure acceptance math (sampling.py) against formulas written out independently here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rapid_integrations.sample.sampling import (
    accepted_count,
    end_guard,
    log_probs,
    one_step_law,
    p_hat,
    residual,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

V = 12


def dists(seed: int, sharp: float = 2.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(V, generator=g, dtype=torch.float64) * sharp
    zq = z + torch.randn(V, generator=g, dtype=torch.float64) * sharp  # a related draft
    return z, torch.log_softmax(z, -1), torch.softmax(zq, -1)


def np_p_hat(
    z: np.ndarray, q: np.ndarray, eta: float, guard: str, ratio: float = 0.1
) -> np.ndarray:
    """docs/algorithm.md section 2.3 written directly in numpy."""
    p = np.exp(z - z.max())
    p /= p.sum()
    shift = eta * (q - p)
    if guard == "draft":
        shift = np.where(q >= ratio * q.max(), shift, 0.0)
    a = z + shift
    ph = np.exp(a - a.max())
    ph /= ph.sum()
    if guard == "paper":
        ph = np.where(ph < ratio * ph.max(), p, ph)
        ph /= ph.sum()
    return ph


@pytest.mark.parametrize("guard", ["paper", "draft", "none"])
@pytest.mark.parametrize("eta", [0.0, 0.5, 3.0, 20.0])
def test_p_hat_matches_the_formula(guard, eta):
    for seed in range(20):
        z, logp, q = dists(seed)
        got = p_hat(logp[None], q[None], eta, guard)[0].numpy()
        want = np_p_hat(z.numpy(), q.numpy(), eta, guard)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
        assert abs(got.sum() - 1) < 1e-12


def test_temperature_and_top_p():
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    np.testing.assert_allclose(log_probs(z, 2.0, 1.0).exp()[0], torch.softmax(z / 2, -1)[0])
    p = torch.softmax(z, -1)[0]
    kept = log_probs(z, 1.0, float(p[0] + p[1]) - 1e-9).exp()[0]  # needs the top two tokens
    np.testing.assert_allclose(
        kept, torch.cat([p[:2] / p[:2].sum(), torch.zeros(2, dtype=p.dtype)])
    )
    assert log_probs(z, 1.0, 1e-6).exp()[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_nan_logits_are_refused():
    from rapid_integrations import NumericalError

    with pytest.raises(NumericalError):
        log_probs(torch.tensor([[0.0, float("nan")]]), 1.0, 1.0)


def test_residuals_and_zero_mass_fallback():
    _, logp, q = dists(0)
    p = logp.exp()
    ph = p_hat(logp[None], q[None], 3.0)[0]
    paper = np.maximum.reduce([(p - ph).numpy(), (p - q).numpy(), np.zeros(V)])
    np.testing.assert_allclose(residual(p, ph, q, "paper"), paper / paper.sum())
    exact = np.maximum((ph - q).numpy(), 0)
    np.testing.assert_allclose(residual(p, ph, q, "exact"), exact / exact.sum())
    assert torch.equal(residual(p, q, q, "exact"), p)  # p_hat == q leaves no mass


def test_exact_residual_law_is_p_hat():
    """Under residual='exact' the one-step law collapses to p_hat (docs/algorithm.md section 4)."""
    for seed in range(10):
        _, logp, q = dists(seed)
        ph = p_hat(logp[None], q[None], 4.0)[0]
        np.testing.assert_allclose(one_step_law(logp.exp(), ph, q, "exact"), ph, atol=1e-12)


def test_paper_residual_law_is_not_p_when_eta_positive():
    _, logp, q = dists(1)
    p = logp.exp()
    ph = p_hat(logp[None], q[None], 4.0)[0]
    assert (one_step_law(p, ph, q, "paper") - p).abs().max() > 1e-3
    np.testing.assert_allclose(one_step_law(p, p, q, "paper"), p, atol=1e-12)  # eta = 0


def test_accepted_count_stops_at_first_rejection():
    x = torch.tensor([0, 1, 2, 3])
    ones = torch.ones(4)
    assert accepted_count(x, ones, ones, torch.tensor([0.1, 0.2, 0.3, 0.4])) == 4
    ratio = torch.tensor([1.0, 0.5, 1.0, 1.0])
    assert accepted_count(x, ratio, ones, torch.tensor([0.9, 0.4, 0.9, 0.9])) == 4
    assert accepted_count(x, ratio, ones, torch.tensor([0.9, 0.6, 0.0, 0.0])) == 1
    assert accepted_count(x, torch.zeros(4), ones, torch.zeros(4)) == 0


@pytest.mark.parametrize("rule", ["paper", "exact"])
@pytest.mark.parametrize("eta", [0.0, 2.0, 8.0])
def test_monte_carlo_of_accept_then_residual_follows_one_step_law(rule, eta):
    """Draw x ~ q, accept with min(1, p_hat/q), else draw from the residual: histogram vs law."""
    _, logp, q = dists(5)
    p = logp.exp()
    ph = p_hat(logp[None], q[None], eta)[0]
    g = torch.Generator().manual_seed(0)
    n = 20000
    xs = torch.multinomial(q, n, replacement=True, generator=g)
    us = torch.rand(n, generator=g, dtype=torch.float64)
    r = residual(p, ph, q, rule)
    fallback = torch.multinomial(r, n, replacement=True, generator=g)
    emitted = [
        int(x) if accepted_count(x[None], ph[x][None], q[x][None], u[None]) else int(f)
        for x, u, f in zip(xs, us, fallback, strict=True)
    ]
    law = one_step_law(p, ph, q, rule).numpy()
    counts = np.bincount(emitted, minlength=V)
    keep = law * n >= 5
    stat = chisquare(counts[keep], law[keep] / law[keep].sum() * counts[keep].sum())
    assert stat.pvalue > 1e-3, (stat, counts, law * n)


def test_end_guard_restores_p_where_the_target_would_end():
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1]], dtype=torch.float64)
    ph = torch.tensor([[0.1, 0.8, 0.1], [0.1, 0.1, 0.8]], dtype=torch.float64)
    out = end_guard(ph, p, torch.tensor([0]))
    assert torch.equal(out[0], p[0]) and torch.equal(out[1], ph[1])
