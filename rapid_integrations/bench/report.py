"""Turn benchmark records into results.json, a Markdown report and PNG plots.

Everything here reads plain record dicts (the `records` of results.json), so a report can be
rebuilt from a saved run: `write_report(out, meta, json.load(...)["records"])`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from statistics import fmean
from typing import Any

SCHEMA_VERSION = 1
GROUP_KEYS = ("suite", "method", "label", "eta", "context_label", "turn")
TASK_ALL = "all"
GIB = 1024**3
PLOTS = ("speedup.png", "accuracy.png", "eta.png")

Record = dict[str, Any]


def write_report(out: Path, meta: dict[str, Any], records: list[Record], plots: bool) -> None:
    """Write results.json and results.md under `out` (and the plots when `plots`)."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(records)
    figures = speed_figures(records, summary, meta)
    written = write_plots(out, records, summary) if plots else []
    payload = {
        "schema_version": SCHEMA_VERSION,
        **meta,
        "summary": summary,
        "speed_figures": figures,
        "records": records,
    }
    (out / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "results.md").write_text(markdown(meta, summary, figures, written))


# ---- aggregation ----------------------------------------------------------------------------


def summarize(records: list[Record]) -> list[Record]:
    """One row per (suite, method, eta, context length, turn, task kind), plus task "all".

    Rates are pooled (total tokens / total seconds), acceptance is accepted / drafted over the
    group, and speedup_vs_lc divides by the `lc` row of the same suite, length, task and turn 1.
    """
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        for task in (r["task"], TASK_ALL):
            groups.setdefault((*(r[k] for k in GROUP_KEYS), task), []).append(r)
    rows = [
        _aggregate(dict(zip((*GROUP_KEYS, "task"), k, strict=True)), rs) for k, rs in groups.items()
    ]
    lc = {_lc_key(r): r for r in rows if r["method"] == "lc" and r["turn"] == 1}
    for row in rows:
        base = lc.get(_lc_key(row))
        rate, base_rate = row["decode_tokens_per_second"], base and base["decode_tokens_per_second"]
        row["speedup_vs_lc"] = rate / base_rate if rate and base_rate else None
    return rows


def _lc_key(row: Record) -> tuple:
    return row["suite"], row["context_label"], row["task"]


def _aggregate(key: Record, rs: list[Record]) -> Record:
    def mean(name: str) -> float | None:
        return _mean(r[name] for r in rs)

    drafted = sum(r["drafted_tokens"] for r in rs)
    return {
        **key,
        "n": len(rs),
        "context_tokens": mean("context_tokens"),
        "draft_context_tokens": mean("draft_context_tokens"),
        "accuracy": mean("accuracy"),
        "f1": mean("f1"),
        "needle_recall": mean("needle_recall"),
        "new_tokens": mean("new_tokens"),
        "decode_tokens_per_second": _pooled_rate(rs),
        "acceptance_rate": sum(r["accepted_tokens"] for r in rs) / drafted if drafted else None,
        "prefill_seconds": mean("prefill_seconds"),
        "time_to_first_token": mean("time_to_first_token"),
        "retrieval_seconds": mean("retrieval_seconds"),
        "outside_forward_fraction": _pooled_outside(rs),
        "main_step_seconds": mean("main_step_seconds"),
        "verify_step_seconds": mean("verify_step_seconds"),
        "draft_step_seconds": mean("draft_step_seconds"),
        "peak_memory_bytes": max((r["peak_memory_bytes"] or 0 for r in rs), default=None),
    }


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return fmean(present) if present else None


def _pooled_rate(rs: list[Record]) -> float | None:
    """Decoded tokens over decode seconds of the whole group (each record's own token count)."""
    timed = [r for r in rs if r["decode_tokens_per_second"] and r["decode_seconds"]]
    seconds = sum(r["decode_seconds"] for r in timed)
    tokens = sum(r["decode_tokens_per_second"] * r["decode_seconds"] for r in timed)
    return tokens / seconds if seconds else None


