"""Log probabilities (docs/algorithm.md section 12) against laws computed without the engine:
transformers' own `generate(output_logits=True)`, cache-free forwards, and the numpy oracle."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from rapid_integrations import RapidConfig, RapidConfigError, RapidEngine
from rapid_integrations.output.logprobs import token_bytes
from tests import oracle
from tests.test_engine_adaptive import repetitive_prompts
from tests.test_engine_exact import random_prompts
from tests.tiny import tiny_llama

REPEATING = [("abc def abc def abc d", "abc d"), ("ghij. ghij. ghij. g", "ghij.")]


def generate_logprobs(model, ids: list[int], n: int, vocab: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the log-softmax of its `output_logits`, [n, vocab]."""
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    logits = torch.stack([step[0, :vocab] for step in out.logits]).double()
    return out.sequences[0, len(ids) :].tolist(), torch.log_softmax(logits, dim=-1)


@torch.inference_mode()
def cache_free_logits(model, ids: list[int], new: list[int], vocab: int) -> np.ndarray:
    """The model's logits [len(new), vocab] before each new token, one full forward each."""
    rows = [
        model(input_ids=torch.tensor([ids + new[:i]]), use_cache=False).logits[0, -1, :vocab]
        for i in range(len(new))
    ]
    return torch.stack(rows).double().numpy()


def check_against_generate(engine, model, tok, prompt, draft_prompt, tolerance, **options):
    """The call's log p and top alternatives equal generate()'s for the same tokens."""
    out = engine.generate(prompt, draft_prompt, logprobs=True, top_logprobs=4, **options)
    want, logp = generate_logprobs(model, tok.encode(prompt), len(out.token_ids), len(tok))
    assert out.token_ids == want
    assert [e.token_id for e in out.logprobs] == want
    got = torch.tensor([e.logprob for e in out.logprobs], dtype=torch.float64)
    assert torch.allclose(got, logp[torch.arange(len(want)), want], rtol=0, atol=tolerance)
    for entry, row in zip(out.logprobs, logp, strict=True):
        values = torch.tensor([t.logprob for t in entry.top_logprobs], dtype=torch.float64)
        assert torch.allclose(values, row.topk(4).values, rtol=0, atol=tolerance)
        for alternative in entry.top_logprobs:  # ids agree with their own values
            assert abs(row[alternative.token_id] - alternative.logprob) <= tolerance
    return out


@pytest.mark.parametrize("kind", ["self", "separate"])
def test_eta0_greedy_logprobs_equal_transformers_output_logits(
    engines, target, tok, kind, one_thread
):
    """Accepted drafts, lookup copies, recovered and bonus tokens: every emitted token's log p
    is generate()'s (whose logits transformers casts to float32: hence 1e-6)."""
    accepted = copied = 0
    for gamma in (1, 4):
        for prompt, draft_prompt in repetitive_prompts(4, seed=3):
            out = check_against_generate(
                engines[kind], target, tok, prompt, draft_prompt, 1e-6, gamma=gamma, lookup_ngram=2
            )
            accepted += out.stats.accepted_tokens
            copied += out.stats.lookup_accepted_tokens
    assert accepted > 0  # drafted tokens were checked, and under self-speculation copies
    assert copied > 0 or kind == "separate"


def test_float32_model_logprobs_equal_transformers_output_logits(tok):
    model = tiny_llama(len(tok), seed=1, dtype=torch.float32)
    cfg = RapidConfig(eta=0.0, max_new_tokens=24, ignore_eos=True)
    engine = RapidEngine(model, tokenizer=tok, config=cfg)
    check_against_generate(engine, model, tok, *REPEATING[0], 2e-5, gamma=4)


def test_float64_logprobs_equal_a_cache_free_forward(engines, target, tok):
    """Exact to float64 rounding against the model read from scratch before each token."""
    for prompt, draft_prompt in REPEATING:
        out = engines["separate"].generate(prompt, draft_prompt, gamma=5, logprobs=True)
        z = cache_free_logits(target, tok.encode(prompt), out.token_ids, len(tok))
        want = np.log(oracle.softmax(z))[np.arange(len(z)), out.token_ids]
        assert np.allclose([e.logprob for e in out.logprobs], want, rtol=0, atol=1e-10)


def test_sampled_calls_report_the_raw_law_and_p_hat_the_tempered_one(engines, target, tok):
    """log p is the raw log-softmax whatever the temperature and top-p (vLLM's raw
    logprobs); at eta = 0 log p_hat is the tempered, nucleus-filtered p the draws follow."""
    prompt, draft_prompt = REPEATING[0]
    options = {"temperature": 0.7, "top_p": 0.9, "seed": 3, "gamma": 4}
    out = engines["separate"].generate(
        prompt, draft_prompt, logprobs=True, logprobs_p_hat=True, **options
    )
    z = cache_free_logits(target, tok.encode(prompt), out.token_ids, len(tok))
    rows = np.arange(len(z)), out.token_ids
    raw = [e.logprob for e in out.logprobs]
    assert np.allclose(raw, np.log(oracle.softmax(z))[rows], rtol=0, atol=1e-10)
    tempered = np.log(oracle.target_p(z, 0.7, 0.9)[rows])
    assert np.allclose([e.p_hat_logprob for e in out.logprobs], tempered, rtol=0, atol=1e-10)


