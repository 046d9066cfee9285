"""Plumbing of `rapid bench --logprobs` (the figures come from the lead's quiet-machine run)."""

from __future__ import annotations

import json

import pytest

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.bench import runner
from rapid_integrations.bench.dataset import build_tasks
from rapid_integrations.bench.logprob_cost import (
    VARIANTS,
    markdown,
    records_json,
    run_logprob_bench,
    run_logprob_cost,
    summary,
)
from rapid_integrations.cli import build_parser
from tests.tiny import char_tokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


@pytest.fixture(scope="module")
def engine():
    tok = char_tokenizer()
    target = tiny_llama(len(tok), seed=1, window=4096)
    return RapidEngine(target, tokenizer=tok, config=RapidConfig(retrieval_budget=64))


@pytest.fixture(scope="module")
def records(engine):
    tasks = build_tasks(engine.tokenizer, ("single",), (512,), per_cell=2)
    return run_logprob_cost(engine, tasks, tokens=12, rounds=2)


def test_every_round_task_method_and_variant_is_timed_on_the_same_tokens(records):
    assert len(records) == 2 * 2 * 2 * len(VARIANTS)
    first = [(r["task_id"], r["method"], r["variant"]) for r in records[: 2 * len(VARIANTS)]]
    assert first == [("single-512-0", m, v) for m in ("lc", "rapid") for v in VARIANTS]
    for r in records:
        assert r["new_tokens"] == 12 and r["same_tokens"]
        assert r["logprob_entries"] == (0 if r["variant"] == "off" else 12)
        assert r["ms_per_token"] == pytest.approx(1000 * r["decode_seconds"] / 12)


def test_summary_pools_runs_and_compares_each_variant_with_off(records):
    rows = summary(records)
    assert [(r["method"], r["variant"], r["runs"]) for r in rows] == [
        (m, v, 4) for m in ("lc", "rapid") for v in VARIANTS
    ]
    for row in rows:
        group = [
            r for r in records if (r["method"], r["variant"]) == (row["method"], row["variant"])
        ]
        ms = 1000 * sum(r["decode_seconds"] for r in group) / sum(r["new_tokens"] for r in group)
        assert row["ms_per_token"] == pytest.approx(ms)
        off = next(o for o in rows if (o["method"], o["variant"]) == (row["method"], "off"))
        assert row["extra_ms_per_token"] == pytest.approx(ms - off["ms_per_token"])
    assert all(r["extra_ms_per_token"] == 0 for r in rows if r["variant"] == "off")
    assert "| extra ms / token |" in markdown(rows).splitlines()[0]
    assert json.loads(records_json(records))["summary"] == rows


def test_cli_takes_logprobs_but_not_with_constrained():
    parser = build_parser()
    assert parser.parse_args(["bench", "--logprobs"]).logprobs
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--logprobs", "--constrained"])


def test_the_command_writes_its_table_and_records(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "_qa_engine", lambda settings, device: (engine, None, {}))
    settings = runner.BenchSettings(out=tmp_path, per_cell=1, speed_tokens=5, methods=("lc",))
    run_logprob_bench(settings, (512,))
    rows = json.loads((tmp_path / "logprobs.json").read_text())["summary"]
    assert [(r["context_label"], r["method"], r["variant"]) for r in rows] == [
        (512, "lc", v) for v in VARIANTS
    ]
    assert (tmp_path / "logprobs.md").read_text() == markdown(rows) + "\n"