def _pooled_outside(rs: list[Record]) -> float | None:
    timed = [r for r in rs if r["forward_seconds"] is not None and r["decode_seconds"]]
    seconds = sum(r["decode_seconds"] for r in timed)
    outside = sum(max(0.0, r["decode_seconds"] - r["forward_seconds"]) for r in timed)
    return outside / seconds if seconds else None


def _find(summary: list[Record], **key: Any) -> Record | None:
    return next((r for r in summary if all(r[k] == v for k, v in key.items())), None)


# ---- the speed figures of issue 7 -----------------------------------------------------------


def speed_figures(
    records: list[Record], summary: list[Record], meta: dict[str, Any]
) -> list[Record]:
    """The targets the benchmark is judged by, each with its measured value and whether it is
    met (None when the run did not measure it). See docs/benchmarks.md."""
    qa = [r for r in summary if r["suite"] == "qa" and r["task"] == TASK_ALL and r["turn"] == 1]
    rapid = [r for r in qa if r["method"] == "rapid" and r["eta"] == _default_eta(meta)]
    figures = [*_followup_figures(records), *_acceptance_figures(rapid)]
    for row in rapid:
        lc = _find(qa, method="lc", context_label=row["context_label"])
        figures += _step_figures(row, lc, meta)
    for row in summary:
        if row["suite"] == "rope" and row["method"] == "rapid" and row["task"] == TASK_ALL:
            figures.append(
                _figure(
                    "rapid decode speedup over lc (RoPE-scaled)",
                    row,
                    row["speedup_vs_lc"],
                    ">= 3 at 32K",
                    3.0,
                )
            )
    return figures


def _default_eta(meta: dict[str, Any]) -> float:
    from ..config import RapidConfig

    return meta.get("default_eta", RapidConfig().eta)


def _figure(
    name: str,
    row: Record | None,
    value: float | None,
    target: str,
    bound: float,
    above: bool = True,
) -> Record:
    met = None if value is None else (value >= bound if above else value <= bound)
    return {
        "figure": name,
        "context_label": row["context_label"] if row else None,
        "value": value,
        "target": target,
        "met": met,
    }


def _followup_figures(records: list[Record]) -> list[Record]:
    """Time to first token of the second question on a document against the first question
    (same method) and against transformers generate on the first."""
    figures = []
    seconds = [r for r in records if r["suite"] == "qa" and r["turn"] == 2]
    for name, method in (("first question", "rapid"), ("transformers generate", "hf")):
        ratios = []
        for second in seconds:
            task_id = second["task_id"].removesuffix("-followup")
            first = next(
                (
                    r
                    for r in records
                    if r["task_id"] == task_id
                    and r["method"] == method
                    and r["eta"] == (second["eta"] if method == "rapid" else None)
                ),
                None,
            )
            if first and second["time_to_first_token"]:
                ratios.append(first["time_to_first_token"] / second["time_to_first_token"])
        row = seconds[0] if seconds else None
        figures.append(
            _figure(
                f"time to first token: {name} / second question", row, _mean(ratios), ">= 10", 10.0
            )
        )
    return figures


def _acceptance_figures(rapid: list[Record]) -> list[Record]:
    return [
        _figure("rapid acceptance rate", row, row["acceptance_rate"], ">= 0.85", 0.85)
        for row in rapid
    ]


def _step_figures(row: Record, lc: Record | None, meta: dict[str, Any]) -> list[Record]:
    """Decode speedup, verify cost, time outside forwards, and peak memory of rapid at one
    context length."""
    verify, step = row["verify_step_seconds"], lc and lc["main_step_seconds"]
    memory = meta.get("memory_model") or {}
    budget = None
    if memory and row["context_tokens"]:
        kv_tokens = (
            row["context_tokens"] + (row["draft_context_tokens"] or 0) + (row["new_tokens"] or 0)
        )
        budget = memory["weights_bytes"] + 2 * memory["kv_bytes_per_token"] * kv_tokens + GIB
    peak = row["peak_memory_bytes"]
    return [
        _figure(
            "rapid decode speedup over lc",
            row,
            row["speedup_vs_lc"],
            ">= 1.5 (issue 6), >= 2 (issue 7) at 8K",
            1.5,
        ),
        _figure(
            "verify step / target decode step",
            row,
            verify / step if verify and step else None,
            "<= 1.5",
            1.5,
            above=False,
        ),
        _figure(
            "share of decode time outside forward passes",
            row,
            row["outside_forward_fraction"],
            "<= 0.10",
            0.10,
            above=False,
        ),
        _figure(
            "peak memory / (weights + 2 KV + 1 GiB)",
            row,
            peak / budget if peak and budget else None,
            "<= 1",
            1.0,
            above=False,
        ),
    ]


