"""The benchmark's haystack: Python standard-library docstrings, the same for a given Python.

Imports nothing heavy, so building tasks (`bench.dataset`) needs neither torch nor a model.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator

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
