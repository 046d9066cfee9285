"""Reading the runnable examples out of a docs page, so tests execute exactly what users read."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def python_sections(page: Path) -> list[tuple[str, str]]:
    """(heading, code) of each `## ` section of `page` with Python blocks, in page order; the
    blocks of one section are joined, since they build on each other."""
    sections = []
    for part in re.split(r"^## ", page.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]:
        heading, _, body = part.partition("\n")
        code = "\n".join(_PYTHON_BLOCK.findall(body))
        if code:
            sections.append((heading.strip(), code))
    return sections
