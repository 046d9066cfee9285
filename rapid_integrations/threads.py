"""How many torch threads to decode with on a machine other processes may be using.

torch's OpenMP threads wait for each other at every operation; on a core shared with another
busy process, a waiting thread that spins steals the time the thread it waits for needs, and
decoding collapses (docs/performance.md, "On a busy machine"). Two measures:

* `prefer_passive_wait()` sets `OMP_WAIT_POLICY=PASSIVE` (waiting threads sleep) when the
  package is imported, with `setdefault`: a user's value is kept. OpenMP reads it once, when
  torch loads, so it only helps where `rapid_integrations` is imported before torch.
* `configure_torch_threads()` runs once per engine build and sets torch's intra-op thread
  count to the usable CPUs minus those other processes keep busy (at least 1). Busy is
  sampled from /proc/stat over `SAMPLE_SECONDS`, not read from the 1-minute load average:
  that average lags, so an engine built within a minute after another heavy process ended
  took the whole machine for busy and decoded on 1 thread of 2. The load average remains
  where /proc/stat is missing.
  `RAPID_NUM_THREADS` (a positive integer, or "auto" for the rule) replaces the pick. A
  user's own setting is never changed: OMP_NUM_THREADS or MKL_NUM_THREADS set, or a torch
  thread count that is neither torch's default nor the count set here last.

The count is not re-checked per generate call: `torch.set_num_threads` is process-wide, so a
change between calls would reach every model and every concurrent call of the process (a
server's worker threads) mid-step; a count chosen once per engine is predictable.

Imports no torch at module top (the package imports this module before torch loads).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import RapidConfigError

log = logging.getLogger(__name__)

ENV = "RAPID_NUM_THREADS"
"""Replaces the automatic pick: a positive integer, or "auto" (empty counts as unset)."""
TORCH_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""A user's own thread settings for torch: when either is set, the count is left alone."""
CGROUP = Path("/sys/fs/cgroup")
STAT = Path("/proc/stat")
SAMPLE_SECONDS = 0.1
"""How long the CPUs' use is sampled when an engine is built: 10 ticks of a 100 Hz clock."""
LOAD_SECONDS = 60.0
"""Time constant of the 1-minute load average (its exponential decay)."""

_applied: int | None = None
"""The count `configure_torch_threads` set last (to tell it from a user's)."""


def prefer_passive_wait(environ: os._Environ[str] | dict[str, str] = os.environ) -> None:
    """`OMP_WAIT_POLICY=PASSIVE` unless already set; called at package import."""
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "torch" in sys.modules:
        log.debug("torch was imported before rapid_integrations: OMP_WAIT_POLICY comes too late")


def cgroup_cpus(root: Path = CGROUP) -> float | None:
    """CPUs the cgroup quota allows (v2 cpu.max, else v1 cfs files); None without a quota."""
    v2 = root / "cpu.max"
    if v2.is_file():
        quota, _, period = v2.read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    for folder in (root / "cpu", root / "cpu,cpuacct", root):
        quota_file, period_file = folder / "cpu.cfs_quota_us", folder / "cpu.cfs_period_us"
        if quota_file.is_file() and period_file.is_file():
            quota_us = int(quota_file.read_text())
            return None if quota_us <= 0 else quota_us / int(period_file.read_text())
    return None


def usable_cpus(affinity: set[int] | None = None, root: Path = CGROUP) -> int:
    """CPUs this process may run on: its affinity, capped by the cgroup quota (at least 1)."""
    cpus = len(affinity if affinity is not None else os.sched_getaffinity(0))
    quota = cgroup_cpus(root)
    return max(1, min(cpus, math.floor(quota)) if quota is not None else cpus)


def own_load(cpu_seconds: float, age_seconds: float) -> float:
    """Our process's estimated share of the 1-minute load average: its mean rate of CPU use
    (CPUs) over its life, damped as the load average damps a process `age_seconds` old."""
    if age_seconds <= 0:
        return 0.0
    return cpu_seconds / age_seconds * (1 - math.exp(-age_seconds / LOAD_SECONDS))


