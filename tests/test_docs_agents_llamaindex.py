"""Runs the examples of docs/agents.md's "LlamaIndex" section on the embedded SmolLM2 (slow).

The section's Python blocks run in order in one namespace, as a reader would run them; the
results are then checked, so the page's claims (the tool called with the right box, its value
in the answer, the structured answers, the cut-off error) are tested rather than only run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.doc_examples import DOCS, python_sections
from tests.test_langchain_reasoning import save_reasoning_model

SECTION = "LlamaIndex"


@pytest.mark.slow
def test_the_llamaindex_examples_run_and_say_what_the_page_says(tmp_path: Path) -> None:
    from llama_index.core.base.llms.types import ThinkingBlock

    from llamaindex_rapid import StructuredOutputError

    code = dict(python_sections(DOCS / "agents.md"))[SECTION]
    ns: dict[str, Any] = {"reasoning_model": str(save_reasoning_model(tmp_path))}
    # dont_inherit: this module's `from __future__ import annotations` would turn the tools'
    # annotations into strings, which FunctionTool cannot resolve in this namespace.
    exec(compile(code, f"docs/agents.md ## {SECTION}", "exec", dont_inherit=True), ns)
    (result,) = ns["tool_results"]
    assert result.tool_kwargs == {"box": "blue"}
    assert result.tool_output.content == "The blue box holds the code 9052."
    assert "9052" in ns["answer"] and "<" not in ns["answer"]
    growing = ns["growing"]
    assert len(growing) > 1 and growing[-1] == {"box": "green"}
    assert ns["scored_call"].logprobs
    assert isinstance(ns["thinking"], ThinkingBlock) and ns["thinking"].content
    [selection] = ns["thinker"].get_tool_calls_from_response(ns["thought_call"])
    assert selection.tool_name == "get_code" and selection.tool_kwargs["box"] in (
        "red",
        "blue",
        "green",
    )
    capital = ns["Capital"]
    assert ns["germany"] == capital(country="Germany", capital="Berlin")
    assert ns["reply"].raw == capital(country="Spain", capital="Madrid")
    cut_off = ns["cut_off"]
    assert isinstance(cut_off, StructuredOutputError) and "finish_reason='length'" in str(cut_off)
