"""The broad QA sweep in parallel: one `rapid bench --suite broad` per (text kind,
question kind) cell, several cells at once, then one report per half from all of them.

Why: the sweep is thousands of calls, and a call's decode step on a GPU is bound by its host
(kernel launches, docs/gpu.md), so one process leaves the device mostly idle; cells are
independent (a task depends on its cell, half and index alone: docs/benchmarks.md), so they
run as separate processes and their records merge into the report one process would write.

Each cell runs PHASES in order (the dev half, the test half, then the test half with an
off-topic C^S for the paper's section 4.5), each phase one `rapid bench` into
OUT/<text>-<kind>/<phase>/. Records are saved after every task, so a cell stopped by
`--deadline` keeps what it finished.

    python scripts/broad_sweep.py run --out sweep --jobs 16 --device cuda --deadline 330
    python scripts/broad_sweep.py merge sweep --phase dev     # choose on this one first
    python scripts/broad_sweep.py merge sweep --phase test    # then read the test half
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MAIN = ["--methods", "lc,rag,rapid", "--etas", "5,10,20", "--variants", "paper,draft-confidence"]
MAIN += ["--variant-etas", "10,20"]
PHASES: dict[str, list[str]] = {
    "dev": ["--split", "dev", *MAIN],
    "test": ["--split", "test", *MAIN],
    "test-off-topic": [
        *("--split", "test", "--methods", "rapid", "--etas", "5"),
        *("--variants", "off-topic,draft-confidence+off-topic", "--variant-etas", "5,20"),
    ],
}
"""The broad QA candidates (lc, rag, rapid with the confidence guard at eta 5, 10, 20, the
paper's p_hat without it and the draft-confidence rule at eta 10, 20), on each half; then
RAPID with an off-topic C^S (`bench/off_topic.py`) on the test half."""


def cell_phases(cell: tuple[str, str], args: argparse.Namespace, stop_at: float) -> str:
    """Run every phase of one cell in turn until the deadline; a line saying how it went."""
    text, kind = cell
    done = []
    for phase, options in PHASES.items():
        left = stop_at - time.monotonic()
        if left <= 5:
            break
        out = args.out / f"{text}-{kind}" / phase
        cmd = [sys.executable, "-m", "rapid_integrations.cli", "bench", "--suite", "broad"]
        cmd += ["--texts", text, "--kinds", kind, "--tasks", str(args.tasks), *options]
        cmd += ["--dtype", args.dtype, "--no-progress", "--out", str(out)]
        cmd += (["--device", args.device] if args.device else []) + args.bench_args
        with (args.out / f"{text}-{kind}-{phase}.log").open("w") as log:
            try:
                code = subprocess.run(cmd, stdout=log, stderr=log, timeout=left).returncode
                ending = str(code)
            except subprocess.TimeoutExpired:
                ending = "timeout"
        done.append(f"{phase}:{ending}")
    return f"{text}-{kind} " + " ".join(done)


def run(args: argparse.Namespace) -> None:
    from rapid_integrations.bench.suite import QUESTION_KINDS
    from rapid_integrations.bench.texts import TEXT_KINDS

    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAPID_NUM_THREADS", "1")  # one core per cell: the host is the cost
    stop_at = time.monotonic() + args.deadline
    cells = [(text, kind) for text in TEXT_KINDS for kind in QUESTION_KINDS]
    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(lambda c: cell_phases(c, args, stop_at), cells):
            print(line, flush=True)


def merge(args: argparse.Namespace) -> None:
    """One report of `phase` from every cell's results.json (write_report, as one run)."""
    from rapid_integrations.bench.report import write_report

    files = sorted(args.folder.glob(f"*/{args.phase}/results.json"))
    if not files:
        sys.exit(f"no {args.phase} results under {args.folder}")
    runs = [json.loads(f.read_text()) for f in files]
    derived = ("summary", "accuracy_cells", "speed_figures", "records", "schema_version")
    meta = {k: v for k, v in runs[0].items() if k not in derived}  # write_report derives these
    meta["cells"] = [str(f.parent.parent.name) for f in files]
    # A phase stopped at the deadline saved its tasks but not its wall time.
    meta["wall_seconds"] = max(r.get("wall_seconds", 0.0) for r in runs)
    meta["stopped_cells"] = [
        str(f.parent.parent.name)
        for f, r in zip(files, runs, strict=True)
        if "wall_seconds" not in r
    ]
    records = [record for r in runs for record in r["records"]]
    out = args.folder / f"merged-{args.phase}"
    write_report(out, meta, records, plots=False)
    print(f"{len(files)} cells, {len(records)} records: {out}/results.md")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run every cell's phases")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--jobs", type=int, default=1, help="cells at once")
    r.add_argument("--tasks", type=int, default=5, help="tasks per cell and half")
    r.add_argument("--device")
    r.add_argument("--dtype", default="auto")
    r.add_argument("--deadline", type=float, default=1e9, help="seconds: no phase runs past it")
    r.add_argument("bench_args", nargs="*", help="more `rapid bench` options, after --")
    m = sub.add_parser("merge", help="one report of a phase from every cell")
    m.add_argument("folder", type=Path)
    m.add_argument("--phase", choices=sorted(PHASES), required=True)
    args = p.parse_args()
    run(args) if args.command == "run" else merge(args)


if __name__ == "__main__":
    main()
