"""Tiny random-weight Llama models and a character tokenizer, for exactness tests.

Built from a config (no files, no hub). Weights use a large init scale so that next-token
distributions are peaked: argmax margins are far above float noise, and acceptance varies.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

if TYPE_CHECKING:
    from rapid_integrations import RapidEngine

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def char_tokenizer(alphabet: str = string.ascii_lowercase[:12] + " .") -> PreTrainedTokenizerFast:
    """A character-level tokenizer: id 0 is </s> (end of sequence), 1 is <unk>."""
    vocab = {"</s>": 0, "<unk>": 1}
    for ch in alphabet + "<>/" + "".join(sorted(set("systemuserassistant"))):
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


JSON_ALPHABET = string.ascii_lowercase + string.digits + ' .{}[]":,-_'


def json_tokenizer() -> PreTrainedTokenizerFast:
    """A character tokenizer that can write JSON (id 0 is </s>)."""
    return char_tokenizer(JSON_ALPHABET)


def tool_engine(seed: int) -> RapidEngine:
    """A tiny target (`seed`) and draft (`seed + 1`) pair that can write JSON and the tool-call
    markup (which needs a newline), with room for a call: the adapters' tool tests."""
    from rapid_integrations import RapidConfig, RapidEngine

    tok = char_tokenizer(JSON_ALPHABET + "\n")
    target = tiny_llama(len(tok), seed=seed, window=2048)
    draft = tiny_llama(len(tok), seed=seed + 1, layers=1, window=2048)
    return RapidEngine(target, draft, tokenizer=tok, config=RapidConfig(max_new_tokens=120))


def tiny_llama(
    vocab: int,
    seed: int,
    layers: int = 2,
    hidden: int = 32,
    scale: float = 0.35,
    window: int = 512,
    dtype: torch.dtype = torch.float64,
) -> LlamaForCausalLM:
    """A random Llama with `vocab` logits; float64 so cache and no-cache paths agree exactly."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=window,
        initializer_range=scale,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).to(dtype).eval()  # type: ignore[arg-type]  # python/typeshed#10653


@torch.inference_mode()
def reference_greedy(
    model: LlamaForCausalLM,
    prompt: list[int],
    n: int,
    vocab: int,
    processor: Callable[[list[int], torch.Tensor], torch.Tensor] | None = None,
) -> list[int]:
    """The target's own greedy decoding, recomputed from scratch each step (no KV cache).

    `processor(ids so far, logits [vocab]) -> logits` shapes each step's logits before the
    argmax (a transformers logits processor, a grammar mask).
    """
    ids = list(prompt)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1, :vocab]
        if processor is not None:
            logits = processor(ids, logits.clone())
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@torch.inference_mode()
def greedy_picks(
    model: LlamaForCausalLM, prompt: list[int], tokens: list[int], vocab: int
) -> list[int]:
    """The model's greedy choice after `prompt + tokens[:i]` for each i < len(tokens), from one
    pass without a KV cache: a causal model's logits at position t are its prediction from the
    first t + 1 tokens, as `reference_greedy`'s pass over those tokens alone computes them."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1, :vocab]
    return logits.argmax(-1).tolist()


def greedy_mismatches(
    model: LlamaForCausalLM, prompt: list[int], tokens: list[int], vocab: int
) -> list[int]:
    """Positions i where `tokens[i]` is not the model's greedy choice after `prompt +
    tokens[:i]`; empty when `tokens` is the model's own greedy continuation of `prompt`.

    The check `tokens == reference_greedy(model, prompt, len(tokens), vocab)` makes (by
    induction on i), without a cache as it does, in one pass instead of one per token.
    """
    picks = greedy_picks(model, prompt, tokens, vocab)
    return [i for i, (token, pick) in enumerate(zip(tokens, picks, strict=True)) if token != pick]


@torch.inference_mode()
def next_token_probs(
    model: LlamaForCausalLM, prompt: list[int], vocab: int, temperature: float = 1.0
) -> torch.Tensor:
    """p(. | prompt) at temperature T, computed without a cache, float64, shape [vocab]."""
    logits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, -1, :vocab]
    return torch.softmax(logits.double() / temperature, dim=-1)
