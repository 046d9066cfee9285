"""Aggregate benchmark records (the `records` of results.json) into summary rows.

Rows are keyed by (suite, method, eta, context length, turn, task kind), plus task "all".
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from statistics import fmean, stdev
from typing import Any

from .bounds import BOUND_NAMES

GROUP_KEYS = ("suite", "method", "label", "eta", "context_label", "turn")
TASK_ALL = "all"
QA_SUITES = ("qa", "broad", "short")
"""Suites whose answers are scored."""
END_TO_END_BASES = (
    ("lc", "end_to_end_over_lc", "lc"),
    ("hf-pld", "end_to_end_over_prompt_lookup", "prompt lookup"),
    ("llama.cpp", "end_to_end_over_llama_cpp", "llama.cpp"),
)
"""The rows a row's end-to-end time is divided by (the target alone, transformers prompt
lookup, llama.cpp greedy): their label, the summary field of the ratio, and its name in the
report."""
CELL_KEYS = ("split", "label", "method", "eta")

Record = dict[str, Any]


def summarize(records: list[Record]) -> list[Record]:
    """One row per (suite, method, eta, context length, turn, task kind), plus task "all".

    Rates are pooled (total tokens / total seconds), also per round (`round_rates`, where a
    speed-only suite ran its methods more than once), acceptance is accepted / drafted over the
    group, and speedup_vs_lc divides by the `lc` row of the same suite, length, task and turn 1.
    end_to_end_seconds is the mean wait for a whole answer; each field of `END_TO_END_BASES`
    divides it by that of its method's row there (turn 1; None where that method did not run):
    below 1, the row's answers arrive sooner. same_text_as_lc is the share of the group's
    answers that are lc's text, first_difference_from_lc the mean token position where the
    others part from it (the short-prompt set; None elsewhere).
    accuracy_stderr is the standard error of the mean accuracy over the group's tasks;
    model_draft_ratio is speedup_vs_lc over the mean `model_draft_speedup` of the group's records;
    the bounds of `bench/bounds.py` and the achieved speedup over each are means over the group,
    and bound_exceeded says whether any of its records was flagged;
    texts the digests of the distinct texts the group decoded.
    """
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        for task in (r["task"], TASK_ALL):
            groups.setdefault((*(r[k] for k in GROUP_KEYS), task), []).append(r)
    rows = [
        _aggregate(dict(zip((*GROUP_KEYS, "task"), k, strict=True)), rs) for k, rs in groups.items()
    ]
    bases = {
        name: {lc_key(r): r for r in rows if r["label"] == name and r["turn"] == 1}
        for name, _, _ in END_TO_END_BASES
    }
    for row in rows:
        base = bases["lc"].get(lc_key(row))
        rate, base_rate = row["decode_tokens_per_second"], base and base["decode_tokens_per_second"]
        row["speedup_vs_lc"] = rate / base_rate if rate and base_rate else None
        best = row["model_draft_speedup"]
        row["model_draft_ratio"] = (
            row["speedup_vs_lc"] / best if row["speedup_vs_lc"] and best else None
        )
        for name, ratio, _ in END_TO_END_BASES:
            other = bases[name].get(lc_key(row))
            wait, base_wait = row["end_to_end_seconds"], other and other["end_to_end_seconds"]
            row[ratio] = wait / base_wait if wait and base_wait else None
    return rows


def lc_key(row: Record) -> tuple:
    """The key a row shares with the `lc` row it is compared against."""
    return row["suite"], row["context_label"], row["task"]


def _aggregate(key: Record, rs: list[Record]) -> Record:
    def field_mean(name: str) -> float | None:
        return mean(r[name] for r in rs)

    drafted = sum(r["drafted_tokens"] for r in rs)
    return {
        **key,
        "n": len(rs),
        "context_tokens": field_mean("context_tokens"),
        "draft_context_tokens": field_mean("draft_context_tokens"),
        "accuracy": field_mean("accuracy"),
        "accuracy_stderr": _stderr([r["accuracy"] for r in rs if r["accuracy"] is not None]),
        "f1": field_mean("f1"),
        "needle_recall": field_mean("needle_recall"),
        "new_tokens": field_mean("new_tokens"),
        "decode_tokens_per_second": _pooled_rate(rs),
        "round_rates": _round_rates(rs),
        "texts": _texts(rs),
        "same_text_as_lc": mean(_number(r.get("same_text_as_lc")) for r in rs),
        "first_difference_from_lc": mean(r.get("first_difference_from_lc") for r in rs),
        "acceptance_rate": sum(r["accepted_tokens"] for r in rs) / drafted if drafted else None,
        "prefill_seconds": field_mean("prefill_seconds"),
        "time_to_first_token": field_mean("time_to_first_token"),
        "end_to_end_seconds": mean(r.get("end_to_end_seconds") for r in rs),
        "retrieval_seconds": field_mean("retrieval_seconds"),
        "outside_forward_fraction": _pooled_outside(rs),
        "main_step_seconds": field_mean("main_step_seconds"),
        "verify_step_seconds": field_mean("verify_step_seconds"),
        "draft_step_seconds": field_mean("draft_step_seconds"),
        "model_draft_speedup": mean(r.get("model_draft_speedup") for r in rs),
        "achieved_speedup": mean(r.get("achieved_speedup") for r in rs),
        **{n: mean(r.get(n) for r in rs) for n in BOUND_NAMES},
        **{
            f"achieved_over_{n}": mean(r.get(f"achieved_over_{n}") for r in rs) for n in BOUND_NAMES
        },
        "bound_exceeded": any(r.get("bound_exceeded") for r in rs),
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


def _number(flag: bool | None) -> float | None:
    """A yes/no field as 1.0/0.0, so its mean is the share of yes (None stays None)."""
    return None if flag is None else float(flag)


def mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return fmean(present) if present else None


def _stderr(values: list[float]) -> float | None:
    """Standard error of the mean (sample standard deviation / sqrt(n)); None below 2 values."""
    return stdev(values) / math.sqrt(len(values)) if len(values) >= 2 else None


def _pooled_rate(rs: list[Record]) -> float | None:
    """Decoded tokens over decode seconds of the whole group (each record's own token count)."""
    timed = [r for r in rs if r["decode_tokens_per_second"] and r["decode_seconds"]]
    seconds = sum(r["decode_seconds"] for r in timed)
    tokens = sum(r["decode_tokens_per_second"] * r["decode_seconds"] for r in timed)
    return tokens / seconds if seconds else None


def _round_rates(rs: list[Record]) -> list[float | None] | None:
    """The pooled decode rate of each round (`BenchSettings.rounds`), in round order; None
    when the group ran once."""
    rounds = sorted({r.get("round", 1) for r in rs})
    if len(rounds) < 2:
        return None
    return [_pooled_rate([r for r in rs if r.get("round", 1) == n]) for n in rounds]


def _texts(rs: list[Record]) -> list[str] | None:
    """The distinct texts the group decoded, each as the first 12 hex digits of its SHA-256
    (sorted; None where a record has no text): rows with equal lists wrote the same texts."""
    if any(r.get("answer") is None for r in rs):
        return None
    return sorted({hashlib.sha256(r["answer"].encode()).hexdigest()[:12] for r in rs})


def _pooled_outside(rs: list[Record]) -> float | None:
    timed = [r for r in rs if r["forward_seconds"] is not None and r["decode_seconds"]]
    seconds = sum(r["decode_seconds"] for r in timed)
    outside = sum(max(0.0, r["decode_seconds"] - r["forward_seconds"]) for r in timed)
    return outside / seconds if seconds else None


def accuracy_cells(records: list[Record]) -> list[Record]:
    """The broad suite's accuracy by (split, method label, text kind, question kind), over all
    lengths, each kind also "all": n, mean accuracy, its standard error over the tasks, and
    the pooled decode rate."""
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        if r["suite"] != "broad":
            continue
        for text in (r["text_kind"], TASK_ALL):
            for task in (r["task"], TASK_ALL):
                groups.setdefault((*(r[k] for k in CELL_KEYS), text, task), []).append(r)
    return [
        {
            **dict(zip((*CELL_KEYS, "text_kind", "task"), key, strict=True)),
            "n": len(rs),
            "accuracy": mean(r["accuracy"] for r in rs),
            "accuracy_stderr": _stderr([r["accuracy"] for r in rs]),
            "decode_tokens_per_second": _pooled_rate(rs),
        }
        for key, rs in groups.items()
    ]


def find_row(summary: list[Record], **key: Any) -> Record | None:
    """The first row whose fields equal `key`, or None."""
    return next((r for r in summary if all(r[k] == v for k, v in key.items())), None)