def busy_cpus(load: float, own: float, usable: int, online: int) -> int:
    """Usable CPUs other processes keep busy: the load average without our own share, the
    whole machine's scaled to the `usable` of its `online` CPUs, rounded."""
    return max(0, round((load - own) * usable / max(online, usable)))


def machine_ticks(stat: str) -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs from /proc/stat's first line (user, nice, system,
    idle, iowait, irq, softirq, steal): idle and iowait are not busy; guest time is already
    counted in user."""
    ticks = [int(value) for value in stat.split("\n", 1)[0].split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def busy_between(
    before: tuple[int, int], after: tuple[int, int], own_cpus: float, online: int
) -> float:
    """CPUs other processes kept busy between two `machine_ticks` readings: the machine's busy
    share times its `online` CPUs, less the `own_cpus` this process used meanwhile."""
    (busy0, total0), (busy1, total1) = before, after
    if total1 <= total0:
        return 0.0
    return max(0.0, (busy1 - busy0) / (total1 - total0) * online - own_cpus)


def pick_threads(usable: int, busy: int) -> int:
    """The usable CPUs minus the busy ones, at least 1."""
    return max(1, usable - busy)


def env_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """`RAPID_NUM_THREADS` as a count; None when unset, empty or "auto"."""
    raw = environ.get(ENV, "").strip()
    if raw.lower() in ("", "auto"):
        return None
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    raise RapidConfigError(ENV, f"must be a positive integer or 'auto', got {raw!r}")


@dataclass(frozen=True)
class ThreadChoice:
    """What `configure_torch_threads` did: the count torch now has, and why."""

    threads: int
    reason: str
    changed: bool


def configure_torch_threads(environ: Mapping[str, str] = os.environ) -> ThreadChoice:
    """Set torch's intra-op threads for an engine (module docstring); a bad `RAPID_NUM_THREADS`
    raises `RapidConfigError` even where a user setting wins."""
    global _applied
    import torch

    asked = env_threads(environ)
    current = torch.get_num_threads()
    explicit = [name for name in TORCH_ENV if environ.get(name)]
    if explicit or current not in (torch_default_threads(), _applied):
        why = f"{' and '.join(explicit)} set" if explicit else "torch.set_num_threads was called"
        return _log(ThreadChoice(current, f"left alone: {why}", False))
    if asked is not None:
        threads, reason = asked, f"{ENV}={asked}"
    else:
        threads, reason = _auto_pick()
    torch.set_num_threads(threads)
    _applied = threads
    return _log(ThreadChoice(threads, reason, threads != current))


def _auto_pick() -> tuple[int, str]:
    usable = usable_cpus()
    online = os.cpu_count() or usable
    sampled = _sample_busy(online)
    if sampled is not None:
        busy = busy_cpus(sampled, 0.0, usable, online)
        return pick_threads(usable, busy), f"{usable} usable CPUs, {busy} busy ({sampled:.2f} now)"
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return usable, f"{usable} usable CPUs, no load average"
    times = os.times()
    own = own_load(times.user + times.system, _process_age())
    busy = busy_cpus(load, own, usable, online)
    threads = pick_threads(usable, busy)
    return threads, f"{usable} usable CPUs, {busy} busy (load {load:.2f}, ours {own:.2f})"


def _sample_busy(online: int) -> float | None:
    """CPUs other processes use over the next `SAMPLE_SECONDS`; None without /proc/stat."""
    try:
        before, own = machine_ticks(STAT.read_text()), sum(os.times()[:2])
        time.sleep(SAMPLE_SECONDS)
        after, own = machine_ticks(STAT.read_text()), sum(os.times()[:2]) - own
    except (OSError, ValueError, IndexError):
        return None
    return busy_between(before, after, own / SAMPLE_SECONDS, online)


def _process_age() -> float:
    """Seconds since this process started (Linux /proc); 0 where unknown."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def torch_default_threads(affinity: set[int] | None = None) -> int:
    """torch's own default count: its MKL build starts with one thread per physical core of
    the CPUs it may use (Linux topology files), else one per CPU."""
    cpus = affinity if affinity is not None else os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            cores.add((package, (topology / "core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def _log(choice: ThreadChoice) -> ThreadChoice:
    log.debug("torch threads %d (%s)", choice.threads, choice.reason)
    return choice
