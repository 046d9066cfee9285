"""Retrieval of the draft's short context C^S: chunking, embeddings, FAISS, prompt splitting."""

from __future__ import annotations

from .base import ContextRetriever, chunk_tokens_for, default_budget
from .chunking import Chunk, chunk_documents, chunk_text
from .embedding import Embedder, SentenceTransformerEmbedder, get_embedder
from .faiss_retriever import FaissContextRetriever, ScoredChunk
from .packing import SEPARATOR, Passage, pack_passages
from .splitting import PromptSplit, default_query, split_prompt

__all__ = [
    "SEPARATOR",
    "Chunk",
    "ContextRetriever",
    "Embedder",
    "FaissContextRetriever",
    "Passage",
    "PromptSplit",
    "ScoredChunk",
    "SentenceTransformerEmbedder",
    "chunk_documents",
    "chunk_text",
    "chunk_tokens_for",
    "default_budget",
    "default_query",
    "get_embedder",
    "pack_passages",
    "split_prompt",
]
