"""Deterministic decoding (`RapidConfig.deterministic`, rapid_integrations/runtime/invariant.py,
docs/algorithm.md section 8): a call's tokens, and the log probabilities they were decided by,
bit for bit, whatever the thread count, a cached prefix, the drafts' lengths, or the other calls
in a batch. On tiny bf16 models (the logits' bits show what the tokens of so peaked a model
would hide) and, marked slow, on SmolLM2 in bf16 with the bundled document, where the default
path gave two answers to one question."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from rapid_integrations import (
    BatchRunner,
    RapidConfig,
    RapidConfigError,
    RapidEngine,
    generate_batch,
)
from rapid_integrations.runtime import invariant
from rapid_integrations.runtime.prefix_cache import PrefixCache
from tests.tiny import char_tokenizer, tiny_llama

ALPHABET = "abcdefghijkl ."


@pytest.fixture
def threads() -> Iterator[None]:
    """Tests set torch's thread count; it is restored after each."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _smol_shaped(vocab: int, seed: int, layers: int) -> LlamaForCausalLM:
    """A random bf16 Llama with SmolLM2-135M's layer shapes (576 wide, 9 query heads on 3 KV
    heads of 64, MLP 1536), `layers` deep: the products and attention blocks whose rounding
    the default path lets move (3 KV heads on 2 threads split the keys into runs there)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=4096,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> RapidEngine:
    tok = char_tokenizer()
    # Keys past two of the flash kernel's key blocks (1,100-character prompts, a token each).
    target = _smol_shaped(len(tok), seed=21, layers=2)
    draft = _smol_shaped(len(tok), seed=22, layers=1)
    config = RapidConfig(
        max_new_tokens=16, ignore_eos=True, logprobs=True, deterministic=True, gamma=4
    )
    return RapidEngine(target, draft, tokenizer=tok, config=config)


def _text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(ALPHABET) for _ in range(n))


DOCUMENT = _text(1, 1100)
PROMPTS = [DOCUMENT + _text(2, 40), DOCUMENT + _text(3, 30), _text(4, 700), _text(5, 900)]
DRAFT = DOCUMENT[-200:]


def _decoded(out: Any) -> tuple[list[int], list[float]]:
    """A call's tokens and the log probability each was emitted with, to compare bit for bit."""
    return list(out.token_ids), [entry.logprob for entry in out.logprobs]


def _alone(engine: RapidEngine, threads: int, **options: Any) -> Any:
    torch.set_num_threads(threads)
    return engine.generate(PROMPTS[0], draft_prompt=DRAFT, mode="rapid", **options)


SAMPLED = {"temperature": 0.9, "seed": 5}


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "seeded"])
def test_a_call_decodes_the_same_however_its_passes_run(engine, sampling):
    engine.prefix_cache.clear()
    reference = _decoded(_alone(engine, 1, prefix_cache_bytes=0, **sampling))
    ways = {"2 threads": _decoded(_alone(engine, 2, prefix_cache_bytes=0, **sampling))}
    # A cached prefix: another question on the document stores it, and this call reads the
    # rest after it (then the exact prompt is stored, and the next call reads only its tail).
    engine.generate(PROMPTS[1], draft_prompt=DRAFT, mode="rapid", max_new_tokens=2)
    for threads in (2, 1):
        cached = _alone(engine, threads, **sampling)
        assert cached.stats.cached_prefix_tokens >= len(DOCUMENT)
        ways[f"cached, {threads} threads"] = _decoded(cached)
    if not sampling:  # a sampled call's draws follow its gamma; greedy tokens do not
        for gamma in (1, 7):
            ways[f"gamma {gamma}"] = _decoded(_alone(engine, 2, gamma=gamma, prefix_cache_bytes=0))
    engine.prefix_cache.clear()
    torch.set_num_threads(2)
    batch = generate_batch(engine, PROMPTS, draft_prompt=DRAFT, mode="rapid", **sampling)
    ways["batch of 4"] = _decoded(batch[0])
    assert {way: decoded == reference for way, decoded in ways.items()} == dict.fromkeys(ways, True)


