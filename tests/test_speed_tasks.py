"""The prompts of the speed-only suites (bench/speed_tasks.py): the free-form `rewrite` kind
is deterministic, names a paragraph of its own document, and `--speed-kinds` selects it."""

from __future__ import annotations

import json

import pytest

from rapid_integrations import RapidConfigError
from rapid_integrations.bench.dataset import build_tasks
from rapid_integrations.bench.runner import BenchSettings
from rapid_integrations.bench.speed_tasks import REWRITE_QUOTED_WORDS, build_speed_tasks
from rapid_integrations.cli import main
from rapid_integrations.tokens import encode_prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from rapid_integrations.models.loading import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


def test_the_rewrite_prompt_is_deterministic_and_independent_of_other_tasks(smol_tokenizer):
    both = build_speed_tasks(smol_tokenizer, ("single", "rewrite"), (2048, 4096), seed=0)
    assert [(t.kind, t.context_label) for t in both] == [
        ("single", 2048),
        ("rewrite", 2048),
        ("single", 4096),
        ("rewrite", 4096),
    ]
    alone = build_speed_tasks(smol_tokenizer, ("rewrite",), (2048,), seed=0)[0]
    assert alone == both[1] and alone.task_id == "rewrite-2048-0"
    # single is the QA suite's single-needle prompt, unchanged.
    assert both[0] == build_tasks(smol_tokenizer, ("single",), (2048,), 1, 0)[0]
    assert build_speed_tasks(smol_tokenizer, ("rewrite",), (2048,), seed=1)[0] != alone


def test_the_rewrite_prompt_names_one_paragraph_of_its_2k_document(smol_tokenizer):
    task = build_speed_tasks(smol_tokenizer, ("rewrite",), (2048,))[0]
    (paragraph,) = task.facts
    document = task.messages[1]["content"]
    assert f"\n\n{paragraph}\n\n" in document  # a whole paragraph, from the middle
    opening = " ".join(paragraph.split()[:REWRITE_QUOTED_WORDS])
    assert f'begins "{opening}" in your own words' in document
    assert "do not copy" in document
    tokens = len(encode_prompt(task.messages, smol_tokenizer, len(smol_tokenizer)))
    assert 1500 < tokens <= 2048


def test_speed_kinds_are_checked():
    assert BenchSettings(speed_kinds=("single", "rewrite")).speed_kinds == ("single", "rewrite")
    for bad in (("nope",), ()):
        with pytest.raises(RapidConfigError, match="speed_kinds"):
            BenchSettings(speed_kinds=bad)


def test_speed_kinds_select_the_prompts_of_a_long_run(tmp_path, capsys):
    out = tmp_path / "bench"
    flags = "--long --tiny-models --lengths 512 --speed-tokens 4 --methods lc,rapid"
    argv = ["bench", *flags.split(), "--gammas", "", "--speed-kinds", "single,rewrite"]
    argv += ["--json", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    records = json.loads((out / "results.json").read_text())["records"]
    assert {(r["task"], r["method"]) for r in records} == {
        ("single", "lc"),
        ("single", "rapid"),
        ("rewrite", "lc"),
        ("rewrite", "rapid"),
    }
    assert "| long | 512 | rewrite | lc |" in (out / "results.md").read_text()
