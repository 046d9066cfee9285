"""Calling an external `ContextRetriever` so that its failures become reasons, not crashes."""

from __future__ import annotations

import threading
from typing import Any

from .base import ContextRetriever


def call_retriever(
    retriever: ContextRetriever, query: str, timeout: float | None
) -> tuple[list[str], str | None]:
    """`(passages, None)` on success, `([], reason)` when the retriever failed.

    Failures: it raised, it ran past `timeout` seconds (None: no limit), it returned something
    other than a list/tuple of strings, or no non-blank passage. A retriever that times out
    keeps running in a daemon thread (Python cannot stop it) and its result is discarded.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = retriever.retrieve(query)
        except BaseException as exc:  # reported to the caller as a reason, by contract
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="rapid-retriever", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return [], f"retriever timed out after {timeout:g} s"
    if "error" in outcome:
        error = outcome["error"]
        return [], f"retriever raised {type(error).__name__}: {error}"
    return _check(outcome["value"])


def _check(value: Any) -> tuple[list[str], str | None]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        return [], f"retriever returned {_describe(value)}, expected list[str]"
    if not any(v.strip() for v in value):
        return [], "retriever returned no passages"
    return list(value), None


def _describe(value: Any) -> str:
    """A type for messages: `dict`, or `list[int, str]` for a sequence with its item types."""
    if not isinstance(value, (list, tuple)):
        return type(value).__name__
    return f"{type(value).__name__}[{', '.join(sorted({type(v).__name__ for v in value}))}]"
