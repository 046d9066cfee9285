"""`verify.verdict` against the independent numpy oracle of `tests/oracle.py`, at eta > 0.

Synthetic steps (target logits z, draft distributions q, drafts x; gamma 4) are built so that
p_hat is far from p: total variation above 0.2 on every draft row, asserted. Sampled steps:
the exact law of (accepted count n, emitted token) from the oracle, against the verdicts of
many seeds by a chi-square test (fixed seeds: deterministic). That one law pins the per-row
acceptance probability min(1, p_hat_i(x_i) / q_i(x_i)), the residual at the rejection row n
under both residual rules, and the bonus token from p at row gamma. Greedy steps are compared
token for token, for every rejection row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rapid_integrations import RapidConfig
from rapid_integrations.sample.verify import verdict
from tests import oracle

V, GAMMA, DRAWS = 10, 4, 2500
pytestmark = pytest.mark.usefixtures("one_thread")


def synthetic(seed: int, top_p: float = 1.0, temperature: float = 1.0):
    """(z [gamma+1, V], q [gamma, V], x [gamma]): a target and an unrelated, peaked draft; x ~ q."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(GAMMA + 1, V)) * 2.0
    q = oracle.target_p(rng.normal(size=(GAMMA, V)) * 2.5, temperature, top_p)
    x = np.array([rng.choice(V, p=row) for row in q])
    return z, q, x


def far_steps(rules: oracle.Rules, count: int = 3):
    """The first `count` synthetic steps whose p_hat is more than 0.2 from p (total
    variation) on every draft row under `rules`. Each draft x_i is the token whose acceptance
    probability is closest to 0.7, so that rejections happen at every row and the bonus row
    is reached too (the verdict's law is conditional on x, whichever x is drafted)."""
    steps, seed = [], 0
    while len(steps) < count:
        z, q, _ = synthetic(seed, rules.top_p, rules.temperature)
        seed += 1
        if far_from_p(z, q, rules).min() > 0.2:
            p = oracle.target_p(z, rules.temperature, rules.top_p)
            p_hat = oracle.augmented(p[:GAMMA], q, rules)
            with np.errstate(divide="ignore", invalid="ignore"):
                a = np.where(q > 0, np.minimum(1.0, p_hat / q), np.inf)
            steps.append((z, q, np.abs(a - 0.7).argmin(axis=-1)))
    return steps


def run_verdicts(
    z, x, q, cfg: RapidConfig, end_ids=(), draws: int = DRAWS, lean=None
) -> np.ndarray:
    """Counts [gamma + 1, V] of (n, token) over `draws` verdicts with a seeded generator."""
    gen = torch.Generator().manual_seed(1234)
    zt, xt = torch.from_numpy(z), torch.from_numpy(x)
    qt = None if q is None else torch.from_numpy(q)
    ends = torch.tensor(end_ids, dtype=torch.long) if end_ids else None
    leans = None if lean is None else torch.tensor(lean)
    counts = np.zeros((len(x) + 1, z.shape[-1]))
    for _ in range(draws):
        n, token = verdict(zt, xt, qt, cfg, gen, ends, leans)
        counts[n, int(token)] += 1
    return counts


def greedy_verdict(z, x, q, cfg: RapidConfig, end_ids=(), lean=None) -> tuple[int, int]:
    """(n, token) of one greedy verdict."""
    ends = torch.tensor(end_ids, dtype=torch.long) if end_ids else None
    t = torch.from_numpy
    leans = None if lean is None else torch.tensor(lean)
    n, token = verdict(t(z), t(x), t(q), cfg, torch.Generator(), ends, leans)
    return n, int(token)


