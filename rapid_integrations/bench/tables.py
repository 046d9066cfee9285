"""The Markdown report: machine, quality and speed tables, speed figures, plot links."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .bounds import BOUND_NAMES, exceeds
from .dataset import TASK_KINDS
from .short import SHORT_KINDS
from .suite import QUESTION_KINDS
from .summary import END_TO_END_BASES, GROUP_KEYS, QA_SUITES, TASK_ALL, Record, find_row
from .texts import TEXT_KINDS

KIND_ORDER = list(dict.fromkeys((*QUESTION_KINDS, *TASK_KINDS)))  # keeps single, two, chat


def markdown(
    meta: dict[str, Any],
    summary: list[Record],
    figures: list[Record],
    plots: Sequence[str],
    cells: Sequence[Record] = (),
) -> str:
    """The report: machine, quality and speed table, speed-only table, speed figures, plots;
    for the broad suite its accuracy `cells` by kind of text and of question."""
    parts = ["# RAPID benchmark results", "", _machine_line(meta), ""]
    if any(r["suite"] == "qa" for r in summary):
        parts += ["## Quality and speed, side by side (greedy)", "", _qa_table(summary), ""]
    if any(r["suite"] == "short" for r in summary):
        parts += ["## Short prompts, nothing to retrieve (greedy)", "", _short_table(summary), ""]
    for split in dict.fromkeys(c["split"] for c in cells):
        parts += [f"## Broad suite, {split} half: accuracy by kind (greedy)", ""]
        parts += [_cells_table([c for c in cells if c["split"] == split]), ""]
        parts += [f"### By length ({split})", "", _qa_table(summary, "broad"), ""]
    speed = _speed_table(summary)
    if speed:
        parts += ["## Speed-only runs (end-of-sequence ignored)", "", speed, ""]
    if meta.get("prefill"):
        parts += ["## Prefill", "", _prefill_table(meta["prefill"]), ""]
    parts += ["## Speed figures and targets", "", _figures_table(figures), ""]
    parts += [f"![{p}]({p})" for p in plots] or ["(plots not written)"]
    return "\n".join(parts) + "\n"


def _machine_line(meta: dict[str, Any]) -> str:
    m, s = meta.get("machine", {}), meta.get("settings", {})
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ""
    wall = meta.get("wall_seconds")
    return (
        f"Machine: {m.get('cpu')} ({m.get('cpu_count')} CPUs, torch threads {m.get('torch_threads')})"
        f"{gpu}, device {m.get('device')}, dtype {meta.get('dtype')}, draft copy "
        f"{meta.get('draft_precision')}"
        f"{' (compiled decode passes)' if s.get('compile_draft') else ''}, target copy "
        f"{meta.get('target_precision')}; "
        f"torch {m.get('torch')}, "
        f"transformers {m.get('transformers')}, Python {m.get('python')}. "
        f"Load average at start {m.get('load_average_start')}, at end {m.get('load_average_end')}. "
        f"Preset: {_preset_name(s)}, {_tasks_text(s)}, "
        f"seed {s.get('seed')}" + (f"; wall time {wall / 60:.1f} min." if wall else ".")
    )


def _preset_name(settings: dict[str, Any]) -> str:
    names = ("quick", "long", "eta_sweep", "prefill")
    name = next((n.replace("_", "-") for n in names if settings.get(n)), "full")
    if settings.get("suite") == "broad":
        return f"broad suite{' quick' if name == 'quick' else ''}, {settings['split']} half"
    if settings.get("suite") == "short":
        return f"short prompts{' quick' if name == 'quick' else ''}"
    return name


def _tasks_text(settings: dict[str, Any]) -> str:
    """How many tasks the run drew ("1 task(s) per kind and length")."""
    suite = settings.get("suite")
    if suite == "short":
        return "its fixed prompts"
    cell = "text and question kind, lengths in turn" if suite == "broad" else "kind and length"
    return f"{settings.get('per_cell')} task(s) per {cell}"


def _end_to_end_bases(rows: list[Record]) -> list[tuple[str, str]]:
    """(summary field, column header) of the end-to-end ratios a table leads with: to lc and
    to prompt lookup always, to llama.cpp where it ran."""
    ran = {r["method"] for r in rows}
    return [
        (field, f"e2e / {shown}")
        for name, field, shown in END_TO_END_BASES
        if name != "llama.cpp" or name in ran
    ]


def _end_to_end_cells(row: Record, bases: list[tuple[str, str]]) -> list[str]:
    """The row's end-to-end ratios of `bases`, then its end-to-end seconds."""
    return [*(_fmt(row[field]) for field, _ in bases), _fmt(row["end_to_end_seconds"], ".1f")]


