"""docs/algorithm.md section 4 on the whole engine: emitted tokens against their analytic laws.

The vocabulary (26 tokens) is small enough to enumerate, so the law of the first emitted token
is computed exactly from no-cache forward passes and compared by a chi-square test to the
engine's output over many seeds (fixed seeds: the test is deterministic). Expected laws at
eta > 0 come from the numpy oracle of `tests/oracle.py`, which shares no code with the package.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rapid_integrations import BatchRunner, RapidConfig, RapidEngine
from rapid_integrations.engine import planning
from rapid_integrations.runtime.kv import KVState, direct
from rapid_integrations.spec_decode.drafting import ModelProposer
from tests import oracle
from tests.seeded import BATCH, counted, position_counts
from tests.test_batch_load import COMPUTE_BOUND, known, run_traced
from tests.tiny import next_token_probs

PROMPT, DRAFT_PROMPT = "kab", "ab"
# Where p_hat pulls hard: at eta = 8 the one-token law is more than 0.36 from p (total
# variation) under either residual and tail guard; on PROMPT at eta = 3 it is 0.009, too close
# to tell apart.
FAR_PROMPT, FAR_DRAFT_PROMPT, FAR_ETA = "cab d", "d", 8.0
FAR_OPTIONS = {"gamma": 3, "max_new_tokens": 4, "eta": FAR_ETA}
N = 1200
pytestmark = pytest.mark.usefixtures("one_thread")


def first_tokens(
    engine: RapidEngine,
    n: int = N,
    prompts: tuple[str, str] = (PROMPT, DRAFT_PROMPT),
    **overrides,
) -> np.ndarray:
    """Counts [2, V] of the first and the second emitted token over `n` seeds: one sampling
    run serves the laws of both positions."""
    return position_counts(engine, prompts, n, ignore_eos=True, **overrides)


@torch.inference_mode()
def last_logits(model, tok, ids: list[int]) -> np.ndarray:
    """Logits [V] after `ids`, recomputed without a cache."""
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1, : len(tok)].numpy()


def assert_follows(counts: np.ndarray, law: np.ndarray) -> None:
    keep = law * counts.sum() >= 5
    expected = law[keep] / law[keep].sum() * counts[keep].sum()
    result = chisquare(counts[keep], expected)
    assert result.pvalue > 1e-3, (result, counts, law * counts.sum())


@pytest.fixture(scope="module")
def engine(tok, target, draft):
    return RapidEngine(
        target,
        draft,
        tokenizer=tok,
        config=RapidConfig(eta=0.0, temperature=1.0, confidence_guard=False),
    )


@pytest.mark.parametrize("gamma", [1, 3])
def test_eta0_sampling_first_two_tokens_follow_p(engine, target, tok, gamma):
    """Token 1 follows p; token 2 its marginal sum_x1 p(x1) p(x2 | x1). With gamma = 1 token 2
    is the bonus token whenever the first draft is accepted; with gamma = 3 it is a verified
    draft position."""
    ids = tok.encode(PROMPT)
    p1 = next_token_probs(target, ids, len(tok))
    law = sum(p1[a] * next_token_probs(target, [*ids, a], len(tok)) for a in range(len(tok)))
    counts = first_tokens(engine, gamma=gamma, max_new_tokens=gamma + 1)
    assert_follows(counts[0], p1.numpy())
    assert_follows(counts[1], law.numpy())


def test_eta0_temperature_and_top_p_follow_filtered_p(engine, target, tok):
    law = oracle.target_p(last_logits(target, tok, tok.encode(PROMPT))[None], 1.5, 0.8)[0]
    counts = first_tokens(engine, gamma=2, max_new_tokens=3, temperature=1.5, top_p=0.8)[0]
    assert 4 <= (law > 0).sum() < len(law)  # the nucleus really cuts, yet leaves a choice
    assert counts[law == 0].sum() == 0  # nothing outside the nucleus, ever
    assert_follows(counts, law)


def oracle_law(target, draft, tok, prefix: list[int], rules: oracle.Rules) -> np.ndarray:
    """The oracle's law [V] of the token emitted after `prefix` (ids after both prompts)."""
    p = oracle.target_p(
        last_logits(target, tok, tok.encode(FAR_PROMPT) + prefix)[None],
        rules.temperature,
        rules.top_p,
    )[0]
    q = oracle.target_p(
        last_logits(draft, tok, tok.encode(FAR_DRAFT_PROMPT) + prefix)[None],
        rules.temperature,
        rules.top_p,
    )[0]
    return oracle.one_token_law(p, q, rules), p


