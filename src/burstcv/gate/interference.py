"""Tell how busy the host was while a measurement ran, so a gate verdict measures the model.

A *watch* records over its window others' CPU time on its CPUs (``/proc/stat``, less the
measurement's own), a calibration kernel timed against this host's quiet figure (it sees what
``/proc/stat`` cannot: a CPU quota, a slower clock, a noisy VM neighbour), CPU pressure (PSI)
and cgroup throttling. A busy window is measured again after a pause; a host that stays busy
makes the measurement inconclusive (:class:`HostBusyError`), not failed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np
import psutil

from burstcv_spec.contracts import (
    ArtifactError,
    CalibrationRecord,
    HostLoad,
    read_artifact,
    write_artifact,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat's user nice system irq softirq steal (guest: user)


@dataclass(frozen=True)
class BusyLimits:
    """Say when a host is too busy to measure on, and how long to wait for it to calm down."""

    others_share: float = 0.5  # of the watched CPUs' time taken by other processes
    slowdown: float = 1.5  # calibration kernel's time over its quiet figure
    throttled_share: float = 0.05  # of the window the own cgroup was throttled
    attempts: int = 3  # measurements tried before the verdict is inconclusive
    backoff_s: float = 5.0  # pause before the second attempt; doubled after each


class HostBusyError(RuntimeError, Generic[T]):
    """A measurement the host's other work spoiled at every attempt: inconclusive, not failed
    (``last``: the last result, kept for the record, not judged)."""

    def __init__(self, what: str, loads: list[HostLoad], last: T) -> None:
        self.what, self.loads, self.last = what, loads, last
        reasons = "; ".join(f"attempt {i}: {load.reason}" for i, load in enumerate(loads, start=1))
        super().__init__(
            f"{what}: inconclusive, the host was busy through {len(loads)} attempt(s) ({reasons})"
        )


def cpu_ticks(cpus: Sequence[int], text: str | None = None) -> float:
    """Return the busy seconds of ``cpus`` since boot, from ``/proc/stat`` (or ``text``)."""
    if text is None:
        text = Path("/proc/stat").read_text()
    wanted = {f"cpu{c}" for c in cpus}
    ticks = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            values = rest.split()
            ticks += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
    return ticks / os.sysconf("SC_CLK_TCK")


def psi_some_us(text: str | None = None) -> int | None:
    """Return the CPU pressure's ``some total`` (µs since boot), or None without PSI."""
    if text is None:
        try:
            text = Path("/proc/pressure/cpu").read_text()
        except OSError:
            return None
    for line in text.splitlines():
        if line.startswith("some "):
            fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
            with contextlib.suppress(KeyError, ValueError):
                return int(fields["total"])
    return None


def _cgroup_cpu_stat() -> Path | None:
    """Return the cpu.stat of this process's cgroup (v2, or v1's cpu controller)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hid == "0" and controllers == "":
            base = Path("/sys/fs/cgroup")
        elif "cpu" in controllers.split(","):
            base = Path("/sys/fs/cgroup") / controllers
        else:
            continue
        candidate = base / path.lstrip("/") / "cpu.stat"
        if candidate.is_file():
            return candidate
    return None


def throttled_s() -> float | None:
    """Return the seconds this process's cgroup has been throttled by its CPU quota, or None."""
    stat = _cgroup_cpu_stat()
    if stat is None:
        return None
    try:
        fields = dict(line.split() for line in stat.read_text().splitlines() if " " in line)
    except (OSError, ValueError):
        return None
    if "throttled_usec" in fields:  # cgroup v2
        return int(fields["throttled_usec"]) / 1e6
    if "throttled_time" in fields:  # cgroup v1, ns
        return int(fields["throttled_time"]) / 1e9
    return None


def _descendants() -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return list(psutil.Process().children(recursive=True))
    return []


def others_among_descendants(own_pids: Sequence[int]) -> set[int]:
    """Return the pids of this process's live descendants outside ``own_pids``' trees."""
    own: set[int] = set(own_pids)
    for pid in own_pids:
        with contextlib.suppress(psutil.Error):
            own.update(p.pid for p in psutil.Process(pid).children(recursive=True))
    return {p.pid for p in _descendants()} - own


def own_cpu_s(exclude: Collection[int] = (), *, include_self: bool = True) -> dict[int, float]:
    """Return the CPU seconds of this process (with the children it waited for) and of each
    live descendant not in ``exclude``, by pid; ``include_self=False``: the children's alone."""
    t = os.times()
    mine = t.user + t.system if include_self else 0.0
    times = {os.getpid(): mine + t.children_user + t.children_system}
    for child in _descendants():
        if child.pid in exclude:
            continue
        with contextlib.suppress(psutil.Error):
            c = child.cpu_times()
            times[child.pid] = c.user + c.system
    return times


