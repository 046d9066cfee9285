"""docs/algorithm.md section 4 on tiny random models: eta = 0 greedy is the target's own greedy decoding."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.runtime import attention
from tests.tiny import greedy_mismatches, greedy_picks, reference_greedy, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

ALPHABET = "abcdefghijkl ."


def random_prompts(n: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, draft_prompt) pairs; the draft reads a random slice, as retrieval would."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 60)))
        a = rng.randint(0, len(prompt) - 1)
        pairs.append((prompt, prompt[a : a + rng.randint(1, 20)]))
    return pairs


@pytest.mark.parametrize("gamma", range(1, 13))
@pytest.mark.parametrize("kind", ["self", "separate"])
def test_eta0_greedy_equals_target_greedy(engines, target, tok, gamma, kind):
    engine = engines[kind]
    for i, (prompt, draft_prompt) in enumerate(random_prompts(6, seed=gamma)):
        mode = "sd" if i % 3 == 2 else "rapid"
        chunk = 1 + i % 7  # chunked prefill of every size, down to one token at a time
        out = engine.generate(
            prompt, draft_prompt, mode=mode, gamma=gamma, prefill_chunk_size=chunk
        )
        # The target's greedy decoding without a cache (one pass, not reference_greedy's 24).
        assert len(out.token_ids) == 24, (kind, gamma, mode, prompt)
        wrong = greedy_mismatches(target, tok.encode(prompt), out.token_ids, len(tok))
        assert wrong == [], (kind, gamma, mode, prompt)
        assert out.finish_reason == "length"


def test_lc_mode_equals_target_greedy(engines, target, tok):
    for prompt, _ in random_prompts(8, seed=99):
        out = engines["separate"].generate(prompt, mode="lc")
        assert out.token_ids == reference_greedy(target, tok.encode(prompt), 24, len(tok))
        assert out.stats.drafted_tokens == 0


def test_rag_mode_is_the_draft_alone_on_the_draft_prompt(engines, draft, tok):
    for prompt, draft_prompt in random_prompts(8, seed=7):
        out = engines["separate"].generate(prompt, draft_prompt, mode="rag")
        assert out.token_ids == reference_greedy(draft, tok.encode(draft_prompt), 24, len(tok))
        assert out.stats.target_context_tokens == len(tok.encode(prompt))


def test_token_ids_and_chat_messages_are_accepted(engines, target, tok):
    messages = [{"role": "system", "content": "ab"}, {"role": "user", "content": "cab d"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    want = reference_greedy(target, ids, 24, len(tok))
    engine = engines["separate"]
    assert engine.generate(messages, messages[-1:]).token_ids == want
    assert engine.generate(ids, [5, 6, 7]).token_ids == want
    assert engine.generate(torch.tensor(ids), [5]).token_ids == want


def test_stats_add_up(engines):
    for gamma in (1, 4, 9):
        for prompt, draft_prompt in random_prompts(4, seed=gamma):
            s = engines["separate"].generate(prompt, draft_prompt, gamma=gamma).stats
            assert 0 <= s.accepted_tokens <= s.drafted_tokens
            assert 0.0 <= s.acceptance_rate <= 1.0
            # Each target pass emits its accepted drafts plus one token, and drafting never
            # runs past max_new_tokens, so the counts tie out exactly.
            assert s.accepted_tokens + s.target_forward_passes == s.new_tokens == 24
            # One draft pass per token the draft picked, plus, only where the lookup's copies
            # were kept (docs/algorithm.md section 2.10), the pass that read them.
            picked = s.drafted_tokens - s.lookup_drafted_tokens
            extra = s.target_forward_passes if s.lookup_drafted_tokens else 0
            assert picked <= s.draft_forward_passes <= picked + extra
            assert s.target_context_tokens > 0 and s.draft_context_tokens > 0
            assert s.decode_seconds > 0 and s.decode_tokens_per_second > 0


def test_self_speculation_uses_one_model_object(target, tok):
    engine = RapidEngine(target, tokenizer=tok)
    assert engine.draft is engine.target is target


def test_prefill_never_materializes_prompt_logits(tok, target, draft):
    """The LM head sees one row per prefill chunk, and per decoding pass at most the drafts
    (gamma picks and lookup_tokens copies) plus one."""
    rows: list[int] = []
    hooks = [
        m.lm_head.register_forward_hook(lambda _m, _i, o: rows.append(o.shape[-2]))
        for m in (target, draft)
    ]
    try:
        cfg = RapidConfig(eta=0.0, gamma=5, lookup_tokens=4)
        engine = RapidEngine(target, draft, tokenizer=tok, config=cfg)
        engine.generate("abcdefghijkl " * 30, "abc", max_new_tokens=12, prefill_chunk_size=64)
    finally:
        for h in hooks:
            h.remove()
    assert max(rows) <= cfg.gamma + cfg.lookup_tokens + 1


def test_gqa_prefill_equals_transformers_sdpa():
    """`attention._gqa_prefill` (SDPA reading the grouped KV in place) computes what
    transformers' SDPA function computes after `repeat_kv`, under a causal mask with an offset
    and a sliding window."""
    torch.manual_seed(0)
    query = torch.randn(1, 6, 80, 16, dtype=torch.float64)
    key, value = torch.randn(2, 1, 2, 200, 16, dtype=torch.float64)
    rows, cols = torch.arange(120, 200)[:, None], torch.arange(200)[None, :]
    mask = ((cols <= rows) & (cols > rows - 50))[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    got = attention._gqa_prefill(query, key, value, mask, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("native_bf16", [True, False], ids=["flash", "matmuls"])
@pytest.mark.parametrize("q_len", [1, 9])
def test_bf16_decode_and_verify_blocks_on_a_cache_view_match_float64(
    monkeypatch, native_bf16, q_len
):
    """A bf16 block reads its cache as a view of a longer buffer (kv.py), through the flash
    kernel where the CPU has native bf16, else two matmuls (attention.py); either gives
    transformers' SDPA attention in float64 (after `repeat_kv`) to bf16's precision, under
    the causal mask of the block's last q_len positions."""
    monkeypatch.setattr(attention, "NATIVE_BF16", native_bf16)
    torch.manual_seed(1)
    buffer = torch.randn(2, 1, 2, 700, 16, dtype=torch.float64)
    key, value = buffer[..., :600, :]  # [1, 2, 600, 16] views, as the cache hands them out
    query = torch.randn(1, 6, q_len, 16, dtype=torch.float64)
    mask = attention._causal(q_len, 600, key)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, False
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    half = [t.to(torch.bfloat16) for t in (query, key, value)]
    key16 = torch.zeros(1, 2, 700, 16, dtype=torch.bfloat16)  # a longer buffer, as in kv.py
    value16 = torch.zeros_like(key16)
    key16[:, :, :600], value16[:, :, :600] = half[1], half[2]
    got, _ = attention.rapid_attention(
        module, half[0], key16[:, :, :600], value16[:, :, :600], mask, scaling=0.25
    )
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 9])
@pytest.mark.parametrize("hole", [False, True], ids=["causal", "padded"])
def test_keys_split_across_threads_match_transformers(monkeypatch, dtype, q_len, hole):
    """A long block's keys are cut into runs, one flash call for them all, and merged by
    their log-sum-exp (`attention._flash_partial`; a verify block's own masked keys apart):
    the result is transformers' SDPA attention (after `repeat_kv`) in float64, to float64's
    or bf16's precision, on a cache view of a longer buffer, with keys left over after the
    runs. A mask with a hole in the keys every query would see (padding) is not split."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # 4 runs for 3 KV heads
    monkeypatch.setattr(attention, "MIN_SPLIT_VERIFY_KEYS", 1024)
    monkeypatch.setattr(attention, "NATIVE_BF16", True)  # bf16 takes the flash kernel anywhere
    batches: list[int] = []
    real = attention._FLASH_CPU

    def counted(query, *args, **kwargs):
        batches.append(query.shape[0])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(attention, "_FLASH_CPU", counted)
    torch.manual_seed(2)
    kv = 2101  # one query: 4 runs of 525 keys and 1 left over; nine: 4 of 523, 9 masked
    buffer = torch.randn(2, 1, 3, kv + 50, 16, dtype=torch.float64)
    key, value = buffer[..., :kv, :]
    query = torch.randn(1, 6, q_len, 16, dtype=torch.float64)
    mask = attention._causal(q_len, kv, key)
    if hole:
        mask = torch.ones(1, 1, q_len, kv, dtype=torch.bool) if mask is None else mask.clone()
        mask[..., 100:140] = False
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, False
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    keys, values = (b.to(dtype)[..., :kv, :] for b in buffer)
    got, _ = attention.rapid_attention(module, query.to(dtype), keys, values, mask, scaling=0.25)
    atol = 1e-12 if dtype == torch.float64 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=0, atol=atol)
    assert (4 in batches) != hole


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "q_len", "kv"), [(3, 1, 300), (9, 11, 300), (3, 1, 2101), (9, 11, 2101)]
)
def test_a_lone_query_row_gets_a_zero_row_and_keeps_its_output(
    monkeypatch, dtype, heads, q_len, kv
):
    """PyTorch's CPU flash kernel cuts the query rows into blocks of 32, and a block of one row
    is slow (`attention._lone_row`): 1 folded row (3 heads on 3 KV heads) or 33 (9 heads, 11
    queries) get a zero row, and a mask row, whose output is dropped (`_padded`). The rows
    kept are the kernel's on the rows as they are, to the dtype's rounding, unsplit (300
    keys) and split (2,101 keys: the runs, and the verify block's own masked keys)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(attention, "MIN_SPLIT_VERIFY_KEYS", 1024)
    monkeypatch.setattr(attention, "NATIVE_BF16", True)  # bf16 takes the flash kernel anywhere
    rows: list[tuple[int, int]] = []
    real = attention._padded

    def spied(query, mask):
        padded, mask = real(query, mask)
        rows.append((query.shape[2], padded.shape[2]))
        return padded, mask

    monkeypatch.setattr(attention, "_padded", spied)
    torch.manual_seed(3)
    buffer = torch.randn(2, 1, 3, kv + 50, 16, dtype=dtype)
    key, value = buffer[..., :kv, :]
    query = torch.randn(1, heads, q_len, 16, dtype=dtype)
    mask = attention._causal(q_len, kv, key)
    module = torch.nn.Module()
    got, _ = attention.rapid_attention(module, query, key, value, mask, scaling=0.25)
    assert rows and all(after == before + 1 for before, after in rows)
    monkeypatch.setattr(attention, "_lone_row", lambda n: False)
    want, _ = attention.rapid_attention(module, query, key, value, mask, scaling=0.25)
    # The kernel's own rounding may move with its blocks (float64's did here), no more.
    atol = 1e-12 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def test_long_prefill_chunks_keep_the_identity(engines, target, tok, monkeypatch):
    """Chunks longer than a verify block, after the first, run under a mask through
    `_gqa_prefill`; the output is still the target's own greedy decoding."""
    lengths: list[int] = []
    real = attention._gqa_prefill

    def counted(query, *args):
        lengths.append(query.shape[2])
        return real(query, *args)

    monkeypatch.setattr(attention, "_gqa_prefill", counted)
    rng = random.Random(5)
    prompt = "".join(rng.choice(ALPHABET) for _ in range(300))
    out = engines["self"].generate(prompt, prompt[100:120], gamma=4, prefill_chunk_size=100)
    assert lengths and min(lengths) > attention.MAX_FOLDED_QUERIES
    assert greedy_mismatches(target, tok.encode(prompt), out.token_ids, len(tok)) == []


def test_eta_positive_greedy_is_deterministic_and_leans_to_draft(tok, target, draft):
    engine = RapidEngine(
        target, draft, tokenizer=tok, config=RapidConfig(max_new_tokens=24, ignore_eos=True)
    )
    base = RapidEngine(
        target,
        draft,
        tokenizer=tok,
        config=RapidConfig(eta=0.0, max_new_tokens=24, ignore_eos=True),
    )
    rates = []
    for prompt, draft_prompt in random_prompts(12, seed=3):
        a = engine.generate(prompt, draft_prompt, eta=20.0)
        assert a.token_ids == engine.generate(prompt, draft_prompt, eta=20.0).token_ids
        rates.append(
            (a.stats.acceptance_rate, base.generate(prompt, draft_prompt).stats.acceptance_rate)
        )
    # A strong pull toward the draft makes the target agree with it more often.
    assert sum(r for r, _ in rates) > sum(b for _, b in rates)


def test_float32_model_matches_too():
    """Exactness does not rely on float64: a float32 tiny pair gives the same identity."""
    from tests.tiny import char_tokenizer

    tok = char_tokenizer()
    t = tiny_llama(len(tok), seed=11, dtype=torch.float32, scale=0.5)
    d = tiny_llama(len(tok), seed=12, dtype=torch.float32, scale=0.5)
    engine = RapidEngine(
        t, d, tokenizer=tok, config=RapidConfig(eta=0.0, max_new_tokens=16, ignore_eos=True)
    )
    for prompt, draft_prompt in random_prompts(10, seed=11):
        out = engine.generate(prompt, draft_prompt, gamma=6)
        assert out.token_ids == reference_greedy(t, tok.encode(prompt), 16, len(tok))


@pytest.mark.parametrize("precision", ["int8", "int8-weight", "bfloat16"])
def test_lower_precision_self_draft_keeps_the_identity(tok, precision):
    """A cheaper copy of the target drafts; only the target's verdict decides the output."""
    t = tiny_llama(len(tok), seed=21, dtype=torch.float32, scale=0.5)
    cfg = RapidConfig(eta=0.0, max_new_tokens=16, ignore_eos=True, gamma=5)
    engine = RapidEngine(t, tokenizer=tok, config=cfg, draft_precision=precision)
    assert engine.draft is not engine.target
    accepted = 0
    for prompt, _ in random_prompts(8, seed=21):
        out = engine.generate(prompt, prompt)
        assert out.token_ids == reference_greedy(t, tok.encode(prompt), 16, len(tok))
        accepted += out.stats.accepted_tokens
    assert accepted > 0


def _continued_past_an_end(target, tok, prompt: str, ids: list[int]) -> bool:
    """True when some emitted token came where the target's own top choice was end-of-sequence
    (its choice after each prefix, all from one pass without a cache: tests/tiny.greedy_picks)."""
    return 0 in greedy_picks(target, tok.encode(prompt), ids, len(tok))


def test_end_guard_never_talks_the_target_out_of_stopping(tok, target, draft):
    engine = RapidEngine(
        target,
        draft,
        tokenizer=tok,
        config=RapidConfig(eta=50.0, max_new_tokens=30, confidence_guard=False),
    )
    prompts = [a + b for a in "abcdefghijkl" for b in "abcdefghijkl"][:40]
    unguarded = 0
    for prompt in prompts:
        out = engine.generate(prompt, prompt[-1])
        assert not _continued_past_an_end(target, tok, prompt, out.token_ids), prompt
        loose = engine.generate(prompt, prompt[-1], end_guard=False)
        unguarded += _continued_past_an_end(target, tok, prompt, loose.token_ids)
    assert unguarded > 0  # without the guard the draft does override the target's stop


@pytest.mark.parametrize("gamma", [1, 2, 5, 12])
def test_a_draft_identical_to_the_target_is_always_accepted(tok, target, gamma):
    """Self-speculation on the full prompt at eta = 0: every draft is the target's own greedy
    token, so acceptance is exactly 1. A draft cache cropped wrongly after a step (which the
    output identity cannot see: the target decides every token) breaks this."""
    engine = RapidEngine(
        target, tokenizer=tok, config=RapidConfig(eta=0.0, max_new_tokens=30, ignore_eos=True)
    )
    for prompt, _ in random_prompts(6, seed=40 + gamma):
        s = engine.generate(prompt, mode="sd", gamma=gamma).stats
        assert s.accepted_tokens == s.drafted_tokens > 0


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_proposer_cache_follows_every_verdict(tok, draft, gamma):
    """After any verdict (n of gamma kept, then a token), the next proposals are the draft's own
    greedy continuation of prompt + kept tokens: the draft cache was cropped exactly."""
    from rapid_integrations.runtime.kv import KVState, direct
    from rapid_integrations.spec_decode.drafting import ModelProposer

    cfg = RapidConfig(eta=0.0, gamma=gamma)
    prompt = tok.encode("abc hij kl")
    for kept in range(gamma + 1):
        state = KVState.start(draft, prompt, len(tok), chunk=4, capacity=len(prompt) + 4 * gamma)
        proposer = ModelProposer(state, cfg, torch.Generator())
        x = direct(proposer.propose(gamma)).x
        assert x.tolist() == reference_greedy(draft, prompt, gamma, len(tok))
        token = torch.tensor([(int(x[kept]) + 1) % len(tok) if kept < gamma else 5])
        proposer.commit(kept, token)
        context = prompt + x[:kept].tolist() + token.tolist()
        assert direct(proposer.propose(gamma)).x.tolist() == reference_greedy(
            draft, context, gamma, len(tok)
        )
