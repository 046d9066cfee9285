"""LangChain integration of RAPID: `ChatRapid`, `RapidLLM` and `RapidRetrieverAdapter`.

Drop-in replacements for `ChatHuggingFace` / `HuggingFacePipeline` that decode long contexts
with retrieval-augmented speculative decoding (see `rapid_integrations`).
"""

from __future__ import annotations

from ._base import RapidTimeoutError
from .chat_models import ChatRapid
from .llms import RapidLLM
from .retrievers import RapidRetrieverAdapter

__all__ = ["ChatRapid", "RapidLLM", "RapidRetrieverAdapter", "RapidTimeoutError"]
