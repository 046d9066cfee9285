"""Fuzzing the acceptance math, the verdict and the detokenizer with random and extreme inputs.

`test_sampling.py` checks the formulas on well-behaved logits; here hypothesis throws huge,
tiny, tied and filtered logits, extreme temperatures, top_p and eta at them. The properties:
every distribution is a valid probability vector (no NaN, non-negative, sums to 1), nothing
outside the target's nucleus is ever emitted, and streamed text equals the decoded text cut at
the first stop string. The draft-prompt builder's bound and provenance on random string prompts
are fuzzed in `test_retrieval_splitter.py`; chat prompts are fuzzed here.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from rapid_integrations.config import RapidConfig
from rapid_integrations.engine.prompts import prepare_draft_prompt
from rapid_integrations.retrieval.base import count_text_tokens
from rapid_integrations.sample.sampling import (
    accepted_count,
    end_guard,
    log_probs,
    one_step_law,
    p_hat,
    residual,
)
from rapid_integrations.sample.verify import verdict
from rapid_integrations.tokens import Detokenizer
from tests.retrieval_fixtures import HashingEmbedder, smol_tokenizer
from tests.tiny import char_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Logits as models produce them, plus the extremes: fp16's largest value, ties, huge gaps.
LOGIT = st.one_of(
    st.floats(-30, 30),
    st.sampled_from([0.0, 65504.0, -65504.0, 1e30, -1e30, 3e38, -3e38]),
)
TEMPERATURE = st.one_of(
    st.just(0.0), st.floats(1e-45, 1e-3), st.floats(1e-3, 10.0), st.floats(10.0, 1e30)
)
TOP_P = st.one_of(st.floats(1e-9, 1.0, exclude_min=True), st.just(1.0))
ETA = st.one_of(st.just(0.0), st.floats(0.0, 50.0), st.floats(50.0, 1e300))
DTYPE = st.sampled_from([torch.float32, torch.float64])


@st.composite
def logits(draw: st.DrawFn, rows: int | None = None) -> torch.Tensor:
    """[rows, V] logits, V in [2, 12], in fp16, fp32 or fp64 as a model would return them."""
    k = rows or draw(st.integers(1, 4))
    width = draw(st.integers(2, 12))
    values = draw(st.lists(LOGIT, min_size=k * width, max_size=k * width))
    dtype = draw(st.sampled_from([torch.float16, torch.float32, torch.float64]))
    z = torch.tensor(values, dtype=torch.float64).view(k, width)
    return z.clamp(torch.finfo(dtype).min, torch.finfo(dtype).max).to(dtype)


@st.composite
def distribution(draw: st.DrawFn, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A probability vector over `width` tokens, often with zeros (a filtered draft)."""
    weights = draw(
        st.lists(st.one_of(st.just(0.0), st.floats(1e-30, 1.0)), min_size=width, max_size=width)
    )
    assume(sum(weights) > 0)
    w = torch.tensor(weights, dtype=torch.float64)
    return (w / w.sum()).to(dtype)


def assert_distribution(d: torch.Tensor) -> None:
    """Finite, non-negative, each row summing to 1."""
    assert torch.isfinite(d).all() and (d >= 0).all(), d
    sums = d.double().sum(dim=-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5), sums


@FUZZ
@given(z=logits(), temperature=TEMPERATURE, top_p=TOP_P)
def test_log_probs_are_valid_and_the_nucleus_is_a_top_set(
    z: torch.Tensor, temperature: float, top_p: float
) -> None:
    logp = log_probs(z, temperature, top_p)
    assert not logp.isnan().any() and (logp <= 1e-6).all()
    assert_distribution(logp.exp())
    full = log_probs(z, temperature, 1.0).exp()
    for row, kept in zip(full, logp > float("-inf"), strict=True):
        assert kept.any() and row[kept].sum() >= min(top_p, row.sum()) - 1e-5
        if not kept.all():
            assert row[kept].min() >= row[~kept].max()  # no token beats one that was kept


