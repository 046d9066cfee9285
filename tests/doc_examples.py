"""Reading the runnable examples out of a docs page, so tests execute exactly what users read."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def python_sections(page: Path) -> list[tuple[str, str]]:
    """(heading, code) of each `## ` section of `page` with Python blocks, in page order; the
    blocks of one section are joined, since they build on each other."""
    return _with_code(_parts(page.read_text(encoding="utf-8"), "## "))


def python_subsections(page: Path, section: str) -> list[tuple[str, str]]:
    """(heading, code) of each `### ` subsection of the `## section` of `page` with Python
    blocks, in page order (a page that several frameworks share, one section each)."""
    body = dict(_parts(page.read_text(encoding="utf-8"), "## "))[section]
    return _with_code(_parts(body, "### "))


def _parts(text: str, marker: str) -> list[tuple[str, str]]:
    """(heading, body) of each part of `text` that starts with `marker` at a line's start."""
    parts = re.split(f"^{re.escape(marker)}", text, flags=re.MULTILINE)[1:]
    return [(heading.strip(), body) for heading, _, body in (p.partition("\n") for p in parts)]


def _with_code(parts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    sections = []
    for heading, body in parts:
        code = "\n".join(_PYTHON_BLOCK.findall(body))
        if code:
            sections.append((heading, code))
    return sections