def length_name(tokens: int) -> str:
    """2048 -> "2K"; lengths under 1024 tokens stay numbers."""
    return f"{tokens // 1024}K" if tokens >= 1024 else str(tokens)


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "–"
    return format(value, spec) if isinstance(value, float) else str(value)


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _accuracy(row: Record | None) -> str:
    """Mean accuracy, with its standard error over the tasks when there are several."""
    if row is None:
        return _fmt(None)
    spread = row.get("accuracy_stderr")
    return _fmt(row["accuracy"]) + (f" ± {spread:.2f}" if spread is not None else "")


def _qa_table(summary: list[Record], suite: str = "qa") -> str:
    qa = [r for r in summary if r["suite"] == suite and r["turn"] == 1]
    kinds = sorted({r["task"] for r in qa} - {TASK_ALL}, key=KIND_ORDER.index)
    bases = _end_to_end_bases(qa)
    rows = []
    for row in (r for r in qa if r["task"] == TASK_ALL):
        by_kind = [find_row(qa, **{k: row[k] for k in GROUP_KEYS}, task=kind) for kind in kinds]
        rows.append(
            [
                length_name(row["context_label"]),
                row["label"],
                *_end_to_end_cells(row, bases),
                _accuracy(row),
                *(_accuracy(k) for k in by_kind),
                _fmt(row["f1"]),
                _fmt(row["needle_recall"]),
                _fmt(row["decode_tokens_per_second"], ".1f"),
                _fmt(row["speedup_vs_lc"]),
                _fmt(row["acceptance_rate"]),
                _fmt(row["prefill_seconds"], ".1f"),
                _fmt(row["time_to_first_token"], ".1f"),
            ]
        )
    headers = [
        "context",
        "method",
        *(header for _, header in bases),
        "e2e s",
        "accuracy",
        *kinds,
        "F1",
        "C^S recall",
        "decode tok/s",
        "decode speedup vs lc",
        "acceptance",
        "prefill s",
        "TTFT s",
    ]
    return _table(headers, rows)


def _short_table(summary: list[Record]) -> str:
    """The short-prompt set, one row per method over every prompt: end to end against lc and
    prompt lookup, then agreement with lc's text (the share of answers that are lc's, and the
    mean token where the others part from it) by kind of prompt."""
    short = [r for r in summary if r["suite"] == "short" and r["turn"] == 1]
    kinds = [k for k in SHORT_KINDS if any(r["task"] == k for r in short)]
    bases = _end_to_end_bases(short)
    rows = []
    for row in (r for r in short if r["task"] == TASK_ALL):
        by_kind = [find_row(short, **{k: row[k] for k in GROUP_KEYS}, task=kind) for kind in kinds]
        rows.append(
            [
                row["label"],
                *_end_to_end_cells(row, bases),
                _agreement(row),
                *(_agreement(k) for k in by_kind),
                _fmt(row["first_difference_from_lc"], ".1f"),
                _accuracy(row),
                _fmt(row["decode_tokens_per_second"], ".1f"),
                _fmt(row["acceptance_rate"]),
                _fmt(row["time_to_first_token"], ".2f"),
                _fmt(row["context_tokens"], ".0f"),
                _fmt(row["draft_context_tokens"], ".0f"),
            ]
        )
    headers = [
        "method",
        *(header for _, header in bases),
        "e2e s",
        "same text as lc",
        *(f"same text, {kind}" for kind in kinds),
        "first difference (token)",
        "accuracy",
        "decode tok/s",
        "acceptance",
        "TTFT s",
        "target tokens",
        "draft tokens",
    ]
    return _table(headers, rows)


def _agreement(row: Record | None) -> str:
    """How many of a row's answers are lc's text, as "5 of 8"."""
    if row is None or row["same_text_as_lc"] is None:
        return _fmt(None)
    return f"{round(row['same_text_as_lc'] * row['n'])} of {row['n']}"


