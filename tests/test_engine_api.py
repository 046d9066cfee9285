"""Engine behaviour at its edges: config errors, vocabularies, stopping, streaming, windows."""

from __future__ import annotations

import dataclasses

import pytest

from rapid_integrations import (
    ContextWindowExceededError,
    RapidConfig,
    RapidConfigError,
    RapidEngine,
    RapidError,
    RapidInputError,
    VocabularyMismatchError,
)
from rapid_integrations.tokens import Detokenizer
from tests.tiny import char_tokenizer, reference_greedy, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

BAD_VALUES = {
    "eta": [-1.0, float("nan"), "5"],
    "gamma": [0, 65, 2.5, True],
    "temperature": [-0.1, float("inf")],
    "top_p": [0.0, 1.5],
    "max_new_tokens": [0, -3, 1.0],
    "stop": [("",), (3,)],
    "seed": [1.5, "x", True, 2**63, -(2**63) - 1, 2**80],
    "residual": ["other"],
    "tail_guard": ["both"],
    "eta_rule": ["confidence", 1],
    "tail_ratio": [1.0, -0.1],
    "ignore_eos": ["yes"],
    "end_guard": ["yes"],
    "confidence_guard": ["yes", 1],
    "prefill_chunk_size": [0],
    "truncation": ["middle"],
    "retrieval_budget": [0],
    "retrieval_chunk_tokens": [4],
    "retrieval_threshold": [2.0],
    "retrieval_top_k": [0],
    "retrieval_fallback": ["ignore"],
    "retrieval_timeout": [0],
    "query_fn": ["not callable"],
    "prefix_cache_bytes": [-1, 1.5],
    "retrieval_embedder": [42, object()],
    "top_k": [-1, 2.5, True],
    "min_p": [-0.1, 1.5, float("nan")],
    "repetition_penalty": [0, -1.0, float("inf")],
    "draft_confidence_threshold": [-0.1, 1.5],
    "adaptive_gamma": ["yes", 1],
    "gamma_max": [0, 65, 2.0],
    "speculate_min_context": [-1, 1.5],
    "lookup_ngram": [1, 9, -2],
    "lookup_tokens": [0, 65, 2.0],
    "logprobs": ["yes", 1],
    "top_logprobs": [-1, 21, 2.0, True],
    "logprobs_p_hat": ["yes", 1],
    "reasoning": ["auto", 1],
    "reasoning_markers": ["<think>", ("<t>",), ("<t>", "<t>"), ("", "</t>"), ("<t>", 3)],
    "max_reasoning_tokens": [0, -2, 1.5, True],
    "deterministic": [1, "yes", None],
}


def test_every_field_has_bad_values_listed():
    assert {f.name for f in dataclasses.fields(RapidConfig)} == set(BAD_VALUES)


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, vs in BAD_VALUES.items() for v in vs])
def test_invalid_config_raises_naming_the_field(field, value):
    with pytest.raises(RapidConfigError) as err:
        RapidConfig(**{field: value})
    assert err.value.field == field and field in str(err.value)
    assert isinstance(err.value, ValueError) and isinstance(err.value, RapidError)


def test_per_call_overrides_are_validated_too(tok, target):
    engine = RapidEngine(target, tokenizer=tok)
    with pytest.raises(RapidConfigError, match="gamma"):
        engine.generate("abc", "a", gamma=0)
    with pytest.raises(RapidConfigError, match="no_such_field"):
        engine.generate("abc", "a", no_such_field=1)
    with pytest.raises(RapidConfigError, match="mode"):
        engine.generate("abc", "a", mode="fast")


def test_stop_accepts_a_single_string():
    assert RapidConfig(stop="END").stop == ("END",)


def test_draft_with_a_different_vocabulary_raises_at_construction(tok, target):
    narrower = tiny_llama(len(tok) - 4, seed=3)
    with pytest.raises(VocabularyMismatchError):
        RapidEngine(target, narrower, tokenizer=tok)
    other_tok = char_tokenizer("zyxwvutsrqponm ,")
    with pytest.raises(VocabularyMismatchError):
        RapidEngine(target, tiny_llama(len(tok), seed=3), tokenizer=tok, draft_tokenizer=other_tok)