# ---- Markdown -------------------------------------------------------------------------------


def markdown(
    meta: dict[str, Any], summary: list[Record], figures: list[Record], plots: Sequence[str]
) -> str:
    """The report: machine, quality and speed table, speed-only table, speed figures, plots."""
    parts = ["# RAPID benchmark results", "", _machine_line(meta), ""]
    parts += ["## Quality and speed, side by side (greedy)", "", _qa_table(summary), ""]
    speed = _speed_table(summary)
    if speed:
        parts += ["## Speed-only runs (end-of-sequence ignored)", "", speed, ""]
    parts += ["## Speed figures and targets", "", _figures_table(figures), ""]
    parts += [f"![{p}]({p})" for p in plots] or ["(plots not written)"]
    return "\n".join(parts) + "\n"


def _machine_line(meta: dict[str, Any]) -> str:
    m, s = meta.get("machine", {}), meta.get("settings", {})
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ""
    wall = meta.get("wall_seconds")
    return (
        f"Machine: {m.get('cpu')} ({m.get('cpu_count')} CPUs, torch threads {m.get('torch_threads')})"
        f"{gpu}, device {m.get('device')}, dtype {meta.get('dtype')}; torch {m.get('torch')}, "
        f"transformers {m.get('transformers')}, Python {m.get('python')}. "
        f"Load average at start {m.get('load_average_start')}, at end {m.get('load_average_end')}. "
        f"Preset: {'quick' if s.get('quick') else 'full'}, {s.get('per_cell')} task(s) per kind "
        f"and length, seed {s.get('seed')}" + (f"; wall time {wall / 60:.1f} min." if wall else ".")
    )


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


