"""`from llama_index.llms.rapid import RapidLLM`: RAPID at the import path of LlamaIndex's LLM
integrations (`llama_index.llms.<name>`), the same classes as `llamaindex_rapid`'s.

`llama_index` and `llama_index.llms` are namespace packages shared by every integration, so
this distribution adds only this module to them (no `__init__.py` above it).
"""

from __future__ import annotations

from llamaindex_rapid import QueryExtractor, RapidLLM, RapidRetrieverAdapter, StructuredOutputError

__all__ = ["QueryExtractor", "RapidLLM", "RapidRetrieverAdapter", "StructuredOutputError"]