@FUZZ
@given(
    data=st.data(),
    z=logits(),
    temperature=TEMPERATURE,
    top_p=TOP_P,
    eta=ETA,
    guard=st.sampled_from(["paper", "draft", "none"]),
    ratio=st.floats(0.0, 0.99),
    rule=st.sampled_from(["paper", "exact"]),
)
def test_p_hat_residual_and_law_are_distributions_inside_the_nucleus(
    data: st.DataObject,
    z: torch.Tensor,
    temperature: float,
    top_p: float,
    eta: float,
    guard: str,
    ratio: float,
    rule: str,
) -> None:
    logp = log_probs(z, temperature, top_p)
    p = logp.exp()
    q = torch.stack([data.draw(distribution(z.shape[-1], logp.dtype)) for _ in range(len(z))])
    ph = p_hat(logp, q, eta, guard, ratio)
    assert_distribution(ph)
    outside = logp == float("-inf")  # filtered by top_p
    assert (ph[outside] == 0).all()  # leaning toward the draft never leaves the nucleus
    guarded = end_guard(ph, p, torch.tensor([0]))
    assert_distribution(guarded)
    for row in range(len(z)):
        r = residual(p[row], ph[row], q[row], rule)
        law = one_step_law(p[row], ph[row], q[row], rule)
        assert_distribution(r)
        assert_distribution(law)
        assert (r[outside[row]] == 0).all()


@FUZZ
@given(probs=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)), max_size=8))
def test_accepted_count_is_the_leading_run_of_accepts(
    probs: list[tuple[float, float, float]],
) -> None:
    gamma = len(probs)
    p_hat_x, q_x, u = (torch.tensor([t[i] for t in probs], dtype=torch.float64) for i in range(3))
    n = accepted_count(torch.arange(gamma), p_hat_x, q_x, u)
    accepts = [bool(u[i] * q_x[i] < p_hat_x[i]) for i in range(gamma)]
    assert n == [*accepts, False].index(False)


@FUZZ
@given(
    data=st.data(),
    gamma=st.integers(0, 4),
    temperature=TEMPERATURE,
    top_p=TOP_P,
    eta=ETA,
    residual_rule=st.sampled_from(["paper", "exact"]),
    tail_guard=st.sampled_from(["paper", "draft", "none"]),
    seed=st.integers(0, 2**32),
    end=st.booleans(),
)
def test_verdict_emits_a_token_of_the_targets_nucleus(
    data: st.DataObject,
    gamma: int,
    temperature: float,
    top_p: float,
    eta: float,
    residual_rule: str,
    tail_guard: str,
    seed: int,
    end: bool,
) -> None:
    """Accepted drafts and the emitted token all lie in the target's nucleus."""
    z = data.draw(logits(rows=gamma + 1))
    vocab = z.shape[-1]
    cfg = RapidConfig(
        eta=eta,
        temperature=temperature,
        top_p=top_p,
        residual=residual_rule,
        tail_guard=tail_guard,
    )
    x = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=gamma, max_size=gamma)))
    q = (
        torch.stack([data.draw(distribution(vocab, torch.float32)) for _ in range(gamma)])
        if gamma
        else torch.zeros(0, vocab)
    )
    if cfg.greedy and eta == 0:
        q = None  # the proposer's contract: greedy with eta = 0 needs no q
    end_ids = torch.tensor([0]) if end else None
    n, token = verdict(z, x, q, cfg, torch.Generator().manual_seed(seed), end_ids)
    assert 0 <= n <= gamma and token.shape == (1,)
    # Greedy decoding reads the T = 1 softmax without top_p (docs/algorithm.md section 3): its nucleus is
    # every token, and with eta = 0 it emits the argmax.
    logp = log_probs(z, cfg.temperature, 1.0 if cfg.greedy else cfg.top_p)
    emitted = [*x[:n].tolist(), int(token)]
    assert all(logp[i, t] > float("-inf") for i, t in enumerate(emitted))
    if cfg.greedy and eta == 0:
        assert int(token) == int(z[n].float().argmax())


# ---- detokenizer: stop strings split across tokens, multi-byte and control characters -----

CHAR_TEXT = st.text(alphabet=string.ascii_lowercase[:12] + " .", max_size=40)
UNICODE_TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("abc .\n\t\x00\x07\x1b\u200b\ufeffé你好，世界🎉🧪👩‍👩‍👧")),
        st.characters(codec="utf-8", exclude_categories=["Cs"]),
    ),
    max_size=30,
)