def _own_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the own processes took between two samples (a new pid counts from 0)."""
    return sum(max(0.0, v - before.get(pid, 0.0)) for pid, v in after.items())


def calibration_kernel_ms(repeats: int = 3) -> float:
    """Return the median time (ms) of a fixed single-thread numpy kernel (~30 ms when quiet):
    longer than a scheduler slice, so a shared CPU shows as a slower run."""
    x = np.linspace(0.0, 1.0, 200_000)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = x
        for _ in range(100):
            y = np.sqrt(y * y + 1.0) - 0.5
        samples.append((time.perf_counter() - t0) * 1000)
    return float(np.median(samples))


def _host_key() -> str:
    return f"{platform.node()}|{platform.processor() or platform.machine()}|numpy {np.__version__}"


@dataclass
class QuietFigure:
    """The calibration kernel's fastest time on this host (``CalibrationRecord``, a file)."""

    path: Path | None

    def _record(self) -> CalibrationRecord:
        if self.path is None or not self.path.exists():
            return CalibrationRecord()
        try:
            return read_artifact(str(self.path), CalibrationRecord)
        except (OSError, ArtifactError):  # damaged: a missing figure, rewritten by offer
            return CalibrationRecord()

    def read(self) -> float | None:
        return self._record().quiet_ms.get(_host_key())

    def offer(self, ms: float) -> None:
        """Keep ``ms`` if it is faster than the figure so far (a quiet window's reading)."""
        if self.path is None or not math.isfinite(ms) or ms <= 0:
            return
        record = self._record()
        quiet = record.quiet_ms.get(_host_key())
        if quiet is not None and quiet <= ms:
            return
        updated = CalibrationRecord(quiet_ms={**record.quiet_ms, _host_key(): round(ms, 3)})
        with contextlib.suppress(OSError):
            write_artifact(str(self.path), updated)


def _now() -> float:
    return time.monotonic()


