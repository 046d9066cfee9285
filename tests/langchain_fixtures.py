"""Material for the LangChain chain and docs tests: a long document with a planted fact, and
LangChain embeddings on the bundled MiniLM (offline)."""

from __future__ import annotations

import functools

from langchain_core.embeddings import Embeddings

from rapid_integrations.bench.recall import Needle, haystack, plant
from rapid_integrations.retrieval import get_embedder
from rapid_integrations.retrieval.base import TokenizerLike

NEEDLE = Needle(
    fact="The access code of the amber otter vault is 4721.",
    question="What is the access code of the amber otter vault?",
    depth=0.5,
)
ANSWER = "4721"
DOCUMENT_TOKENS = 1200
"""Long for the draft (its C^S is ~100 tokens), short enough for two CPU cores: at 8K the
target's prefill alone takes ~30 s here."""


@functools.cache
def long_document(tokenizer: TokenizerLike, n_tokens: int = DOCUMENT_TOKENS) -> str:
    """Python standard-library docstrings of about `n_tokens` tokens, the fact in the middle."""
    return plant(haystack(n_tokens, tokenizer), NEEDLE)


class MiniLMEmbeddings(Embeddings):
    """LangChain `Embeddings` on the bundled all-MiniLM-L6-v2, sharing the engine's cache."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return get_embedder().embed(texts).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]
