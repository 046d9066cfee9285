"""Fixtures of the LlamaIndex tests: the bundled MiniLM as a LlamaIndex embedding, and one
`RapidLLM` over the session's default SmolLM2 engine.

Test modules load them with ``pytest_plugins = ["tests.llamaindex_fixtures"]`` (and take the
document and its question from `tests.llamaindex_data`, so this module is imported only once,
by pytest, and its asserts are rewritten).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from llamaindex_rapid import RapidLLM
    from rapid_integrations import RapidEngine

from tests.llamaindex_data import GENERATE


@pytest.fixture(scope="session")
def embed_model() -> HuggingFaceEmbedding:
    """The bundled all-MiniLM-L6-v2 as a LlamaIndex embedding, loaded from its folder."""
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from rapid_integrations.models.loading import default_embedder_path

    return HuggingFaceEmbedding(model_name=str(default_embedder_path()), device="cpu")


@pytest.fixture(scope="module")
def rapid_llm(default_engine: RapidEngine) -> RapidLLM:
    """A RapidLLM sharing the engine `RapidEngine.from_default()` builds (bf16 SmolLM2, its
    int4 copy drafting)."""
    from llamaindex_rapid import RapidLLM

    return RapidLLM(engine=default_engine, generate_kwargs=GENERATE)
