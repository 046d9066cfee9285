"""PNG plots of a benchmark summary (matplotlib, optional: without it no plot is written)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .dataset import TASK_KINDS
from .summary import TASK_ALL, Record, find_row
from .tables import length_name

PLOTS = ("speedup.png", "accuracy.png", "eta.png")


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
    kinds = [k for k in (*TASK_KINDS, TASK_ALL) if any(r["task"] == k for r in qa)]
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 4), squeeze=False)
    width = 0.8 / max(1, len(kinds))
    for ax, length in zip(axes[0], lengths, strict=True):
        for i, kind in enumerate(kinds):
            values = [
                (find_row(qa, label=lab, task=kind, context_label=length) or {}).get("accuracy")
                or 0.0
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
    axes[0][0].legend(fontsize=7, ncol=max(1, len(kinds)), loc="upper left")
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