def assert_law(counts: np.ndarray, law: np.ndarray) -> None:
    """Chi-square of counts against an exact law; cells expected below 5 are pooled, and a
    count in a cell the law gives probability 0 fails outright."""
    assert np.isclose(law.sum(), 1.0)
    counts, law = counts.ravel(), law.ravel()
    assert counts[law == 0].sum() == 0, "emitted an (n, token) the oracle says is impossible"
    expected = law * counts.sum()
    small = (expected < 5) & (law > 0)
    obs = np.append(counts[expected >= 5], counts[small].sum())
    exp = np.append(expected[expected >= 5], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    result = chisquare(obs, exp)
    assert result.pvalue > 1e-4, (result, counts.reshape(GAMMA + 1, -1))


def far_from_p(z, q, rules: oracle.Rules) -> np.ndarray:
    """TV(p_hat_i, p_i) per draft row, [gamma]."""
    p = oracle.target_p(z, rules.temperature, rules.top_p)
    return oracle.total_variation(oracle.augmented(p[:GAMMA], q, rules), p[:GAMMA])


@pytest.mark.parametrize("residual", ["paper", "exact"])
@pytest.mark.parametrize("guard", ["paper", "draft", "none"])
def test_sampled_verdict_follows_the_oracle(residual, guard):
    eta = 6.0
    rules = oracle.Rules(eta, residual=residual, tail_guard=guard)
    for z, q, x in far_steps(rules):
        assert far_from_p(z, q, rules).min() > 0.2
        law = oracle.step_law(z, x, q, rules)
        assert law[:GAMMA].sum() > 0.3 and law[1:].sum() > 0.3  # rejections at several rows
        cfg = RapidConfig(
            eta=eta, temperature=1.0, residual=residual, tail_guard=guard, confidence_guard=False
        )
        assert_law(run_verdicts(z, x, q, cfg), law)


@pytest.mark.parametrize("residual", ["paper", "exact"])
def test_sampled_verdict_at_temperature_and_top_p(residual):
    """T = 0.7, top_p = 0.8: p is filtered, and nothing outside its nucleus is ever emitted."""
    eta, temperature, top_p = 5.0, 0.7, 0.8
    rules = oracle.Rules(eta, temperature, top_p, residual)
    for z, q, x in far_steps(rules):
        p = oracle.target_p(z, temperature, top_p)
        assert ((p > 0).sum(axis=-1) < V).all()  # the nucleus cuts every row
        assert far_from_p(z, q, rules).min() > 0.2
        cfg = RapidConfig(
            eta=eta, temperature=temperature, top_p=top_p, residual=residual, confidence_guard=False
        )
        assert_law(run_verdicts(z, x, q, cfg), oracle.step_law(z, x, q, rules))


def test_draft_confidence_rule_scales_eta_by_the_drafts_top_probability():
    """eta_rule="draft-confidence" (section 2.3): row i shifts by eta max_v q_i(v). Sampled
    law against the oracle, on steps where that p_hat is far from both p and the fixed rule's."""
    eta = 4.0
    rules = oracle.Rules(eta, eta_rule="draft-confidence", confidence_guard=True)
    fixed = oracle.Rules(eta, confidence_guard=True)
    cfg = RapidConfig(eta=eta, temperature=1.0, eta_rule="draft-confidence")
    for z, q, x in far_steps(rules):
        p = oracle.target_p(z, 1.0, 1.0)[:GAMMA]
        apart = oracle.total_variation(oracle.augmented(p, q, rules), oracle.augmented(p, q, fixed))
        assert apart.max() > 0.05  # the rule is not the fixed eta in disguise
        assert_law(run_verdicts(z, x, q, cfg), oracle.step_law(z, x, q, rules))
    for seed in range(20):  # greedy: argmax of the rule's p_hat, token for token
        z, q, _ = synthetic(seed)
        greedy = oracle.Rules(eta, temperature=0.0, eta_rule="draft-confidence")
        x = oracle.augmented(oracle.softmax(z[:GAMMA]), q, greedy).argmax(-1)
        x[1] = (x[1] + 1) % V
        want = oracle.greedy_step(z, x, q, greedy)
        cfg0 = RapidConfig(
            eta=eta, temperature=0.0, eta_rule="draft-confidence", confidence_guard=False
        )
        assert greedy_verdict(z, x, q, cfg0) == want == (1, want[1])


def test_rows_that_do_not_lean_follow_p():
    """eta_rule="grounded" (section 2.3): the verdict leans only on the rows `lean` marks; the
    others follow p. Sampled law against the oracle with rows 1 and 3 held to p, on steps
    where p_hat is far from p on every row (so holding a row back changes the law), and greedy
    token for token."""
    eta, lean = 6.0, (True, False, True, False)
    every = oracle.Rules(eta)
    rules = oracle.Rules(eta, lean=lean)
    cfg = RapidConfig(eta=eta, temperature=1.0, eta_rule="grounded", confidence_guard=False)
    for z, q, x in far_steps(every):
        p = oracle.target_p(z, 1.0, 1.0)[:GAMMA]
        held = oracle.total_variation(oracle.augmented(p, q, every), oracle.augmented(p, q, rules))
        assert held[[1, 3]].min() > 0 and held[[0, 2]].max() == 0
        assert_law(run_verdicts(z, x, q, cfg, lean=lean), oracle.step_law(z, x, q, rules))
    greedy = oracle.Rules(eta, temperature=0.0, lean=lean)
    cfg0 = RapidConfig(eta=eta, temperature=0.0, eta_rule="grounded", confidence_guard=False)
    for seed in range(20):
        z, q, _ = synthetic(seed)
        x = oracle.augmented(oracle.softmax(z[:GAMMA]), q, greedy).argmax(-1)
        x[3] = (x[3] + 1) % V
        want = oracle.greedy_step(z, x, q, greedy)
        assert greedy_verdict(z, x, q, cfg0, lean=lean) == want == (3, want[1])


def test_accepted_drafts_reach_the_bonus_row():
    """Drafts equal to argmax p_hat with a draft that agrees: most steps accept all gamma and
    emit the bonus token from p at row gamma (section 2.7), whose law the oracle pins."""
    eta = 4.0
    for seed in range(6, 9):
        z, _, _ = synthetic(seed)
        rng = np.random.default_rng(seed)
        q = oracle.softmax(z[:GAMMA] + rng.normal(size=(GAMMA, V)))  # a draft close to p
        rules = oracle.Rules(eta)
        x = oracle.augmented(oracle.softmax(z[:GAMMA]), q, rules).argmax(axis=-1)
        law = oracle.step_law(z, x, q, rules)
        assert law[GAMMA].sum() > 0.3
        assert_law(
            run_verdicts(z, x, q, RapidConfig(eta=eta, temperature=1.0, confidence_guard=False)),
            law,
        )


def test_the_bonus_row_follows_p_hat_where_q_has_a_row_there():
    """With eta > 0 the draft gives q one row past its drafts (section 2.7): the bonus token
    follows p_hat there, and the accepted and rejected rows are as before."""
    eta = 4.0
    rules = oracle.Rules(eta)
    for seed in range(6, 9):
        z, _, _ = synthetic(seed)
        rng = np.random.default_rng(seed)
        q = oracle.softmax(z + rng.normal(size=(GAMMA + 1, V)))  # a draft close to p
        x = oracle.augmented(oracle.softmax(z[:GAMMA]), q[:GAMMA], rules).argmax(axis=-1)
        law = oracle.step_law(z, x, q, rules)
        plain = oracle.step_law(z, x, q[:GAMMA], rules)
        assert law[GAMMA].sum() > 0.3
        assert oracle.total_variation(law[GAMMA][None], plain[GAMMA][None])[0] > 0.05
        cfg = RapidConfig(eta=eta, temperature=1.0, confidence_guard=False)
        assert_law(run_verdicts(z, x, q, cfg), law)


def test_end_guard_rows_use_p():
    """Rows whose most likely target token ends the sequence get p_hat = p (section 2.4)."""
    eta = 6.0
    unguarded = oracle.Rules(eta)
    for z, q, x in far_steps(unguarded):
        ends = (int(z[1].argmax()), int(z[2].argmax()))  # rows 1 and 2 (at least) are guarded
        rules = oracle.Rules(eta, end_ids=ends)
        law = oracle.step_law(z, x, q, rules)
        assert (
            oracle.total_variation(
                law.ravel()[None], oracle.step_law(z, x, q, unguarded).ravel()[None]
            )[0]
            > 0.05
        )
        assert_law(
            run_verdicts(
                z, x, q, RapidConfig(eta=eta, temperature=1.0, confidence_guard=False), ends
            ),
            law,
        )


def test_confidence_guard_rows_use_p():
    """Rows where the target is at least as sure as the draft (max p >= max q) get p_hat = p
    (section 2.4); the others keep the shift. The steps mix both kinds of row."""
    eta = 6.0
    unguarded, rules = oracle.Rules(eta), oracle.Rules(eta, confidence_guard=True)
    mixed = 0
    for z, q, x in far_steps(unguarded, count=4):
        sure = oracle.softmax(z[:GAMMA]).max(axis=-1) >= q.max(axis=-1)
        mixed += int(sure.any() and not sure.all())
        law = oracle.step_law(z, x, q, rules)
        if sure.any():
            moved = oracle.total_variation(
                law.ravel()[None], oracle.step_law(z, x, q, unguarded).ravel()[None]
            )[0]
            assert moved > 0.02
        cfg = RapidConfig(eta=eta, temperature=1.0, confidence_guard=True)
        assert_law(run_verdicts(z, x, q, cfg), law)
    assert mixed >= 2


def test_greedy_confidence_guard_keeps_the_sure_targets_choice():
    """Greedy, token for token: on a guarded row the target's argmax is accepted and emitted,
    on the others argmax p_hat is."""
    eta, guarded, shifted = 6.0, 0, 0
    rules = oracle.Rules(eta, temperature=0.0, confidence_guard=True)
    cfg = RapidConfig(eta=eta, temperature=0.0, confidence_guard=True)
    for seed in range(40):
        z, q, _ = synthetic(seed)
        sure = oracle.softmax(z[:GAMMA]).max(axis=-1) >= q.max(axis=-1)
        best = oracle.augmented(oracle.softmax(z[:GAMMA]), q, rules).argmax(-1)
        unguarded = oracle.augmented(oracle.softmax(z[:GAMMA]), q, oracle.Rules(eta)).argmax(-1)
        guarded += int((sure & (unguarded != z[:GAMMA].argmax(-1))).sum())
        shifted += int((~sure & (best != z[:GAMMA].argmax(-1))).sum())
        for n in range(GAMMA + 1):
            x = best.copy()
            if n < GAMMA:
                x[n] = (best[n] + 1) % V
            want = oracle.greedy_step(z, x, q, rules)
            assert greedy_verdict(z, x, q, cfg) == want, (seed, n)
    assert guarded > 5 and shifted > 5  # the guard changes choices, and leaves others shifted


@pytest.mark.parametrize("guard", ["paper", "draft", "none"])
def test_greedy_verdict_accepts_argmax_p_hat_and_emits_it(guard):
    """Section 3 at eta > 0, token for token, with the rejection at every row 0..gamma."""
    eta = 6.0
    differs = 0
    for seed in range(40):
        z, q, _ = synthetic(seed)
        rules = oracle.Rules(eta, temperature=0.0, tail_guard=guard)
        best_hat = oracle.augmented(oracle.softmax(z[:GAMMA]), q, rules).argmax(-1)
        best_p = z.argmax(-1)
        differs += int((best_hat != best_p[:GAMMA]).sum())
        for n in range(GAMMA + 1):
            x = best_hat.copy()
            if n < GAMMA:  # reject at row n: the target's own choice if that differs, else another
                x[n] = best_p[n] if best_p[n] != best_hat[n] else (best_hat[n] + 1) % V
            want = oracle.greedy_step(z, x, q, rules)
            assert want[0] == n
            cfg = RapidConfig(eta=eta, temperature=0.0, tail_guard=guard, confidence_guard=False)
            assert greedy_verdict(z, x, q, cfg) == want, (seed, n)
    assert differs > 40  # argmax p_hat is often not argmax p: the test tells them apart


def test_greedy_end_guard_keeps_the_targets_choice():
    eta = 6.0
    for seed in range(20):
        z, q, _ = synthetic(seed)
        ends = (int(z[0].argmax()),)
        rules = oracle.Rules(eta, temperature=0.0, end_ids=ends)
        x = np.full(GAMMA, (int(z[0].argmax()) + 1) % V)  # rejected at row 0
        want = oracle.greedy_step(z, x, q, rules)
        assert want == (0, int(z[0].argmax()))
        cfg = RapidConfig(eta=eta, temperature=0.0, confidence_guard=False)
        assert greedy_verdict(z, x, q, cfg, ends) == want


def test_greedy_keeps_argmax_p_hat_and_the_bonus_row_has_it_too():
    """Drafts with a q row for the bonus position too (eta > 0, section 2.7): rejected at
    each row n in turn, or all kept, and the bonus row then emits argmax p_hat."""
    eta, bonus_differs = 6.0, 0
    rules = oracle.Rules(eta, temperature=0.0, confidence_guard=True)
    cfg = RapidConfig(eta=eta, temperature=0.0)
    for seed in range(40):
        rng = np.random.default_rng(seed)
        z = rng.normal(size=(GAMMA + 1, V)) * 2.0
        q = oracle.softmax(rng.normal(size=(GAMMA + 1, V)) * 2.5)
        best = oracle.augmented(oracle.softmax(z), q, rules).argmax(-1)
        bonus_differs += int(best[GAMMA] != z[GAMMA].argmax())
        for n in range(GAMMA + 1):
            x = best[:GAMMA].copy()
            if n < GAMMA:
                x[n] = (best[n] + 1) % V
            want = oracle.greedy_step(z, x, q, rules)
            assert want[0] == n
            assert greedy_verdict(z, x, q, cfg) == want, (seed, n)
    assert bonus_differs > 5  # the bonus row's p_hat changes the choice: the test sees it
