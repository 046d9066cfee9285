"""The figures the benchmark is judged by: each value against its target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rapid_integrations.config import RapidConfig

from .summary import END_TO_END_BASES, TASK_ALL, Record, find_row, lc_key, mean

GIB = 1024**3


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
SPEEDUP_TARGETS = {
    "qa": {AT_8K: _Target(1.5)},
    "speed": {AT_8K: _Target(2.0), 32768: _Target(3.0)},
    "long": {32768: _Target(3.0), 65536: _Target(4.0)},
}
"""Decode speedup of rapid over lc: on QA answers at 8K; on fixed-length decoding at 8K and
(RoPE-scaled) 32K; on the `long` suite at 32K and 64K."""
AT_16K = 16384
NEVER_LATER = _Target(1.0, above=False)
END_TO_END_TARGETS = {
    "end_to_end_over_lc": {AT_8K: _Target(0.8, above=False), AT_16K: _Target(0.8, above=False)},
    "end_to_end_over_prompt_lookup": {},
}
"""RAPID's end-to-end time over lc's and over transformers prompt lookup's, on the QA answers
and the `long` suite: at most 1 at every length (`NEVER_LATER`), over lc's at most 0.8 at 8K
and 16K. Over llama.cpp's, reported without a target."""
END_TO_END_SUITES = ("qa", "long")
MODEL_DRAFT_TARGET = _Target(0.85)
"""Achieved speedup over the model-draft speedup of `bench/model_draft.py` (what the model
draft's own acceptance would give; not a ceiling: lookup copies cost no draft step), from 8K up."""


def speed_figures(
    records: list[Record], summary: list[Record], meta: dict[str, Any]
) -> list[Record]:
    """The figures the benchmark is judged by, each with its value, target and status.

    From the QA suite (default eta): accuracy against the better of lc and rag per task kind
    at the longest length; decode speedup over lc and over transformers prompt lookup;
    acceptance. Time to first token of a second question on the same document. From the
    speed suite: decode speedup, verify step against a decode step, the share of
    decode time outside forward passes, and peak memory against weights + 2 KV + 1 GiB.
    From every one of these suites, rapid's end-to-end time over lc's, prompt lookup's and
    llama.cpp's (where they ran). From the short-prompt set, rapid's agreement with lc.
    """
    eta = meta.get("default_eta", RapidConfig().eta)
    rows = [r for r in summary if r["turn"] == 1 and r["suite"] in SPEEDUP_TARGETS]
    figures = _accuracy_figures([r for r in rows if r["suite"] == "qa"], eta)
    figures += _followup_figures(records)
    figures += _short_figures(summary, eta)
    for row in rows:
        if _headline(row, eta):
            same = [r for r in rows if lc_key(r) == lc_key(row)]
            lc = next((r for r in same if r["method"] == "lc"), None)
            ones = _rapid_figures(row, same, lc, meta) + _end_to_end_figures(row)
            if row["suite"] != "qa":
                ones += _drafting_figures(row, same, lc)
            if row["eta"] != eta:
                for figure in ones:
                    figure["figure"] += f" at eta={row['eta']:g}"
            figures += ones
    return figures


def _headline(row: Record, eta: float) -> bool:
    """Whether `row` is rapid at fixed gamma, over all tasks, at the default `eta` (the long
    suite: at each eta it ran, each with its own figures, named with the eta)."""
    if row["method"] != "rapid" or row["task"] != TASK_ALL:
        return False
    return row["label"] == f"rapid eta={row['eta']:g}" and (
        row["eta"] == eta or row["suite"] == "long"
    )


ADAPTIVE_ROWS = (("adaptive", "adaptive drafting"), ("adaptive-again", "adaptive, next call"))
"""The adaptive variants' labels and figure names: a call that measures its schedule from
scratch, and the engine's next call at the same length, which starts from it
(docs/algorithm.md section 2.11)."""


def _drafting_figures(row: Record, same: list[Record], lc: Record | None) -> list[Record]:
    """At one length of a speed suite: rapid against its model-draft speedup; the adaptive
    variant against the best fixed gamma and against lc; rapid against rapid without the
    lookup proposer."""
    length = row["context_label"]
    rapid = [r for r in same if r["method"] == "rapid" and r["eta"] == row["eta"]]
    fixed = [r for r in rapid if "adaptive" not in r["label"] and "no-lookup" not in r["label"]]
    by_label = {r["label"].removeprefix(row["label"]).strip(): r for r in rapid}
    best_fixed = max(fixed, key=lambda r: r["decode_tokens_per_second"] or 0, default=None)
    unaided = by_label.get("no-lookup")
    figures = [
        _figure(
            f"rapid speedup / model draft ({row['suite']})",
            length,
            row["model_draft_ratio"],
            MODEL_DRAFT_TARGET if length >= AT_8K else None,
        )
    ]
    for label, name in ADAPTIVE_ROWS:
        if adaptive := by_label.get(label):
            figures += [
                _schedule_figure(f"{name} / best fixed gamma", adaptive, best_fixed),
                _rate_figure(f"{name} / lc", adaptive, lc, _Target(0.95)),
            ]
    if unaided:
        figures.append(_schedule_figure("rapid / rapid without the lookup", row, unaided))
    return figures


