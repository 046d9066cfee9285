"""`rapid bench`: the QA suite, the speed-only suites, and the files they write.

Suites (field `suite` of each record):
  qa             embedded model (or --model/--draft): every method on every task, greedy,
                 answers scored; a second question on the same document at the longest length
                 (`turn` 2) for time-to-first-token on a repeated document
  tiny-downward  speed only: random 8-layer target, 2-layer draft, on the single-needle prompts
  tiny-upward    speed only: the same pair with the roles swapped (the draft is the larger)
  rope           speed only: the embedded model RoPE-scaled to 16K/32K, lc against rapid
Speed-only runs ignore end-of-sequence so every method decodes the same number of tokens.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm

from ..config import RapidConfig
from ..engine import RapidEngine
from ..errors import RapidConfigError
from ..models import ensure_default_model, load_default, load_model, resolve_dtype
from ..prompts import prepare_draft_prompt
from ..tokens import encode_prompt
from .dataset import CONTEXT_LENGTHS, TASK_KINDS, Task, build_tasks
from .methods import (
    ENGINE_METHODS,
    METHODS,
    Measurement,
    Method,
    measure_engine,
    measure_transformers,
    model_name,
    warm_up,
)
from .models import choose_dtype, load_rope_scaled, tiny_pair
from .probe import ForwardProbe
from .report import write_report
from .scoring import exact_match, token_f1

DEFAULT_ETA = RapidConfig().eta
QA_STOP = ("\n\n",)
"""Answers end at a blank line, as in `make demo`; the models otherwise ramble on."""
SPEED_METHODS = (Method("lc"), Method("sd"), Method("rapid", DEFAULT_ETA))
ROPE_METHODS = (Method("lc"), Method("rapid", DEFAULT_ETA))


@dataclass(frozen=True)
class BenchSettings:
    """What `rapid bench` runs. Lengths are nominal context sizes in tokens.

    per_cell: tasks per (kind, length); etas: the rapid eta values; max_new_tokens: answer
    cap of QA runs; speed_tokens: tokens decoded by speed-only runs; rope_lengths: lengths of
    the RoPE-scaled speed runs (empty: skip); tiny_speed: run the upward/downward suites;
    tiny_models: run the QA suite on the tiny random pair instead of real models (smoke tests).
    """

    out: Path = Path("bench-out")
    lengths: tuple[int, ...] = CONTEXT_LENGTHS
    kinds: tuple[str, ...] = TASK_KINDS
    per_cell: int = 5
    methods: tuple[str, ...] = METHODS
    etas: tuple[float, ...] = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0)
    max_new_tokens: int = 48
    speed_tokens: int = 128
    rope_lengths: tuple[int, ...] = (16384, 32768)
    tiny_speed: bool = True
    tiny_models: bool = False
    model: str | None = None
    draft: str | None = None
    dtype: str = "auto"
    device: str | None = None
    seed: int = 0
    progress: bool = True
    quick: bool = False

    def __post_init__(self) -> None:
        checks = (
            (
                "methods",
                set(self.methods) <= set(METHODS) and self.methods,
                f"names from {METHODS}",
            ),
            (
                "kinds",
                set(self.kinds) <= set(TASK_KINDS) and self.kinds,
                f"names from {TASK_KINDS}",
            ),
            ("lengths", all(n >= 256 for n in self.lengths) and self.lengths, "lengths >= 256"),
            ("rope_lengths", all(n >= 256 for n in self.rope_lengths), "lengths >= 256"),
            ("per_cell", self.per_cell >= 1, "an integer >= 1"),
            ("etas", all(e >= 0 for e in self.etas) and self.etas, "values >= 0"),
            ("max_new_tokens", self.max_new_tokens >= 1, "an integer >= 1"),
            ("speed_tokens", self.speed_tokens >= 1, "an integer >= 1"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise RapidConfigError(name, f"must be {expected}, got {getattr(self, name)!r}")

    @classmethod
    def preset(cls, quick: bool, **overrides: Any) -> BenchSettings:
        """The full run, or the `--quick` one (about 10 minutes on 2 CPU cores), with overrides
        (None values are ignored)."""
        base = cls(**QUICK) if quick else cls()
        return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})

    def method_list(self) -> list[Method]:
        """The methods to run, rapid expanded over `etas`."""
        return [
            m
            for name in METHODS
            if name in self.methods
            for m in (
                [Method(name, eta) for eta in self.etas] if name == "rapid" else [Method(name)]
            )
        ]


QUICK: dict[str, Any] = {
    "quick": True,
    "per_cell": 1,
    "etas": (0.0, DEFAULT_ETA, 10.0),
    "speed_tokens": 64,
    "rope_lengths": (16384,),
}
"""The `--quick` preset: one task per (kind, length), three eta values, 16K RoPE run only."""


@dataclass
class _Session:
    """State shared by the suites of one run: where records go and how progress shows."""

    settings: BenchSettings
    device: torch.device
    dtype: torch.dtype
    meta: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    bar: Any = None

    def save(self, plots: bool = False) -> None:
        write_report(self.settings.out, self.meta, self.records, plots=plots)


def run_bench(settings: BenchSettings) -> Path:
    """Run every suite `settings` asks for; write results.json, results.md and plots under
    `settings.out`; return that folder."""
    start = time.perf_counter()
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    engine, dtype, probe_seconds = _qa_engine(settings, device)
    meta = {
        "settings": _jsonable(dataclasses.asdict(settings)),
        "machine": machine_info(device),
        "dtype": str(dtype).removeprefix("torch."),
        "dtype_probe_seconds": probe_seconds,
        "memory_model": memory_model(engine.target, dtype),
        "default_eta": DEFAULT_ETA,
    }
    session = _Session(settings, device, dtype, meta)
    tasks = build_tasks(
        engine.tokenizer, settings.kinds, settings.lengths, settings.per_cell, settings.seed
    )
    speed_tasks = build_tasks(engine.tokenizer, ("single",), settings.lengths, 1, settings.seed)
    rope_tasks = build_tasks(engine.tokenizer, ("single",), settings.rope_lengths, 1, settings.seed)
    total = _planned_runs(settings, tasks, len(speed_tasks), len(rope_tasks))
    with tqdm(total=total, unit="run", disable=not settings.progress) as session.bar:
        _qa_suite(session, engine, tasks)
        if settings.tiny_speed:
            _tiny_suites(session, engine.tokenizer, speed_tasks)
        if rope_tasks:
            _rope_suite(session, engine.tokenizer, rope_tasks)
    meta["wall_seconds"] = time.perf_counter() - start
    meta["machine"]["load_average_end"] = _load_average()
    session.save(plots=True)
    return settings.out


def _planned_runs(
    settings: BenchSettings, tasks: list[Task], speed_tasks: int, rope_tasks: int
) -> int:
    methods = settings.method_list()
    followups = sum(1 for t in tasks if _asks_followup(settings, t))
    speed = 2 * speed_tasks * len(SPEED_METHODS) if settings.tiny_speed else 0
    return len(tasks) * len(methods) + followups + speed + rope_tasks * len(ROPE_METHODS)


# ---- engines --------------------------------------------------------------------------------


def _qa_engine(
    settings: BenchSettings, device: torch.device
) -> tuple[RapidEngine, torch.dtype, dict[str, float]]:
    """The QA suite's engine, in the dtype asked for or, for "auto", the faster one here."""
    fixed = settings.dtype not in ("auto", "")
    dtype = resolve_dtype(settings.dtype if fixed else "float32", device)
    if settings.tiny_models:
        tokenizer = load_model(ensure_default_model(), device=device, dtype=dtype)[1]
        small, large = tiny_pair(len(tokenizer), max(settings.lengths) * 2)
        target, draft = large.to(device), small.to(device)
    elif settings.model:
        target, tokenizer = load_model(settings.model, device=device, dtype=dtype)
        draft = (
            load_model(settings.draft, device=device, dtype=dtype)[0] if settings.draft else None
        )
    else:
        target, tokenizer = load_default(device=device, dtype=dtype)
        draft = (
            load_model(settings.draft, device=device, dtype=dtype)[0] if settings.draft else None
        )
    probe_seconds: dict[str, float] = {}
    if not fixed:
        dtype, probe_seconds = choose_dtype(target, device)
        if draft is not None:
            draft.to(dtype)
    return RapidEngine(target, draft, tokenizer), dtype, probe_seconds


