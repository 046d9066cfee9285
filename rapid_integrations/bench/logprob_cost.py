"""`rapid bench --logprobs`: what log probabilities cost per token (docs/algorithm.md section 12).

Each task's question is decoded greedily, a fixed number of tokens (end of sequence ignored),
by each method with log probabilities off, on, on with the 20 top alternatives, and on with
log p_hat too; the variants of a task run one after another, so the machine's drift touches
them alike. Per method, length and variant it reports decode speed, decode milliseconds per
token and the extra milliseconds per token over the same method without log probabilities.
Every variant must emit the same tokens as the run without them (`same_tokens`): asking for
log probabilities must not change the output.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .dataset import build_tasks
from .tables import _fmt, _table

LENGTHS = (4096,)
METHODS = ("lc", "rapid")
VARIANTS: dict[str, dict[str, Any]] = {
    "off": {},
    "logprobs": {"logprobs": True},
    "top-20": {"logprobs": True, "top_logprobs": 20},
    "p_hat": {"logprobs": True, "logprobs_p_hat": True},
}
"""The variants timed, by name: the call's log-probability options."""


def run_logprob_cost(
    engine: Any,
    tasks: Sequence[Any],
    methods: Sequence[str] = METHODS,
    tokens: int = 128,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """One record per (round, task, method, variant): `tokens` greedy tokens of the task."""
    engine.generate(tasks[0].messages[-1:], mode="lc", max_new_tokens=4, logprobs=True)  # warm
    records = []
    for round_index in range(rounds):
        for task in tasks:
            for method in methods:
                plain: list[int] = []
                for variant, options in VARIANTS.items():
                    out = engine.generate(
                        task.messages,
                        mode=method,
                        temperature=0.0,
                        max_new_tokens=tokens,
                        ignore_eos=True,
                        prefix_cache_bytes=0,
                        **options,
                    )
                    plain = out.token_ids if variant == "off" else plain
                    records.append(_record(round_index, task, method, variant, out, plain))
    return records


def _record(
    round_index: int, task: Any, method: str, variant: str, out: Any, plain: list[int]
) -> dict[str, Any]:
    s = out.stats
    return {
        "suite": "logprobs",
        "round": round_index,
        "task_id": task.task_id,
        "context_label": task.context_label,
        "method": method,
        "variant": variant,
        "new_tokens": s.new_tokens,
        "same_tokens": out.token_ids == plain,
        "logprob_entries": len(out.logprobs or ()),
        "decode_seconds": s.decode_seconds,
        "decode_tokens_per_second": s.decode_tokens_per_second,
        "ms_per_token": 1000 * s.decode_seconds / s.new_tokens if s.new_tokens else None,
        "target_forward_passes": s.target_forward_passes,
        "stats": s.to_dict(),
    }


def summary(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (length, method, variant): runs, pooled tokens/s and ms per token, the extra ms
    per token over the variant "off" of the same length and method (and as a share of it),
    and whether every run emitted the tokens of "off"."""
    rows = []
    keys = sorted({(r["context_label"], r["method"]) for r in records})
    for length, method in keys:
        base = None
        for variant in VARIANTS:
            group = [
                r
                for r in records
                if (r["context_label"], r["method"], r["variant"]) == (length, method, variant)
            ]
            if not group:
                continue
            tokens = sum(r["new_tokens"] for r in group)
            seconds = sum(r["decode_seconds"] for r in group)
            ms = 1000 * seconds / tokens if tokens else None
            base = ms if variant == "off" else base
            extra = ms - base if ms is not None and base is not None else None
            rows.append(
                {
                    "context_label": length,
                    "method": method,
                    "variant": variant,
                    "runs": len(group),
                    "decode_tokens_per_second": tokens / seconds if seconds else None,
                    "ms_per_token": ms,
                    "extra_ms_per_token": extra,
                    "extra_fraction": extra / base if extra is not None and base else None,
                    "same_tokens": all(r["same_tokens"] for r in group),
                }
            )
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The summary as a Markdown table."""
    headers = (
        "length",
        "method",
        "variant",
        "runs",
        "decode tok/s",
        "ms / token",
        "extra ms / token",
        "extra",
        "same tokens",
    )
    return _table(
        headers,
        (
            (
                str(r["context_label"]),
                r["method"],
                r["variant"],
                str(r["runs"]),
                _fmt(r["decode_tokens_per_second"]),
                _fmt(r["ms_per_token"], ".3f"),
                _fmt(r["extra_ms_per_token"], "+.3f"),
                _fmt(r["extra_fraction"], "+.1%"),
                "yes" if r["same_tokens"] else "NO",
            )
            for r in rows
        ),
    )


def records_json(records: Sequence[dict[str, Any]]) -> str:
    return json.dumps({"records": list(records), "summary": summary(records)}, indent=1)


def run_logprob_bench(settings: Any, lengths: Sequence[int] = LENGTHS) -> Path:
    """`rapid bench --logprobs`: the suite on the settings' model at `lengths`,
    `settings.per_cell` single-fact tasks per length, `settings.speed_tokens` tokens per run,
    `settings.rounds` rounds; writes logprobs.json and logprobs.md under `settings.out`."""
    import torch

    from .runner import _qa_engine

    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    engine = _qa_engine(settings, device)[0]
    tasks = build_tasks(engine.tokenizer, ("single",), lengths, settings.per_cell, settings.seed)
    methods = [m for m in METHODS if m in settings.methods] or list(METHODS)
    records = run_logprob_cost(engine, tasks, methods, settings.speed_tokens, settings.rounds)
    settings.out.mkdir(parents=True, exist_ok=True)
    (settings.out / "logprobs.json").write_text(records_json(records))
    (settings.out / "logprobs.md").write_text(markdown(summary(records)) + "\n")
    return settings.out
