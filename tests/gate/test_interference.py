"""How busy the host was while a measurement ran: real /proc figures, real CPU burners.

The burners are other processes spinning on the measurement's CPUs (``cpu_burners``), bounded
in time; a window the measurement's own processes keep busy must not read as busy.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from burstcv_testkit import cpu_burners

from burstcv.gate.interference import (
    BusyLimits,
    HostBusyError,
    Placement,
    QuietFigure,
    Window,
    calibration_kernel_ms,
    cpu_ticks,
    measure_quietly,
    psi_some_us,
    running_on,
    throttled_s,
    watch,
)
from burstcv.gate.sizing import size_placement
from burstcv_spec.contracts import CalibrationRecord, HostLoad, read_artifact

SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"
# A worker of the service's worker, spinning: two levels below the service.
NESTED_SPIN = (
    f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {SPIN.format(s=5.0)!r}])"
)
# About 0.7 s of system time: copying from /dev/zero to /dev/null in 1 MiB reads.
KERNEL_WORK = (
    "import os, time\n"
    "src, dst = os.open('/dev/zero', os.O_RDONLY), os.open('/dev/null', os.O_WRONLY)\n"
    "end = time.monotonic() + 0.7\n"
    "while time.monotonic() < end:\n"
    "    os.write(dst, os.read(src, 1 << 20))\n"
)


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_quiet_window_is_quiet_and_says_what_it_watched() -> None:
    with watch() as window:
        time.sleep(1.0)
    load = window.close(BusyLimits())
    assert not load.busy and load.reason is None
    assert load.others_share < BusyLimits().others_share
    assert load.wall_s >= 1.0 and load.cpus


def test_other_processes_on_the_cpus_make_the_window_busy_naming_their_share() -> None:
    with cpu_burners(per_cpu=1, seconds=30), watch() as window:
        time.sleep(1.5)
        load = window.close(BusyLimits())  # while the neighbours still run
    assert load.busy
    assert load.others_share > 0.8  # one spinning process per CPU: nearly all their time
    assert load.reason is not None
    assert f"other processes took {load.others_share:.0%} of CPUs" in load.reason
    assert "(at most 50%)" in load.reason


def test_the_measurements_own_work_is_not_a_neighbours() -> None:
    # This process spinning, a service it started before the window (named), and a child it
    # starts and waits for within the window: all the measurement's own.
    # The service's own worker (a grandchild of this process) is the measurement's too.
    service = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {NESTED_SPIN!r}])",
        ]
    )
    time.sleep(0.3)  # its worker is running before the window opens
    try:
        with watch(own_pids=[service.pid]) as window:
            spin(0.7)
            subprocess.run([sys.executable, "-c", SPIN.format(s=0.7)], check=True)
            subprocess.run([sys.executable, "-c", KERNEL_WORK], check=True)
        load = window.close(BusyLimits())
    finally:
        for proc in [*psutil.Process(service.pid).children(recursive=True)]:
            proc.kill()
        service.kill()
        service.wait()
    assert not load.busy, load.reason
    assert load.others_share < 0.1  # the kernel time of the child it waited for included
    assert load.own_cpu_s > 2.0  # 0.7 s here, 0.7 s in the child, ~1.4 s of the service's


def test_a_descendant_that_is_not_the_measurements_is_a_neighbour() -> None:
    stranger = subprocess.Popen([sys.executable, "-c", SPIN.format(s=2.0)])
    try:
        with watch(cpus=[0, 1] if len(cpu_list()) > 1 else [0]) as window:
            time.sleep(1.5)
        load = window.close(BusyLimits(others_share=0.2))
    finally:
        stranger.kill()
        stranger.wait()
    assert load.busy and load.others_share >= 0.3


def cpu_list() -> list[int]:
    import os

    return sorted(os.sched_getaffinity(0))


def test_one_watched_cpu_kept_busy_is_all_taken() -> None:
    cpu = cpu_list()[-1]
    with cpu_burners(per_cpu=1, seconds=30, cpus=[cpu]), watch(cpus=[cpu]) as window:
        time.sleep(1.0)
        load = window.close(BusyLimits())
    assert load.cpus == [cpu] and load.others_share > 0.8


def test_the_service_gets_cpus_of_its_own_and_the_generator_the_first() -> None:
    two = Placement.split([1, 0])
    assert (two.service, two.generator, two.isolated) == ([1], [0], True)
    many = Placement.split([3, 0, 2, 1])
    assert (many.service, many.generator, many.isolated) == ([1, 2, 3], [0], True)
    one = Placement.split([5])  # nothing to split: they share it, and the window knows
    assert (one.service, one.generator, one.isolated) == ([5], [5], False)
    # The sizing places a service of each size on the last CPUs, as the benchmark does.
    assert size_placement([0, 1], 1) == two
    assert size_placement([0, 1, 2, 3], 2) == Placement(service=[2, 3], generator=[0, 1])
    every = size_placement([0, 1, 2, 3], 4)
    assert every.service == [0, 1, 2, 3] and every.generator == [0] and not every.isolated


needs_two_cpus = pytest.mark.skipif(len(cpu_list()) < 2, reason="isolation needs two CPUs")


@needs_two_cpus
def test_an_isolated_window_counts_its_services_not_the_generator_beside_it() -> None:
    place = Placement.split(cpu_list())
    with running_on(place.generator):
        # The service, pinned to its CPUs, spins; the generator (this process) spins on its
        # own CPU: neither is a neighbour of the service's CPUs.
        pinned = ",".join(map(str, place.service))
        spinning = SPIN.format(s=3.0)
        service = subprocess.Popen(["taskset", "-c", pinned, sys.executable, "-c", spinning])
        try:
            time.sleep(0.3)
            with watch(place.service, [service.pid], isolated=True) as window:
                spin(1.0)
                load = window.close(BusyLimits(others_share=0.2))
        finally:
            service.kill()
            service.wait()
    assert load.cpus == place.service and not load.busy, load.reason
    assert load.own_cpu_s > 0.8  # the service spun through the window: its own
    assert load.others_share < 0.15


@needs_two_cpus
def test_an_isolated_window_sees_a_neighbour_on_the_services_cpus_not_beside_them() -> None:
    place = Placement.split(cpu_list())
    with (
        running_on(place.generator),
        cpu_burners(per_cpu=1, seconds=30, cpus=place.service),
        watch(place.service, isolated=True) as window,
    ):
        time.sleep(1.0)
        busy = window.close(BusyLimits())
    assert busy.busy and busy.others_share > 0.8
    with (
        running_on(place.generator),
        cpu_burners(per_cpu=2, seconds=30, cpus=place.generator),
        watch(place.service, isolated=True) as window,
    ):
        time.sleep(1.0)
        beside = window.close(BusyLimits())
    assert not beside.busy and beside.others_share < 0.15, beside.reason


def test_shares_are_clamped_and_rounded_as_recorded() -> None:
    window = Window.open(cpu_list())
    window.busy_s -= 1000.0  # far more ticks than the window holds: coarse ticks, clamped
    window.started -= 0.5
    assert window.close(BusyLimits()).others_share == 1.0
    window = Window.open(cpu_list())
    window.busy_s -= 0.123456  # a share with more digits than are kept
    window.started -= 1.0
    load = window.close(BusyLimits())
    assert load.others_share == round(load.others_share, 4) and load.others_share > 0.05
    window = Window.open(cpu_list())
    window.throttled = None  # a cgroup that appeared during the window: nothing to compare
    assert window.close(BusyLimits()).throttled_s is None


def test_the_slower_kernel_run_decides_and_the_faster_is_kept_as_quiet(tmp_path: Path) -> None:
    quiet = QuietFigure(tmp_path / "calibration.json")
    quiet.offer(30.0)
    runs = iter([31.0, 61.0, 33.0, 32.0])  # attempt 1: slow after; attempt 2: quiet
    result, load = measure_quietly(
        "latency",
        lambda: "figures",
        limits=BusyLimits(others_share=1.0, attempts=2, backoff_s=0.0),
        quiet=quiet,
        sleep=lambda _: None,
        kernel=lambda: next(runs),
    )
    assert result == "figures" and load.calibration_ms == 33.0 and not load.busy
    assert quiet.read() == 30.0  # neither attempt ran faster than the recorded figure
    fresh = QuietFigure(tmp_path / "fresh.json")
    runs = iter([35.0, 31.5])
    # Only the kernel decides: other work on this (shared) host must not add an attempt.
    measure_quietly(
        "latency",
        lambda: 1,
        limits=BusyLimits(others_share=1.0, attempts=1),
        quiet=fresh,
        sleep=lambda _: None,
        kernel=lambda: next(runs),
    )
    assert fresh.read() == 31.5  # the faster of the two


def test_a_calibration_kernel_slower_than_its_quiet_figure_makes_the_window_busy() -> None:
    # Only the kernel decides here: a window this short is all tick noise for /proc/stat.
    limits = BusyLimits(others_share=1.0)
    with watch() as window:
        pass
    load = window.close(limits, calibration_ms=61.0, quiet_ms=30.5)
    assert load.busy
    assert load.reason == (
        "the calibration kernel ran 2.0x its quiet time (61.0 ms vs 30.5 ms; at most 1.5x)"
    )
    assert (load.calibration_ms, load.calibration_quiet_ms) == (61.0, 30.5)
    for calibration in (40.0, 45.75):  # 45.75 ms: exactly 1.5x, still quiet
        with watch() as window:
            pass
        assert not window.close(limits, calibration_ms=calibration, quiet_ms=30.5).busy


def test_the_calibration_kernel_runs_slower_beside_a_burner_on_its_cpu() -> None:
    import os

    cpu = cpu_list()[0]
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        quiet = min(calibration_kernel_ms() for _ in range(3))
        with cpu_burners(per_cpu=2, seconds=30, cpus=[cpu]):
            busy = calibration_kernel_ms()
    finally:
        os.sched_setaffinity(0, before)
    # Three runnable tasks on one CPU: the kernel gets about a third of it.
    assert busy > BusyLimits().slowdown * quiet


def test_the_quiet_figure_keeps_the_fastest_reading_per_host(tmp_path: Path) -> None:
    figure = QuietFigure(tmp_path / "bench" / "calibration.json")
    assert figure.read() is None
    figure.offer(40.0)
    figure.offer(50.0)  # slower: not a quieter reading
    assert figure.read() == 40.0
    figure.offer(35.5)
    assert figure.read() == 35.5
    figure.offer(35.12345)
    assert figure.read() == 35.123  # to the microsecond
    record = read_artifact(str(figure.path), CalibrationRecord)
    (key,) = record.quiet_ms
    assert "numpy" in key and record.quiet_ms[key] == 35.123
    figure.path.write_text("{not json")  # type: ignore[union-attr]
    assert figure.read() is None  # a damaged file is a missing figure, and is rewritten
    figure.offer(36.0)
    assert figure.read() == 36.0
    for nonsense in (0.0, -1.0, float("nan"), float("inf")):
        figure.offer(nonsense)  # never a figure to divide by
    assert figure.read() == 36.0
    assert QuietFigure(None).read() is None
    fast = QuietFigure(tmp_path / "fast.json")
    fast.offer(0.9)  # any positive time is a figure
    assert fast.read() == 0.9


def test_a_busy_measurement_is_repeated_then_taken_once_the_host_is_quiet(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="burstcv.gate.interference")
    pauses: list[float] = []
    runs: list[int] = []
    with cpu_burners(per_cpu=1, seconds=30) as burners:

        def pause(seconds: float) -> None:
            pauses.append(seconds)
            for proc in burners:  # the neighbour's job ends during the pause
                proc.kill()
                proc.wait()

        def measure() -> int:
            runs.append(len(runs) + 1)
            time.sleep(0.8)
            return runs[-1]

        result, load = measure_quietly(
            "latency",
            measure,
            limits=BusyLimits(attempts=3, backoff_s=5.0),
            quiet=QuietFigure(tmp_path / "calibration.json"),
            sleep=pause,
        )
    assert result == 2 and runs == [1, 2] and pauses == [5.0]
    assert not load.busy and load.calibration_ms is not None
    messages = [r.getMessage() for r in caplog.records]
    assert "latency: the host was quiet at attempt 2" in messages
    assert any(m.startswith("latency: the host was busy (attempt 1): other") for m in messages)


def test_a_quiet_host_is_measured_once_without_a_recorded_figure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="burstcv.gate.interference")
    result, load = measure_quietly("latency", lambda: "figures")
    assert not [r for r in caplog.records if "quiet at attempt" in r.getMessage()]
    assert result == "figures" and not load.busy
    assert load.calibration_quiet_ms is None  # nowhere to keep one: none to compare with


def test_a_busy_result_that_passes_even_so_is_kept_one_that_fails_is_measured_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="burstcv.gate.interference")
    pauses: list[float] = []
    limits = BusyLimits(attempts=2, backoff_s=1.0)
    with cpu_burners(per_cpu=1, seconds=30):
        kept, load = measure_quietly(
            "latency",
            lambda: time.sleep(0.8) or 7.0,
            limits=limits,
            sleep=pauses.append,
            passes=lambda p95: p95 <= 10.0,
        )
        assert kept == 7.0 and load.busy and pauses == []
        assert any("and the figures pass even so: kept" in m for m in caplog.messages)
        with pytest.raises(HostBusyError) as caught:
            measure_quietly(
                "latency",
                lambda: time.sleep(0.8) or 70.0,
                limits=limits,
                sleep=pauses.append,
                passes=lambda p95: p95 <= 10.0,
            )
    assert caught.value.last == 70.0 and len(caught.value.loads) == 2 and pauses == [1.0]


def test_one_attempt_means_no_repeat() -> None:
    pauses: list[float] = []
    with cpu_burners(per_cpu=1, seconds=30), pytest.raises(HostBusyError) as caught:
        measure_quietly(
            "sizing",
            lambda: time.sleep(0.8),
            limits=BusyLimits(attempts=1),
            sleep=pauses.append,
        )
    assert len(caught.value.loads) == 1 and pauses == []


def test_a_host_busy_at_every_attempt_is_inconclusive_with_each_reason(tmp_path: Path) -> None:
    pauses: list[float] = []
    with cpu_burners(per_cpu=1, seconds=30), pytest.raises(HostBusyError) as caught:
        measure_quietly(
            "latency of the candidate",
            lambda: time.sleep(0.8) or "figures",
            limits=BusyLimits(attempts=3, backoff_s=2.0),
            quiet=QuietFigure(tmp_path / "calibration.json"),
            sleep=pauses.append,
        )
    error = caught.value
    assert pauses == [2.0, 4.0]  # doubled after each busy attempt
    assert len(error.loads) == 3 and all(load.busy for load in error.loads)
    assert error.last == "figures"  # kept for the record, not judged
    message = str(error)
    assert message.startswith(
        "latency of the candidate: inconclusive, the host was busy through 3 attempt(s)"
    )
    assert "attempt 1: other processes took" in message and "attempt 3:" in message
    # Nothing busy was recorded as the host's quiet figure.
    assert QuietFigure(tmp_path / "calibration.json").read() is None


def test_a_windows_figures_are_computed_from_its_readings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from burstcv.gate import interference

    me = os.getpid()
    readings: dict[str, Any] = {}
    monkeypatch.setattr(interference, "_now", lambda: readings["now"])
    monkeypatch.setattr(interference, "cpu_ticks", lambda cpus, text=None: readings["busy"])
    monkeypatch.setattr(
        interference, "own_cpu_s", lambda exclude=(), include_self=True: readings["own"]
    )
    monkeypatch.setattr(interference, "psi_some_us", lambda text=None: readings["psi"])
    monkeypatch.setattr(interference, "throttled_s", lambda: readings["throttled"])

    def window(**after: Any) -> HostLoad:
        readings.update(now=1000.0, busy=100.0, own={me: 10.0}, psi=1_000_000, throttled=5.0)
        opened = Window.open([0, 1])
        readings.update(after)
        return opened.close(BusyLimits(others_share=0.25), calibration_ms=30.12345, quiet_ms=30.0)

    # 2 s on 2 CPUs: 2.5 s busy, 1.5 s of it the measurement's (its pid, and a new child).
    at_limits = window(
        now=1002.0,
        busy=102.5,
        own={me: 11.0, me + 1: 0.5},
        psi=1_600_000,
        throttled=5.1,  # 5% of the window: the limit
    )
    assert at_limits.others_share == 0.25 and at_limits.own_cpu_s == 1.5
    assert at_limits.psi_some_share == 0.3 and at_limits.throttled_s == 0.1
    assert at_limits.wall_s == 2.0 and at_limits.calibration_ms == 30.123
    assert not at_limits.busy and at_limits.reason is None  # at each limit is not past it
    past = window(
        now=1002.0001234,
        busy=103.0,
        own={me: 11.0, me + 1: 0.5},
        psi=3_600_000,
        throttled=5.2001234,
    )
    assert past.busy and past.wall_s == 2.0
    assert past.others_share == round(1.5 / (2 * 2.0001234), 4)
    assert past.psi_some_share == 1.0  # clamped: a share of the window
    assert past.throttled_s == 0.2
    assert past.reason == (
        "other processes took 37% of CPUs 0,1 (at most 25%); "
        "the CPU quota throttled this cgroup for 0.2 s of 2.0 s"
    )
    # A process that was the measurement's at the start and is gone takes nothing back.
    gone = window(now=1002.0, busy=100.4, own={})
    assert gone.own_cpu_s == 0.0 and gone.others_share == 0.1
    # Nor does a pid that reads less than at the start (another process by the same pid).
    reused = window(now=1002.0, busy=100.4, own={me: 9.0})
    assert reused.own_cpu_s == 0.0 and reused.others_share == 0.1
    # Without PSI or cgroup figures at the end, there are none to report.
    blind = window(now=1002.0, busy=100.0, psi=None, throttled=None)
    assert blind.psi_some_share is None and blind.throttled_s is None
    # The window's own time never reads as zero: no division by it.
    instant = window(now=1000.0, busy=100.0)
    assert instant.wall_s == 0.0 and instant.others_share == 0.0


def test_the_proc_figures_are_read_as_the_kernel_writes_them() -> None:
    stat = (
        "cpu  10 0 10 100 0 0 0 0 0 0\n"
        "cpu0 100 5 50 1000 7 3 2 40 9 0\n"
        "cpu1 1 1 1 1000 0 0 0 0 0 0\n"
        "intr 1 2 3\n"
    )
    import os

    hz = os.sysconf("SC_CLK_TCK")
    # user nice system irq softirq steal; idle and iowait are not work, guest is in user.
    assert cpu_ticks([0], stat) == pytest.approx(200 / hz)
    assert cpu_ticks([0, 1], stat) == pytest.approx(203 / hz)
    assert cpu_ticks([7], stat) == 0.0
    # An older kernel's shorter line (no steal, guest): the fields it has.
    assert cpu_ticks([0], "cpu0 100 5 50 1000 7 3 2\n") == pytest.approx(160 / hz)
    psi = "some avg10=0.10 avg60=2.29 avg300=1.29 total=14815811\nfull avg10=0 total=0\n"
    assert psi_some_us(psi) == 14815811
    assert psi_some_us("full avg10=0 total=3\n") is None
    assert cpu_ticks(cpu_list()) > 0  # this host's own /proc/stat


def test_cpu_pressure_is_the_share_of_the_window_some_task_waited() -> None:
    if psi_some_us() is None:
        pytest.skip("this kernel has no PSI")
    window = Window.open(cpu_list())
    # As if some task had waited 0.5 s of a 2 s window before this one closes.
    window.psi_us = (window.psi_us or 0) - 500_000
    window.started -= 2.0
    load = window.close(BusyLimits())
    assert load.psi_some_share is not None
    assert 0.25 <= load.psi_some_share < 0.3
    assert load.psi_some_share == round(load.psi_some_share, 4)


def test_a_window_the_cpu_quota_throttled_is_busy() -> None:
    if throttled_s() is None:
        pytest.skip("no cgroup CPU statistics here")
    window = Window.open(cpu_list())
    window.throttled = (window.throttled or 0.0) - 1.0001234  # ~1 s of a 2 s window
    window.started -= 2.0
    load = window.close(BusyLimits())
    assert load.busy and load.throttled_s is not None and load.throttled_s >= 1.0
    assert load.throttled_s == round(load.throttled_s, 3)
    assert load.reason is not None
    assert load.reason.startswith("the CPU quota throttled this cgroup for 1.0 s of 2.0 s")


def test_a_window_records_pressure_and_throttling_where_the_kernel_has_them() -> None:
    window = Window.open(cpu_list())
    load = window.close(BusyLimits())
    if Path("/proc/pressure/cpu").exists():
        assert load.psi_some_share is not None and 0.0 <= load.psi_some_share <= 1.0
    if load.throttled_s is not None:
        assert load.throttled_s >= 0.0


@pytest.fixture
def cgroup_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Show this process the cgroup files under ``tmp_path`` (``proc/self/cgroup`` and
    ``sys/fs/cgroup/...``) in place of the kernel's; every other path is the real one."""
    from burstcv.gate import interference

    real = interference.Path

    def rooted(*parts: Any) -> Path:
        path: Path = real(*parts)
        text = str(path)
        if text in ("/proc/self/cgroup", "/sys/fs/cgroup") or text.startswith("/sys/fs/cgroup/"):
            return tmp_path / text.lstrip("/")
        return path

    monkeypatch.setattr(interference, "Path", rooted)
    return tmp_path