def test_padded_draft_head_is_fine(tok, target):
    padded = tiny_llama(len(tok) + 6, seed=4)
    engine = RapidEngine(
        target, padded, tokenizer=tok, config=RapidConfig(eta=0.0, ignore_eos=True)
    )
    out = engine.generate("abc de", "de", max_new_tokens=12)
    assert out.token_ids == reference_greedy(target, tok.encode("abc de"), 12, len(tok))


def _eos_prompt(tok, target) -> tuple[str, list[int]]:
    """A prompt whose greedy continuation reaches end-of-sequence (id 0) after a few tokens."""
    for a in "abcdefghijkl":
        for b in "abcdefghijkl":
            ref = reference_greedy(target, tok.encode(a + b), 20, len(tok))
            if 0 in ref[2:]:
                return a + b, ref
    raise AssertionError("no prompt reaches eos")


def test_stops_on_eos_excluding_it(tok, target, draft):
    prompt, ref = _eos_prompt(tok, target)
    engine = RapidEngine(
        target, draft, tokenizer=tok, config=RapidConfig(eta=0.0, max_new_tokens=20)
    )
    out = engine.generate(prompt, prompt[-1])
    assert out.finish_reason == "eos"
    assert out.token_ids == ref[: ref.index(0)]
    assert out.text == tok.decode(ref[: ref.index(0)])


def test_stop_string_trims_output_and_streams_nothing_past_it(tok, target, draft):
    prompt = "kab"
    ref = reference_greedy(target, tok.encode(prompt), 20, len(tok))
    ref_text = tok.decode(ref)
    stop = ref_text[5:7]
    engine = RapidEngine(
        target,
        draft,
        tokenizer=tok,
        config=RapidConfig(eta=0.0, max_new_tokens=20, ignore_eos=True),
    )
    out = engine.generate(prompt, "ab", stop=[stop, "zzz"])
    assert out.finish_reason == "stop"
    assert out.text == ref_text[: ref_text.index(stop)]
    stream = engine.stream(prompt, "ab", stop=[stop])
    assert "".join(stream) == out.text and stream.output.text == out.text


def test_max_new_tokens_gives_length(tok, target):
    engine = RapidEngine(target, tokenizer=tok, config=RapidConfig(ignore_eos=True))
    out = engine.generate("abc", "c", max_new_tokens=7)
    assert (len(out.token_ids), out.finish_reason) == (7, "length")


def test_stream_equals_generate_and_same_seed_repeats(tok, target, draft):
    engine = RapidEngine(
        target, draft, tokenizer=tok, config=RapidConfig(temperature=0.9, max_new_tokens=30)
    )
    for seed in range(5):
        out = engine.generate("hello kab", "kab", seed=seed)
        stream = engine.stream("hello kab", "kab", seed=seed)
        assert "".join(stream) == out.text
        assert stream.output.token_ids == out.token_ids and stream.output.stats.seed == seed
        deltas = engine.stream("hello kab", "kab", seed=seed)
        assert "".join(d.text for d in deltas.deltas()) == out.text
        assert deltas.output.token_ids == out.token_ids


