"""The benchmark: answer scoring, deterministic tasks, settings, measurement, and a smoke run."""

from __future__ import annotations

import json

import pytest
import torch

from rapid_integrations import RapidConfig, RapidConfigError
from rapid_integrations.bench.dataset import TASK_KINDS, build_tasks
from rapid_integrations.bench.figures import speed_figures
from rapid_integrations.bench.methods import DEFAULT_METHODS, METHODS, Method
from rapid_integrations.bench.models import load_rope_scaled, tiny_pair
from rapid_integrations.bench.plots import PLOTS
from rapid_integrations.bench.probe import ForwardProbe, peak_memory_bytes, reset_peak_memory
from rapid_integrations.bench.runner import BenchSettings, long_methods
from rapid_integrations.bench.scoring import exact_match, normalize_words, token_f1
from rapid_integrations.bench.short import short_tasks
from rapid_integrations.bench.summary import find_row, summarize
from rapid_integrations.bench.tables import length_name, markdown
from rapid_integrations.cli import main
from rapid_integrations.tokens import encode_prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

REQUIRED_FIELDS = {
    "method",
    "eta",
    "task",
    "context_tokens",
    "accuracy",
    "prefill_seconds",
    "decode_tokens_per_second",
    "acceptance_rate",
    "time_to_first_token",
    "suite",
    "context_label",
    "turn",
    "f1",
    "peak_memory_bytes",
    "outside_forward_fraction",
    "verify_step_seconds",
    "main_step_seconds",
    "cached_prefix_tokens",
    "call_seconds",
    "reused_prefill_seconds",
    "end_to_end_seconds",
}


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from rapid_integrations.models.loading import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


# ---- scoring --------------------------------------------------------------------------------


def test_normalize_drops_case_punctuation_and_articles():
    assert normalize_words("The Code is 4721.") == ["code", "is", "4721"]


@pytest.mark.parametrize(
    ("prediction", "references", "expected"),
    [
        ("The access code is 4721.", ["4721"], 1.0),
        ("It is in LISBON; code 4721", ["Lisbon", "4721"], 1.0),
        ("It is in Lisbon.", ["Lisbon", "4721"], 0.0),  # every reference is required
        ("code 47210", ["4721"], 0.0),  # whole words only
        ("in new york city", ["New York"], 1.0),  # multi-word references as a run
        ("york new", ["New York"], 0.0),
        ("anything", [], 0.0),
    ],
)
def test_exact_match(prediction, references, expected):
    assert exact_match(prediction, references) == expected


def test_token_f1():
    assert token_f1("4721", ["4721"]) == 1.0
    assert token_f1("nothing here", ["4721"]) == 0.0
    assert token_f1("code is 4721", ["4721"]) == pytest.approx(0.5)  # precision 1/3, recall 1
    assert token_f1("Lisbon", ["Lisbon", "4721"]) == pytest.approx(2 / 3)


# ---- tasks ----------------------------------------------------------------------------------


def test_tasks_are_deterministic_and_seeded(smol_tokenizer):
    first = build_tasks(smol_tokenizer, lengths=(1024,), per_cell=2, seed=3)
    again = build_tasks(smol_tokenizer, lengths=(1024,), per_cell=2, seed=3)
    other = build_tasks(smol_tokenizer, lengths=(1024,), per_cell=2, seed=4)
    assert first == again
    assert [t.messages for t in first] != [t.messages for t in other]
    assert [t.task_id for t in first] == [
        f"{kind}-1024-{i}" for kind in TASK_KINDS for i in range(2)
    ]
    # A task does not depend on which other tasks are built.
    alone = build_tasks(smol_tokenizer, kinds=("chat",), lengths=(1024,), per_cell=1, seed=3)
    assert alone[0] == first[4]


@pytest.mark.parametrize("length", [1024, 8192])
def test_tasks_fit_their_length_and_plant_their_facts(smol_tokenizer, length):
    for task in build_tasks(smol_tokenizer, lengths=(length,), seed=0):
        tokens = len(encode_prompt(task.messages, smol_tokenizer, len(smol_tokenizer)))
        assert 0.7 * length < tokens <= length - 48  # room for a 48-token answer
        text = "\n".join(m["content"] for m in task.messages)
        assert all(fact in text for fact in task.facts)
        assert all(any(ref in fact for fact in task.facts) for ref in task.references)