@pytest.mark.usefixtures("threads")
def test_a_batch_that_mixes_deterministic_calls_with_others(engine):
    """A deterministic call's passes never share a pass with a default call's rows (here a
    default call's prefill chunk, first while the deterministic calls prefill, then while they
    decode), nor its prefill chunk with anything: each call's output is its own."""
    torch.set_num_threads(2)
    engine.prefix_cache.clear()
    alone = [
        _decoded(engine.generate(p, draft_prompt=DRAFT, mode="rapid", prefix_cache_bytes=0))
        for p in PROMPTS[:2]
    ]
    runner = BatchRunner(engine)
    default = {"deterministic": False, "prefix_cache_bytes": 0}
    others = [runner.submit(PROMPTS[2], DRAFT, "rapid", **default)]
    ids = [runner.submit(p, DRAFT, "rapid", prefix_cache_bytes=0) for p in PROMPTS[:2]]
    for _ in range(6):
        runner.step()
    others.append(runner.submit(PROMPTS[3], DRAFT, "rapid", **default))
    runner.run()
    assert [_decoded(runner.outputs[i]) for i in ids] == alone
    assert all(len(runner.outputs[i].token_ids) == 16 for i in others)


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)], ids=["smollm2", "mha"])
def test_the_attention_of_a_row_is_the_same_in_any_block(heads, kv_heads):
    """`invariant.attention`: a query row against the same keys gives the same bits in a
    prefill block, a verify block and alone, at 1 and 2 threads, whatever the padding past
    its keys: SmolLM2's heads (9 query heads on 3 KV heads of 64), and one query head per KV
    head, where a row alone would be a block of one row."""
    gen = torch.Generator().manual_seed(0)
    length = 1500
    query = torch.randn(1, heads, length, 64, generator=gen).to(torch.bfloat16)
    keys, values = (
        torch.randn(
            1, kv_heads, invariant.padded_keys(length) + invariant.KEY_BLOCK, 64, generator=gen
        )
        .to(torch.bfloat16)
        .contiguous()
        for _ in range(2)
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        padded = invariant.padded_keys(length)
        whole = invariant.attention(
            query, keys[..., :padded, :], values[..., :padded, :], length, 0.125
        )
        # Single rows too, 48 of them: a row alone rounds otherwise only now and then.
        blocks = [(1500, 5, 2), (1000, 11, 1), (700, 300, 2)]
        for end, t, threads in blocks + [(end, 1, end % 2 + 1) for end in range(1453, 1501)]:
            torch.set_num_threads(threads)
            # Keys past `end` are not seen; a block may read one more key block of padding.
            pad = invariant.padded_keys(end) + (invariant.KEY_BLOCK if t == 5 else 0)
            out = invariant.attention(
                query[:, :, end - t : end],
                keys[..., :pad, :],
                values[..., :pad, :],
                end,
                0.125,
            )
            assert torch.equal(out, whole[:, end - t : end]), (end, t, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_linear_rows_product_is_the_same_at_any_row_count(kind):
    """A wrapped bf16 layer in a deterministic pass: each row's product is the same in a pass
    of 1, 12, 52 or 588 rows, on 1 or 2 threads. The plain product is not (oneDNN picks its
    kernel by the row count: an element in about 17,000 rounds the other way)."""
    gen = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(1536, 576, generator=gen) / 24)
    model = torch.nn.Sequential(layer)
    invariant.prepare(model, "target", None)
    rows = torch.randn(1200, 576, generator=gen).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(2)
            plain = torch.cat([F.linear(r, layer.weight) for r in rows.split(588)])
            assert not torch.equal(plain, F.linear(rows, layer.weight))  # the default moves
            with invariant.pass_of(kind):
                whole = layer(rows)
                for count, threads in [(1, 1), (12, 2), (52, 1), (588, 2)]:
                    torch.set_num_threads(threads)
                    parts = torch.cat([layer(part[None])[0] for part in rows.split(count)])
                    assert torch.equal(parts, whole), (count, threads)
    finally:
        torch.set_num_threads(before)


def test_stored_prefixes_serve_their_own_kind_only():
    """A deterministic sequence never reads KV the default path computed, nor the reverse."""
    cache = PrefixCache()
    model = torch.nn.Linear(2, 2)
    kv = [(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2))]
    cache.store(model, [1, 2, 3, 4], [kv], 1 << 20, deterministic=True)
    assert cache.lookup(model, [1, 2, 3, 4, 5])[0] == 0
    assert cache.lookup(model, [1, 2, 3, 4, 5], deterministic=True)[0] == 4
    cache.store(model, [1, 2, 3, 4], [kv], 1 << 20)  # the other kind: kept beside it
    assert cache.lookup(model, [1, 2, 3, 4, 5])[0] == 4
    assert cache.lookup(model, [1, 2, 3, 4, 5], deterministic=True)[0] == 4


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"speculate_min_context": "auto"}, "speculate_min_context"),
        ({"adaptive_gamma": "measured", "temperature": 0.7}, "adaptive_gamma"),
        ({"deterministic": "yes"}, "bool"),
    ],
)
def test_settings_that_follow_wall_time_are_refused(options, names):
    with pytest.raises(RapidConfigError, match=names) as error:
        RapidConfig(**{"deterministic": True, **options})
    assert error.value.field == "deterministic"
    RapidConfig(deterministic=True, adaptive_gamma="measured")  # greedy: gamma changes nothing


