"""How busy the host was while a measurement ran: real /proc figures, real CPU burners.

The burners are other processes spinning on the measurement's CPUs (``cpu_burners``), bounded
in time; a window the measurement's own processes keep busy must not read as busy.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from burstcv_testkit import cpu_burners

from burstcv.gate.interference import (
    BusyLimits,
    HostBusyError,
    QuietFigure,
    Window,
    calibration_kernel_ms,
    cpu_ticks,
    measure_quietly,
    psi_some_us,
    watch,
)
from burstcv_spec.contracts import CalibrationRecord, read_artifact

SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


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
    assert "(at most 25%)" in load.reason


def test_the_measurements_own_work_is_not_a_neighbours() -> None:
    # This process spinning, a service it started before the window (named), and a child it
    # starts and waits for within the window: all the measurement's own.
    service = subprocess.Popen([sys.executable, "-c", SPIN.format(s=2.0)])
    try:
        with watch(own_pids=[service.pid]) as window:
            spin(0.7)
            subprocess.run([sys.executable, "-c", SPIN.format(s=0.7)], check=True)
        load = window.close(BusyLimits())
    finally:
        service.kill()
        service.wait()
    assert not load.busy, load.reason
    assert load.own_cpu_s > 2.0  # 0.7 s here, 0.7 s in the child, ~1.4 s of the service


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


def test_a_calibration_kernel_slower_than_its_quiet_figure_makes_the_window_busy() -> None:
    with watch() as window:
        pass
    load = window.close(BusyLimits(), calibration_ms=61.0, quiet_ms=30.5)
    assert load.busy
    assert load.reason == (
        "the calibration kernel ran 2.0x its quiet time (61.0 ms vs 30.5 ms; at most 1.5x)"
    )
    assert (load.calibration_ms, load.calibration_quiet_ms) == (61.0, 30.5)
    with watch() as window:
        pass
    assert not window.close(BusyLimits(), calibration_ms=40.0, quiet_ms=30.5).busy


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
    record = read_artifact(str(figure.path), CalibrationRecord)
    (key,) = record.quiet_ms
    assert "numpy" in key and record.quiet_ms[key] == 35.5
    figure.path.write_text("{not json")  # type: ignore[union-attr]
    assert figure.read() is None  # a damaged file is a missing figure, and is rewritten
    figure.offer(36.0)
    assert figure.read() == 36.0
    assert QuietFigure(None).read() is None


def test_a_busy_measurement_is_repeated_then_taken_once_the_host_is_quiet(tmp_path: Path) -> None:
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
    psi = "some avg10=0.10 avg60=2.29 avg300=1.29 total=14815811\nfull avg10=0 total=0\n"
    assert psi_some_us(psi) == 14815811
    assert psi_some_us("full avg10=0 total=3\n") is None
    assert cpu_ticks(cpu_list()) > 0  # this host's own /proc/stat


def test_a_window_records_pressure_and_throttling_where_the_kernel_has_them() -> None:
    window = Window.open(cpu_list())
    load = window.close(BusyLimits())
    if Path("/proc/pressure/cpu").exists():
        assert load.psi_some_share is not None and 0.0 <= load.psi_some_share <= 1.0
    if load.throttled_s is not None:
        assert load.throttled_s >= 0.0