def write(root: Path, path: str, text: str) -> None:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text)


V2_STAT = "usage_usec 9000000\nuser_usec 6000000\nsystem_usec 3000000\nnr_periods 40\n"
V1_CGROUPS = (
    "12:memory:/docker/web:1\n"  # a cgroup's name may hold a colon: the path is all after two
    "4:cpu,cpuacct:/docker/web:1\n"
    "1:name=systemd:/docker/web:1\n"
    "0::/\n"
)


def test_the_cgroups_throttling_is_read_from_its_cpu_stat_in_either_hierarchy(
    cgroup_root: Path,
) -> None:
    # No /proc/self/cgroup (not Linux, or no cgroups): no figure, not a zero.
    assert throttled_s() is None
    # cgroup v2: the unified hierarchy's line, its cpu.stat in microseconds.
    write(cgroup_root, "proc/self/cgroup", "0::/user.slice/burstcv.service\n")
    assert throttled_s() is None  # listed, but no cpu.stat there
    stat = "sys/fs/cgroup/user.slice/burstcv.service/cpu.stat"
    write(cgroup_root, stat, V2_STAT)
    assert throttled_s() is None  # a cgroup without the cpu controller counts no throttling
    write(cgroup_root, stat, V2_STAT + "nr_throttled 3\nthrottled_usec 1500000\n")
    assert throttled_s() == 1.5
    # cgroup v1 (a hybrid host: v2 mounted beside, without a cpu.stat of its own): the cpu
    # controller's hierarchy, named by its controllers, in nanoseconds.
    write(cgroup_root, "proc/self/cgroup", V1_CGROUPS)
    assert throttled_s() is None  # not the v2 figure of another cgroup
    v1 = "nr_periods 5\nnr_throttled 1\nthrottled_time 250000000\n"
    write(cgroup_root, "sys/fs/cgroup/cpu,cpuacct/docker/web:1/cpu.stat", v1)
    assert throttled_s() == 0.25
    # An unreadable statistics file: no figure rather than a wrong one.
    write(cgroup_root, "sys/fs/cgroup/cpu,cpuacct/docker/web:1/cpu.stat", "nr_periods 5 extra\n")
    assert throttled_s() is None