def test_task_kinds_shape(smol_tokenizer):
    single, two, chat = build_tasks(smol_tokenizer, lengths=(2048,), seed=1)
    assert len(single.references) == 1 and single.followup is None
    assert len(two.references) == 2 and len(two.facts) == 2
    document = two.messages[-1]["content"]
    place, code = (document.index(f) for f in two.facts)
    assert place < len(document) / 2 < code  # the two facts sit in different halves
    follow = two.followup
    assert follow is not None and follow.references == (two.references[1],)
    shared = follow.messages[-1]["content"].rsplit("Question:", 1)[0]
    assert document.startswith(shared)  # same document, new question
    turns = [m["role"] for m in chat.messages]
    assert turns[0] == "system" and turns[-1] == "user" and len(turns) > 10
    stated = next(i for i, m in enumerate(chat.messages) if chat.facts[0] in m["content"])
    assert stated < len(turns) - 4  # said many turns before the question


def test_unknown_task_kind_is_a_config_error(smol_tokenizer):
    with pytest.raises(RapidConfigError, match="kinds"):
        build_tasks(smol_tokenizer, kinds=("single", "poem"))


# ---- settings and methods -------------------------------------------------------------------


def test_settings_presets_and_validation():
    quick = BenchSettings.preset(True, per_cell=None, seed=7)
    assert quick.quick and quick.per_cell == 1 and quick.seed == 7
    labels = [m.label for m in quick.method_list()]
    assert labels[:3] == ["lc", "rag", "sd"] and labels[-2:] == ["hf", "hf-pld"]
    assert sum(m.name == "rapid" for m in quick.method_list()) == len(quick.etas)
    # magicdec (a self-draft of the full target) is opt-in, but --long runs it; llama.cpp
    # (an optional extra) runs only when named.
    opt_in = ("magicdec", "llama.cpp", "llama.cpp-lookup")
    assert (
        BenchSettings().methods == DEFAULT_METHODS == tuple(m for m in METHODS if m not in opt_in)
    )
    assert "magicdec" in [m.name for m in long_methods(BenchSettings.preset("long"))]
    bad = [
        ("methods", ("lc", "nope")),
        ("lengths", (100,)),
        ("etas", (-1.0,)),
        ("variant_etas", (-2.0,)),
        ("draft_precision", "int4"),
    ]
    for field, value in bad:
        with pytest.raises(RapidConfigError, match=field):
            BenchSettings(**{field: value})
    # Rounds repeat the speed-only suites: none runs in the eta sweep or the prefill preset.
    assert BenchSettings.preset("long", rounds=3).rounds == 3
    for preset in ("eta-sweep", "prefill"):
        with pytest.raises(RapidConfigError, match="rounds"):
            BenchSettings.preset(preset, rounds=2)


def test_rapid_variants_join_the_qa_methods_at_their_etas():
    sweep = BenchSettings.preset("eta-sweep")
    paper = [m for m in sweep.method_list() if m.variant == "paper"]
    assert [m.eta for m in paper] == list(sweep.variant_etas) and len(paper) == 3
    assert all(dict(m.options) == {"confidence_guard": False} for m in paper)
    assert paper[0].label == "rapid eta=5 paper"
    settings = BenchSettings(methods=("lc", "rapid"), etas=(5.0,), variants=("no-lookup",))
    labels = ["lc", "rapid eta=5", "rapid eta=5 no-lookup"]
    assert [m.label for m in settings.method_list()] == labels
    with pytest.raises(RapidConfigError, match="variants"):
        BenchSettings(variants=("turbo",))


def test_method_labels():
    assert Method("rapid", 5.0).label == "rapid eta=5"
    assert Method("rapid", 0.5).retrieves and Method("rag").retrieves
    assert not Method("sd").retrieves and Method("hf-pld").label == "hf-pld"