def _qa_table(summary: list[Record]) -> str:
    qa = [r for r in summary if r["suite"] == "qa" and r["turn"] == 1]
    kinds = sorted({r["task"] for r in qa} - {TASK_ALL}, key=("single", "two", "chat").index)
    rows = []
    for row in (r for r in qa if r["task"] == TASK_ALL):
        by_kind = [_find(qa, **{k: row[k] for k in GROUP_KEYS}, task=kind) for kind in kinds]
        rows.append(
            [
                length_name(row["context_label"]),
                row["label"],
                _fmt(row["accuracy"]),
                *(_fmt(k and k["accuracy"]) for k in by_kind),
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
        "accuracy",
        *kinds,
        "F1",
        "C^S recall",
        "decode tok/s",
        "speedup vs lc",
        "acceptance",
        "prefill s",
        "TTFT s",
    ]
    return _table(headers, rows)


def _speed_table(summary: list[Record]) -> str:
    rows = [
        [
            r["suite"],
            length_name(r["context_label"]),
            r["label"],
            _fmt(r["context_tokens"], ".0f"),
            _fmt(r["draft_context_tokens"], ".0f"),
            _fmt(r["decode_tokens_per_second"], ".1f"),
            _fmt(r["speedup_vs_lc"]),
            _fmt(r["acceptance_rate"]),
        ]
        for r in summary
        if r["suite"] != "qa" and r["task"] == TASK_ALL
    ]
    headers = [
        "suite",
        "context",
        "method",
        "target tokens",
        "draft tokens",
        "decode tok/s",
        "speedup vs lc",
        "acceptance",
    ]
    return _table(headers, rows) if rows else ""


def _figures_table(figures: list[Record]) -> str:
    marks = {True: "met", False: "not met", None: "not measured"}
    rows = [
        [
            f["figure"],
            _fmt(f["context_label"] and length_name(f["context_label"])),
            _fmt(f["value"], ".3g"),
            f["target"],
            marks[f["met"]],
        ]
        for f in figures
    ]
    return _table(["figure", "context", "value", "target", "status"], rows)


# ---- plots ----------------------------------------------------------------------------------


def write_plots(out: Path, records: list[Record], summary: list[Record]) -> list[str]:
    """Write `PLOTS` under `out`; returns the file names written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    drawers: list[Callable[[Any, list[Record], list[Record]], Any]] = [
        _plot_speedup,
        _plot_accuracy,
        _plot_eta,
    ]
    for name, draw in zip(PLOTS, drawers, strict=True):
        fig = draw(plt, records, summary)
        fig.tight_layout()
        fig.savefig(out / name, dpi=80)
        plt.close(fig)
    return list(PLOTS)


def _length_axis(ax: Any, lengths: Iterable[int]) -> None:
    ticks = sorted(set(lengths))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [length_name(t) for t in ticks])
    ax.set_xlabel("context length (tokens)")


def _plot_speedup(plt: Any, records: list[Record], summary: list[Record]) -> Any:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = (
        (axes[0], ("qa", "rope"), "embedded model (rope: RoPE-scaled)"),
        (axes[1], ("tiny-downward", "tiny-upward"), "tiny random models, speed only"),
    )
    for ax, suites, title in panels:
        rows = [
            r
            for r in summary
            if r["suite"] in suites
            and r["task"] == TASK_ALL
            and r["turn"] == 1
            and r["method"] != "lc"
            and r["speedup_vs_lc"]
        ]
        for suite, label in dict.fromkeys((r["suite"], r["label"]) for r in rows):
            line = sorted(
                (r["context_label"], r["speedup_vs_lc"])
                for r in rows
                if r["suite"] == suite and r["label"] == label
            )
            name = label if suite == "qa" else f"{label} ({suite.removeprefix('tiny-')})"
            ax.plot(
                *zip(*line, strict=True),
                marker="o",
                label=name,
                linestyle="--" if suite == "rope" else "-",
            )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        _length_axis(ax, [r["context_label"] for r in rows] or [1024])
        ax.set_ylabel("decode speedup over lc")
        ax.set_title(title)
        if rows:
            ax.legend(fontsize=7)
    return fig


def _plot_accuracy(plt: Any, records: list[Record], summary: list[Record]) -> Any:
    qa = [r for r in summary if r["suite"] == "qa" and r["turn"] == 1]
    lengths = sorted({r["context_label"] for r in qa}) or [0]
    labels = list(dict.fromkeys(r["label"] for r in qa))
    kinds = [k for k in ("single", "two", "chat", TASK_ALL) if any(r["task"] == k for r in qa)]
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 4), squeeze=False)
    width = 0.8 / max(1, len(kinds))
    for ax, length in zip(axes[0], lengths, strict=True):
        for i, kind in enumerate(kinds):
            values = [
                (_find(qa, label=lab, task=kind, context_label=length) or {}).get("accuracy") or 0.0
                for lab in labels
            ]
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=kind)
        ax.set_xticks(
            [x + 0.4 - width / 2 for x in range(len(labels))],
            labels,
            rotation=45,
            ha="right",
            fontsize=7,
        )
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{length_name(length)} tokens")
        ax.set_ylabel("accuracy (exact match)")
    axes[0][0].legend(fontsize=7)
    return fig


def _plot_eta(plt: Any, records: list[Record], summary: list[Record]) -> Any:
    rows = [
        r
        for r in summary
        if r["suite"] == "qa"
        and r["method"] == "rapid"
        and r["task"] == TASK_ALL
        and r["turn"] == 1
    ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, field, name in (
        (axes[0], "acceptance_rate", "acceptance rate"),
        (axes[1], "accuracy", "accuracy"),
    ):
        for length in sorted({r["context_label"] for r in rows}):
            line = sorted(
                (r["eta"], r[field])
                for r in rows
                if r["context_label"] == length and r[field] is not None
            )
            if line:
                ax.plot(*zip(*line, strict=True), marker="o", label=length_name(length))
        ax.set_xlabel("eta")
        ax.set_ylabel(name)
        ax.set_ylim(0, 1.05)
        if rows:
            ax.legend(title="context", fontsize=7)
    return fig
