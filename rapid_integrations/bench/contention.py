"""`rapid bench --contention`: decode speed beside one busy process (docs/performance.md,
"On a busy machine").

lc and rapid decode `speed_tokens` tokens of one single-fact task per length, solo and beside
a competitor (a spawned process running a pure-Python loop, started before and terminated
after the runs it contends with), under two policies, each in a fresh process:
  fixed    torch imported first, threads = every usable CPU (torch's own behaviour)
  managed  threads by load, followed per pass (threads.py)
An engine built beside the competitor is built after the load average shows it, as a user's
would be. In the last phase ("late") the competitor starts after the managed engine was built
on a quiet machine and warmed: the threads it picked then must follow the load.
Order: managed solo (a quiet machine), fixed solo, fixed busy, managed busy, managed late.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rapid_integrations.config import Mode
from rapid_integrations.runtime.threads import ENV, usable_cpus

from .dataset import build_tasks
from .tables import _fmt, _table

LENGTHS = (4096,)
METHODS: tuple[Mode, ...] = ("lc", "rapid")
PHASES = (
    ("managed", "solo"),
    ("fixed", "solo"),
    ("fixed", "busy"),
    ("managed", "busy"),
    ("managed", "late"),
)
LOADS = ("solo", "busy", "late")
"""Phases' loads: none, a competitor from before the engine's build, one from after it."""
START_SECONDS = 1.0
"""How long a late competitor is given to start (a spawned interpreter) before the runs."""
RAMP_SECONDS = 180.0
"""Longest wait for the 1-minute load average to show the competitor (about 45 s)."""
_CHILD = "from rapid_integrations.bench.contention import child_main; child_main()"


def busy_loop() -> None:
    """The competitor: one CPU kept busy by pure Python until terminated."""
    n = 0
    while True:
        n = (n + 1) % 1_000_003


def run_contention_bench(settings: Any, lengths: Sequence[int] = LENGTHS) -> Path:
    """Every phase in its own process; writes contention.json and contention.md."""
    records: list[dict[str, Any]] = []
    for policy, load in PHASES:
        competitor = _start_competitor() if load == "busy" else None
        try:
            if competitor is not None and policy == "managed":
                _wait_for_load(0.5)
            found = _run_child(settings, lengths, policy, load)
        finally:
            if competitor is not None:
                competitor.terminate()
                competitor.join()
        records += found
        if settings.dtype in ("auto", "") and found:  # every phase in the first one's dtype
            settings = _replace_dtype(settings, found[0]["dtype"])
    settings.out.mkdir(parents=True, exist_ok=True)
    rows = summary(records)
    (settings.out / "contention.json").write_text(
        json.dumps({"records": records, "summary": rows}, indent=1)
    )
    (settings.out / "contention.md").write_text(markdown(rows) + "\n")
    return settings.out


def _replace_dtype(settings: Any, dtype: str) -> Any:
    import dataclasses

    return dataclasses.replace(settings, dtype=dtype)


def _start_competitor() -> multiprocessing.process.BaseProcess:
    process = multiprocessing.get_context("spawn").Process(target=busy_loop, daemon=True)
    process.start()
    return process


def _wait_for_load(level: float) -> None:
    deadline = time.monotonic() + RAMP_SECONDS
    while os.getloadavg()[0] < level and time.monotonic() < deadline:
        time.sleep(2)


def _run_child(settings: Any, lengths: Sequence[int], policy: str, load: str) -> list[Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.pop("OMP_WAIT_POLICY", None)
    env[ENV] = str(usable_cpus()) if policy == "fixed" else "auto"
    code = ("import torch; " if policy == "fixed" else "") + _CHILD
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.pickle"
        job.write_bytes(pickle.dumps((settings, tuple(lengths), policy, load)))
        subprocess.run([sys.executable, "-c", code, str(job)], env=env, check=True)
        return list(json.loads(job.with_suffix(".json").read_text()))


def child_main() -> None:
    """One phase: build the engine (the thread policy applies), time each method."""
    import torch

    from .runner import _qa_engine

    job = Path(sys.argv[1])
    settings, lengths, policy, load = pickle.loads(job.read_bytes())
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    engine, dtype = _qa_engine(settings, device)[:2]
    tasks = build_tasks(engine.tokenizer, ("single",), lengths, 1, settings.seed)
    engine.generate(tasks[0].messages[-1:], mode="rapid", max_new_tokens=4)  # warm
    competitor = _start_competitor() if load == "late" else None
    try:
        if competitor is not None:
            time.sleep(START_SECONDS)
        records = _time_methods(engine, tasks, settings, policy, load, str(dtype))
    finally:
        if competitor is not None:
            competitor.terminate()
            competitor.join()
    job.with_suffix(".json").write_text(json.dumps(records))


def _time_methods(
    engine: Any, tasks: Sequence[Any], settings: Any, policy: str, load: str, dtype: str
) -> list[dict[str, Any]]:
    import torch

    records = []
    for round_ in range(1, settings.rounds + 1):
        for task in tasks:
            for method in METHODS:
                out = engine.generate(
                    task.messages,
                    mode=method,
                    temperature=0.0,
                    max_new_tokens=settings.speed_tokens,
                    ignore_eos=True,
                    prefix_cache_bytes=0,
                )
                s = out.stats
                records.append(
                    {
                        "suite": "contention",
                        "policy": policy,
                        "load": load,
                        "round": round_,
                        "method": method,
                        "context_label": task.context_label,
                        "new_tokens": s.new_tokens,
                        "decode_seconds": s.decode_seconds,
                        "torch_threads": torch.get_num_threads(),
                        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
                        "dtype": dtype.removeprefix("torch."),
                    }
                )
    return records


def _rate(records: Sequence[dict[str, Any]], **match: Any) -> float | None:
    """Pooled decode tokens per second of the records matching `match`."""
    group = [r for r in records if all(r[k] == v for k, v in match.items())]
    seconds = sum(r["decode_seconds"] for r in group)
    return sum(r["new_tokens"] for r in group) / seconds if seconds else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (length, method, policy): tok/s under each load of `LOADS` (None where not run),
    each loaded one over solo, and solo against the fixed policy's solo."""
    rows = []
    keys = sorted({(r["context_label"], r["method"], r["policy"]) for r in records})
    for length, method, policy in keys:
        at = {"context_label": length, "method": method}
        rates = {load: _rate(records, **at, policy=policy, load=load) for load in LOADS}
        fixed = _rate(records, **at, policy="fixed", load="solo")
        rows.append(
            {
                **at,
                "policy": policy,
                **{f"{load}_tokens_per_second": rate for load, rate in rates.items()},
                **{f"{load}_over_solo": _ratio(rates[load], rates["solo"]) for load in LOADS[1:]},
                "solo_over_fixed_solo": _ratio(rates["solo"], fixed),
            }
        )
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The summary as a Markdown table."""
    rates = tuple(f"{load} tok/s" for load in LOADS)
    ratios = tuple(f"{load} / solo" for load in LOADS[1:])
    return _table(
        ("length", "method", "policy", *rates, *ratios, "solo / fixed solo"),
        (
            (
                str(r["context_label"]),
                r["method"],
                r["policy"],
                *(_fmt(r[f"{load}_tokens_per_second"], ".1f") for load in LOADS),
                *(_fmt(r[f"{load}_over_solo"]) for load in LOADS[1:]),
                _fmt(r["solo_over_fixed_solo"]),
            )
            for r in rows
        ),
    )
