"""LlamaIndex integration of RAPID: `RapidLLM` (a `FunctionCallingLLM`), `RapidRetrieverAdapter`,
and `StructuredOutputError` (a structured answer cut off by the token limit)."""

from __future__ import annotations

from .llms import RapidLLM
from .retrievers import RapidRetrieverAdapter
from .structured import StructuredOutputError
from .templates import QueryExtractor

__all__ = ["QueryExtractor", "RapidLLM", "RapidRetrieverAdapter", "StructuredOutputError"]
