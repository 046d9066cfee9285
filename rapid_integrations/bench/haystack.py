"""The benchmark's haystack: Python standard-library docstrings, the same for a given Python.

Imports nothing heavy, so building tasks (`bench.dataset`) needs neither torch nor a model.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HAYSTACK_MODULES = (
    "argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal",
    "email", "fractions", "functools", "http.client", "inspect", "itertools", "json",
    "logging", "os", "pathlib", "pickle", "re", "shutil", "socket", "string", "subprocess",
    "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.parse", "zipfile",
)  # fmt: skip
"""Pure-Python standard-library modules whose docstrings make the haystack, in this order."""


def stdlib_paragraphs() -> Iterator[str]:
    """Docstrings of `HAYSTACK_MODULES` and their public members, each once, in a fixed order."""
    seen: set[str] = set()
    for name in HAYSTACK_MODULES:
        module = importlib.import_module(name)
        members = [module] + [obj for key, obj in sorted(vars(module).items()) if key[:1] != "_"]
        for obj in members:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200 and doc not in seen:
                seen.add(doc)
                yield doc


def leading_text(tokenizer: PreTrainedTokenizerBase, tokens: int) -> str:
    """The haystack's first `tokens` tokens (fewer where it runs out), as text: a long prompt
    for the scripts that time one prefill or check one long call."""
    paragraphs: list[str] = []
    for paragraph in stdlib_paragraphs():
        paragraphs.append(paragraph)
        if sum(map(len, paragraphs)) > 5 * tokens:  # about 4 characters a token
            break
    ids = tokenizer("\n\n".join(paragraphs))["input_ids"][:tokens]
    return str(tokenizer.decode(ids))