# ---- measurement helpers --------------------------------------------------------------------


def test_forward_probe_tells_roles_and_decode_passes():
    small, large = tiny_pair(vocab_size=300, window=128)
    ids = torch.arange(40)[None]
    with ForwardProbe([large, small]) as probe:
        large.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert [c.tokens for c in probe.calls] == [40, 1, 1, 1]
        assert {c.role for c in probe.calls} == {0}
        timings = probe.decode_timings(probe.calls[1].start)
        assert timings.main_step_seconds is not None and timings.verify_step_seconds is None
        assert timings.forward_seconds == pytest.approx(sum(c.seconds for c in probe.calls[1:]))
    large(ids)  # hooks are gone once the probe is left
    assert len(probe.calls) == 4


def test_tiny_pair_shares_the_small_models_weights():
    small, large = tiny_pair(vocab_size=300, window=128)
    assert small.config.num_hidden_layers < large.config.num_hidden_layers
    assert torch.equal(small.lm_head.weight, large.lm_head.weight)
    assert torch.equal(
        small.model.layers[0].mlp.up_proj.weight, large.model.layers[0].mlp.up_proj.weight
    )


def test_peak_memory_is_positive():
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    assert peak_memory_bytes(cpu) > 0


@pytest.mark.slow
def test_rope_scaled_model_has_the_longer_window():
    from rapid_integrations.models.loading import ensure_default_model

    folder = ensure_default_model()
    model, factor = load_rope_scaled(folder, 16384, torch.device("cpu"), torch.float32)
    assert factor == 2 and model.config.max_position_embeddings == 16384
    assert model.config.rope_parameters["rope_type"] == "linear"


def _summary_record(method, eta, tokens, seconds, drafted=0, accepted=0, **fields):
    """A results record with the fields `summarize` reads (qa suite at 2K unless `fields`)."""
    return {
        "suite": "qa",
        "method": method,
        "label": method,
        "eta": eta,
        "context_label": 2048,
        "turn": 1,
        "task": "single",
        "context_tokens": 2000,
        "draft_context_tokens": 0,
        "accuracy": 1.0,
        "f1": 0.5,
        "needle_recall": None,
        "new_tokens": tokens,
        "decode_tokens_per_second": tokens / seconds,
        "decode_seconds": seconds,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "prefill_seconds": 1.0,
        "time_to_first_token": 1.1,
        "retrieval_seconds": None,
        "forward_seconds": seconds / 2,
        "main_step_seconds": None,
        "verify_step_seconds": None,
        "draft_step_seconds": None,
        "peak_memory_bytes": 10,
        **fields,
    }


def test_summary_pools_rates_and_divides_by_lc():
    record = _summary_record
    records = [
        record("lc", None, 10, 1.0),
        record("lc", None, 30, 1.0),  # pooled: 40 tokens / 2 s = 20 tok/s
        record("rapid", 5.0, 60, 1.0, drafted=80, accepted=60),
    ]
    rows = {(r["method"], r["task"]): r for r in summarize(records)}
    assert rows["lc", "all"]["decode_tokens_per_second"] == pytest.approx(20.0)
    assert rows["rapid", "single"]["speedup_vs_lc"] == pytest.approx(3.0)
    assert rows["rapid", "all"]["acceptance_rate"] == pytest.approx(0.75)
    assert rows["lc", "all"]["outside_forward_fraction"] == pytest.approx(0.5)
    assert length_name(8192) == "8K" and length_name(512) == "512"