def test_a_window_is_busy_when_its_cgroups_cpu_stat_says_it_was_throttled(
    cgroup_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The throttling the kernel counted during a window, read from the cgroup's own file; the
    other processes' share is not judged here (the limit is the whole), nor is the clock."""
    from burstcv.gate import interference

    clock = {"now": 100.0}
    monkeypatch.setattr(interference, "_now", lambda: clock["now"])
    stat = "sys/fs/cgroup/burstcv/cpu.stat"
    write(cgroup_root, "proc/self/cgroup", "0::/burstcv\n")
    limits = BusyLimits(others_share=1.0)

    def counted(throttled_us: int | None) -> None:
        """Write the cgroup's cpu.stat, throttled this long since boot (None: not counted)."""
        line = "" if throttled_us is None else f"throttled_usec {throttled_us}\n"
        write(cgroup_root, stat, V2_STAT + line)

    def window(before_us: int | None, after_us: int | None) -> HostLoad:
        """Return the load of a 2 s window the cgroup's counter went through these values."""
        counted(before_us)
        clock["now"] = 100.0
        opened = Window.open(cpu_list())
        counted(after_us)
        clock["now"] = 102.0
        return opened.close(limits)

    throttled = window(1_000_000, 2_500_000)  # 1.5 s of a 2 s window
    assert throttled.busy and throttled.throttled_s == 1.5
    assert throttled.reason == "the CPU quota throttled this cgroup for 1.5 s of 2.0 s"
    # The counter since boot is not the window's: an unthrottled window is quiet.
    quiet = window(1_000_000, 1_000_000)
    assert not quiet.busy and quiet.throttled_s == 0.0 and quiet.reason is None
    # At most 5% of the window: a little under is quiet, a little over is busy.
    assert not window(1_000_000, 1_099_000).busy
    assert window(1_000_000, 1_101_000).busy
    # A counter that went back (the cgroup made anew) throttled nothing in this window.
    assert window(2_000_000, 500_000).throttled_s == 0.0
    # Statistics that appear or vanish during the window: nothing to compare, not busy.
    for before_us, after_us in ((None, 9_000_000), (1_000_000, None)):
        load = window(before_us, after_us)
        assert load.throttled_s is None and not load.busy