def test_a_float32_model_is_refused():
    tok = char_tokenizer()
    engine = RapidEngine(tiny_llama(len(tok), seed=3, dtype=torch.float32), tokenizer=tok)
    with pytest.raises(RapidConfigError, match="bf16") as error:
        engine.generate("abc", deterministic=True)
    assert error.value.field == "deterministic"


@pytest.mark.slow
@pytest.mark.usefixtures("threads")
def test_smollm2_gives_one_answer_about_the_observatory():
    """The question of the report that found it: SmolLM2 in bf16, RAPID (eta 5, greedy), on
    the bundled document around its field note, asked about the visiting hours. On the
    default path, with 6,000 characters, the call after another question on the document (its
    prefix cached) answered "... 10:30am to 10:30", the fresh call "... 10:30am to 12:30"; here
    3,000 characters (about 850 tokens) keep the five ways under half a minute."""
    from rapid_integrations.demo_data import QUESTION, demo_excerpt, demo_messages

    engine = RapidEngine.from_default(dtype="bfloat16", deterministic=True)
    document = demo_excerpt(3000)
    asked = demo_messages(
        document, "What does the document say about the observatory's visiting hours?"
    )
    other = demo_messages(document, QUESTION)
    options = {"mode": "rapid", "max_new_tokens": 22, "temperature": 0.0, "eta": 5.0}
    answers = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        engine.prefix_cache.clear()
        answers[f"fresh, {threads} threads"] = engine.generate(
            asked, prefix_cache_bytes=0, **options
        ).text
        engine.generate(other, **options)  # stores the document's prefix
        cached = engine.generate(asked, **options)
        assert cached.stats.cached_prefix_tokens > 700
        answers[f"cached, {threads} threads"] = cached.text
    engine.prefix_cache.clear()
    questions = [asked, other, demo_messages(document, "Who wrote the field note?")]
    questions.append(demo_messages(document, "What is kept in the teapot?"))
    batch = generate_batch(engine, questions, prefix_cache_bytes=0, **options)
    answers["batch of 4, 2 threads"] = batch[0].text
    assert set(answers.values()) == {answers["fresh, 1 threads"]}, answers
    assert "visiting hours" in answers["fresh, 1 threads"]
