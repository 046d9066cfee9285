"""RAPID: retrieval-augmented speculative decoding for long-context generation.

Public names only; heavy modules (torch, transformers) load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rapid_integrations.config import RapidConfig
from rapid_integrations.engine.call_options import CallOptions
from rapid_integrations.errors import (
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
from rapid_integrations.output.outputs import (
    CallFragment,
    Delta,
    RapidOutput,
    RapidStats,
    RapidStream,
    ToolCall,
)
from rapid_integrations.quiet import install as _quiet_start

_quiet_start()  # third-party warnings off stderr unless asked for (quiet.py)

if TYPE_CHECKING:
    from rapid_integrations.batching.runner import BatchRunner, generate_batch
    from rapid_integrations.engine.prompts import build_draft_prompt
    from rapid_integrations.engine.rapid_engine import RapidEngine
    from rapid_integrations.retrieval import ContextRetriever, FaissContextRetriever
    from rapid_integrations.structured_output.grammar import Grammar

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
    "BatchRunner": "batching.runner",
    "generate_batch": "batching.runner",
    "RapidEngine": "engine.rapid_engine",
    "build_draft_prompt": "engine.prompts",
    "ContextRetriever": "retrieval",
    "FaissContextRetriever": "retrieval",
    "Grammar": "structured_output.grammar",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'rapid_integrations' has no attribute {name!r}")