def _schedule_figure(name: str, row: Record, base: Record | None) -> Record:
    """`_rate_figure` of two ways to draft, at least 1 to be met, and `same_text`: whether
    the two rows decoded the same text in every round (None: unknown). Greedy texts agree
    only up to bf16 rounding between verify widths and, at eta > 0, the draft's q: rows that
    wrote other texts compare texts as well as schedules."""
    figure = _rate_figure(name, row, base, _Target(1))
    ours, theirs = row.get("texts"), base and base.get("texts")
    figure["same_text"] = None if ours is None or theirs is None else ours == theirs
    return figure


def _rate_figure(name: str, row: Record, base: Record | None, target: _Target | None) -> Record:
    """`row`'s decode rate over `base`'s, pooled over the rounds, with the lowest and highest
    ratio of one round's rates (`spread`, where the suite ran more than one round)."""
    value = _ratio(
        row["decode_tokens_per_second"], base["decode_tokens_per_second"] if base else None
    )
    figure = _figure(name, row["context_label"], value, target)
    ours, theirs = row.get("round_rates"), base and base.get("round_rates")
    if ours and theirs and len(ours) == len(theirs):
        ratios = [r for r in map(_ratio, ours, theirs) if r is not None]
        figure["spread"] = [min(ratios), max(ratios)] if ratios else None
    return figure


def _figure(name: str, length: int | None, value: float | None, target: _Target | None) -> Record:
    return {
        "figure": name,
        "context_label": length,
        "value": value,
        "target": target.text if target else None,
        "met": target.met(value) if target else None,
        "spread": None,
    }


def _accuracy_figures(qa: list[Record], eta: float) -> list[Record]:
    """rapid's accuracy minus the better of lc and rag, per task kind, at the longest length."""
    if not qa:
        return []
    longest = max(r["context_label"] for r in qa)
    figures = []
    for kind in [TASK_ALL, *dict.fromkeys(r["task"] for r in qa if r["task"] != TASK_ALL)]:
        cell = {"context_label": longest, "task": kind}
        rapid = find_row(qa, method="rapid", eta=eta, **cell)
        others = [find_row(qa, method=m, **cell) for m in ("lc", "rag")]
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
        figures.append(_figure(name, length, mean(ratios), _Target(10.0)))
    return figures


def _rapid_figures(
    row: Record, same: list[Record], lc: Record | None, meta: dict[str, Any]
) -> list[Record]:
    """Figures of rapid at one suite and length; `same`: the other methods' rows there, `lc`
    the one it is compared against."""
    suite, length = row["suite"], row["context_label"]
    name = f"decode speedup of rapid over lc ({suite})"
    speedup = _rate_figure(name, row, lc, SPEEDUP_TARGETS[suite].get(length))
    acceptance = _figure(
        f"acceptance rate ({suite})",
        length,
        row["acceptance_rate"],
        _Target(0.85) if suite == "qa" and length == AT_8K else None,
    )
    if suite == "qa":
        pld = next((r for r in same if r["method"] == "hf-pld"), None)
        ratio = _ratio(
            row["decode_tokens_per_second"], pld["decode_tokens_per_second"] if pld else None
        )
        target = _Target(1.0) if length == AT_8K else None
        return [
            speedup,
            _figure("decode speed of rapid / transformers prompt lookup", length, ratio, target),
            acceptance,
        ]
    verify = _ratio(row["verify_step_seconds"], lc["main_step_seconds"] if lc else None)
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


def _end_to_end_figures(row: Record) -> list[Record]:
    """`row`'s end-to-end time over that of each row of `END_TO_END_BASES` that ran beside
    it (a time ratio: below 1, rapid's answers arrive sooner)."""
    suite, length = row["suite"], row["context_label"]
    figures = []
    for _, field, shown in END_TO_END_BASES:
        if row[field] is None:
            continue
        target = None
        if suite in END_TO_END_SUITES and field in END_TO_END_TARGETS:
            target = END_TO_END_TARGETS[field].get(length, NEVER_LATER)
        name = f"end to end of rapid / {shown} ({suite})"
        figures.append(_figure(name, length, row[field], target))
    return figures


def _short_figures(summary: list[Record], eta: float) -> list[Record]:
    """From the short-prompt set (nothing retrieved: the draft reads the target's prompt),
    the share of rapid's answers at the default `eta` that are lc's text, which should be
    all of them; and its end-to-end figures."""
    row = find_row(summary, suite="short", label=f"rapid eta={eta:g}", turn=1, task=TASK_ALL)
    if row is None:
        return []
    name = "short prompts: share of rapid's answers that are lc's text"
    agreement = _figure(name, None, row["same_text_as_lc"], _Target(1.0))
    return [agreement, *_end_to_end_figures(row)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _memory_ratio(
    row: Record, meta: dict[str, Any], used: int | None, with_weights: bool
) -> float | None:
    """`used` bytes over the memory bound: 2 x the call's KV caches + 1 GiB, plus the weights
    when `used` is the whole peak (on CPU the resident set also holds Python, torch and the
    embedder, which the bound does not count; the growth during the call leaves them out)."""
    memory = meta.get("memory_model")
    if not memory or not used:
        return None
    tokens = row["context_tokens"] + (row["draft_context_tokens"] or 0) + (row["new_tokens"] or 0)
    bound = 2 * memory["kv_bytes_per_token"] * tokens + GIB
    return used / (bound + (memory["weights_bytes"] if with_weights else 0))
