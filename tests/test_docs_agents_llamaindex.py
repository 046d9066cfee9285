"""Runs the examples of docs/agents.md's "LlamaIndex" section on the embedded SmolLM2 (slow).

The section's Python blocks run in order in one namespace, as a reader would run them; the
results are then checked, so the page's claims (the tool called with the right box, its value
in the answer, the structured answers, the cut-off error) are tested rather than only run.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.doc_examples import DOCS, python_sections

SECTION = "LlamaIndex"


@pytest.mark.slow
def test_the_llamaindex_examples_run_and_say_what_the_page_says() -> None:
    from llamaindex_rapid import StructuredOutputError

    code = dict(python_sections(DOCS / "agents.md"))[SECTION]
    ns: dict[str, Any] = {}
    # dont_inherit: this module's `from __future__ import annotations` would turn the tools'
    # annotations into strings, which FunctionTool cannot resolve in this namespace.
    exec(compile(code, f"docs/agents.md ## {SECTION}", "exec", dont_inherit=True), ns)
    (result,) = ns["tool_results"]
    assert result.tool_kwargs == {"box": "blue"}
    assert result.tool_output.content == "The blue box holds the code 9052."
    assert "9052" in ns["answer"] and "<" not in ns["answer"]
    capital = ns["Capital"]
    assert ns["germany"] == capital(country="Germany", capital="Berlin")
    assert ns["reply"].raw == capital(country="Spain", capital="Madrid")
    cut_off = ns["cut_off"]
    assert isinstance(cut_off, StructuredOutputError) and "finish_reason='length'" in str(cut_off)