def test_p_hat_logprob_is_the_oracle_p_hat_under_eta(tok, target):
    """eta > 0, greedy, self-speculation: log p_hat(token) at each position is the oracle's
    p_hat from the target on the full prompt (p) and on the draft prompt (q), T = 1."""
    eta = 2.0
    cfg = RapidConfig(eta=eta, max_new_tokens=20, ignore_eos=True, lookup_ngram=0)
    engine = RapidEngine(target, tokenizer=tok, config=cfg)
    shifted = 0
    for prompt, draft_prompt in random_prompts(4, seed=5):
        out = engine.generate(prompt, draft_prompt, logprobs=True, logprobs_p_hat=True, gamma=3)
        new = out.token_ids
        p = oracle.softmax(cache_free_logits(target, tok.encode(prompt), new, len(tok)))
        q = oracle.softmax(cache_free_logits(target, tok.encode(draft_prompt), new, len(tok)))
        p_hat = oracle.augmented(p, q, oracle.Rules(eta=eta, confidence_guard=True))
        rows = np.arange(len(new)), new
        assert np.allclose([e.p_hat_logprob for e in out.logprobs], np.log(p_hat[rows]), atol=1e-9)
        assert np.allclose([e.logprob for e in out.logprobs], np.log(p[rows]), atol=1e-10)
        shifted += int((np.abs(p_hat[rows] - p[rows]) > 1e-6).sum())
    assert shifted > 0  # p_hat differed from p somewhere: the check could tell them apart


def test_streamed_deltas_carry_each_token_once_and_eos_none(tok, target):
    """Deltas' entries join into `output.logprobs`, one per token id: the end-of-sequence
    token has none, nor does anything past a stop string (its token is in token_ids)."""
    engine = RapidEngine(target, tokenizer=tok, config=RapidConfig(eta=0.0, max_new_tokens=60))
    for prompt, stop in [("abc def abc", ()), ("ghij. ghij.", ("j",)), ("ab", ())]:
        stream = engine.stream(prompt, prompt[:3], logprobs=True, stop=stop, gamma=4)
        deltas = list(stream.deltas())
        out = stream.output
        entries = [e for d in deltas for e in d.logprobs]
        assert entries == out.logprobs
        assert [e.token_id for e in entries] == out.token_ids
        assert "".join(d.text for d in deltas) == out.text
        assert all(d.text or d.logprobs for d in deltas)


def test_nothing_is_computed_unless_asked(tok, target):
    engine = RapidEngine(target, tokenizer=tok, config=RapidConfig(eta=0.0, max_new_tokens=8))
    stream = engine.stream("abc def", "abc")
    assert all(d.logprobs == () for d in stream.deltas())
    assert stream.output.logprobs is None
    assert engine._token_bytes is None  # the vocabulary's bytes were never built
    out = engine.generate("abc def", "abc", logprobs=True)
    assert len(out.logprobs) == len(out.token_ids) > 0


def test_top_logprobs_are_sorted_and_as_many_as_asked(engines):
    out = engines["self"].generate("abc def", "abc", logprobs=True, top_logprobs=20)
    for entry in out.logprobs:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 20 and values == sorted(values, reverse=True)
        assert entry.logprob == values[0]  # greedy: the emitted token is the most likely
        assert entry.p_hat_logprob is None  # not asked for


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs_p_hat": True}, "logprobs_p_hat"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
    ],
)
def test_bad_logprob_options_raise_naming_the_field(engines, options, field):
    with pytest.raises(RapidConfigError) as err:
        engines["self"].generate("abc", "a", **options)
    assert err.value.field == field


def test_token_bytes_are_exact_for_a_byte_level_tokenizer():
    """SmolLM2's byte-level BPE splits characters across tokens: the bytes still join."""
    from rapid_integrations.models.loading import default_model_dir, load_tokenizer

    smol = load_tokenizer(default_model_dir(), None)
    text = "héllo 日本 🎉"
    table = token_bytes(smol, len(smol))
    ids = smol.encode(text, add_special_tokens=False)
    assert b"".join(table[i] for i in ids) == text.encode()
    assert any(len(table[i]) == 1 and table[i][0] >= 0x80 for i in ids)  # a split character


def test_token_bytes_without_xgrammar_decode_each_token(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    table = token_bytes(tok, len(tok))
    assert table[tok.convert_tokens_to_ids("a")] == b"a" and len(table) == len(tok)