@contextlib.contextmanager
def running_on(cpus: Collection[int]) -> Iterator[None]:
    """Run this thread on ``cpus`` for a while (the threads and children it starts, too)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass(frozen=True)
class Placement:
    """Where a measurement runs: the measured service's CPUs and the load generator's
    (``isolated``: disjoint, so the service's CPUs carry the service and the host's others)."""

    service: list[int]
    generator: list[int]

    @property
    def isolated(self) -> bool:
        return not set(self.service) & set(self.generator)

    @classmethod
    def split(cls, cpus: Sequence[int]) -> Placement:
        """Give the load generator the first CPU and the service the rest (one CPU: both)."""
        cpus = sorted(cpus)
        return cls(service=cpus[1:] or cpus, generator=cpus[:1])


@dataclass
class Window:
    """What a watch sampled at its start; :meth:`close` turns it into a :class:`HostLoad`."""

    cpus: list[int]
    started: float = field(default_factory=_now)
    busy_s: float = 0.0
    own: dict[int, float] = field(default_factory=dict)
    neighbours: set[int] = field(default_factory=set)
    psi_us: int | None = None
    throttled: float | None = None
    # The load generator (this process) runs on other CPUs: only its children's time counts.
    isolated: bool = False

    @classmethod
    def open(
        cls, cpus: Sequence[int], own_pids: Sequence[int] = (), *, isolated: bool = False
    ) -> Window:
        window = cls(cpus=sorted(cpus), isolated=isolated)
        window.neighbours = others_among_descendants(own_pids)
        window.own = window._own_now()
        window.busy_s = cpu_ticks(window.cpus)
        window.psi_us = psi_some_us()
        window.throttled = throttled_s()
        window.started = _now()
        return window

    def _own_now(self) -> dict[int, float]:
        return own_cpu_s(self.neighbours, include_self=not self.isolated)

    def close(
        self,
        limits: BusyLimits,
        *,
        calibration_ms: float | None = None,
        quiet_ms: float | None = None,
    ) -> HostLoad:
        wall = max(_now() - self.started, 1e-6)
        busy = cpu_ticks(self.cpus) - self.busy_s
        own = _own_delta(self.own, self._own_now())
        # Ticks are coarse (10 ms): a share is never below zero nor above the whole.
        others = min(1.0, max(0.0, (busy - own) / (wall * max(1, len(self.cpus)))))
        psi_us = _grown(self.psi_us, psi_some_us())
        psi = None if psi_us is None else min(1.0, psi_us / 1e6 / wall)
        throttled = _grown(self.throttled, throttled_s())
        reasons = []
        if others > limits.others_share:
            reasons.append(
                f"other processes took {others:.0%} of CPUs {_cpu_list(self.cpus)} "
                f"(at most {limits.others_share:.0%})"
            )
        if calibration_ms is not None and quiet_ms is not None:
            slowdown = calibration_ms / quiet_ms
            if slowdown > limits.slowdown:
                reasons.append(
                    f"the calibration kernel ran {slowdown:.1f}x its quiet time "
                    f"({calibration_ms:.1f} ms vs {quiet_ms:.1f} ms; at most "
                    f"{limits.slowdown:g}x)"
                )
        if throttled is not None and throttled > limits.throttled_share * wall:
            reasons.append(
                f"the CPU quota throttled this cgroup for {throttled:.1f} s of {wall:.1f} s"
            )
        return HostLoad(
            cpus=self.cpus,
            wall_s=round(wall, 3),
            others_share=round(others, 4),
            own_cpu_s=round(own, 3),
            psi_some_share=None if psi is None else round(psi, 4),
            throttled_s=None if throttled is None else round(throttled, 3),
            calibration_ms=None if calibration_ms is None else round(calibration_ms, 3),
            calibration_quiet_ms=None if quiet_ms is None else round(quiet_ms, 3),
            busy=bool(reasons),
            reason="; ".join(reasons) or None,
        )


def _grown(before: float | None, after: float | None) -> float | None:
    """Return how much a counter grew (never below zero), or None where the kernel lacks it."""
    return None if before is None or after is None else max(0.0, after - before)


def _cpu_list(cpus: Sequence[int]) -> str:
    return ",".join(map(str, cpus)) if len(cpus) <= 8 else f"{cpus[0]}-{cpus[-1]}"


@contextlib.contextmanager
def watch(
    cpus: Sequence[int] | None = None, own_pids: Sequence[int] = (), *, isolated: bool = False
) -> Iterator[Window]:
    """Sample the host around a block; close the yielded window afterwards for its load (what
    runs on ``cpus`` besides this process, its children and ``own_pids`` is a neighbour)."""
    cpus = cpus if cpus is not None else sorted(os.sched_getaffinity(0))
    yield Window.open(cpus, own_pids, isolated=isolated)


def _on(cpus: Sequence[int] | None, kernel: Callable[[], float]) -> float:
    """Run the calibration kernel on ``cpus`` (None: wherever this thread runs)."""
    with running_on(cpus) if cpus is not None else contextlib.nullcontext():
        return kernel()


def measure_quietly(
    what: str,
    measure: Callable[[], T],
    *,
    limits: BusyLimits | None = None,
    quiet: QuietFigure | None = None,
    cpus: Sequence[int] | None = None,
    own_pids: Sequence[int] = (),
    isolated: bool = False,
    sleep: Callable[[float], None] = time.sleep,
    kernel: Callable[[], float] = calibration_kernel_ms,
    passes: Callable[[T], bool] | None = None,
) -> tuple[T, HostLoad]:
    """Run ``measure`` until a run of it finds the host quiet; return its result and load.
    ``own_pids``: the measurement's processes started before the call (the staging service);
    ``passes``: whether a busy result is kept even so (other work only slows it down)."""
    limits = limits or BusyLimits()
    quiet = quiet or QuietFigure(None)
    loads: list[HostLoad] = []
    for attempt in range(1, max(1, limits.attempts) + 1):
        result, load = _watched(measure, limits, quiet, cpus, own_pids, isolated, kernel)
        if not load.busy:
            if attempt > 1:
                log.info("%s: the host was quiet at attempt %d", what, attempt)
            return result, load
        if passes is not None and passes(result):
            log.warning(
                "%s: the host was busy (attempt %d: %s), and the figures pass even so: kept "
                "(a busy host only slows a measurement down)",
                what,
                attempt,
                load.reason,
            )
            return result, load
        loads.append(load)
        log.warning("%s: the host was busy (attempt %d): %s", what, attempt, load.reason)
        if attempt < limits.attempts:
            pause = limits.backoff_s * 2 ** (attempt - 1)
            log.info("%s: measuring again in %.0f s", what, pause)
            sleep(pause)
    raise HostBusyError(what, loads, result)


def _watched(
    measure: Callable[[], T],
    limits: BusyLimits,
    quiet: QuietFigure,
    cpus: Sequence[int] | None,
    own_pids: Sequence[int],
    isolated: bool,
    kernel: Callable[[], float],
) -> tuple[T, HostLoad]:
    """Run ``measure`` once in a watch, the calibration ``kernel`` before and after: the
    slower of the two is compared with the quiet figure, the faster offered as one."""
    kernel_cpus = cpus if isolated else None
    before = _on(kernel_cpus, kernel)
    with watch(cpus, own_pids, isolated=isolated) as window:
        result = measure()
    after = _on(kernel_cpus, kernel)
    load = window.close(limits, calibration_ms=max(before, after), quiet_ms=quiet.read())
    if load.others_share <= limits.others_share:
        quiet.offer(min(before, after))
    return result, load
