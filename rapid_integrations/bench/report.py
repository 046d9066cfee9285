"""Turn benchmark records into results.json, a Markdown report and PNG plots.

Everything here reads plain record dicts (the `records` of results.json), so a report can be
rebuilt from a saved run: `write_report(out, meta, json.load(...)["records"])`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from ..config import RapidConfig

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
        "memory_growth_bytes": max(
            (
                r["peak_memory_bytes"] - r["baseline_memory_bytes"]
                for r in rs
                if r["peak_memory_bytes"] and r.get("baseline_memory_bytes")
            ),
            default=None,
        ),
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


# ---- figures against the issues' targets ---------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """A bound a figure should meet: value >= bound (or <= when not `above`)."""

    bound: float
    above: bool = True

    @property
    def text(self) -> str:
        return f"{'>=' if self.above else '<='} {self.bound:g}"

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value >= self.bound if self.above else value <= self.bound


AT_8K = 8192
SPEEDUP_TARGETS = {"qa": {AT_8K: _Target(1.5)}, "speed": {AT_8K: _Target(2.0), 32768: _Target(3.0)}}
"""Decode speedup of rapid over lc: issue 6 on QA answers at 8K; issue 7 on fixed-length
decoding at 8K and (RoPE-scaled) 32K."""


def speed_figures(
    records: list[Record], summary: list[Record], meta: dict[str, Any]
) -> list[Record]:
    """The figures the benchmark is judged by, each with its value, target and status.

    Issue 6 (QA suite, default eta): accuracy against the better of lc and rag per task kind
    at the longest length; decode speedup over lc and over transformers prompt lookup;
    acceptance. Issue 7: time to first token of a second question on the same document;
    from the speed suite: decode speedup, verify step against a decode step, the share of
    decode time outside forward passes, and peak memory against weights + 2 KV + 1 GiB.
    """
    eta = meta.get("default_eta", RapidConfig().eta)
    rows = [r for r in summary if r["turn"] == 1 and r["suite"] in ("qa", "speed")]
    figures = _accuracy_figures([r for r in rows if r["suite"] == "qa"], eta)
    figures += _followup_figures(records)
    for row in rows:
        if row["method"] == "rapid" and row["eta"] == eta and row["task"] == TASK_ALL:
            same = [r for r in rows if _lc_key(r) == _lc_key(row)]
            figures += _rapid_figures(row, same, meta)
    return figures


def _figure(name: str, length: int | None, value: float | None, target: _Target | None) -> Record:
    return {
        "figure": name,
        "context_label": length,
        "value": value,
        "target": target.text if target else None,
        "met": target.met(value) if target else None,
    }


def _accuracy_figures(qa: list[Record], eta: float) -> list[Record]:
    """rapid's accuracy minus the better of lc and rag, per task kind, at the longest length."""
    if not qa:
        return []
    longest = max(r["context_label"] for r in qa)
    figures = []
    for kind in [TASK_ALL, *dict.fromkeys(r["task"] for r in qa if r["task"] != TASK_ALL)]:
        cell = {"context_label": longest, "task": kind}
        rapid = _find(qa, method="rapid", eta=eta, **cell)
        others = [_find(qa, method=m, **cell) for m in ("lc", "rag")]
        scores = [r["accuracy"] for r in others if r and r["accuracy"] is not None]
        value = rapid["accuracy"] - max(scores) if rapid and scores else None
        name = f"accuracy: rapid minus the better of lc and rag ({kind})"
        figures.append(_figure(name, longest, value, _Target(0.0)))
    return figures


def _followup_figures(records: list[Record]) -> list[Record]:
    """Time to first token of the first question (rapid; transformers generate) over that of
    the second question on the same document (rapid, prefix cache warm)."""
    seconds = [r for r in records if r["suite"] == "qa" and r["turn"] == 2]
    figures = []
    for name, method in (("rapid, first question", "rapid"), ("transformers generate", "hf")):
        ratios = []
        for second in seconds:
            first = next(
                (
                    r
                    for r in records
                    if r["task_id"] == second["task_id"].removesuffix("-followup")
                    and r["method"] == method
                    and r["eta"] == (second["eta"] if method == "rapid" else None)
                ),
                None,
            )
            if first and second["time_to_first_token"]:
                ratios.append(first["time_to_first_token"] / second["time_to_first_token"])
        length = seconds[0]["context_label"] if seconds else None
        name = f"time to first token: {name} / second question"
        figures.append(_figure(name, length, _mean(ratios), _Target(10.0)))
    return figures