def test_end_to_end_ratios_lead_the_tables_and_meet_their_targets():
    """A row's end-to-end time over lc's, prompt lookup's and llama.cpp's at the same length
    and kind: times, so below 1 is sooner. The QA table leads with them (llama.cpp's column
    only where it ran), and rapid's figures hold them against at most 1, 0.8 over lc at 8K."""
    record = _summary_record
    records = [
        record(method, eta, 10, 1.0, drafted=10, accepted=8, context_label=length, **wait)
        for length in (2048, 8192)
        for method, eta, wait in (
            ("lc", None, {"end_to_end_seconds": 10.0}),
            ("hf-pld", None, {"end_to_end_seconds": 8.0}),
            ("rapid", 5.0, {"end_to_end_seconds": 6.0 + length / 8192, "label": "rapid eta=5"}),
        )
    ]
    summary = summarize(records)
    rows = {(r["label"], r["context_label"]): r for r in summary if r["task"] == "all"}
    assert rows["rapid eta=5", 2048]["end_to_end_over_lc"] == pytest.approx(6.25 / 10)
    assert rows["rapid eta=5", 2048]["end_to_end_over_prompt_lookup"] == pytest.approx(6.25 / 8)
    assert rows["rapid eta=5", 8192]["end_to_end_over_lc"] == pytest.approx(0.7)
    assert rows["lc", 2048]["end_to_end_over_prompt_lookup"] == pytest.approx(1.25)
    assert rows["rapid eta=5", 2048]["end_to_end_over_llama_cpp"] is None
    figures = speed_figures(records, summary, {"default_eta": 5.0})
    table = markdown({}, summary, figures, [])
    assert "| context | method | e2e / lc | e2e / prompt lookup | e2e s | accuracy |" in table
    assert "| 2K | rapid eta=5 | 0.62 | 0.78 | 6.2 |" in table
    assert "| end to end of rapid / lc (qa) | 2K | 0.625 | <= 1 | met |" in table
    assert "| end to end of rapid / lc (qa) | 8K | 0.7 | <= 0.8 | met |" in table
    assert "| end to end of rapid / prompt lookup (qa) | 8K | 0.875 | <= 1 | met |" in table
    llama = record("llama.cpp", None, 10, 1.0, end_to_end_seconds=12.5)
    summary = summarize([*records, llama])
    rapid = find_row(summary, label="rapid eta=5", context_label=2048, task="all")
    assert rapid["end_to_end_over_llama_cpp"] == pytest.approx(0.5)
    table = markdown({}, summary, [], [])
    assert "| e2e / lc | e2e / prompt lookup | e2e / llama.cpp | e2e s |" in table


def test_rate_figures_pool_rounds_and_give_the_spread_of_their_ratios():
    """Over rounds, the best fixed gamma is the fixed row with the best pooled rate (here
    gamma 16, though gamma 8 wins round 2), and a figure's spread is the lowest and highest
    ratio of the two rows' rates within one round."""
    rates = {  # tok/s in rounds 1 and 2; 12 tokens each
        "lc": (10.0, 10.0),
        "rapid eta=5": (12.5, 12.5),
        "rapid eta=5 gamma=4": (14.0, 9.0),
        "rapid eta=5 gamma=16": (16.0, 11.0),
        "rapid eta=5 adaptive": (13.0, 12.0),
    }
    records = [
        _summary_record(
            "lc" if label == "lc" else "rapid",
            None if label == "lc" else 5.0,
            12,
            12 / rate,
            drafted=0 if label == "lc" else 10,
            accepted=0 if label == "lc" else 8,
            suite="long",
            label=label,
            round=n,
        )
        for label, pair in rates.items()
        for n, rate in enumerate(pair, 1)
    ]
    summary = summarize(records)
    rows = {r["label"]: r for r in summary if r["task"] == "all"}
    assert rows["rapid eta=5 gamma=4"]["round_rates"] == pytest.approx([14.0, 9.0])
    pooled = {label: 24 / (12 / a + 12 / b) for label, (a, b) in rates.items()}
    figures = {f["figure"]: f for f in speed_figures(records, summary, {"default_eta": 5.0})}
    best = figures["adaptive drafting / best fixed gamma"]
    assert best["value"] == pytest.approx(
        pooled["rapid eta=5 adaptive"] / pooled["rapid eta=5 gamma=16"]
    )
    assert best["spread"] == pytest.approx([13 / 16, 12 / 11]) and best["met"] is False
    versus_lc = figures["adaptive drafting / lc"]
    assert versus_lc["spread"] == pytest.approx([1.2, 1.3]) and versus_lc["met"] is True
    assert figures["decode speedup of rapid over lc (long)"]["spread"] == pytest.approx(
        [1.25, 1.25]
    )
    table = markdown({}, summary, list(figures.values()), [])
    assert (
        "| adaptive drafting / best fixed gamma | 2K | 0.957 (0.812-1.09) | >= 1 | not met |"
        in table
    )


