"""Data of the LlamaIndex tests: a long document with one planted fact, and its question."""

from __future__ import annotations

import inspect
import json
import string
import textwrap

NEEDLE = "The access code for the north warehouse is 7391."
QUESTION = "What is the access code for the north warehouse?"
ANSWER = "7391"
# Greedy decoding keeps every run reproducible; few new tokens keep the suite short.
GENERATE = {"temperature": 0.0, "max_new_tokens": 24}


def filler_paragraphs(limit: int) -> list[str]:
    """Real English prose that ships with Python: docstrings of a few stdlib modules."""
    paragraphs = []
    for module in (textwrap, json, string):
        for name, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) and not name.startswith("_") else None
            if doc and len(doc) > 200 and getattr(obj, "__module__", "") == module.__name__:
                paragraphs.append(f"{module.__name__}.{name}: " + " ".join(doc.split()))
    return paragraphs[:limit]


def long_document(paragraphs: int = 12) -> str:
    """About 2K SmolLM2 tokens of docstrings with `NEEDLE` planted in the middle."""
    body = filler_paragraphs(paragraphs)
    body.insert(len(body) // 2, NEEDLE)
    return "\n\n".join(body)