def _rapid_figures(row: Record, same: list[Record], meta: dict[str, Any]) -> list[Record]:
    """Figures of rapid at one suite and length; `same`: the other methods' rows there."""
    suite, length = row["suite"], row["context_label"]
    speedup = _figure(
        f"decode speedup of rapid over lc ({suite})",
        length,
        row["speedup_vs_lc"],
        SPEEDUP_TARGETS[suite].get(length),
    )
    acceptance = _figure(
        f"acceptance rate ({suite})",
        length,
        row["acceptance_rate"],
        _Target(0.85) if suite == "qa" and length == AT_8K else None,
    )
    if suite == "qa":
        pld = next((r for r in same if r["method"] == "hf-pld"), None)
        ratio = _ratio(row["decode_tokens_per_second"], pld and pld["decode_tokens_per_second"])
        target = _Target(1.0) if length == AT_8K else None
        return [
            speedup,
            _figure("decode speed of rapid / transformers prompt lookup", length, ratio, target),
            acceptance,
        ]
    lc = next((r for r in same if r["method"] == "lc"), None)
    verify = _ratio(row["verify_step_seconds"], lc and lc["main_step_seconds"])
    return [
        speedup,
        acceptance,
        _figure("verify step / target decode step", length, verify, _Target(1.5, above=False)),
        _figure(
            "share of decode time outside forward passes",
            length,
            row["outside_forward_fraction"],
            _Target(0.10, above=False),
        ),
        _figure(
            "peak memory / (weights + 2 KV + 1 GiB)",
            length,
            _memory_ratio(row, meta, row["peak_memory_bytes"], with_weights=True),
            _Target(1.0, above=False),
        ),
        _figure(
            "memory growth during the call / (2 KV + 1 GiB)",
            length,
            _memory_ratio(row, meta, row["memory_growth_bytes"], with_weights=False),
            _Target(1.0, above=False),
        ),
    ]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _memory_ratio(
    row: Record, meta: dict[str, Any], used: int | None, with_weights: bool
) -> float | None:
    """`used` bytes over issue 7's bound: 2 x the call's KV caches + 1 GiB, plus the weights
    when `used` is the whole peak (on CPU the resident set also holds Python, torch and the
    embedder, which the bound does not count; the growth during the call leaves them out)."""
    memory = meta.get("memory_model")
    if not memory or not used:
        return None
    tokens = row["context_tokens"] + (row["draft_context_tokens"] or 0) + (row["new_tokens"] or 0)
    bound = 2 * memory["kv_bytes_per_token"] * tokens + GIB
    return used / (bound + (memory["weights_bytes"] if with_weights else 0))


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
    rows = [
        [
            f["figure"],
            _fmt(f["context_label"] and length_name(f["context_label"])),
            _fmt(f["value"], ".3g"),
            _fmt(f["target"]),
            _status(f),
        ]
        for f in figures
    ]
    return _table(["figure", "context", "value", "target", "status"], rows)


def _status(figure: Record) -> str:
    if figure["value"] is None:
        return "not measured"
    if figure["met"] is None:
        return "–"
    return "met" if figure["met"] else "not met"


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


_LINES = {
    "qa": ("", "-"),
    "speed": (" (fixed length)", "--"),
    "tiny-downward": (" (downward)", "-"),
    "tiny-upward": (" (upward)", "--"),
}
"""Legend suffix and line style of each suite in the speedup plot."""


def _plot_speedup(plt: Any, records: list[Record], summary: list[Record]) -> Any:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = (
        (axes[0], ("qa", "speed"), "model: QA answers; dashed: fixed-length decode"),
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
            suffix, style = _LINES[suite]
            ax.plot(*zip(*line, strict=True), marker="o", label=label + suffix, linestyle=style)
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
        ax.set_ylim(0, 1.2)  # headroom for the legend above the bars
        ax.set_title(f"{length_name(length)} tokens")
        ax.set_ylabel("accuracy (exact match)")
    axes[0][0].legend(fontsize=7, ncol=len(kinds), loc="upper left")
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