def _cells_table(cells: list[Record]) -> str:
    """One row per method: accuracy ± standard error over all tasks, by question kind (over
    every text) and by text kind (over every question)."""
    kinds = sorted({c["task"] for c in cells} - {TASK_ALL}, key=KIND_ORDER.index)
    texts = sorted({c["text_kind"] for c in cells} - {TASK_ALL}, key=TEXT_KINDS.index)
    rows = []
    for label in dict.fromkeys(c["label"] for c in cells):
        mine = [c for c in cells if c["label"] == label]
        columns = [(TASK_ALL, TASK_ALL), *((TASK_ALL, k) for k in kinds)]
        columns += [(t, TASK_ALL) for t in texts]
        found = [find_row(mine, text_kind=text, task=kind) for text, kind in columns]
        total = found[0]
        rows.append([label, _fmt(total and total["n"]), *(_accuracy(c) for c in found)])
    return _table(["method", "tasks", "accuracy", *kinds, *(f"text {t}" for t in texts)], rows)


def _speed_table(summary: list[Record]) -> str:
    """One row per suite, length, kind of prompt (`--speed-kinds`) and method; prefill s is
    the call's own (near 0 where `--long` reused lc's prompt KV), so lc, transformers and
    llama.cpp prefills compare side by side; the end-to-end times charge a call that reused
    lc's prompt KV with lc's prefill (docs/benchmarks.md)."""
    speed = [r for r in summary if r["suite"] not in QA_SUITES and r["task"] != TASK_ALL]
    bases = _end_to_end_bases(speed)
    rows = [
        [
            r["suite"],
            length_name(r["context_label"]),
            r["task"],
            r["label"],
            *_end_to_end_cells(r, bases),
            _fmt(r["context_tokens"], ".0f"),
            _fmt(r["draft_context_tokens"], ".0f"),
            _fmt(r["prefill_seconds"], ".1f"),
            _fmt(r["decode_tokens_per_second"], ".1f"),
            _fmt(r["speedup_vs_lc"]),
            _fmt(r["acceptance_rate"]),
            _fmt(r.get("model_draft_speedup")),
            _fmt(r.get("model_draft_ratio")),
            *(_bound_cell(r.get(f"achieved_over_{name}")) for name in BOUND_NAMES),
            _fmt(r["peak_memory_bytes"] and r["peak_memory_bytes"] / 2**30),
        ]
        for r in speed
    ]
    headers = [
        "suite",
        "context",
        "prompt",
        "method",
        *(header for _, header in bases),
        "e2e s",
        "target tokens",
        "draft tokens",
        "prefill s",
        "decode tok/s",
        "decode speedup vs lc",
        "acceptance",
        "model draft",
        "speedup / model draft",
        "achieved / speculation bound",
        "achieved / bandwidth bound",
        "peak GiB",
    ]
    return _table(headers, rows) if rows else ""


def _bound_cell(ratio: float | None) -> str:
    """An achieved / bound ratio, flagged when it passes the bound (docs/algorithm.md 2.12)."""
    return _fmt(ratio, ".2g") + (" **over the bound**" if exceeds(ratio) else "")


def _prefill_table(rows: list[Record]) -> str:
    """results.json `prefill` rows (`rapid bench --prefill`)."""
    body = [
        [
            length_name(r["context_label"]),
            str(r["context_tokens"]),
            r["method"] + (f" chunk {r['chunk']}" if r["chunk"] else ""),
            _fmt(r["seconds"], ".1f"),
            _fmt(r["tokens_per_second"], ".0f"),
            _fmt(r["bound_seconds"], ".1f"),
            _fmt(r["fraction_of_bound"]),
        ]
        for r in rows
    ]
    headers = ["context", "tokens", "prefill", "seconds", "tok/s", "bound s", "bound / measured"]
    return _table(headers, body)


def _figures_table(figures: list[Record]) -> str:
    rows = [
        [
            f["figure"],
            _fmt(f["context_label"] and length_name(f["context_label"])),
            _fmt(f["value"], ".3g") + _spread_text(f.get("spread")),
            _fmt(f["target"]),
            _status(f),
        ]
        for f in figures
    ]
    return _table(["figure", "context", "value", "target", "status"], rows)


def _spread_text(spread: list[float] | None) -> str:
    """The lowest and highest ratio of one round, as " (0.97-1.08)"; "" after one round."""
    return f" ({spread[0]:.3g}-{spread[1]:.3g})" if spread else ""


def _status(figure: Record) -> str:
    if figure["value"] is None:
        return "not measured"
    if figure["met"] is None:
        return "–"
    status = "met" if figure["met"] else "not met"
    return status + (", texts differ" if figure.get("same_text") is False else "")
