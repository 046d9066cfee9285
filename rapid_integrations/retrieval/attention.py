"""C^S chosen by the target's own attention, read from the cache its prefill left.

`retriever="attention"`: after the target has read the whole prompt, each chunk of C is
scored by the attention mass that the question's last tokens put on its positions, summed
over a few (layer, head) pairs that a needle probe chose once per model (`probe_heads`).
The queries of those tokens are recomputed from the cache (`question_attention`: per layer
one norm, the q projection and one [heads, m, P] product for m <= `QUERY_TOKENS` tokens),
so there is no second pass over the document and no embedding pass. `retriever="hybrid"`
adds the embedder's cosine ranks (reciprocal-rank fusion, `HybridRetriever`).

Both select and pack chunks exactly as `FaissContextRetriever` does (same chunks, budget,
merge of neighbours), so the draft prompt has the same shape whichever scores chose them.
Llama-family models only (a pre-norm block with `q_proj`, `o_proj` and rotary positions);
others raise `AttentionUnavailable` and the engine falls back to the embedder.
"""

from __future__ import annotations

import bisect
import inspect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .base import TokenizerLike, chunk_tokens_for, count_text_tokens
from .chunking import Chunk, chunk_documents
from .faiss_retriever import FaissContextRetriever
from .packing import SEPARATOR

if TYPE_CHECKING:
    from rapid_integrations.config import RapidConfig

CACHE_RETRIEVERS = ("attention", "hybrid", "following")
"""The retriever names that read the target's cache (C^S is built after its prefill)."""

QUERY_TOKENS = 32
"""Question tokens whose queries score the chunks (the last ones before the prompt's end)."""

PROBE_HEADS = 8
"""(layer, head) pairs kept by the probe."""

ANCHOR_TOKENS = 16
"""Tokens of a document searched for in the prompt's ids to place it (`token_spans`)."""

RRF_K = 60
"""Reciprocal-rank fusion's constant (Cormack et al. 2009): ranks past ~60 weigh little."""

Heads = tuple[tuple[int, int], ...]


class AttentionUnavailable(RuntimeError):
    """The model's layers or the prompt's ids do not allow scoring from the cache."""