def test_schedule_figures_say_when_the_rows_wrote_other_texts():
    """A schedule figure compares two rows' texts as well as their schedules where the rows
    decoded different texts (bf16 rounding, or the draft's q at eta > 0, forks them): the
    figure says so. Adaptive wrote gamma 16's text in round 1 only, the next call in both
    rounds, and the no-lookup row another text."""
    answers = {  # text in rounds 1 and 2
        "rapid eta=5": ("a", "a"),
        "rapid eta=5 gamma=16": ("b", "b"),
        "rapid eta=5 adaptive": ("b", "c"),
        "rapid eta=5 adaptive-again": ("b", "b"),
        "rapid eta=5 no-lookup": ("d", "d"),
    }
    records = [
        _summary_record("lc", None, 12, 1.0, suite="long", label="lc", round=n, answer="a")
        for n in (1, 2)
    ]
    rates = {"rapid eta=5 gamma=16": 16.0, "rapid eta=5 adaptive-again": 17.0}
    records += [
        _summary_record(
            "rapid",
            5.0,
            12,
            12 / rates.get(label, 12.0),
            drafted=10,
            accepted=8,
            suite="long",
            label=label,
            round=n,
            answer=text,
        )
        for label, texts in answers.items()
        for n, text in enumerate(texts, 1)
    ]
    summary = summarize(records)
    figures = {f["figure"]: f for f in speed_figures(records, summary, {"default_eta": 5.0})}
    assert figures["adaptive drafting / best fixed gamma"]["same_text"] is False
    assert figures["adaptive, next call / best fixed gamma"]["same_text"] is True
    assert figures["rapid / rapid without the lookup"]["same_text"] is False
    assert "same_text" not in figures["adaptive drafting / lc"]
    table = markdown({}, summary, list(figures.values()), [])
    differ = "| 0.75 (0.75-0.75) | >= 1 | not met, texts differ |"
    assert f"| adaptive drafting / best fixed gamma | 2K {differ}" in table
    assert (
        "| adaptive, next call / best fixed gamma | 2K | 1.06 (1.06-1.06) | >= 1 | met |" in table
    )


def test_long_preset_at_two_etas_gives_each_its_rows_and_figures():
    """`--long --etas 0,5`: every rapid row at each eta (eta 0: every schedule writes the
    target's greedy text), and each eta's figures; those at eta 0, not the default, are named
    with it."""
    labels = [m.label for m in long_methods(BenchSettings.preset("long", etas=(0.0, 5.0)))]
    for eta in ("0", "5"):
        assert f"rapid eta={eta} gamma=16" in labels and f"rapid eta={eta} adaptive" in labels
    assert labels.count("lc") == 1 and labels[0] == "lc"
    records = [
        _summary_record(*method, 12, 1.0, drafted=10, accepted=8, suite="long", label=label)
        for label, method in (
            ("lc", ("lc", None)),
            ("rapid eta=0", ("rapid", 0.0)),
            ("rapid eta=0 adaptive", ("rapid", 0.0)),
            ("rapid eta=5", ("rapid", 5.0)),
        )
    ]
    figures = {f["figure"] for f in speed_figures(records, summarize(records), {"default_eta": 5})}
    assert {
        "adaptive drafting / best fixed gamma at eta=0",
        "decode speedup of rapid over lc (long) at eta=0",
        "decode speedup of rapid over lc (long)",
    } <= figures
    assert "adaptive drafting / best fixed gamma" not in figures


# ---- a whole run on tiny random models ------------------------------------------------------


