"""The broad QA suite: generators, splits, scoring rules, settings, a tiny run."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest

from rapid_integrations import RapidConfigError
from rapid_integrations.bench.runner import BenchSettings
from rapid_integrations.bench.scoring import abstains, first_number, score
from rapid_integrations.bench.suite import (
    _FIRST,
    _LAST,
    ABSENT_ANSWER,
    QUESTION_KINDS,
    SPLITS,
    _Draw,
    build_suite,
    make_task,
    split_of,
    task_seed,
)
from rapid_integrations.bench.texts import TEXT_KINDS
from rapid_integrations.cli import main
from rapid_integrations.tokens import encode_prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from rapid_integrations.models.loading import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


@pytest.fixture(scope="module")
def dev(smol_tokenizer):
    """Three dev tasks per cell: one at each of 2K, 4K and 8K."""
    return build_suite(smol_tokenizer, "dev", per_cell=3)


def _text(task) -> str:
    """Everything the model reads before the question."""
    last = task.messages[-1]["content"]
    before = [m["content"] for m in task.messages[:-1]]
    if task.kind == "chat":
        return "\n".join(before)
    return "\n".join([*before, last.rsplit("\n\nQuestion:", 1)[0]])


def _question(task) -> str:
    return task.messages[-1]["content"].rsplit("Question:", 1)[-1]


def _count_words(text: str, phrase: str) -> int:
    return len(re.findall(rf"(?<!\w){re.escape(phrase)}(?!\w)", text))


# ---- generators -----------------------------------------------------------------------------


def test_every_text_by_every_question_at_every_length(dev):
    cells = {(t.text_kind, t.kind) for t in dev}
    assert cells == {(text, kind) for text in TEXT_KINDS for kind in QUESTION_KINDS}
    for text in TEXT_KINDS:
        for kind in QUESTION_KINDS:
            lengths = [t.context_label for t in dev if (t.text_kind, t.kind) == (text, kind)]
            assert lengths == [2048, 4096, 8192]
    assert len({t.task_id for t in dev}) == len(dev)


def test_suite_is_deterministic_and_a_task_depends_on_its_own_key_only(smol_tokenizer, dev):
    again = build_suite(smol_tokenizer, "dev", per_cell=3)
    assert again == dev
    task = next(t for t in dev if t.task_id == "logs-hop-4096-s2")
    alone = build_suite(smol_tokenizer, "dev", ("logs",), ("hop",), (2048, 4096), per_cell=2)[1]
    assert alone == task == make_task(smol_tokenizer, "logs", "hop", 4096, 2)
    other = make_task(smol_tokenizer, "logs", "hop", 4096, 4)
    assert other.messages != task.messages and other.references != task.references


def test_prompts_fit_their_nominal_length_with_the_embedded_tokenizer(smol_tokenizer, dev):
    for task in dev:
        tokens = len(encode_prompt(task.messages, smol_tokenizer, len(smol_tokenizer)))
        assert 0.8 * task.context_label < tokens <= task.context_label - 48, task.task_id


def test_each_planted_sentence_is_there_once_and_the_absent_subject_never(dev):
    for task in dev:
        text = _text(task)
        planted = (*task.facts, *task.distractors)
        assert planted and len(set(planted)) == len(planted)
        for sentence in planted:
            assert text.count(sentence) == 1, (task.task_id, sentence)
        if task.kind == "absent":
            assert task.absent in _question(task) and task.absent not in text
            assert not task.facts and task.references == (ABSENT_ANSWER,)
        elif task.rule == "contains":
            # Each answer is named by a fact and nowhere else in the text (not by the filler).
            for ref in task.references:
                in_facts = sum(_count_words(f, ref) for f in task.facts)
                assert in_facts >= 1 and _count_words(text, ref) == in_facts, task.task_id
        for wrong in task.wrong:  # another subject's or person's number: a distractor's only
            assert sum(_count_words(d, wrong) for d in task.distractors) == 1
            assert _count_words(text, wrong) == 1
        # The answer is not in the question.
        assert not any(_count_words(_question(task), ref) for ref in task.references)


def test_question_kinds_plant_what_they_claim(dev):
    for task in dev:
        text, question = _text(task), _question(task)
        depth = [text.index(f) / len(text) for f in task.facts]
        if task.kind == "two":
            assert depth[0] < 0.5 < depth[1]  # in different halves
        if task.kind == "hop":
            link, answer = task.facts
            keeper = link.removesuffix(".").rsplit(" by ", 1)[1]
            assert keeper in answer and keeper not in question  # the first names the second
            assert (depth[0] < 0.5) != (depth[1] < 0.5)
            assert len(task.wrong) == 2 and all("badge number" in d for d in task.distractors)
        if task.kind == "count":
            subject = question.rsplit("guest book of ", 1)[1].rstrip("?")
            assert len(task.facts) == int(task.references[0]) >= 2
            assert all(f.endswith(f"guest book of {subject}.") for f in task.facts)
            assert subject not in task.distractors[0]  # one signature for another subject
            assert max(depth) - min(depth) > 0.2  # spread over the text
        if task.kind == "absent":
            # A namesake: same noun and site, another adjective.
            planted = re.search(r"code of (the \w+ \w+ \w+)", task.distractors[0])[1]
            assert planted.split()[2:] == task.absent.split()[2:] and planted != task.absent
        if task.kind == "chat":
            stated = next(i for i, m in enumerate(task.messages) if task.facts[0] in m["content"])
            assert task.messages[stated]["role"] == "user" and stated < len(task.messages) - 4
        else:
            assert [m["role"] for m in task.messages] == ["system", "user"]
    systems = {t.messages[0]["content"] for t in dev if t.kind != "chat"}
    assert len(systems) == 1 and ABSENT_ANSWER in systems.pop()  # the same for every kind


def test_text_kinds_are_of_different_nature(dev):
    by_text = {
        k: [_text(t) for t in dev if t.text_kind == k and t.kind == "single"] for k in TEXT_KINDS
    }
    stamp = re.compile(r"^\w{3} [ \d]\d \d\d:\d\d:\d\d \S+ \w+\[\d+\]: ", re.MULTILINE)
    assert all(len(stamp.findall(text)) > 20 for text in by_text["logs"])
    assert not any(stamp.search(text) for text in by_text["story"] + by_text["docs"])
    assert all(text.count("Ada") + text.count("Bruno") > 3 for text in by_text["story"])
    assert all("Return" in text or "return" in text for text in by_text["docs"])


def test_planted_numbers_and_names_avoid_those_of_the_text_and_each_other():
    """Where the filler holds almost every 4-digit number and person's name, the draws take
    the few left, each once (the filler naming an answer would make the fact not the only
    sentence that answers)."""
    left = {"1234", "5678", "9012"}
    numbers = [str(n) for n in range(1000, 10000) if str(n) not in left]
    people = [f"{first} {last}" for first in _FIRST for last in _LAST]
    free = set(people[:3])
    filler = "\n".join([*numbers, *(p + " said hello." for p in people[3:])])
    draw = _Draw(random.Random(0), filler)
    assert {draw.number() for _ in range(3)} == left
    assert {draw.person() for _ in range(3)} == free


def test_dev_and_test_never_share_a_seed(smol_tokenizer):
    halves = {s: build_suite(smol_tokenizer, s, lengths=(2048,), per_cell=4) for s in SPLITS}
    seeds = {s: {t.seed for t in tasks} for s, tasks in halves.items()}
    assert len(seeds["dev"]) == len(seeds["test"]) == 4
    assert not seeds["dev"] & seeds["test"]
    for split, tasks in halves.items():
        assert all(t.split == split == split_of(t.seed) for t in tasks)
    assert {t.messages[-1]["content"] for t in halves["dev"]}.isdisjoint(
        t.messages[-1]["content"] for t in halves["test"]
    )
    assert [task_seed("test", i) for i in range(3)] == [1, 3, 5]
    with pytest.raises(RapidConfigError, match="split"):
        task_seed("train", 0)


def test_unknown_text_or_question_kind_is_a_config_error(smol_tokenizer):
    with pytest.raises(RapidConfigError, match="texts"):
        build_suite(smol_tokenizer, "dev", texts=("poems",))
    with pytest.raises(RapidConfigError, match="kinds"):
        build_suite(smol_tokenizer, "dev", kinds=("riddle",))


# ---- scoring rules --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("Three people signed it.", 3),
        ("3", 3),
        ("There were 4 signatures, not 3.", 4),  # the first number counts
        ("Nobody knows.", None),
        ("twenty", 20),
    ],
)
def test_first_number(answer, expected):
    assert first_number(answer) == expected


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("It is not in the document.", True),
        ("The document doesn't say.", True),
        ("There is no information about it.", True),
        ("Unknown.", True),
        ("The access code is 4721.", False),
        ("Nothing.", False),
    ],
)
def test_abstains(answer, expected):
    assert abstains(answer) is expected


def test_score_applies_the_rule_and_the_wrong_answers():
    assert score("The code is 4721.", ["4721"]) == 1.0
    assert score("Either 4721 or 5830.", ["4721"], wrong=["5830"]) == 0.0  # names a distractor
    assert score("Three.", ["3"], "count") == 1.0
    assert score("Two, maybe 3.", ["3"], "count") == 0.0
    assert score("It is not in the document.", [ABSENT_ANSWER], "absent", ["4721"]) == 1.0
    assert score("Not sure, but 4721.", [ABSENT_ANSWER], "absent", ["4721"]) == 0.0
    assert score("The code is 1234.", [ABSENT_ANSWER], "absent", ["4721"]) == 0.0


# ---- settings and a run on tiny random models -----------------------------------------------


def test_broad_presets_and_validation():
    full = BenchSettings.preset("full", suite="broad")
    assert full.split == "dev" and full.per_cell == 10 and full.kinds == QUESTION_KINDS
    assert full.methods == ("lc", "rag", "rapid") and not full.speed_lengths
    labels = [m.label for m in full.method_list()]
    assert "rapid eta=20" in labels and "rapid eta=20 paper" in labels  # guard on and off
    quick = BenchSettings.preset("quick", suite="broad", split="test")
    assert quick.quick and quick.per_cell == 1 and quick.split == "test"
    with pytest.raises(RapidConfigError, match="preset"):
        BenchSettings.preset("long", suite="broad")
    with pytest.raises(RapidConfigError, match="kinds"):
        BenchSettings(kinds=("hop",))  # a broad question kind, not a standard task kind
    for field, value in (("split", "train"), ("suite", "huge"), ("texts", ("poems",))):
        with pytest.raises(RapidConfigError, match=field):
            BenchSettings.preset("full", **{"suite": "broad", field: value})


def _run(tmp_path, capsys, flags: str) -> dict:
    out = tmp_path / "broad"
    argv = ["bench", "--suite", "broad", "--tiny-models", "--lengths", "512", *flags.split()]
    assert main([*argv, "--max-new-tokens", "4", "--json", "--no-progress", "--out", str(out)]) == 0
    capsys.readouterr()
    return json.loads((out / "results.json").read_text())


def test_broad_quick_run_keeps_every_answer_with_its_kinds_and_split(tmp_path, capsys):
    results = _run(tmp_path, capsys, "--quick --methods lc,rapid --etas 5")
    records = results["records"]
    assert len(records) == len(TEXT_KINDS) * len(QUESTION_KINDS) * 2
    assert all(r["suite"] == "broad" and r["split"] == "dev" for r in records)
    assert {(r["text_kind"], r["task"]) for r in records} == {
        (t, k) for t in TEXT_KINDS for k in QUESTION_KINDS
    }
    assert {r["task_seed"] for r in records} == {0}
    # Every score can be recomputed from the record alone.
    for r in records:
        assert r["accuracy"] == score(r["answer"], r["references"], r["rule"], r["wrong"])
    # The cells table is the mean of the records it covers.
    cells = results["accuracy_cells"]
    story_lc = [r["accuracy"] for r in records if r["label"] == "lc" and r["text_kind"] == "story"]
    total = next(
        c for c in cells if c["label"] == "lc" and c["text_kind"] == "story" and c["task"] == "all"
    )
    assert total["n"] == len(QUESTION_KINDS) and total["accuracy"] == pytest.approx(
        sum(story_lc) / len(story_lc)
    )
    # The methods after the first reuse the task's prompt KV.
    assert all(r["cached_prefix_tokens"] > 0 for r in records if r["method"] == "rapid")
    report = (tmp_path / "broad" / "results.md").read_text()
    assert "Preset: broad suite quick, dev half, 1 task(s) per text and question kind" in report
    header = (
        "| method | tasks | accuracy | single | two | hop | absent | chat | count | text docs |"
    )
    assert "## Broad suite, dev half: accuracy by kind (greedy)" in report and header in report
    assert "| lc | 18 |" in report and "## Speed-only runs" not in report


def test_broad_test_half_runs_odd_seeds_and_scores_by_each_tasks_rule(
    tmp_path, capsys, monkeypatch
):
    """The test half's tasks have odd seeds; an answer that declines is right on an `absent`
    task and wrong on a `count` one (the model's own answers replaced after the call)."""
    from rapid_integrations.bench import runner

    measure = runner.measure_engine

    def declining(*args, **kwargs):
        return dataclasses.replace(measure(*args, **kwargs), answer="I have no information.")

    monkeypatch.setattr(runner, "measure_engine", declining)
    flags = "--split test --tasks 2 --texts story --kinds absent,count --methods lc"
    records = _run(tmp_path, capsys, flags)["records"]
    assert [r["task_id"] for r in records] == [
        "story-absent-512-s1",
        "story-count-512-s1",
        "story-absent-512-s3",
        "story-count-512-s3",
    ]
    assert {r["split"] for r in records} == {"test"}
    assert [(r["rule"], r["accuracy"]) for r in records] == [
        ("absent", 1.0),
        ("count", 0.0),
    ] * 2


@pytest.mark.parametrize("flags", [["--split", "test"], ["--texts", "story"]])
def test_broad_only_flags_are_refused_without_the_broad_suite(flags, capsys):
    assert main(["bench", "--tiny-models", "--quick", *flags]) == 2  # not a standard run
    assert f"{flags[0]} need --suite broad" in capsys.readouterr().err


def test_off_topic_passages_hold_no_answer_of_any_task(dev):
    """The `off-topic` variant's C^S (bench/off_topic.py) holds none of a task's answers."""
    from rapid_integrations.bench.off_topic import OffTopicRetriever

    passages = " ".join(OffTopicRetriever().retrieve("any question"))
    assert passages.strip()
    for task in dev:
        assert not any(ref in passages for ref in task.references), task.task_id


def test_off_topic_variant_drafts_from_its_own_passages(tmp_path, capsys):
    """The `off-topic` rows read the off-topic C^S, not the task's retrieved passages (2K: past
    the 512-token floor of C^S, under which the whole document passes through): none of
    the planted facts (recall 0) and a draft context of another size than the plain row's."""
    flags = "--tasks 1 --lengths 2048 --texts story --kinds single,two --methods rapid --etas 5"
    records = _run(tmp_path, capsys, f"{flags} --variants off-topic --variant-etas 5")["records"]
    plain = {r["task_id"]: r for r in records if r["label"] == "rapid eta=5"}
    off = {r["task_id"]: r for r in records if r["label"] == "rapid eta=5 off-topic"}
    assert plain.keys() == off.keys() and len(off) == 2
    for task_id, r in off.items():
        assert plain[task_id]["needle_recall"] == 1.0 and r["needle_recall"] == 0.0
        assert r["draft_context_tokens"] != plain[task_id]["draft_context_tokens"]