def far_tokens(engine: RapidEngine, **overrides) -> np.ndarray:
    """Counts [2, V] of the first two tokens on the far prompt, gamma 3, eta FAR_ETA."""
    return first_tokens(engine, prompts=(FAR_PROMPT, FAR_DRAFT_PROMPT), **FAR_OPTIONS, **overrides)


def second_token_law(target, draft, tok, first: np.ndarray, rules: oracle.Rules) -> np.ndarray:
    """The marginal law [V] of the second token, given the first's law `first`: gamma = 3 emits
    it at a drafted position (a verified draft, or the first draft of the next step after a
    rejection), so given token 1 = a it follows the one-token law at prefix [a]."""
    return sum(
        first[a] * oracle_law(target, draft, tok, [a], rules)[0]
        for a in range(len(tok))
        if first[a] > 0
    )


@pytest.mark.parametrize("rule", ["paper", "exact"])
@pytest.mark.parametrize("guard", ["paper", "draft"])
def test_eta_positive_first_two_tokens_follow_the_oracle(engine, target, draft, tok, rule, guard):
    """Token 1 follows the one-token law, token 2 its marginal (`second_token_law`)."""
    rules = oracle.Rules(FAR_ETA, residual=rule, tail_guard=guard)
    first, p = oracle_law(target, draft, tok, [], rules)
    assert oracle.total_variation(first[None], p[None])[0] > 0.2  # far from p: a real test
    second = second_token_law(target, draft, tok, first, rules)
    counts = far_tokens(engine, residual=rule, tail_guard=guard)
    assert_follows(counts[0], first)
    assert_follows(counts[1], second)


def test_eta_positive_at_temperature_and_top_p_follows_the_oracle(engine, target, draft, tok):
    rules = oracle.Rules(FAR_ETA, temperature=1.3, top_p=0.8)
    law, p = oracle_law(target, draft, tok, [], rules)
    assert 2 <= (p > 0).sum() < len(p) and oracle.total_variation(law[None], p[None])[0] > 0.2
    counts = far_tokens(engine, temperature=1.3, top_p=0.8)[0]
    assert counts[p == 0].sum() == 0  # nothing outside the target's nucleus
    assert_follows(counts, law)


def test_unseeded_calls_capped_in_a_busy_batch_follow_the_oracle(
    engine, target, draft, tok, monkeypatch
):
    """Section 14.2: a compute-bound batch (known costs) caps its unseeded sampled calls at 0,
    so every pass under the cap reads one token a call, and their first two tokens still
    follow the eta > 0 law (a cap is a gamma; the law holds at any). The seeds the engine
    draws for unseeded calls come from a fixed sequence here, so the test is deterministic."""
    seeds = itertools.count(10_000)
    fixed = SimpleNamespace(randrange=lambda _n: next(seeds))
    monkeypatch.setattr(planning, "random", SimpleNamespace(SystemRandom=lambda: fixed))
    call = (FAR_PROMPT, FAR_DRAFT_PROMPT, {**FAR_OPTIONS, "ignore_eos": True})
    emitted = []
    for _ in range(N // BATCH):
        runner = BatchRunner(engine, known(COMPUTE_BOUND))
        outputs, passes = run_traced(engine, runner, [call] * BATCH)
        capped = [(n, width) for cap, n, width in passes if cap == 0]
        assert capped and all(width == n for n, width in capped)  # no drafts under the cap
        emitted += outputs
    counts = counted(emitted, len(tok))
    rules = oracle.Rules(FAR_ETA)
    first, _ = oracle_law(target, draft, tok, [], rules)
    assert_follows(counts[0], first)
    assert_follows(counts[1], second_token_law(target, draft, tok, first, rules))


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.8), (1.6, 0.9), (0.0, 0.8)])
def test_proposer_q_is_the_drafts_own_filtered_distribution(draft, tok, temperature, top_p):
    """q at every drafted row, and at the bonus row past them (eta > 0, section 2.7), equals
    softmax(draft logits / T) after top-p, computed here by the oracle from no-cache logits
    (greedy: the T = 1 softmax, unfiltered, section 3)."""
    cfg = RapidConfig(eta=2.0, temperature=temperature, top_p=top_p, gamma=4)
    ids = tok.encode("hello. ab cd")
    state = KVState.start(draft, ids, len(tok), chunk=5, capacity=len(ids) + 8)
    proposal = direct(ModelProposer(state, cfg, torch.Generator().manual_seed(0)).propose(4))
    x, q = proposal.x, proposal.q
    assert q.shape == (5, len(tok))
    for i in range(5):
        want = oracle.target_p(
            last_logits(draft, tok, ids + x[:i].tolist())[None],
            temperature,
            top_p if temperature else 1.0,
        )[0]
        np.testing.assert_allclose(q[i].detach().double().numpy(), want, atol=1e-9)
        assert i == 4 or want[int(x[i])] > 0