def test_bench_smoke_run_writes_results_table_and_plots(tmp_path, capsys):
    out = tmp_path / "bench"
    flags = "--tiny-models --lengths 512 --speed-lengths 512 --tasks 1 --etas 0,5"
    flags += " --max-new-tokens 6 --speed-tokens 6 --json --no-progress"
    argv = ["bench", *flags.split(), "--rope-lengths", "", "--out", str(out)]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    results = json.loads((out / "results.json").read_text())
    assert printed["out"] == str(out) and printed["summary"] == results["summary"]
    records = results["records"]
    assert set(records[0]) >= REQUIRED_FIELDS
    qa = [r for r in records if r["suite"] == "qa" and r["turn"] == 1]
    assert len(qa) == len(TASK_KINDS) * (len(DEFAULT_METHODS) + 1)  # rapid at two etas
    assert {r["method"] for r in qa} == set(DEFAULT_METHODS)
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in qa)
    followup = [r for r in records if r["turn"] == 2]
    assert len(followup) == 1 and followup[0]["method"] == "rapid"
    assert followup[0]["cached_prefix_tokens"] > 0  # the document's KV was reused
    suites = {r["suite"] for r in records}
    assert suites == {"qa", "short", "speed", "tiny-downward", "tiny-upward"}
    # Every call here paid its own prefill (the follow-up's warm cache is the point of it):
    # the wait for the whole answer is the call's, plus C^S built before it.
    for r in records:
        assert r["reused_prefill_seconds"] == 0.0
        before = r["retrieval_seconds"] or 0.0
        assert r["end_to_end_seconds"] == pytest.approx(r["call_seconds"] + before)
        assert r["time_to_first_token"] <= r["end_to_end_seconds"]
    short = [r for r in records if r["suite"] == "short"]
    assert len(short) == len(short_tasks()) * (len(DEFAULT_METHODS) + 1)
    assert all(r["same_text_as_lc"] is not None and 0 <= r["accuracy"] <= 1 for r in short)
    speed = [r for r in records if r["suite"] not in ("qa", "short")]
    assert all(r["accuracy"] is None and r["new_tokens"] == 6 for r in speed)
    rapid = [r for r in speed if r["method"] == "rapid"]
    assert all(r["acceptance_rate"] is not None and r["verify_step_seconds"] for r in rapid)
    figures = {f["figure"] for f in results["speed_figures"]}
    assert "verify step / target decode step" in figures
    assert "accuracy: rapid minus the better of lc and rag (two)" in figures
    table = (out / "results.md").read_text()
    assert "| context | method | e2e / lc | e2e / prompt lookup | e2e s | accuracy |" in table
    assert "rapid eta=5" in table and "## Short prompts, nothing to retrieve" in table
    assert results["draft_precision"] == "none" and "draft copy none, target copy none;" in table
    for name in PLOTS:
        assert (out / name).read_bytes().startswith(b"\x89PNG")


# ---- bench presets on tiny random models ----------------------------------------------------

LONG_FIELDS = {
    "method",
    "context_tokens",
    "decode_tokens_per_second",
    "acceptance_rate",
    "model_draft_speedup",
}


def _bench(tmp_path, capsys, flags: str) -> dict:
    out = tmp_path / "bench"
    assert main(["bench", *flags.split(), "--json", "--no-progress", "--out", str(out)]) == 0
    capsys.readouterr()
    return json.loads((out / "results.json").read_text())


