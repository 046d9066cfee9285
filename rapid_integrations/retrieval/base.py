"""The retriever protocol, the tokenizer surface retrieval uses, and the default budget rules.

Budgets and chunk sizes are counted in tokens of the *target* tokenizer, the unit in which the
draft's context window and KV cache are paid for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

PAPER_BUDGET_CAP = 4096
"""Paper: the retrieved context is capped at about 4096 tokens."""
PAPER_COMPRESSION = 24
"""Paper: the retrieved context is about 1/24 of the input."""
MIN_BUDGET = 512
"""Floor of the automatic budget, so 4K-8K prompts still give the draft a useful context."""
MIN_CHUNK_TOKENS = 64
"""Smallest automatic chunk: about two sentences, enough for an embedding to mean something."""
CHUNKS_PER_BUDGET = 8
"""Automatic chunk size is budget / 8: the paper's 512-token chunks under its 4096 cap."""


@runtime_checkable
class ContextRetriever(Protocol):
    """Anything that maps a query to passages of text for the draft's context C^S.

    `retrieve` returns the passages most relevant first (or in document order); the caller
    packs them into its token budget and never alters their text. External sources (LangChain,
    LlamaIndex, a vector database) implement this through thin adapters.
    """

    def retrieve(self, query: str) -> list[str]: ...


class TokenizerLike(Protocol):
    """The part of a Hugging Face tokenizer retrieval uses.

    `tokenizer(texts, add_special_tokens=False)["input_ids"]` for counting, plus
    `return_offsets_mapping=True` where the tokenizer is fast, and `decode` for token-id prompts.
    """

    def __call__(self, text: Any, **kwargs: Any) -> Mapping[str, Any]: ...

    # A list comes back only for a batch of id lists (Hugging Face's own return type).
    def decode(self, token_ids: Any, **kwargs: Any) -> str | list[str]: ...

    # Hashable, as every tokenizer object is: the benchmarks cache token counts per tokenizer.
    def __hash__(self) -> int: ...


def count_tokens(tokenizer: TokenizerLike, texts: Sequence[str]) -> list[int]:
    """Token count of each text (no special tokens), in one batched tokenizer call."""
    if not texts:
        return []
    # verbose=False: documents longer than the model window are expected here, not a mistake.
    ids = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
    return [len(row) for row in ids]


def count_text_tokens(tokenizer: TokenizerLike, text: str) -> int:
    """Token count of one text (no special tokens)."""
    return count_tokens(tokenizer, [text])[0]


def default_budget(input_tokens: int) -> int:
    """Automatic size of C^S in tokens for an input of `input_tokens` tokens.

    `clamp(ceil(input / 24), 512, 4096)`: the paper's ratio and cap, with a 512-token floor
    so that at the 4K-8K windows of small models the draft still sees several passages
    (at 8K: 512 tokens, a 16x shorter context; at 32K: 1366; from ~98K: 4096).
    """
    return min(PAPER_BUDGET_CAP, max(MIN_BUDGET, math.ceil(input_tokens / PAPER_COMPRESSION)))


def chunk_tokens_for(budget: int, max_chunk_tokens: int = 512) -> int:
    """Chunk size in tokens for a budget: `clamp(budget // 8, 64, max_chunk_tokens)`.

    About eight chunks fit the budget, so several separate places of a document can be
    retrieved; a small budget gets small chunks rather than a single one. Never above the
    budget itself.
    """
    size = max(MIN_CHUNK_TOKENS, budget // CHUNKS_PER_BUDGET)
    return max(1, min(size, max_chunk_tokens, budget))