def memory_model(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of the weights and of one token of KV cache (keys and values, every layer)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    return {
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "kv_bytes_per_token": 2 * cfg.num_hidden_layers * kv_heads * head_dim * itemsize,
    }


# ---- suites ---------------------------------------------------------------------------------


def _qa_suite(session: _Session, engine: RapidEngine, tasks: list[Task]) -> None:
    settings = session.settings
    methods = settings.method_list()
    overrides = {
        "max_new_tokens": settings.max_new_tokens,
        "stop": QA_STOP,
        "temperature": 0.0,
        "seed": settings.seed,
    }
    with ForwardProbe([engine.target, engine.draft]) as probe:
        warm_up(engine, methods, probe)
        for task in tasks:
            draft_prompt = _Retrieved.build(engine, task, any(m.retrieves for m in methods))
            for method in methods:
                measured = _measure(engine, method, task, draft_prompt, probe, overrides)
                session.records.append(
                    _record(session, engine, "qa", method, task, draft_prompt, measured)
                )
                _advance(session, method, task)
            if _asks_followup(settings, task):
                assert task.followup is not None
                method, follow = Method("rapid", DEFAULT_ETA), task.followup
                retrieved = _Retrieved.build(engine, follow, True)
                # Warm: the engine still holds this document's KV from the methods above.
                measured = _measure(engine, method, follow, retrieved, probe, overrides, cold=False)
                session.records.append(
                    _record(session, engine, "qa", method, follow, retrieved, measured, turn=2)
                )
                _advance(session, method, follow)
            session.save()


def _asks_followup(settings: BenchSettings, task: Task) -> bool:
    return (
        task.followup is not None
        and task.context_label == max(settings.lengths)
        and "rapid" in settings.methods
    )


def _tiny_suites(session: _Session, tokenizer: Any, tasks: list[Task]) -> None:
    """Downward then upward speculation with the tiny random pair, speed only."""
    small, large = tiny_pair(len(tokenizer), max(t.context_label for t in tasks) * 2)
    small, large = small.to(session.device, session.dtype), large.to(session.device, session.dtype)
    for suite, target, draft in (("tiny-downward", large, small), ("tiny-upward", small, large)):
        _speed_suite(session, suite, RapidEngine(target, draft, tokenizer), tasks, SPEED_METHODS)


def _rope_suite(session: _Session, tokenizer: Any, tasks: list[Task]) -> None:
    """The embedded model stretched by linear RoPE scaling: lc against rapid, speed only."""
    window = max(t.context_label for t in tasks)
    model, factor = load_rope_scaled(window, session.device, session.dtype)
    session.meta["rope_scaling_factor"] = factor
    _speed_suite(session, "rope", RapidEngine(model, tokenizer=tokenizer), tasks, ROPE_METHODS)


def _speed_suite(
    session: _Session,
    suite: str,
    engine: RapidEngine,
    tasks: list[Task],
    methods: Sequence[Method],
) -> None:
    overrides = {
        "max_new_tokens": session.settings.speed_tokens,
        "ignore_eos": True,
        "stop": (),
        "temperature": 0.0,
        "seed": session.settings.seed,
    }
    with ForwardProbe([engine.target, engine.draft]) as probe:
        warm_up(engine, list(methods), probe)
        for task in tasks:
            draft_prompt = _Retrieved.build(engine, task, True)
            for method in methods:
                measured = _measure(engine, method, task, draft_prompt, probe, overrides)
                session.records.append(
                    _record(
                        session, engine, suite, method, task, draft_prompt, measured, scored=False
                    )
                )
                _advance(session, method, task, suite)
            session.save()


# ---- one measurement ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Retrieved:
    """The draft prompt built once per task (every retrieving method reads the same C^S),
    how long building it took, and how many planted facts it kept."""

    prompt: Any
    seconds: float
    needle_recall: float | None

    @classmethod
    def build(cls, engine: RapidEngine, task: Task, needed: bool) -> _Retrieved:
        if not needed:
            return cls(None, 0.0, None)
        start = time.perf_counter()
        built = prepare_draft_prompt(task.messages, engine.tokenizer, config=engine.config)
        seconds = time.perf_counter() - start
        if built.target_only:  # retrieval failed: the engine falls back to the target alone
            return cls(None, seconds, 0.0)
        text = "\n".join(m["content"] for m in built.prompt)
        return cls(built.prompt, seconds, sum(f in text for f in task.facts) / len(task.facts))


def _measure(
    engine: RapidEngine,
    method: Method,
    task: Task,
    retrieved: _Retrieved,
    probe: ForwardProbe,
    overrides: dict[str, Any],
    cold: bool = True,
) -> Measurement:
    if method.name in ENGINE_METHODS:
        draft_prompt = retrieved.prompt if method.retrieves else None
        return measure_engine(
            engine, method, task.messages, draft_prompt, probe, cold=cold, **overrides
        )
    ids = encode_prompt(task.messages, engine.tokenizer, engine.vocab_size)
    return measure_transformers(
        engine,
        method,
        ids,
        probe,
        max_new_tokens=overrides["max_new_tokens"],
        stop=overrides["stop"],
    )


def _record(
    session: _Session,
    engine: RapidEngine,
    suite: str,
    method: Method,
    task: Task,
    retrieved: _Retrieved,
    measured: Measurement,
    turn: int = 1,
    scored: bool = True,
) -> dict[str, Any]:
    """One results record: what ran, on what, how well (None when `scored` is False: speed-only
    runs), at what cost. Fields are described in docs/benchmarks.md."""
    uses_retrieval = method.retrieves
    record = {
        "suite": suite,
        "method": method.name,
        "label": method.label,
        "eta": method.eta if method.name == "rapid" else (0.0 if method.name == "sd" else None),
        "task": task.kind,
        "task_id": task.task_id,
        "context_label": task.context_label,
        "turn": turn,
        "target_model": model_name(engine.target),
        "draft_model": model_name(engine.draft) if method.name in ("rag", "sd", "rapid") else None,
        "dtype": str(session.dtype).removeprefix("torch."),
        "accuracy": exact_match(measured.answer, task.references) if scored else None,
        "f1": token_f1(measured.answer, task.references) if scored else None,
        "references": list(task.references),
        "needle_recall": retrieved.needle_recall if uses_retrieval else None,
        "retrieval_seconds": retrieved.seconds if uses_retrieval else None,
        **dataclasses.asdict(measured),
    }
    if uses_retrieval:  # the draft prompt was built before the call: count it in the wait
        record["time_to_first_token"] += retrieved.seconds
    return record


def _advance(session: _Session, method: Method, task: Task, suite: str = "qa") -> None:
    session.bar.set_postfix_str(f"{suite} {task.task_id} {method.label}", refresh=False)
    session.bar.update()


# ---- machine description --------------------------------------------------------------------


def machine_info(device: torch.device) -> dict[str, Any]:
    """The machine and software the figures come from, and how busy it was at the start."""
    info: dict[str, Any] = {
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "load_average_start": _load_average(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return str(value) if isinstance(value, Path) else value
