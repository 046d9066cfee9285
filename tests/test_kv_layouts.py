"""Cache layouts other than full attention (docs/algorithm.md section 2.8, rollback).

Sliding-window layers (Mistral, Qwen2's upper layers, Gemma 2/3's local layers) keep every
token in a buffer and show each pass only its window, so rejected drafts can be rolled back
after the window is passed. Checked against each model's own greedy decoding recomputed without
a cache; a model whose cache cannot be rolled back is refused when the engine is built.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Lfm2Config,
    Lfm2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rapid_integrations import RapidConfig, RapidConfigError, RapidEngine
from rapid_integrations.runtime.kv import BufferedLayer, BufferedSlidingLayer, new_cache
from tests.tiny import reference_greedy

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

WINDOW = 16
NEW = 40
PROMPTS = ["abcdefghijkl abcdefghijkl abc kjihg", "hello. ab cd ef", "lk ji hg fe dc ba " * 3]


def tiny(cls, config_cls, seed: int, vocab: int, **kw):
    torch.manual_seed(seed)
    cfg = config_cls(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.35,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        **kw,
    )
    return cls(cfg).to(torch.float64).eval()


def mistral(vocab: int, seed: int, window: int | None = WINDOW):
    return tiny(
        MistralForCausalLM, MistralConfig, seed, vocab, num_hidden_layers=2, sliding_window=window
    )


@pytest.fixture(scope="module")
def pair(tok):
    return mistral(len(tok), 31), mistral(len(tok), 32)


def test_the_window_changes_the_reference(tok, pair):
    """Not vacuous: the same weights without a window decode differently past 16 tokens."""
    target, _ = pair
    unwindowed = mistral(len(tok), 31, window=None)
    unwindowed.load_state_dict(target.state_dict())
    ids = tok.encode(PROMPTS[0])
    assert reference_greedy(unwindowed, ids, NEW, len(tok)) != reference_greedy(
        target, ids, NEW, len(tok)
    )
    kinds = [type(layer) for layer in new_cache(target, 8).layers]
    assert kinds == [BufferedSlidingLayer, BufferedSlidingLayer]


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("mode", ["rapid", "sd"])
def test_mistral_sliding_window_equals_its_own_greedy(tok, pair, gamma, mode):
    target, draft = pair
    cfg = RapidConfig(eta=0.0, max_new_tokens=NEW, ignore_eos=True, gamma=gamma)
    engines = [
        RapidEngine(target, draft, tokenizer=tok, config=cfg),
        RapidEngine(target, tokenizer=tok, config=cfg),  # self-speculation: two caches
    ]
    rejected = 0
    for prompt in PROMPTS:
        want = reference_greedy(target, tok.encode(prompt), NEW, len(tok))
        for engine in engines:
            # twice: the second call reuses the prompt's KV from the prefix cache
            for _ in range(2):
                out = engine.generate(prompt, prompt[-5:], mode=mode, prefill_chunk_size=7)
                assert out.token_ids == want, (prompt, gamma, mode)
                rejected += out.stats.drafted_tokens - out.stats.accepted_tokens
            assert out.stats.cached_prefix_tokens == len(tok.encode(prompt)) - 1
    assert rejected > 0  # rollbacks did happen past the window


def _gemma2(vocab: int):
    return tiny(
        Gemma2ForCausalLM, Gemma2Config, 41, vocab, num_hidden_layers=2, sliding_window=WINDOW
    )


def _gemma3(vocab: int):
    # layer_types given: Gemma 3's default puts a full layer every sixth, here every second
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    return tiny(
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        42,
        vocab,
        num_hidden_layers=3,
        sliding_window=WINDOW,
        layer_types=types,
        head_dim=8,
    )


def _qwen2(vocab: int):
    # layers from max_window_layers on slide; the first one attends to everything
    return tiny(
        Qwen2ForCausalLM,
        Qwen2Config,
        43,
        vocab,
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    )


@pytest.mark.parametrize("build", [_gemma2, _gemma3, _qwen2], ids=["gemma2", "gemma3", "qwen2"])
def test_hybrid_full_and_sliding_layouts_equal_their_own_greedy(tok, build):
    model = build(len(tok))
    kinds = {type(layer) for layer in new_cache(model, 8).layers}
    assert kinds == {BufferedLayer, BufferedSlidingLayer}
    engine = RapidEngine(
        model, tokenizer=tok, config=RapidConfig(eta=0.0, max_new_tokens=NEW, ignore_eos=True)
    )
    for prompt in PROMPTS[:2]:
        want = reference_greedy(model, tok.encode(prompt), NEW, len(tok))
        for mode in ("rapid", "sd"):
            out = engine.generate(prompt, prompt[-4:], mode=mode, gamma=4)
            assert out.token_ids == want, (build.__name__, prompt, mode)


def test_a_cache_that_cannot_roll_back_is_refused_at_construction(tok, target):
    """LFM2's convolutional layers keep a recurrent state, not per-token KV."""
    torch.manual_seed(0)
    cfg = Lfm2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention"],
    )
    lfm = Lfm2ForCausalLM(cfg).eval()
    with pytest.raises(RapidConfigError, match="LinearAttentionLayer") as err:
        RapidEngine(lfm, tokenizer=tok)
    assert err.value.field == "target" and "lfm2" in str(err.value)
    with pytest.raises(RapidConfigError) as err:
        RapidEngine(target, lfm, tokenizer=tok)
    assert err.value.field == "draft"