def test_long_preset_records_carry_the_model_draft_speedup(tmp_path, capsys):
    results = _bench(
        tmp_path, capsys, "--long --tiny-models --lengths 512 --speed-tokens 8 --gammas 2"
    )
    records = results["records"]
    assert all(set(r) >= LONG_FIELDS and r["suite"] == "long" for r in records)
    labels = [r["label"] for r in records]
    assert labels[0] == "lc" and "hf-pld" in labels and "sd" in labels
    # magicdec: the target drafts on its prompt's 16 sinks + 512 recent tokens, at eta 0.
    (magic,) = [r for r in records if r["method"] == "magicdec"]
    assert magic["eta"] == 0.0 and magic["draft_model"] == magic["target_model"]
    assert magic["draft_context_tokens"] == min(528, magic["context_tokens"])
    assert magic["engine_stats"]["mode"] == "rapid" and magic["drafted_tokens"] > 0
    # Every method decodes the same number of tokens, transformers too: none stops at an eos.
    assert {r["new_tokens"] for r in records} == {8}
    assert {
        "rapid eta=5",
        "rapid eta=5 gamma=2",
        "rapid eta=5 adaptive",
        "rapid eta=5 adaptive-again",
        "rapid eta=5 no-lookup",
    } <= set(labels)
    # adaptive-again is the engine's next call at the length: it starts from adaptive's schedule.
    by_label = {r["label"]: r for r in records}
    assert not by_label["rapid eta=5 adaptive"]["engine_stats"]["schedule_from_earlier_call"]
    assert by_label["rapid eta=5 adaptive-again"]["engine_stats"]["schedule_from_earlier_call"]
    # A model-draft speedup is computed for every row that drafted (a call may stop before it does).
    drafted = [r for r in records if r["acceptance_rate"] is not None]
    assert {"sd", "rapid eta=5", "rapid eta=5 gamma=2"} <= {r["label"] for r in drafted}
    assert all(
        r["model_draft_speedup"] >= 1.0 and r["step_costs"]["target_step"] > 0 for r in drafted
    )
    assert all(r["model_draft_speedup"] is None for r in records if r["method"] in ("lc", "hf-pld"))
    # After lc, the methods reuse the prompt's KV instead of prefilling it again.
    assert all(r["cached_prefix_tokens"] > 0 for r in records if r["method"] in ("sd", "rapid"))
    # Each is charged lc's prefill, pro rata of the tokens it found cached, so that its wait
    # for the whole answer compares with lc's and prompt lookup's, which prefill their own.
    lc = by_label["lc"]
    for r in records:
        share = min(1.0, r["cached_prefix_tokens"] / lc["context_tokens"])
        assert r["reused_prefill_seconds"] == pytest.approx(lc["prefill_seconds"] * share)
        before = r["reused_prefill_seconds"] + (r["retrieval_seconds"] or 0.0)
        assert r["end_to_end_seconds"] == pytest.approx(r["call_seconds"] + before)
    assert by_label["rapid eta=5"]["reused_prefill_seconds"] > 0.5 * lc["prefill_seconds"]
    assert by_label["hf-pld"]["reused_prefill_seconds"] == 0.0
    # Every record gets both bounds (docs/algorithm.md section 2.12), K from the widest method
    # (the adaptive rows: gamma_max 32 + 10 copies + 1), and its achieved speedup over each.
    assert results["read_bytes_per_second"] > 0
    assert all(r["speculation_bound"] >= 1.0 and r["bandwidth_bound"] > 0 for r in records)
    assert {r["widest_pass"] for r in records} == {43}
    assert all(r["achieved_over_speculation_bound"] > 0 for r in records)
    assert "achieved / speculation bound" in (tmp_path / "bench" / "results.md").read_text()
    figures = {f["figure"] for f in results["speed_figures"]}
    assert {
        "rapid speedup / model draft (long)",
        "adaptive drafting / best fixed gamma",
        "adaptive, next call / lc",
    } <= figures


