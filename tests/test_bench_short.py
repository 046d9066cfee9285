"""The bench's short-prompt set: prompts with nothing to retrieve, and agreement with lc."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rapid_integrations import RapidConfigError
from rapid_integrations.bench import runner
from rapid_integrations.bench.runner import BenchSettings
from rapid_integrations.bench.scoring import score
from rapid_integrations.bench.short import (
    SHORT_CONTEXT,
    SHORT_KINDS,
    attach_agreement,
    first_difference,
    short_tasks,
)
from rapid_integrations.cli import main
from rapid_integrations.engine.prompts import prepare_draft_prompt
from rapid_integrations.tokens import encode_prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from rapid_integrations.models.loading import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


def test_short_prompts_are_under_the_retrieval_budget(smol_tokenizer):
    """Nothing to retrieve: each prompt is shorter than the set's nominal length, and the
    draft prompt is the target's, passed through whole."""
    tasks = short_tasks()
    assert {t.kind for t in tasks} == set(SHORT_KINDS)
    assert len({t.task_id for t in tasks}) == len(tasks)
    for task in tasks:
        ids = encode_prompt(task.messages, smol_tokenizer, len(smol_tokenizer))
        assert len(ids) < SHORT_CONTEXT
        built = prepare_draft_prompt(task.messages, smol_tokenizer)
        assert built.passthrough and built.prompt == task.messages


RIGHT = {
    "short-question-0": "The capital of France is Paris.",
    "short-question-1": "There are seven days in a week.",
    "short-question-2": "Mars.",
    "short-question-3": "William Shakespeare wrote it.",
    "short-chat-0": "You live in Lisbon.",
    "short-chat-1": "You have 4 apples now.",
    "short-agent-0": '{"tool": "get_weather", "arguments": {"city": "Paris"}}',
    "short-agent-1": "It is 18 degrees and sunny in Paris.",
}
WRONG = {
    "short-question-0": "The capital of France is Lyon.",
    "short-question-1": "A week has 5 working days and 7 days in all.",
    "short-question-2": "Jupiter.",
    "short-question-3": "Charles Dickens wrote it.",
    "short-chat-0": "You live in Paris.",
    "short-chat-1": "You have 5 apples now.",
    "short-agent-0": '{"tool": "search", "arguments": {"query": "Paris weather"}}',
    "short-agent-1": '{"tool": "get_weather", "arguments": {"city": "Paris"}}',
}


@pytest.mark.parametrize("task", short_tasks(), ids=lambda t: t.task_id)
def test_short_answers_are_scored_by_their_rule(task):
    assert score(RIGHT[task.task_id], task.references, task.rule) == 1.0
    assert score(WRONG[task.task_id], task.references, task.rule) == 0.0


@pytest.mark.parametrize(
    ("ours", "theirs", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 9, 3], 1),
        ([7, 2], [1, 2], 0),
        ([1, 2], [1, 2, 3, 4], 2),  # one ends where the other goes on
        ([1, 2, 3, 4], [1, 2], 2),
        ([], [5], 0),
    ],
)
def test_first_difference(ours, theirs, expected):
    assert first_difference(ours, theirs) == expected


def _answer(method, answer):
    return {"method": method, "answer": answer}


def test_agreement_compares_each_answer_with_lcs_in_tokens():
    """Character codes stand in for token ids: "abXd" parts from "abcd" at its third token,
    "ab" where lc's goes on; lc agrees with itself."""
    records = [
        _answer("rapid", "abXd"),
        _answer("lc", "abcd"),
        _answer("sd", "abcd"),
        _answer("rag", "ab"),
    ]
    attach_agreement(records, lambda text: [ord(c) for c in text])
    found = [(r["same_text_as_lc"], r["first_difference_from_lc"]) for r in records]
    assert found == [(False, 2), (True, None), (True, None), (False, 2)]
    alone = [_answer("rapid", "abcd")]
    attach_agreement(alone, lambda text: [ord(c) for c in text])
    assert alone[0]["same_text_as_lc"] is None and alone[0]["first_difference_from_lc"] is None


def test_short_suite_refuses_the_presets_that_replace_the_suites():
    assert BenchSettings.preset("quick", suite="short").suite == "short"
    for preset in ("long", "eta-sweep", "prefill"):
        with pytest.raises(RapidConfigError, match="preset"):
            BenchSettings.preset(preset, suite="short")


def test_short_suite_reports_agreement_with_lc_and_catches_a_planted_difference(
    tmp_path, capsys, monkeypatch
):
    """`--suite short` on the tiny pair (float32): sd decodes lc's greedy text on every
    prompt; rapid's answers are planted to differ from their first token. The records, the
    summary, the report's table and the agreement figure all say so."""
    measure = runner.measure_engine

    def planted(engine, method, *args, **kwargs):
        measured = measure(engine, method, *args, **kwargs)
        if method.name != "rapid":
            return measured
        return dataclasses.replace(measured, answer="Planted! " + measured.answer)

    monkeypatch.setattr(runner, "measure_engine", planted)
    out = tmp_path / "bench"
    flags = "--suite short --tiny-models --dtype float32 --methods lc,sd,rapid --etas 5"
    flags += " --max-new-tokens 6 --json --no-progress"
    assert main(["bench", *flags.split(), "--out", str(out)]) == 0
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    records = results["records"]
    tasks = short_tasks()
    assert {r["suite"] for r in records} == {"short"}
    assert len(records) == 3 * len(tasks)
    by_method = {m: [r for r in records if r["method"] == m] for m in ("lc", "sd", "rapid")}
    assert all(
        r["same_text_as_lc"] and r["first_difference_from_lc"] is None for r in by_method["sd"]
    )
    assert all(
        r["same_text_as_lc"] is False and r["first_difference_from_lc"] == 0
        for r in by_method["rapid"]
    )
    # Nothing retrieved: rapid's draft read the whole prompt, and no fact was there to find.
    assert all(r["draft_context_tokens"] == r["context_tokens"] for r in by_method["rapid"])
    assert all(r["needle_recall"] is None for r in records)
    rows = {r["label"]: r for r in results["summary"] if r["task"] == "all"}
    assert rows["sd"]["same_text_as_lc"] == 1.0 and rows["rapid eta=5"]["same_text_as_lc"] == 0.0
    assert rows["rapid eta=5"]["first_difference_from_lc"] == 0.0
    assert rows["lc"]["end_to_end_over_lc"] == 1.0
    assert rows["rapid eta=5"]["end_to_end_over_prompt_lookup"] is None  # hf-pld did not run
    figure = next(f for f in results["speed_figures"] if f["figure"].startswith("short prompts"))
    assert figure["value"] == 0.0 and figure["met"] is False
    table = (out / "results.md").read_text()
    n = len(tasks)
    assert f"| rapid eta=5 | {_fmt(rows['rapid eta=5'])} | 0 of {n} | 0 of 4 |" in table
    assert f"| sd | {_fmt(rows['sd'])} | {n} of {n} | 4 of 4 |" in table
    assert "Preset: short prompts, its fixed prompts" in table


def _fmt(row):
    """The end-to-end cells the short table leads a row with: over lc, over prompt lookup
    (not run: "–"), seconds."""
    return f"{row['end_to_end_over_lc']:.2f} | – | {row['end_to_end_seconds']:.1f}"
