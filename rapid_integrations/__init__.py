"""RAPID: retrieval-augmented speculative decoding for long-context generation.

Public names only; heavy modules (torch, transformers) load on first use.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from .call_options import CallOptions
from .config import RapidConfig
from .errors import (
    ContextWindowExceededError,
    DeviceOutOfMemoryError,
    GrammarError,
    ModelNotFoundError,
    NumericalError,
    RapidConfigError,
    RapidError,
    RapidInputError,
    RetrievalError,
    VocabularyMismatchError,
)
from .outputs import Delta, RapidOutput, RapidStats, RapidStream
from .tools import ToolCall

# With torchao installed (extra `quant`), transformers imports it with its models, and torchao
# logs a warning for each optional CUDA kernel it cannot load; without a handler of the
# application's, Python would print them to stderr on every CPU-only run.
logging.getLogger("torchao").addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from .engine import RapidEngine
    from .grammar import Grammar
    from .prompts import build_draft_prompt
    from .retrieval import ContextRetriever, FaissContextRetriever

__all__ = [
    "CallOptions",
    "ContextRetriever",
    "ContextWindowExceededError",
    "Delta",
    "DeviceOutOfMemoryError",
    "FaissContextRetriever",
    "Grammar",
    "GrammarError",
    "ModelNotFoundError",
    "NumericalError",
    "RapidConfig",
    "RapidConfigError",
    "RapidEngine",
    "RapidError",
    "RapidInputError",
    "RapidOutput",
    "RapidStats",
    "RapidStream",
    "RetrievalError",
    "ToolCall",
    "VocabularyMismatchError",
    "build_draft_prompt",
]

# Names whose modules pull in torch / transformers: imported on first use.
_LAZY = {
    "RapidEngine": "engine",
    "build_draft_prompt": "prompts",
    "ContextRetriever": "retrieval",
    "FaissContextRetriever": "retrieval",
    "Grammar": "grammar",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'rapid_integrations' has no attribute {name!r}")