def test_long_preset_rounds_repeat_every_method_as_a_fresh_engine_would(tmp_path, capsys):
    """`--rounds 3` runs every method three times, round after round. Each round starts as a
    fresh engine would: lc prefills cold, the first adaptive call measures afresh (without
    the reset, the third round's would start from the second's schedule, which bought 2
    calls) and the next starts from its schedule. Summary rows give each round's rate, and
    the figures the spread of their ratios."""
    flags = "--long --tiny-models --lengths 512 --speed-tokens 8 --gammas 2 --rounds 3"
    records = (results := _bench(tmp_path, capsys, flags))["records"]
    third = len(records) // 3
    assert [r["round"] for r in records] == [1] * third + [2] * third + [3] * third
    labels = [r["label"] for r in records]
    assert labels[:third] == labels[third : 2 * third] == labels[2 * third :]
    for n in (1, 2, 3):
        by_label = {r["label"]: r for r in records if r["round"] == n}
        assert by_label["lc"]["cached_prefix_tokens"] == 0
        assert by_label["rapid eta=5"]["cached_prefix_tokens"] > 0
        assert not by_label["rapid eta=5 adaptive"]["engine_stats"]["schedule_from_earlier_call"]
        assert by_label["rapid eta=5 adaptive-again"]["engine_stats"]["schedule_from_earlier_call"]
    rows = {r["label"]: r for r in results["summary"] if r["task"] == "all"}
    for label, row in rows.items():
        rates = [r["decode_tokens_per_second"] for r in records if r["label"] == label]
        assert row["n"] == 3 and row["round_rates"] == pytest.approx(rates)
    again, lc = rows["rapid eta=5 adaptive-again"]["round_rates"], rows["lc"]["round_rates"]
    figure = next(f for f in results["speed_figures"] if f["figure"] == "adaptive, next call / lc")
    ratios = [a / b for a, b in zip(again, lc, strict=True)]
    assert figure["spread"] == pytest.approx([min(ratios), max(ratios)])


def test_long_preset_runs_the_methods_named():
    """A 64K run may skip the slow methods: `--long --methods lc,rapid` keeps lc first (it
    prefills for the others) and every rapid variant, and drops sd and prompt lookup."""
    every = [m.label for m in long_methods(BenchSettings.preset("long"))]
    assert every[0] == "lc" and {"sd", "hf-pld"} <= set(every)
    some = long_methods(BenchSettings.preset("long", methods=("rapid", "lc")))
    assert [m.label for m in some] == [x for x in every if x == "lc" or x.startswith("rapid")]


def test_eta_sweep_reports_accuracy_with_its_spread(tmp_path, capsys):
    flags = "--eta-sweep --tiny-models --lengths 512 --tasks 2 --etas 0,5 --max-new-tokens 4"
    results = _bench(tmp_path, capsys, flags)
    records = results["records"]
    assert {r["method"] for r in records} == {"lc", "rag", "rapid"}
    assert all(r["suite"] == "qa" and r["turn"] == 1 for r in records)
    rows = [r for r in results["summary"] if r["task"] == "all"]
    assert all(r["n"] == 2 * len(TASK_KINDS) and r["accuracy_stderr"] is not None for r in rows)


def test_prefill_preset_tries_chunk_sizes_then_keeps_the_best(tmp_path, capsys):
    flags = "--prefill --tiny-models --lengths 512,1024 --chunk-sizes 64,128"
    rows = _bench(tmp_path, capsys, flags)["prefill"]
    first = [(r["method"], r["chunk"]) for r in rows if r["context_label"] == 512]
    assert first == [("engine", 64), ("engine", 128), ("transformers", None)]
    second = [r for r in rows if r["context_label"] == 1024]
    default = RapidConfig().prefill_chunk_size
    assert {r["chunk"] for r in second if r["method"] == "engine"} <= {64, 128, default}
    assert all(r["tokens_per_second"] > 0 and r["bound_seconds"] > 0 for r in rows)


@pytest.mark.parametrize("method", ["hf", "hf-pld"])
def test_transformers_speed_runs_ignore_eos_as_the_engine_does(tok, target, method):
    """A speed run decodes its token count whatever comes: here the eos id is the target's
    first greedy token, which would end `generate` at once."""
    from rapid_integrations import RapidEngine
    from rapid_integrations.bench.methods import Method, measure_transformers
    from rapid_integrations.bench.probe import ForwardProbe
    from tests.tiny import reference_greedy

    engine = RapidEngine(target, tokenizer=tok)
    ids = tok.encode("abcabcabc")
    want = reference_greedy(target, ids, 12, len(tok))
    engine.eos_token_ids = frozenset({want[0]})
    with ForwardProbe([target]) as probe:
        run = measure_transformers(engine, Method(method), ids, probe, max_new_tokens=12)
        assert run.new_tokens == 0  # stopped at the eos
        run = measure_transformers(
            engine, Method(method), ids, probe, max_new_tokens=12, ignore_eos=True
        )
    assert run.new_tokens == 12