def expected_text(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: list[str]) -> str:
    """What the stream must show (the `Detokenizer` contract, recomputed naively): generation
    stops at the first token whose decoded prefix (whole characters) holds a stop string, and
    the text is cut before the earliest stop in it; without a stop, the decoded text less the
    replacement marks of bytes left incomplete at the end."""
    for k in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:k], skip_special_tokens=True)
        cuts = [i for i in (prefix.find(s) for s in stop) if i >= 0]
        if cuts and not prefix.endswith("\ufffd"):
            return prefix[: min(cuts)]
    return tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def check_stream(tokenizer: PreTrainedTokenizerBase, text: str, stop: list[str]) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    detok = Detokenizer(tokenizer, stop)
    deltas = []
    for token in ids:
        deltas.append(detok.push(token))
        if detok.stopped:
            break
    else:
        deltas.append(detok.finish())
    assert "".join(deltas) == detok.text == expected_text(tokenizer, ids, stop)
    if "\ufffd" not in decoded:  # else the tokenizer itself cannot encode a character
        assert all("\ufffd" not in d for d in deltas)


@FUZZ
@given(
    text=CHAR_TEXT,
    stop=st.lists(st.text(string.ascii_lowercase[:5] + " .", min_size=1, max_size=4), max_size=3),
)
def test_stop_strings_split_across_character_tokens(text: str, stop: list[str]) -> None:
    check_stream(char_tokenizer(), text, stop)


@FUZZ
@given(data=st.data(), text=UNICODE_TEXT)
def test_multibyte_and_control_characters_stream_exactly(data: st.DataObject, text: str) -> None:
    """Byte-level BPE splits emoji and CJK across tokens; a stop string drawn from the text
    itself usually straddles token boundaries too."""
    start = data.draw(st.integers(0, len(text)))
    stop = text[start : start + data.draw(st.integers(1, 4))]
    check_stream(smol_tokenizer(), text, [stop] if stop else [])


# ---- draft prompts of chat conversations ---------------------------------------------------

WORD = st.one_of(
    st.sampled_from(["the", "lamp", "was", "green", "in", "1931", "naïve", "你好", "🎉"]),
    st.text(string.ascii_letters, min_size=1, max_size=9),
)
SENTENCE = st.lists(WORD, min_size=2, max_size=12).map(lambda words: " ".join(words) + ".")
TURN = st.lists(SENTENCE, min_size=1, max_size=8).map(" ".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    turns=st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]), TURN), max_size=12),
    question=st.text(alphabet=string.ascii_letters + " ?", min_size=1, max_size=15),
    budget=st.integers(16, 64),
)
def test_chat_draft_prompt_bound_and_provenance(
    turns: list[tuple[str, str]], question: str, budget: int
) -> None:
    """Short system turns and the last user turn stay; a system turn longer than the budget
    and the earlier turns are cut to passages of their own, the earlier turns within the
    budget, never text of the builder's own."""
    tok = smol_tokenizer()
    chat = [{"role": r, "content": c} for r, c in turns] + [{"role": "user", "content": question}]
    cfg = RapidConfig(
        retrieval_budget=budget, retrieval_threshold=-1.0, retrieval_embedder=HashingEmbedder()
    )
    result = prepare_draft_prompt(chat, tok, config=cfg)
    draft = result.prompt
    assert result.fallback is None and isinstance(draft, list)
    assert draft[-1] == chat[-1]
    systems = [m["content"] for m in chat if m["role"] == "system"]
    cut_systems = [m["content"] for m in draft if m["role"] == "system"]
    for original, cut in zip(systems, cut_systems, strict=True):
        if count_text_tokens(tok, original) <= budget:
            assert cut == original  # a short system message is an instruction, kept whole
        else:  # a long one carries context: cut to its own head, passages and tail
            assert count_text_tokens(tok, cut) <= count_text_tokens(tok, original)
            assert all(piece in original for piece in cut.split())
    event(f"passthrough={result.passthrough}")
    if result.passthrough:
        assert draft == chat
        return
    middle = [m for m in draft[:-1] if m["role"] != "system"]
    assert sum(count_text_tokens(tok, m["content"]) for m in middle) <= budget
    sources = "\n".join(m["content"] for m in chat)
    for message in middle:
        for passage in filter(None, message["content"].split("\n\n")):
            assert passage in sources  # nothing invented
