"""The torch thread policy (rapid_integrations/runtime/threads.py) on fake cgroup files and loads."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading

import pytest
import torch

from rapid_integrations.errors import RapidConfigError
from rapid_integrations.runtime import threads


def _write(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)
    return folder


def test_cgroup_v2_quota_and_no_quota(tmp_path):
    assert threads.cgroup_cpus(_write(tmp_path / "a", cpu__max="150000 100000\n")) == 1.5
    assert threads.cgroup_cpus(_write(tmp_path / "b", cpu__max="max 100000\n")) is None
    assert threads.cgroup_cpus(tmp_path / "none") is None


def test_cgroup_v1_quota(tmp_path):
    _write(tmp_path / "cpu", cpu__cfs_quota_us="200000\n", cpu__cfs_period_us="100000\n")
    assert threads.cgroup_cpus(tmp_path) == 2.0
    _write(tmp_path / "cpu", cpu__cfs_quota_us="-1\n")
    assert threads.cgroup_cpus(tmp_path) is None


def test_usable_cpus_is_affinity_capped_by_the_quota(tmp_path):
    assert threads.usable_cpus({0, 1, 2, 3}, tmp_path) == 4
    root = _write(tmp_path / "q", cpu__max="250000 100000")
    assert threads.usable_cpus({0, 1, 2, 3}, root) == 2
    assert threads.usable_cpus({0}, _write(tmp_path / "s", cpu__max="50000 100000")) == 1
    assert threads.usable_cpus() == len(os.sched_getaffinity(0))


def test_loadavg_rule_excludes_our_share():
    assert threads.busy_cpus(load=1.1, own=0.0, usable=2, online=2) == 1
    assert threads.busy_cpus(load=2.0, own=1.0, usable=2, online=2) == 1  # our own load
    assert threads.busy_cpus(load=0.3, own=0.6, usable=2, online=2) == 0
    assert threads.busy_cpus(load=8.0, own=0.0, usable=2, online=8) == 2  # scaled to ours
    assert threads.pick_threads(2, 1) == 1
    assert threads.pick_threads(2, 5) == 1
    assert threads.pick_threads(4, 0) == 4
    # Two CPUs' worth for one minute: the load average has reached 1 - 1/e of 2.
    assert threads.own_load(120.0, 60.0) == pytest.approx(2 * (1 - math.exp(-1)))
    assert threads.own_load(5.0, 0.0) == 0.0


@pytest.mark.parametrize("raw", ["0", "-2", "two", "1.5"])
def test_bad_env_value_names_the_variable(raw):
    with pytest.raises(RapidConfigError, match=r"RAPID_NUM_THREADS.*positive integer or 'auto'"):
        threads.env_threads({"RAPID_NUM_THREADS": raw})


def test_env_values():
    assert threads.env_threads({"RAPID_NUM_THREADS": " 3 "}) == 3
    assert threads.env_threads({"RAPID_NUM_THREADS": "AUTO"}) is None
    assert threads.env_threads({}) is None


@pytest.fixture
def restore_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_applied", None)
    monkeypatch.setattr(threads, "_follower", None)
    monkeypatch.setattr(threads, "_thread_applied", threading.local())
    monkeypatch.setattr(threads, "torch_default_threads", lambda: before)
    yield before
    torch.set_num_threads(before)


def test_override_sets_the_count(restore_threads):
    choice = threads.configure_torch_threads({"RAPID_NUM_THREADS": "1"})
    assert (torch.get_num_threads(), choice.reason) == (1, "RAPID_NUM_THREADS=1")
    # Ours, not the user's: a second engine may set it again.
    assert threads.configure_torch_threads({"RAPID_NUM_THREADS": "2"}).threads == 2


def test_auto_pick_uses_the_load_without_proc_stat(restore_threads, monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "STAT", threads.Path("/nonexistent/stat"))
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads, "_process_age", lambda: 0.0)  # no share of ours
    assert threads.configure_torch_threads({}).threads == 1 == torch.get_num_threads()


STAT_LINE = "cpu  {user} 0 {system} {idle} {iowait} 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"


def test_machine_ticks_count_idle_and_iowait_as_not_busy():
    stat = STAT_LINE.format(user=100, system=50, idle=800, iowait=50)
    assert threads.machine_ticks(stat) == (150, 1000)


def test_busy_between_two_readings_excludes_our_own_use():
    before, after = (150, 1000), (150 + 150, 1000 + 200)  # 2 CPUs, 100 ticks each, 150 busy
    assert threads.busy_between(before, after, own_cpus=0.0, online=2) == pytest.approx(1.5)
    assert threads.busy_between(before, after, own_cpus=1.0, online=2) == pytest.approx(0.5)
    assert threads.busy_between(before, after, own_cpus=2.0, online=2) == 0.0
    assert threads.busy_between(before, before, own_cpus=0.0, online=2) == 0.0  # no tick yet


def test_auto_pick_reads_the_cpus_now_not_the_lagging_load(restore_threads, monkeypatch, tmp_path):
    """A heavy process that ended seconds ago leaves the 1-minute load average near 2 on a
    2-CPU machine; the engine built then must still take both CPUs (it took 1 before)."""
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.0, 0.5))
    readings = iter([(0, 0, 800, 0), (0, 0, 1000, 0)])  # 200 idle ticks: nothing busy now

    def read_text(self):
        user, system, idle, iowait = next(readings)
        return STAT_LINE.format(user=user, system=system, idle=idle, iowait=iowait)

    monkeypatch.setattr(threads.Path, "read_text", read_text)
    monkeypatch.setattr(threads.time, "sleep", lambda seconds: None)
    choice = threads.configure_torch_threads({})
    assert choice.threads == 2 == torch.get_num_threads(), choice.reason


@pytest.mark.parametrize("name", threads.TORCH_ENV)
def test_user_env_is_left_alone(restore_threads, name):
    choice = threads.configure_torch_threads({name: "1", "RAPID_NUM_THREADS": "1"})
    assert not choice.changed and torch.get_num_threads() == restore_threads
    assert name in choice.reason


def test_user_set_num_threads_is_left_alone(restore_threads, monkeypatch):
    monkeypatch.setattr(threads, "torch_default_threads", lambda: restore_threads + 1)
    choice = threads.configure_torch_threads({"RAPID_NUM_THREADS": "1"})
    assert not choice.changed and torch.get_num_threads() == restore_threads
    with pytest.raises(RapidConfigError):  # a bad value is reported even then
        threads.configure_torch_threads({"RAPID_NUM_THREADS": "x"})


def test_torch_default_is_one_per_core_here():
    assert threads.torch_default_threads({0}) == 1
    assert threads.torch_default_threads() >= 1


def _wait_policy(env):
    code = "import os, sys, rapid_integrations; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return out.stdout.split()


def test_import_leaves_openmps_wait_alone():
    """The passive wait cost solo decoding 14-26% (threads.py); the counts keep spinning
    threads off busy cores instead."""
    assert _wait_policy({"OMP_WAIT_POLICY": None}) == ["None", "False"]
    assert _wait_policy({"OMP_WAIT_POLICY": "PASSIVE"}) == ["PASSIVE", "False"]


class FakeCpus:
    """/proc/stat and our CPU time as a test drives them: `run(seconds, others, ours)` passes
    `seconds` with `others` CPUs kept busy by other processes and `ours` by this one."""

    def __init__(self, online: int) -> None:
        self.online, self.at, self.busy, self.total, self.own = online, 0.0, 0, 0, 0.0

    def run(self, seconds: float, others: float, ours: float) -> float:
        ticks = round(100 * seconds)  # per CPU, at 100 Hz
        self.at += seconds
        self.busy += round(ticks * (others + ours))
        self.total += ticks * self.online
        self.own += seconds * ours
        return self.at

    def read(self) -> threads.CpuReading:
        return threads.CpuReading(self.at, (self.busy, self.total), self.own)


def test_the_follower_gives_a_decoding_thread_the_cpus_others_left_free():
    cpus = FakeCpus(online=2)
    follower = threads.LoadFollower(usable=2, online=2, free=2, last=cpus.read(), read=cpus.read)
    assert follower.due(thread=1, now=cpus.at) == 2  # the build's pick, until measured
    # A competitor starts: our 2 threads and it share 2 CPUs (2/3 of one each).
    now = cpus.run(0.3, others=0.67, ours=1.33)
    assert follower.due(1, now) is None  # not due within REPICK_SECONDS: the pass goes on
    now = cpus.run(0.3, others=0.67, ours=1.33)
    assert follower.due(1, now) == 1
    now = cpus.run(0.6, others=1.0, ours=1.0)  # on one thread, beside it
    assert follower.due(1, now) == 1
    now = cpus.run(0.6, others=0.0, ours=1.0)  # it stopped: both CPUs again
    assert follower.due(1, now) == 2


def test_the_follower_shares_the_free_cpus_among_our_decoding_threads():
    cpus = FakeCpus(online=4)
    follower = threads.LoadFollower(usable=4, online=4, free=4, last=cpus.read(), read=cpus.read)
    assert follower.due(thread=1, now=cpus.at) == 4
    now = cpus.run(0.6, others=1.0, ours=3.0)
    assert follower.due(2, now) == 1  # 3 free CPUs, 2 threads decoding
    assert follower.due(1, now) == 1
    now = cpus.run(0.6, others=0.0, ours=2.0)
    assert follower.due(1, now) == 2
    now = cpus.run(threads.LoadFollower.ACTIVE_SECONDS, others=0.0, ours=2.0)
    assert follower.due(1, now) == 4  # thread 2 has not decoded since: it finished


def test_the_follower_ignores_our_own_cpu_use_and_a_missing_proc_stat():
    cpus = FakeCpus(online=2)
    follower = threads.LoadFollower(usable=2, online=2, free=1, last=cpus.read(), read=cpus.read)
    now = cpus.run(0.6, others=0.0, ours=2.0)  # our own threads alone
    assert follower.due(1, now) == 2
    blind = threads.LoadFollower(usable=2, online=2, free=1, last=None, read=lambda: None)
    assert blind.due(1, 0.0) == blind.due(1, 10.0) == 1  # the build's pick stays


def test_follow_load_sets_the_decoding_threads_count_and_leaves_a_users_alone(
    restore_threads, monkeypatch
):
    cpus = FakeCpus(online=2)
    follower = threads.LoadFollower(usable=2, online=2, free=2, last=cpus.read(), read=cpus.read)
    monkeypatch.setattr(threads, "_follower", follower)
    monkeypatch.setattr(threads.time, "monotonic", lambda: cpus.at)
    torch.set_num_threads(2)
    follower.default = 2
    cpus.run(0.6, others=1.0, ours=1.0)
    threads.follow_load()
    assert torch.get_num_threads() == 1
    cpus.run(0.6, others=0.0, ours=1.0)
    threads.follow_load()
    assert torch.get_num_threads() == 2
    torch.set_num_threads(3)  # the user's own count, set meanwhile
    cpus.run(0.6, others=1.0, ours=1.0)
    threads.follow_load()
    assert torch.get_num_threads() == 3


def test_an_engine_built_with_a_fixed_count_or_without_proc_stat_is_not_followed(
    restore_threads, monkeypatch
):
    threads.configure_torch_threads({"RAPID_NUM_THREADS": "1"})
    assert threads._follower is None
    threads.configure_torch_threads({})
    assert threads._follower is not None
    monkeypatch.setattr(threads, "STAT", threads.Path("/nonexistent/stat"))
    threads.configure_torch_threads({})
    assert threads._follower is None  # nothing to follow: the load average's pick stays


def test_contention_summary_arithmetic():
    from rapid_integrations.bench.contention import markdown, summary

    def rec(policy, load, method, tokens, seconds):
        return {
            "context_label": 4096,
            "method": method,
            "policy": policy,
            "load": load,
            "new_tokens": tokens,
            "decode_seconds": seconds,
        }

    records = [
        rec("fixed", "solo", "lc", 100, 10.0),
        rec("fixed", "busy", "lc", 100, 50.0),
        rec("managed", "solo", "lc", 100, 10.5),
        rec("managed", "busy", "lc", 60, 10.0),
        rec("managed", "busy", "lc", 40, 10.0),  # pooled: 100 tokens in 20 s
        rec("managed", "late", "lc", 100, 25.0),
    ]
    fixed, managed = summary(records)
    assert fixed["policy"] == "fixed" and fixed["busy_over_solo"] == pytest.approx(0.2)
    assert fixed["late_over_solo"] is None  # not run
    assert managed["busy_over_solo"] == pytest.approx(5.0 / (100 / 10.5))
    assert managed["late_over_solo"] == pytest.approx(4.0 / (100 / 10.5))
    assert managed["solo_over_fixed_solo"] == pytest.approx(10 / 10.5)
    table = markdown([fixed, managed])
    assert "| 4096 | lc | managed | 9.5 | 5.0 | 4.0 | 0.53 | 0.42 | 0.95 |" in table
    assert "| 4096 | lc | fixed | 10.0 | 2.0 | – | 0.20 | – | 1.00 |" in table