@torch.inference_mode()
def question_attention(
    model: Any, cache: Any, ids: Sequence[int], layers: Sequence[int], queries: int
) -> dict[int, torch.Tensor]:
    """Attention probabilities of the last `queries` cached tokens over every cached token.

    model: a Llama-family causal LM; cache: its DynamicCache after the prefill, P tokens,
    per layer keys/values [1, kv_heads, P, head_dim] (post-rotary, as the model stored them);
    ids: the prompt's ids, of which the first P are cached. Returns layer -> probabilities
    [heads, m, P] (float32, or float64 for a float64 model), m = min(queries, P), for each
    layer in `layers`. The queries' hidden states are rebuilt layer by layer from the cached
    keys and values (the tokens' own KV included), so the cache is read, never written.
    Runs under inference mode: no autograd graph, whoever calls it.
    """
    inner: Any = getattr(model, "model", None)
    blocks = getattr(inner, "layers", None)
    if blocks is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "embed_tokens"):
        raise AttentionUnavailable(f"{type(model).__name__} has no Llama-style decoder layers")
    total = cache.get_seq_length()
    m = min(queries, total)
    last = max(layers)
    device = inner.embed_tokens.weight.device
    positions = torch.arange(total - m, total, device=device)[None]  # [1, m]
    hidden = inner.embed_tokens(torch.tensor(list(ids[total - m : total]), device=device)[None])
    cos, sin = inner.rotary_emb(hidden, positions)
    # Query i sits at position total - m + i: it sees keys 0 .. total - m + i, so only the
    # last m keys are masked ([m, m], -inf above the diagonal).
    hidden_mask = torch.ones(m, m, dtype=torch.bool, device=device).triu(1)
    wide = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    out: dict[int, torch.Tensor] = {}
    for index in range(last + 1):
        block = blocks[index]
        attn = block.self_attn
        for part in ("q_proj", "o_proj", "input_layernorm", "post_attention_layernorm", "mlp"):
            if not hasattr(attn if part.endswith("proj") else block, part):
                raise AttentionUnavailable(f"layer {index} has no {part}")
        dim = attn.head_dim
        normed = block.input_layernorm(hidden)
        q = attn.q_proj(normed).view(1, m, -1, dim).transpose(1, 2)  # [1, heads, m, dim]
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        keys, values = _layer_kv(cache.layers[index])  # [1, kv_heads, P, dim]
        kv_heads, heads = keys.shape[1], q.shape[1]
        # Grouped queries against their shared key head, without copying the keys:
        # [1, kv_heads, groups * m, dim] @ [1, kv_heads, dim, P] -> [1, heads, m, P].
        grouped = q.to(wide).reshape(1, kv_heads, heads // kv_heads * m, dim)
        scores = (grouped @ keys.to(wide).transpose(-1, -2)).view(1, heads, m, total)
        scores = scores * attn.scaling
        scores[..., total - m :].masked_fill_(hidden_mask, float("-inf"))
        probs = scores.softmax(-1)
        if index in layers:
            out[index] = probs[0]
        if index == last:
            break
        grouped_probs = probs.to(values.dtype).view(1, kv_heads, heads // kv_heads * m, total)
        context = (grouped_probs @ values).view(1, heads, m, -1).transpose(1, 2).reshape(1, m, -1)
        hidden = hidden + attn.o_proj(context)
        hidden = hidden + block.mlp(block.post_attention_layernorm(hidden))
    return out


def mass_by_position(attention: dict[int, torch.Tensor], heads: Heads) -> torch.Tensor:
    """Attention mass [P] on each cached position, summed over `heads` ((layer, head) pairs)
    and over the queries of `attention` (`question_attention`'s layer -> [heads, m, P])."""
    return sum((attention[layer][head].sum(0) for layer, head in heads), torch.zeros(()))


def span_mass(mass: torch.Tensor, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Sum of `mass` [P] over each token span [start, end), shape (len(spans),), float64."""
    edges = np.concatenate([[0.0], np.cumsum(mass.double().cpu().numpy())])
    return np.array([edges[end] - edges[start] for start, end in spans], dtype=np.float64)


def token_spans(
    documents: Sequence[str],
    chunks: Sequence[Chunk],
    ids: Sequence[int],
    tokenizer: TokenizerLike,
) -> list[tuple[int, int]]:
    """Each chunk's token span [start, end) in `ids`, the prompt as the target read it.

    Each document is tokenized alone (with character offsets; a fast tokenizer is needed)
    and placed in `ids` where a run of `ANCHOR_TOKENS` of its tokens occurs and most of its
    tokens agree; tokens merged across the document's edges with the text around it may
    shift a chunk's first or last token by one. Raises `AttentionUnavailable` where a
    document cannot be placed (a truncated prompt, a template that escapes its text)."""
    if not getattr(tokenizer, "is_fast", False):
        raise AttentionUnavailable("chunk positions need a fast tokenizer's offsets")
    prompt = np.asarray(ids, dtype=np.int64)
    placed = []
    for text in documents:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        placed.append((_place(encoded["input_ids"], prompt), encoded["offset_mapping"]))
    spans = []
    for chunk in chunks:
        shift, offsets = placed[chunk.doc]
        ends = [end for _, end in offsets]
        starts = [start for start, _ in offsets]
        first = bisect.bisect_right(ends, chunk.start)  # first token ending inside the chunk
        stop = bisect.bisect_left(starts, chunk.end)  # first token starting at or after its end
        spans.append((shift + first, shift + max(stop, first + 1)))
    return spans


def _place(doc_ids: list[int], prompt: np.ndarray) -> int:
    """Where `doc_ids` start in `prompt` (its best-agreeing placement on an anchor run)."""
    n = len(doc_ids)
    width = min(ANCHOR_TOKENS, n)
    if width == 0 or len(prompt) < width:
        raise AttentionUnavailable("a document is not in the prompt's ids")
    windows = np.lib.stride_tricks.sliding_window_view(prompt, width)
    doc = np.asarray(doc_ids, dtype=np.int64)
    best, best_shift = 0.0, None
    for anchor in sorted({(n - width) // 2, 0, n - width}):
        for pos in np.flatnonzero((windows == doc[anchor : anchor + width]).all(1)):
            shift = int(pos) - anchor
            lo, hi = max(0, -shift), min(n, len(prompt) - shift)
            agree = float((prompt[shift + lo : shift + hi] == doc[lo:hi]).sum()) / n
            if agree > best:
                best, best_shift = agree, shift
    if best_shift is None or best < 0.9:
        raise AttentionUnavailable("a document is not in the prompt's ids")
    return best_shift


def cache_keyword(model: Any) -> str:
    """The forward's cache argument: "cache" in newer transformers, "past_key_values" before."""
    return (
        "cache"
        if "cache" in inspect.signature(type(model).forward).parameters
        else ("past_key_values")
    )


def _layer_kv(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's keys and values [1, kv_heads, P, dim], its parts joined (a shared
    prefix read in place, then the sequence's own tokens: `runtime.kv.SharedPrefixLayer`)."""
    parts = layer.parts() if hasattr(layer, "parts") else [(layer.keys, layer.values)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([k for k, _ in parts], -2), torch.cat([v for _, v in parts], -2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ---- the probe -------------------------------------------------------------------------------

_PROBE_FILLER = (
    "The committee met on a grey morning and read the minutes of the last meeting aloud. ",
    "Nobody objected to the budget, and the tea was served a little late as usual. ",
    "A long discussion about the car park ended without any decision at all. ",
    "The weather stayed mild for the season, with light wind from the west. ",
)
_PROBE_NEEDLES = (
    ("The secret password for the vault is tangerine.", "What is the secret password?"),
    ("The lighthouse keeper's dog is called Biscuit.", "What is the keeper's dog called?"),
    ("The train to the coast leaves from platform nine.", "Which platform does it leave from?"),
)
_heads_by_model: weakref.WeakKeyDictionary[Any, Heads] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ProbePrompt:
    """A needle prompt's ids and the needle's token span [start, end) in them."""

    ids: list[int]
    needle: tuple[int, int]


def probe_prompts(tokenizer: TokenizerLike, filler_tokens: int = 512) -> list[ProbePrompt]:
    """Needle prompts: filler text, one fact at a depth of 1/4, 1/2 or 3/4, then a question
    on it. Pieces are tokenized apart and joined, so the needle's span is exact."""

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    filler: list[int] = []
    while len(filler) < filler_tokens:
        for sentence in _PROBE_FILLER:
            filler += encode(sentence)
    prompts = []
    for depth, (fact, question) in zip((1, 2, 3), _PROBE_NEEDLES, strict=True):
        cut = len(filler) * depth // 4
        head = encode("Read the notes.\n\n") + filler[:cut]
        needle = encode(" " + fact + " ")
        tail = filler[cut:] + encode(f"\n\nQuestion: {question}\nAnswer:")
        prompts.append(ProbePrompt(head + needle + tail, (len(head), len(head) + len(needle))))
    return prompts


def probe_heads(model: Any, tokenizer: TokenizerLike, top: int = PROBE_HEADS) -> Heads:
    """The `top` (layer, head) pairs whose question queries put the most attention mass on
    a planted fact (`probe_prompts`), averaged over the probe's prompts; measured once per
    model object and kept while it lives."""
    known = _heads_by_model.get(model)
    if known is not None:
        return known
    from transformers import DynamicCache

    config = model.config
    layers = list(range(config.num_hidden_layers))
    total: torch.Tensor | None = None
    for prompt in probe_prompts(tokenizer):
        cache = DynamicCache(config=config)
        device = model.get_input_embeddings().weight.device
        with torch.inference_mode():
            model(torch.tensor([prompt.ids[:-1]], device=device), **{cache_keyword(model): cache})
            attention = question_attention(model, cache, prompt.ids, layers, QUERY_TOKENS)
        start, end = prompt.needle
        # [layers, heads]: mass on the needle per query, averaged over the queries.
        mass = torch.stack([attention[i][:, :, start:end].sum(-1).mean(-1) for i in layers])
        total = mass if total is None else total + mass
    assert total is not None  # the probe has prompts
    heads = total.shape[1]
    best = torch.argsort(total.flatten().cpu(), descending=True, stable=True)[:top]
    chosen = tuple((int(i) // heads, int(i) % heads) for i in best)
    _heads_by_model[model] = chosen
    return chosen


# ---- retrievers ------------------------------------------------------------------------------


class AttentionRetriever(FaissContextRetriever):
    """`FaissContextRetriever`'s chunks, budget and packing, scored by the target's attention.

    documents, tokenizer, budget, max_chunk_tokens, top_k: as `FaissContextRetriever`;
    model, cache, ids: the target, its cache after the prefill and the prompt's ids
    (`question_attention`); heads: the (layer, head) pairs to sum (None: `probe_heads`).
    There is no similarity floor: attention mass is relative, the budget alone bounds C^S.
    Scoring happens on construction (`attention_scores`, shape (n_chunks,)); the query string
    is not read, the question's own tokens in the cache are the query.
    """

    def __init__(
        self,
        documents: str | Sequence[str],
        tokenizer: TokenizerLike,
        *,
        model: Any,
        cache: Any,
        ids: Sequence[int],
        budget: int,
        heads: Heads | None = None,
        max_chunk_tokens: int = 512,
        top_k: int | None = None,
    ) -> None:
        # No embedder and no index: the parent's selection reads only these attributes.
        self.documents = [documents] if isinstance(documents, str) else list(documents)
        self.tokenizer = tokenizer
        self.budget = budget
        self.chunk_tokens = chunk_tokens_for(budget, max_chunk_tokens)
        self.threshold = float("-inf")
        self.top_k = top_k
        self.chunks = chunk_documents(self.documents, tokenizer, self.chunk_tokens)
        self._separator_tokens = count_text_tokens(tokenizer, SEPARATOR)
        self.heads = heads if heads is not None else probe_heads(model, tokenizer)
        self.spans = token_spans(self.documents, self.chunks, ids, tokenizer)
        after = max((end for _, end in self.spans), default=0)
        queries = max(1, min(QUERY_TOKENS, cache.get_seq_length() - after))
        self.attention_scores = self.chunk_mass(model, cache, ids, queries)

    def chunk_mass(self, model: Any, cache: Any, ids: Sequence[int], queries: int) -> np.ndarray:
        """Attention mass the last `queries` cached tokens put on each chunk, summed over
        `heads`: shape (n_chunks,), float64. model, cache, ids: as `question_attention`."""
        layers = sorted({layer for layer, _ in self.heads})
        attention = question_attention(model, cache, ids, layers, queries)
        return span_mass(mass_by_position(attention, self.heads), self.spans)

    def scores(self, query: str) -> np.ndarray:
        """Attention mass on each chunk, shape (n_chunks,) (`query` unused: see the class)."""
        return self.attention_scores.astype(np.float32)


class HybridRetriever(FaissContextRetriever):
    """The embedder's and the attention's rankings fused: a chunk scores
    1 / (RRF_K + its cosine rank) + 1 / (RRF_K + its attention rank) (ranks from 1).

    Ranks, not raw scores, because cosine similarity and attention mass have no common
    scale; fusion rather than a first cut because a cut by the embedder would keep its
    misses (the first link of a two-step question is rarely similar to the question), while
    here either signal can bring a chunk in. `attention`: an `AttentionRetriever` over the
    same documents and budget (same chunks); the rest as `FaissContextRetriever`."""

    def __init__(self, attention: AttentionRetriever, **kwargs: Any) -> None:
        super().__init__(attention.documents, attention.tokenizer, **kwargs)
        if [c.start for c in self.chunks] != [c.start for c in attention.chunks]:
            raise AttentionUnavailable("the embedder's chunks are not the attention's")
        self.attention = attention

    def scores(self, query: str) -> np.ndarray:
        cosine = super().scores(query)
        return (_rrf(cosine) + _rrf(self.attention.attention_scores)).astype(np.float32)


def _rrf(scores: np.ndarray) -> np.ndarray:
    """1 / (RRF_K + rank) per entry, rank 1 for the highest score (ties by position)."""
    ranks = np.empty(len(scores), dtype=np.float64)
    ranks[np.argsort(-scores, kind="stable")] = np.arange(1, len(scores) + 1)
    return 1.0 / (RRF_K + ranks)


def cache_retriever_factory(
    name: str, model: Any, cache: Any, ids: Sequence[int]
) -> Callable[[list[str], TokenizerLike, RapidConfig, int], FaissContextRetriever]:
    """The built-in retriever `engine.prompts` makes over a prompt's documents for the
    retriever `name` (one of `CACHE_RETRIEVERS`), reading `model`'s `cache` of `ids`."""

    def make(
        documents: list[str], tokenizer: TokenizerLike, config: RapidConfig, budget: int
    ) -> FaissContextRetriever:
        try:
            attention = AttentionRetriever(
                documents,
                tokenizer,
                model=model,
                cache=cache,
                ids=ids,
                budget=budget,
                max_chunk_tokens=config.retrieval_chunk_tokens,
                top_k=config.retrieval_top_k,
            )
        except AttentionUnavailable:  # another architecture, or a truncated prompt
            return FaissContextRetriever.from_config(documents, tokenizer, config, budget)
        if name != "hybrid":  # "following" starts from the attention's C^S
            return attention
        return HybridRetriever(
            attention,
            embedder=config.retrieval_embedder,
            budget=budget,
            max_chunk_tokens=config.retrieval_chunk_tokens,
            threshold=float("-inf"),
            top_k=config.retrieval_top_k,
        )

    return make


__all__ = [
    "CACHE_RETRIEVERS",
    "AttentionRetriever",
    "AttentionUnavailable",
    "HybridRetriever",
    "cache_retriever_factory",
    "probe_heads",
    "question_attention",
    "token_spans",
]
