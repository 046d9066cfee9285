"""LlamaIndex integration of RAPID: `RapidLLM` (a `CustomLLM`) and `RapidRetrieverAdapter`."""

from __future__ import annotations

from .llms import RapidLLM
from .retrievers import RapidRetrieverAdapter
from .templates import QueryExtractor

__all__ = ["QueryExtractor", "RapidLLM", "RapidRetrieverAdapter"]
