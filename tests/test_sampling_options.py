"""top_k, min_p and repetition_penalty (docs/algorithm.md section 9) against transformers' own
logits processors, which serve as the independent reference: the greedy identity of section 4
and the laws of single emitted tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rapid_integrations import RapidConfig, RapidConfigError, RapidEngine
from rapid_integrations.sample.sampling import log_probs, one_step_law, p_hat
from tests.test_engine_distribution import DRAFT_PROMPT, PROMPT, assert_follows, first_tokens
from tests.test_engine_exact import random_prompts
from tests.tiny import reference_greedy

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


def transformers_probs(
    logits: torch.Tensor,
    history: list[int],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    penalty: float = 1.0,
) -> torch.Tensor:
    """softmax of [V] logits after transformers' processors in `generate`'s order, float64."""
    steps = LogitsProcessorList()
    if penalty != 1.0:
        steps.append(RepetitionPenaltyLogitsProcessor(penalty))
    steps.append(TemperatureLogitsWarper(temperature))
    if top_k:
        steps.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        steps.append(TopPLogitsWarper(top_p))
    if min_p:
        steps.append(MinPLogitsWarper(min_p))
    scores = steps(torch.tensor([history]), logits.double()[None].clone())
    return torch.softmax(scores[0], dim=-1)


@torch.inference_mode()
def model_logits(model, ids: list[int], vocab: int) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1, :vocab]


def penalized(penalty: float):
    """A `reference_greedy` processor: transformers' repetition penalty over the ids so far."""
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    return lambda ids, z: processor(torch.tensor([ids]), z[None])[0]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("min_p", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.2),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", "1.2"),
    ],
)
def test_bad_values_name_their_field(field, value):
    with pytest.raises(RapidConfigError) as caught:
        RapidConfig(**{field: value})
    assert caught.value.field == field and field in str(caught.value)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 5, 1.0, 0.0), (0.7, 0, 1.0, 0.2), (1.3, 12, 0.9, 0.05), (1.0, 1, 1.0, 0.0)],
)
def test_log_probs_match_transformers_warpers(temperature, top_k, top_p, min_p):
    torch.manual_seed(0)
    for _ in range(20):
        z = torch.randn(40, dtype=torch.float64) * 3
        want = transformers_probs(z, [0], temperature, top_k, top_p, min_p)
        got = log_probs(z[None], temperature, top_p, top_k, min_p).exp()[0]
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-9)


@pytest.fixture(scope="module")
def engines(tok, target, draft):
    cfg = RapidConfig(eta=0.0, max_new_tokens=24, ignore_eos=True, repetition_penalty=1.8)
    return {
        "self": RapidEngine(target, tokenizer=tok, config=cfg),
        "separate": RapidEngine(target, draft, tokenizer=tok, config=cfg),
    }


@pytest.mark.parametrize(
    ("kind", "gamma"), [("self", 3), ("separate", 1), ("separate", 5), ("separate", 12)]
)
def test_eta0_greedy_with_penalty_equals_target_greedy(engines, target, tok, gamma, kind):
    """Every verified row is penalized with its own history (prompt, emitted tokens and the
    drafts before it): a row that missed one would pick another token."""
    changed = 0
    for i, (prompt, draft_prompt) in enumerate(random_prompts(4, seed=gamma)):
        ids = tok.encode(prompt)
        want = reference_greedy(target, ids, 24, len(tok), penalized(1.8))
        changed += want != reference_greedy(target, ids, 24, len(tok))
        mode = "sd" if i % 2 else "rapid"
        out = engines[kind].generate(
            prompt, draft_prompt, mode=mode, gamma=gamma, top_k=3, min_p=0.3
        )
        assert out.token_ids == want, (kind, gamma, mode, prompt)
    assert changed >= 2  # the penalty really changes the greedy decoding


def test_eta0_greedy_with_penalty_equals_transformers_generate(engines, target, tok):
    ids = tok.encode("abc abc")
    want = target.generate(
        torch.tensor([ids]),
        do_sample=False,
        repetition_penalty=1.8,
        max_new_tokens=24,
        min_new_tokens=24,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(ids) :].tolist()
    assert engines["separate"].generate("abc abc", "abc", gamma=5).token_ids == want


N = 700  # samples per law: a chi-square test at p > 1e-3 still sees a wrong law at this size
OPTIONS = {"temperature": 1.2, "top_k": 6, "min_p": 0.03, "repetition_penalty": 1.6}


def filtered(logits: torch.Tensor, history: list[int]) -> torch.Tensor:
    o = OPTIONS
    return transformers_probs(
        logits, history, o["temperature"], o["top_k"], 1.0, o["min_p"], o["repetition_penalty"]
    )


def filtered_p(model, ids, tok):
    return filtered(model_logits(model, ids, len(tok)), ids)


@pytest.fixture(scope="module")
def sampler(tok, target, draft):
    cfg = RapidConfig(eta=0.0, confidence_guard=False, **OPTIONS)  # eta > 0 laws: paper p_hat
    return RapidEngine(target, draft, tokenizer=tok, config=cfg)


def test_eta0_sampling_first_two_tokens_follow_filtered_p(sampler, target, tok):
    """Token 1 follows filtered p; token 2 is a verified draft row (gamma 3): its penalty
    counts the first token."""
    ids = tok.encode(PROMPT)
    p1 = filtered_p(target, ids, tok)
    assert 3 <= (p1 > 0).sum() < len(p1)  # the filters cut, yet leave a choice
    law = sum(p1[a] * filtered_p(target, [*ids, a], tok) for a in range(len(tok)) if p1[a] > 0)
    counts = first_tokens(sampler, N, gamma=3, max_new_tokens=4)
    assert counts[0, p1.numpy() == 0].sum() == 0
    assert_follows(counts[0], p1.numpy())
    assert_follows(counts[1], law.numpy())


def test_eta_positive_law_with_filtered_p_and_q(sampler, target, draft, tok):
    """p and q are filtered alike; q's penalty counts the target's prompt (section 9)."""
    ids = tok.encode(PROMPT)
    p = filtered_p(target, ids, tok)
    draft_logits = model_logits(draft, tok.encode(DRAFT_PROMPT), len(tok))
    q = filtered(draft_logits, ids)
    ph = p_hat(torch.log(p)[None], q[None], 3.0)[0]
    law = one_step_law(p, ph, q).numpy()
    counts = first_tokens(sampler, N, gamma=2, max_new_tokens=3, eta=3.0)[0]
    assert counts[law == 0].sum() == 0
    assert_follows(counts, law)
