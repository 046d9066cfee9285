"""How many torch threads to decode with on a machine other processes may be using.

torch's OpenMP threads wait for each other at every operation; on a core shared with another
busy process, a waiting thread that spins steals the time the thread it waits for needs, and
decoding collapses (docs/performance.md, "On a busy machine"). So the engine never runs more
threads than there are CPUs nobody else keeps busy, and keeps checking while it decodes:

* `configure_torch_threads()` runs once per engine build and sets torch's intra-op thread
  count to the usable CPUs (affinity, cgroup quota) minus those other processes keep busy
  (at least 1). Busy is sampled from /proc/stat over `SAMPLE_SECONDS`, not read from the
  1-minute load average: that average lags, so an engine built within a minute after another
  heavy process ended took the whole machine for busy and decoded on 1 thread of 2. The load
  average remains where /proc/stat is missing.
* `follow_load()` runs at every pass (a call alone) and every batch step (the batcher's
  thread). At most every `REPICK_SECONDS` per decoding thread it re-reads /proc/stat and sets
  that thread's count to the CPUs other processes left free over the time since the last
  reading, shared among the threads of this process decoding at the time. A competitor that
  starts mid-call costs at most `REPICK_SECONDS` of spinning; one that stops gives the CPUs
  back as fast. torch's count is per calling thread in OpenMP (`omp_set_num_threads` sets
  the caller's own value), so the change reaches the decoding thread's next pass only.
  A count that changes mid-call may change float sums' order, as any other thread count does;
  a deterministic call (`RapidConfig.deterministic`, invariant.py) computes the same bits on
  any count, so it is followed all the same.
* OpenMP's wait is left as it is (torch's default spins a while, then sleeps): the passive
  wait `OMP_WAIT_POLICY=PASSIVE` that this module once set cost solo decoding 14-26%
  (many small operations each paid a wake-up), and with no more threads than free CPUs a
  spinning thread has a core of its own.

`RAPID_NUM_THREADS` (a positive integer, or "auto" for the rule) replaces the pick; a number
is kept for good (not followed). A user's own setting is never changed: OMP_NUM_THREADS or
MKL_NUM_THREADS set, or a torch thread count that is neither torch's default nor the count
set here last.

Imports no torch at module top: torch loads where a count is read or set.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from rapid_integrations.errors import RapidConfigError

log = logging.getLogger(__name__)

ENV = "RAPID_NUM_THREADS"
"""Replaces the automatic pick: a positive integer, or "auto" (empty counts as unset)."""
TORCH_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""A user's own thread settings for torch: when either is set, the count is left alone."""
CGROUP = Path("/sys/fs/cgroup")
STAT = Path("/proc/stat")
SAMPLE_SECONDS = 0.1
"""How long the CPUs' use is sampled when an engine is built: 10 ticks of a 100 Hz clock."""
REPICK_SECONDS = 0.5
"""How often a decoding thread re-picks its count (`follow_load`): 50 ticks of a 100 Hz clock
per CPU, and a pass or two of decoding on a competitor's core."""
LOAD_SECONDS = 60.0
"""Time constant of the 1-minute load average (its exponential decay)."""

_applied: int | None = None
"""The count `configure_torch_threads` or `follow_load` set last (to tell it from a user's)."""


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
    global _applied, _follower
    import torch

    asked = env_threads(environ)
    current = torch.get_num_threads()
    explicit = [name for name in TORCH_ENV if environ.get(name)]
    _follower = None
    if explicit or current not in (torch_default_threads(), _applied):
        why = f"{' and '.join(explicit)} set" if explicit else "torch.set_num_threads was called"
        return _log(ThreadChoice(current, f"left alone: {why}", False))
    if asked is not None:
        threads, reason = asked, f"{ENV}={asked}"
    else:
        threads, reason, _follower = _auto_pick()
    torch.set_num_threads(threads)
    _applied = threads
    return _log(ThreadChoice(threads, reason, threads != current))


def _auto_pick() -> tuple[int, str, LoadFollower | None]:
    """The count by load, why, and the follower that keeps it up to date from the sample's
    last reading (None without /proc/stat: nothing to follow)."""
    usable = usable_cpus()
    online = os.cpu_count() or usable
    sample = _sample_busy(online)
    if sample is not None:
        sampled, last = sample
        busy = busy_cpus(sampled, 0.0, usable, online)
        threads = pick_threads(usable, busy)
        reason = f"{usable} usable CPUs, {busy} busy ({sampled:.2f} now)"
        return threads, reason, LoadFollower(usable, online, threads, last)
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return usable, f"{usable} usable CPUs, no load average", None
    times = os.times()
    own = own_load(times.user + times.system, _process_age())
    busy = busy_cpus(load, own, usable, online)
    threads = pick_threads(usable, busy)
    return threads, f"{usable} usable CPUs, {busy} busy (load {load:.2f}, ours {own:.2f})", None


