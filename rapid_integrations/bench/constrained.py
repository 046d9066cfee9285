"""`rapid bench --constrained`: JSON extraction under a schema.

Each task plants 3 facts about one subject (city, founding year, access code) at random
depths of a long document and asks for them as a JSON record; decoding is constrained to
`RECORD_SCHEMA` (docs/algorithm.md section 10). Per method (lc, rag, rapid) and length it
reports validity (parses and validates: must be 100%), field accuracy, acceptance, decode
speed and the grammar's cost per step relative to a decode step
(`grammar_seconds / decode_seconds`: mask work is per target pass, as is a decode step).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rapid_integrations.demo_data import demo_messages
from rapid_integrations.retrieval.base import TokenizerLike

from .dataset import CITIES, RESERVE_FRACTION, RESERVE_TOKENS, _document, _subject, haystack_pool

LENGTHS = (4096, 8192)
METHODS = ("lc", "rag", "rapid")
FIELDS = ("city", "year", "code")
RECORD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "code": {"type": "integer", "minimum": 0, "maximum": 99999},
    },
    "required": list(FIELDS),
    "additionalProperties": False,
}


@dataclass(frozen=True)
class ExtractionTask:
    """messages: the chat prompt; answer: the planted values by field."""

    task_id: str
    context_label: int
    messages: list[dict[str, str]]
    answer: dict[str, Any]


def build_extraction_tasks(
    tokenizer: TokenizerLike, lengths: Sequence[int] = LENGTHS, per_cell: int = 2, seed: int = 0
) -> list[ExtractionTask]:
    """`per_cell` tasks per nominal length, deterministic in (seed, length, index)."""
    pool = haystack_pool(tokenizer)
    tasks = []
    for length in lengths:
        budget = length - min(RESERVE_TOKENS + int(length * RESERVE_FRACTION), length // 4)
        for i in range(per_cell):
            rng = random.Random(f"{seed}:extract:{length}:{i}")
            subject = _subject(rng)
            answer = {
                "city": rng.choice(CITIES),
                "year": rng.randrange(1700, 2000),
                "code": rng.randrange(1000, 10000),
            }
            facts = [
                f"{subject.capitalize()} is located in {answer['city']}.",
                f"{subject.capitalize()} was founded in {answer['year']}.",
                f"The access code of {subject} is {answer['code']}.",
            ]
            document = _document(pool, budget, rng, [(f, rng.uniform(0.05, 0.95)) for f in facts])
            question = (
                f"Extract the city, the founding year and the access code of {subject} as a "
                'JSON object with the keys "city", "year" and "code".'
            )
            messages = demo_messages(document, question)
            tasks.append(ExtractionTask(f"extract-{length}-{i}", length, messages, answer))
    return tasks


def score(text: str, finish_reason: str, answer: dict[str, Any]) -> tuple[bool, float]:
    """(valid: parses and validates against RECORD_SCHEMA, share of the fields correct)."""
    import jsonschema

    if finish_reason != "eos":
        return False, 0.0
    try:
        value = json.loads(text)
        jsonschema.validate(value, RECORD_SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False, 0.0
    right = sum(str(value[f]).strip().lower() == str(answer[f]).lower() for f in FIELDS)
    return True, right / len(FIELDS)


def run_constrained(
    engine: Any,
    tasks: Sequence[ExtractionTask],
    methods: Sequence[str] = METHODS,
    eta: float | None = None,
    max_new_tokens: int = 64,
) -> list[dict[str, Any]]:
    """One record per (task, method): greedy decoding under `RECORD_SCHEMA`."""
    from rapid_integrations.structured_output.grammar import Grammar

    grammar = Grammar.json_schema(RECORD_SCHEMA)
    engine.generate(tasks[0].messages[-1:], mode="lc", grammar=grammar, max_new_tokens=4)  # warm
    records = []
    for task in tasks:
        for method in methods:
            overrides = {} if eta is None or method != "rapid" else {"eta": eta}
            out = engine.generate(
                task.messages,
                mode=method,
                grammar=grammar,
                temperature=0.0,
                max_new_tokens=max_new_tokens,
                prefix_cache_bytes=0,
                **overrides,
            )
            valid, accuracy = score(out.text, out.finish_reason, task.answer)
            s = out.stats
            records.append(
                {
                    "suite": "constrained",
                    "task_id": task.task_id,
                    "context_label": task.context_label,
                    "method": method,
                    "answer": out.text,
                    "finish_reason": out.finish_reason,
                    "valid": valid,
                    "field_accuracy": accuracy,
                    "acceptance_rate": s.acceptance_rate if s.drafted_tokens else None,
                    "decode_tokens_per_second": s.decode_tokens_per_second,
                    "target_forward_passes": s.target_forward_passes,
                    "grammar_seconds": s.grammar_seconds,
                    "mask_cost_per_step": s.grammar_seconds / s.decode_seconds
                    if s.decode_seconds
                    else None,
                    "stats": s.to_dict(),
                }
            )
    return records


def summary(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Means per (length, method): validity, field accuracy, acceptance, tokens/s, mask cost."""
    rows = []
    keys = sorted({(r["context_label"], r["method"]) for r in records})
    for length, method in keys:
        group = [r for r in records if (r["context_label"], r["method"]) == (length, method)]

        def mean(name: str, group: list[dict[str, Any]] = group) -> float | None:
            values = [r[name] for r in group if r[name] is not None]
            return sum(values) / len(values) if values else None

        rows.append(
            {
                "context_label": length,
                "method": method,
                "tasks": len(group),
                "validity": mean("valid"),
                "field_accuracy": mean("field_accuracy"),
                "acceptance_rate": mean("acceptance_rate"),
                "decode_tokens_per_second": mean("decode_tokens_per_second"),
                "mask_cost_per_step": mean("mask_cost_per_step"),
            }
        )
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The summary as a Markdown table."""

    def cell(v: Any, pct: bool = False) -> str:
        if v is None:
            return "-"
        return f"{100 * v:.1f}%" if pct else (f"{v:.2f}" if isinstance(v, float) else str(v))

    lines = [
        "| length | method | tasks | validity | field accuracy | acceptance | decode tok/s "
        "| mask cost / step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['context_label']} | {r['method']} | {r['tasks']} | {cell(r['validity'], True)} "
            f"| {cell(r['field_accuracy'], True)} | {cell(r['acceptance_rate'], True)} "
            f"| {cell(r['decode_tokens_per_second'])} | {cell(r['mask_cost_per_step'], True)} |"
        )
    return "\n".join(lines)


def records_json(records: Sequence[dict[str, Any]]) -> str:
    return json.dumps({"records": list(records), "summary": summary(records)}, indent=1)


def run_constrained_bench(settings: Any, eta: float | None = None) -> Path:
    """`rapid bench --constrained`: the extraction suite on the settings' model (lengths
    default to 4K and 8K); writes constrained.json and constrained.md under `settings.out`."""
    import torch

    from .runner import _qa_engine

    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    engine = _qa_engine(settings, device)[0]
    lengths = tuple(n for n in settings.lengths if n in LENGTHS) or LENGTHS
    tasks = build_extraction_tasks(engine.tokenizer, lengths, settings.per_cell, settings.seed)
    methods = [m for m in METHODS if m in settings.methods] or list(METHODS)
    records = run_constrained(engine, tasks, methods, eta)
    settings.out.mkdir(parents=True, exist_ok=True)
    (settings.out / "constrained.json").write_text(records_json(records))
    (settings.out / "constrained.md").write_text(markdown(summary(records)) + "\n")
    return settings.out