def test_a_drawn_seed_fits_javascript_numbers_and_replays_the_call(tok, target, draft):
    """An unseeded call reports the seed it drew: below 2**53, so that a JavaScript client
    (whose numbers are doubles) sends back the same integer, and that seed gives the same
    tokens again, also where the draft's token price (measured under the machine's load) is
    one that would leave copies unread. The seeds at the ends of the accepted range run; one
    past them is refused by name before anything runs."""
    engine = RapidEngine(
        target, draft, tokenizer=tok, config=RapidConfig(temperature=1.0, max_new_tokens=20)
    )
    engine.draft_token_price = 0.4  # measured on a busy CPU: copies are worth reading rarely
    for _ in range(8):
        out = engine.generate("hello kab abc kab ab", "kab")
        seed = out.stats.seed
        assert seed is not None and 0 <= seed < 2**53 and int(float(seed)) == seed
        replay = engine.generate("hello kab abc kab ab", "kab", seed=seed)
        assert replay.token_ids == out.token_ids
    for edge in (-(2**63), 2**63 - 1):
        assert engine.generate("hello kab", "kab", seed=edge).stats.seed == edge
    for beyond in (2**63, -(2**63) - 1, 10**30):
        with pytest.raises(RapidConfigError, match="seed") as err:
            engine.generate("hello kab", "kab", seed=beyond)
        assert err.value.field == "seed"


def test_context_window_is_enforced_or_truncated(tok):
    small = tiny_llama(len(tok), seed=5, window=64)
    engine = RapidEngine(small, tokenizer=tok, config=RapidConfig(ignore_eos=True))
    with pytest.raises(ContextWindowExceededError, match=r"70 tokens.*64 tokens"):
        engine.generate("a" * 70, "a", max_new_tokens=4)
    out = engine.generate("b" + "a" * 70 + "c", "a", max_new_tokens=40, truncation="head_tail")
    assert out.prompt_tokens + len(out.token_ids) <= 64
    # the generation budget is cut at the window: never a silent overrun
    out = engine.generate("a" * 60, "a", max_new_tokens=40)
    assert (len(out.token_ids), out.finish_reason) == (4, "length")


@pytest.mark.parametrize(
    "prompt", ["", "   \n", [], [{"role": "wizard", "content": "x"}], 3.5, [10**6]]
)
def test_bad_prompts_raise_input_errors(tok, target, prompt):
    engine = RapidEngine(target, tokenizer=tok)
    with pytest.raises(RapidInputError):
        engine.generate(prompt, "a")


MULTIBYTE = "naïve café — 你好，世界 🎉🧪 ok"


@pytest.mark.slow
def test_detokenizer_never_splits_multibyte_characters(smol):
    _, tokenizer = smol
    ids = tokenizer.encode(MULTIBYTE)
    detok = Detokenizer(tokenizer)
    deltas = [detok.push(t) for t in ids] + [detok.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE
    assert sum(1 for d in deltas if d) < len(ids)  # some tokens are partial characters


@pytest.mark.slow
def test_stop_string_split_across_tokens(smol):
    _, tokenizer = smol
    ids = tokenizer.encode(MULTIBYTE)
    detok = Detokenizer(tokenizer, stop=["世界 🎉"])
    out = []
    for t in ids:
        out.append(detok.push(t))
        if detok.stopped:
            break
    assert detok.stopped and "".join(out) == detok.text == "naïve café — 你好，"


@pytest.mark.slow
def test_generation_cut_inside_a_character_drops_the_partial_bytes(smol):
    _, tokenizer = smol
    ids = tokenizer.encode("ok 🎉")
    detok = Detokenizer(tokenizer)
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    text = "".join(detok.push(t) for t in ids[:cut]) + detok.finish()
    assert text == detok.text == "ok " and "\ufffd" not in text


def test_a_dropped_engine_is_freed_at_once_with_its_caches(tok, target, draft):
    """No reference cycle holds an engine: the last reference dropped frees it (and the
    models, caches and prefix cache it owns) without waiting for the cyclic collector, which
    a server replacing its engine or a notebook rebuilding one would otherwise wait on."""
    import gc
    import weakref

    gc.disable()  # a collection in between would hide a cycle
    try:
        engine = RapidEngine(target, draft, tokenizer=tok, config=RapidConfig(max_new_tokens=4))
        engine.generate("abc", tools=None)
        engine.generate([{"role": "user", "content": "abc"}], mode="lc")
        dropped = weakref.ref(engine)
        del engine
        assert dropped() is None
    finally:
        gc.enable()