def _sample_busy(online: int) -> tuple[float, CpuReading] | None:
    """CPUs other processes use over the next `SAMPLE_SECONDS`, and the reading at its end;
    None without /proc/stat."""
    before = read_cpus()
    time.sleep(SAMPLE_SECONDS)
    after = read_cpus()
    return None if before is None or after is None else (after.busy_since(before, online), after)


@dataclass(frozen=True)
class CpuReading:
    """The machine's CPU ticks and this process's own CPU time, at one moment."""

    at: float  # time.monotonic(), seconds
    ticks: tuple[int, int]  # `machine_ticks`: (busy, total)
    own_seconds: float  # this process's user + system CPU time

    def busy_since(self, before: CpuReading, online: int) -> float:
        """CPUs other processes kept busy between `before` and this reading."""
        seconds = self.at - before.at
        own = (self.own_seconds - before.own_seconds) / seconds if seconds > 0 else 0.0
        return busy_between(before.ticks, self.ticks, own, online)


def read_cpus() -> CpuReading | None:
    """A `CpuReading` now; None without /proc/stat."""
    try:
        ticks = machine_ticks(STAT.read_text())
    except (OSError, ValueError, IndexError):
        return None
    return CpuReading(time.monotonic(), ticks, sum(os.times()[:2]))


class LoadFollower:
    """The decoding threads' counts, re-picked from the load as they decode (module
    docstring): the CPUs other processes left free since the last reading, shared among
    the threads of this process that picked within `ACTIVE_SECONDS`."""

    ACTIVE_SECONDS = 4 * REPICK_SECONDS
    """A thread that picked this recently is still decoding (a long prefill pass included)."""

    def __init__(
        self,
        usable: int,
        online: int,
        free: int,
        last: CpuReading | None,
        read: Callable[[], CpuReading | None] = read_cpus,
    ) -> None:
        """`free`: the CPUs picked at the engine's build, until the first interval since
        `last` (the build's reading) is measured."""
        self.usable, self.online, self._read = usable, online, read
        self.default = torch_default_threads()  # a count still ours (`follow_load`)
        self._lock = threading.Lock()
        self._last = last
        self._free = free  # CPUs left free over the last interval measured
        self._picked: dict[int, float] = {}  # decoding thread id -> when it last picked

    def due(self, thread: int, now: float) -> int | None:
        """`thread`'s count, where its re-pick is due at `now` (monotonic seconds); else
        None (the fast path of every pass)."""
        with self._lock:
            last = self._picked.get(thread)
            if last is not None and now - last < REPICK_SECONDS:
                return None
            self._picked[thread] = now
            self._picked = {
                t: at for t, at in self._picked.items() if now - at <= self.ACTIVE_SECONDS
            }
            self._measure(now)
            return max(1, self._free // len(self._picked))

    def _measure(self, now: float) -> None:
        if self._last is not None and now - self._last.at < REPICK_SECONDS:
            return  # another thread measured just now
        reading = self._read()
        if reading is None or self._last is None:
            self._last = reading
            return
        busy = reading.busy_since(self._last, self.online)
        self._free = pick_threads(self.usable, busy_cpus(busy, 0.0, self.usable, self.online))
        self._last = reading


_follower: LoadFollower | None = None
"""Set by `configure_torch_threads` where it picked by load; None: counts stay as they are."""
_thread_applied = threading.local()  # .count: what `follow_load` set in this thread last


def follow_load() -> None:
    """At a pass or step boundary of a decoding thread: re-pick its count (module docstring).
    A count the user set in this thread meanwhile is left alone."""
    global _applied
    follower = _follower
    if follower is None:
        return
    count = follower.due(threading.get_ident(), time.monotonic())
    if count is None:
        return
    import torch

    current = torch.get_num_threads()
    ours = (_applied, getattr(_thread_applied, "count", None), follower.default)
    if current != count and current in ours:
        torch.set_num_threads(count)
        _thread_applied.count = _applied = count


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
