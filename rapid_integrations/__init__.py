"""RAPID: retrieval-augmented speculative decoding for long-context generation.

Public names only; heavy modules (torch, transformers) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import RapidConfig
from .errors import (
    ContextWindowExceededError,
    DeviceOutOfMemoryError,
    ModelNotFoundError,
    NumericalError,
    RapidConfigError,
    RapidError,
    RapidInputError,
    RetrievalError,
    VocabularyMismatchError,
)
from .outputs import RapidOutput, RapidStats, RapidStream

if TYPE_CHECKING:
    from .engine import RapidEngine

__all__ = [
    "ContextWindowExceededError",
    "DeviceOutOfMemoryError",
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
    "VocabularyMismatchError",
]


def __getattr__(name: str) -> Any:
    if name == "RapidEngine":
        from .engine import RapidEngine

        return RapidEngine
    raise AttributeError(f"module 'rapid_integrations' has no attribute {name!r}")
