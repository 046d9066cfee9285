"""Shared pieces of the LlamaIndex tests: a long document with a planted fact, the bundled
MiniLM as a LlamaIndex embedding, and one `RapidLLM` over the session's SmolLM2 engine.

Test modules load these fixtures with ``pytest_plugins = ["tests.llamaindex_fixtures"]``.
"""

from __future__ import annotations

import inspect
import json
import string
import textwrap
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from llamaindex_rapid import RapidLLM
    from rapid_integrations import RapidEngine

NEEDLE = "The access code for the north warehouse is 7391."
QUESTION = "What is the access code for the north warehouse?"
ANSWER = "7391"
# Greedy decoding keeps every run reproducible; few new tokens keep the suite short.
GENERATE = {"temperature": 0.0, "max_new_tokens": 24}


def filler_paragraphs(limit: int) -> list[str]:
    """Real English prose that ships with Python: docstrings of a few stdlib modules."""
    paragraphs = []
    for module in (textwrap, json, string):
        for name, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) and not name.startswith("_") else None
            if doc and len(doc) > 200 and getattr(obj, "__module__", "") == module.__name__:
                paragraphs.append(f"{module.__name__}.{name}: " + " ".join(doc.split()))
    return paragraphs[:limit]


def long_document(paragraphs: int = 12) -> str:
    """About 2K SmolLM2 tokens of docstrings with `NEEDLE` planted in the middle."""
    body = filler_paragraphs(paragraphs)
    body.insert(len(body) // 2, NEEDLE)
    return "\n\n".join(body)


@pytest.fixture(scope="session")
def embed_model() -> HuggingFaceEmbedding:
    """The bundled all-MiniLM-L6-v2 as a LlamaIndex embedding, loaded from its folder."""
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from rapid_integrations.models import default_embedder_path

    return HuggingFaceEmbedding(model_name=str(default_embedder_path()), device="cpu")


@pytest.fixture(scope="session")
def rapid_llm(smol_engine: RapidEngine) -> RapidLLM:
    """A RapidLLM sharing the session's SmolLM2 engine (self-speculation)."""
    from llamaindex_rapid import RapidLLM

    return RapidLLM(engine=smol_engine, generate_kwargs=GENERATE)
