"""The service sizes itself from the CPUs it may use: affinity, capped by a cgroup CPU quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from burstcv_serving import settings as serving_settings
from burstcv_serving.settings import cgroup_cpu_quota


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cgroup_v2_quota_is_read_as_cpus(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "150000 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 1.5
    write(tmp_path / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None


def test_a_cgroup_v1_quota_is_read_as_cpus(tmp_path: Path) -> None:
    write(tmp_path / "cpu" / "cpu.cfs_quota_us", "200000\n")
    write(tmp_path / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 2.0
    write(tmp_path / "cpu" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    assert cgroup_cpu_quota(str(tmp_path / "nothing-here")) is None


def test_threads_follow_the_quota_not_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(serving_settings, "cgroup_cpu_quota", lambda: 1.5)
    assert serving_settings._host_cores() == 2  # a partial CPU still runs a thread
    monkeypatch.setattr(serving_settings, "cgroup_cpu_quota", lambda: None)
    assert serving_settings._host_cores() == 16
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(serving_settings, "cgroup_cpu_quota", lambda: 4.0)
    assert serving_settings._host_cores() == 1  # pinned to one CPU: one, whatever the quota
