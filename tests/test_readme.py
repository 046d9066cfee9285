"""The README's examples of the engine, LangChain and LlamaIndex, run as written on the embedded
SmolLM2 (slow). Each asks the bundled document's question and must answer it from the document,
the text ending before the "\\n\\n" stop string it sets. `demo_document` gives them the
excerpt around the answer (`demo_excerpt`, a third of the prefill): what they test is the
examples' code; the whole document is `make demo`'s and the benchmark's (docs/benchmarks.md).
The README's "Serve" section runs against a live server in tests/test_serve_clients.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from rapid_integrations import demo_data
from rapid_integrations.demo_data import ANSWER_KEYWORD
from tests.doc_examples import DOCS, python_sections

SECTIONS = dict(python_sections(DOCS.parent / "README.md"))


@pytest.fixture(autouse=True)
def _excerpt(monkeypatch: pytest.MonkeyPatch) -> None:
    excerpt = demo_data.demo_excerpt()
    monkeypatch.setattr(demo_data, "demo_document", lambda: excerpt)


def _run(section: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    code = compile(SECTIONS[section], f"README.md ## {section}", "exec", dont_inherit=True)
    exec(code, namespace)
    return namespace


def _assert_answered(text: str) -> None:
    assert ANSWER_KEYWORD in text.lower()
    assert "\n\n" not in text.strip()


def _assert_rapid(mode: str, draft_tokens: int, target_tokens: int) -> None:
    """RAPID ran with the draft on a retrieved context, not on the whole document."""
    assert mode == "rapid"
    assert 0 < draft_tokens * 3 < target_tokens


@pytest.mark.slow
def test_the_engine_example(capsys: pytest.CaptureFixture[str]) -> None:
    ns = _run("Use")
    out = ns["out"]
    _assert_answered(out.text)
    assert out.finish_reason in ("eos", "stop")
    stats = out.stats
    _assert_rapid(stats.mode, stats.draft_context_tokens, stats.target_context_tokens)
    first = " ".join(
        map(
            str,
            (out.text, out.finish_reason, stats.acceptance_rate, stats.decode_tokens_per_second),
        )
    )
    printed = capsys.readouterr().out
    assert printed.startswith(first + "\n") and printed[len(first) :].strip()  # and the stream


@pytest.mark.slow
def test_the_langchain_example() -> None:
    ns = _run("LangChain")
    assert isinstance(ns["answer"], str)
    _assert_answered(ns["answer"])


@pytest.mark.slow
def test_the_llamaindex_example() -> None:
    response = _run("LlamaIndex")["response"]
    _assert_answered(response.text)
    stats = response.raw["rapid_stats"]
    _assert_rapid(stats["mode"], stats["draft_context_tokens"], stats["target_context_tokens"])
