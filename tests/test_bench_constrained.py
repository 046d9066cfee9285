"""Plumbing of `rapid bench --constrained` (the figures come from the lead's quiet-machine run)."""

from __future__ import annotations

import json

import pytest

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.bench.constrained import (
    RECORD_SCHEMA,
    build_extraction_tasks,
    markdown,
    records_json,
    run_constrained,
    score,
    summary,
)
from tests.tiny import json_tokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


@pytest.fixture(scope="module")
def setup():
    tok = json_tokenizer()
    target = tiny_llama(len(tok), seed=5, window=4096)
    draft = tiny_llama(len(tok), seed=6, layers=1, window=4096)
    engine = RapidEngine(target, draft, tokenizer=tok, config=RapidConfig(retrieval_budget=128))
    return engine, build_extraction_tasks(tok, (1024,), per_cell=2)


def test_tasks_plant_all_three_facts(setup):
    _, tasks = setup
    assert [t.task_id for t in tasks] == ["extract-1024-0", "extract-1024-1"]
    for task in tasks:
        document = task.messages[-1]["content"]
        for value in task.answer.values():
            assert str(value) in document
    assert tasks[0].answer != tasks[1].answer


def test_score_validity_and_field_accuracy(setup):
    answer = {"city": "Oslo", "year": 1850, "code": 4721}
    assert score('{"city": "Oslo", "year": 1850, "code": 4721}', "eos", answer) == (True, 1.0)
    assert score('{"city": "oslo", "year": 1851, "code": 1}', "eos", answer) == (True, 1 / 3)
    assert score('{"city": "Oslo", "year": 1850}', "eos", answer) == (False, 0.0)  # schema
    assert score('{"city": "Oslo", "ye', "length", answer) == (False, 0.0)


def test_run_records_every_method_and_summarizes(setup):
    engine, tasks = setup
    records = run_constrained(engine, tasks, max_new_tokens=60)
    assert [(r["task_id"], r["method"]) for r in records[:3]] == [
        ("extract-1024-0", m) for m in ("lc", "rag", "rapid")
    ]
    for r in records:
        assert (r["valid"], r["field_accuracy"]) == score(
            r["answer"], r["finish_reason"], tasks[int(r["task_id"][-1])].answer
        )
        assert r["grammar_seconds"] > 0 and 0 < r["mask_cost_per_step"] < 1
        assert (r["acceptance_rate"] is None) == (r["method"] != "rapid")
    assert any(r["valid"] for r in records)
    rows = summary(records)
    assert [(r["context_label"], r["method"], r["tasks"]) for r in rows] == [
        (1024, m, 2) for m in ("lc", "rag", "rapid")
    ]
    assert "| mask cost / step |" in markdown(rows)
    assert json.loads(records_json(records))["summary"] == rows
    assert RECORD_SCHEMA["required"] == ["city", "year", "code"]
