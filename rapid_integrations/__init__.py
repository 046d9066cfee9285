"""RAPID: retrieval-augmented speculative decoding for long-context generation.

Public names only; heavy modules (torch, transformers) load on first use.
"""

from __future__ import annotations

import importlib
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
from .outputs import CallFragment, Delta, RapidOutput, RapidStats, RapidStream
from .quiet import install as _quiet_start
from .tools import ToolCall

_quiet_start()  # third-party warnings off stderr unless asked for (quiet.py)

if TYPE_CHECKING:
    from .batch import BatchRunner, generate_batch
    from .engine import RapidEngine
    from .grammar import Grammar
    from .prompts import build_draft_prompt
    from .retrieval import ContextRetriever, FaissContextRetriever

__all__ = [
    "BatchRunner",
    "CallFragment",
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
    "generate_batch",
]

# Names whose modules pull in torch / transformers: imported on first use.
_LAZY = {
    "BatchRunner": "batch",
    "generate_batch": "batch",
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
