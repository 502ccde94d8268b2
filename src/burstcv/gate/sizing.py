"""Right-size the CPU serving fleet: measure, per CPU size, the load the service sustains.

Each size is a staging copy of the service pinned to that many CPUs, driven open-loop (clients
that wait would hide a slow service) at rising rates until p95 breaks the SLO or a request fails;
the cheapest fleet is priced from that, types larger than the host extrapolated and marked so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from burstcv.cost.model import DEFAULT_HEADROOM, fleet_cost, replicas_for
from burstcv.cost.pricing import instance_arch, instance_shapes, normal_arch
from burstcv.gate import loadgen
from burstcv.gate.interference import Placement, running_on
from burstcv.gate.latency import staging_process
from burstcv_spec.contracts import (
    ArtifactError,
    BoxSizing,
    FleetOption,
    LoadStep,
    ModelCard,
    PriceQuote,
    SizePoint,
    SizingReport,
    read_artifact,
    write_artifact,
)

log = logging.getLogger(__name__)

STEP_FACTOR = 1.5  # each rate tried is this much higher than the last that held
STEP_DURATION_S = 3.0
SCOUT_SHARE = 3.0  # a scouting step lasts a measuring step's length over this
SCOUT_FACTOR = 2.0  # ... and doubles the rate (only measuring steps give a size's figures)
MAX_RATE_RPS = 5000.0
MIN_RATE_RPS = 1.0
MIN_SCALING_EXPONENT = 0.5  # sizes beyond the host scale at least this well (at most linearly)
# The generator must send this many times a size's rate on time to a trivial endpoint, or the
# size is generator-bound: its rate is then the generator's, a lower bound of the service's.
GENERATOR_MARGIN = 1.25
GENERATOR_PROBE = 2.0  # ... and is first tried at this many times (where it outruns the service)
# The generator's own delay a check allows: a tenth of the SLO, and never under this (ms): a
# request over loopback takes about a millisecond however fast the generator is.
GENERATOR_DELAY_FLOOR_MS = 5.0
GENERATOR_CHECK_S = 1.0  # seconds each generator check drives the trivial endpoint for
FALLING_SHARE = 0.9  # a rate below this share of a smaller size's is a measurement error
GENERATOR_VERSION = 2  # bumped when the load generator changes: its sizes are measured again


@dataclass
class LoadRun:
    """What one open-loop run at a fixed rate measured."""

    rate_rps: float
    sent: int
    latencies_ms: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    lags_ms: list[float] = field(default_factory=list)

    @property
    def send_lag_p95_ms(self) -> float:
        """How late the requests left, p95 (ms): the generator's own lateness."""
        return float(np.percentile(self.lags_ms, 95)) if self.lags_ms else 0.0

    @property
    def errors(self) -> int:
        return sum(n for code, n in self.statuses.items() if code != "200")

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else math.inf

    @property
    def achieved_rps(self) -> float:
        return self.sent / self.wall_s if self.wall_s > 0 else 0.0


def open_loop(
    url: str,
    images: Sequence[bytes],
    *,
    rate_rps: float,
    duration_s: float = STEP_DURATION_S,
    timeout_s: float = 10.0,
    pool: loadgen.Senders | None = None,
) -> LoadRun:
    """Send predictions to ``url`` at ``rate_rps`` for ``duration_s``, whatever the answers do."""
    n = max(1, round(rate_rps * duration_s))
    load = loadgen.send(url, images, requests=n, rate_rps=rate_rps, timeout_s=timeout_s, pool=pool)
    return LoadRun(rate_rps, n, load.latencies, load.statuses, load.wall_s, load.lags)


def _holds(run: LoadRun, latency_slo_ms: float) -> bool:
    """A rate holds when nothing failed, p95 met the SLO, and the requests left on time."""
    return (
        run.errors == 0
        and run.percentile(95) <= latency_slo_ms
        and run.achieved_rps >= 0.9 * run.rate_rps
    )


def sustainable_rate(
    url: str,
    images: Sequence[bytes],
    *,
    latency_slo_ms: float,
    start_rps: float | None = None,
    step: float = STEP_FACTOR,
    duration_s: float = STEP_DURATION_S,
    max_rps: float = MAX_RATE_RPS,
    tried: list[LoadStep] | None = None,
    pool: loadgen.Senders | None = None,
    scout_s: float | None = None,
) -> LoadRun | None:
    """Step the open-loop rate up until the SLO breaks; return the last run that held, or None.
    ``scout_s``: short steps first double the rate until one breaks (a fast service is not
    climbed to at full length); only a measuring step's rate is returned."""

    def attempt(rate_rps: float, seconds: float = duration_s) -> tuple[LoadRun, bool]:
        run = open_loop(url, images, rate_rps=rate_rps, duration_s=seconds, pool=pool)
        held = _holds(run, latency_slo_ms)
        _record(run, held, seconds, seconds < duration_s, tried)
        return run, held

    if start_rps is None:  # a quarter of the rate one request's latency allows
        probe = open_loop(url, images, rate_rps=2.0, duration_s=1.0)
        start_rps = max(1.0, 250.0 / max(probe.percentile(50), 1.0))
    rate, broke_at = start_rps, math.inf
    if scout_s is not None and scout_s < duration_s:
        scouted = None
        while rate <= max_rps:
            _, held = attempt(rate, scout_s)
            if not held:
                broke_at = rate
                break
            scouted, rate = rate, rate * SCOUT_FACTOR
        # From the last scouting rate that held; below the first rate when even that broke.
        rate = scouted if scouted is not None else start_rps / (step * step)
    best = None
    # A first rate that already breaks the SLO: step down until one holds (or below 1 req/s).
    while rate >= MIN_RATE_RPS:
        first, held = attempt(rate)
        if held:
            best, rate = first, rate * step
            break
        broke_at = min(broke_at, rate)
        rate /= step * step
    if best is None:
        return None
    while rate <= max_rps and rate < broke_at:
        run, held = attempt(rate)
        if not held:
            break
        best, rate = run, rate * step
    rate = min(rate, broke_at)
    if rate <= max_rps:  # one more try between the last hold and the break
        between, held = attempt(math.sqrt(best.rate_rps * rate))
        if held:
            best = between
    return best


def _record(
    run: LoadRun, held: bool, seconds: float, scouting: bool, tried: list[LoadStep] | None
) -> None:
    p95 = run.percentile(95)
    log.info(
        "sizing: %.1f req/s%s: p95 %.1f ms, %d error(s), sent at %.1f req/s: %s",
        run.rate_rps,
        f" (scouting, {seconds:g} s)" if scouting else "",
        p95,
        run.errors,
        run.achieved_rps,
        "held" if held else "broke",
    )
    if tried is not None:
        tried.append(
            LoadStep(
                rate_rps=round(run.rate_rps, 2),
                p95_ms=round(p95, 3) if math.isfinite(p95) else 1e9,
                errors=run.errors,
                held=held,
                requests=sum(run.statuses.values()),
                seconds=round(seconds, 3),
                scouting=scouting,
            )
        )


@contextlib.contextmanager
def pinned_service(
    model_dir: str, cpus: Sequence[int], queue_delay_target_ms: float | None = None
) -> Iterator[tuple[str, psutil.Process]]:
    with staging_process(model_dir, cpus=cpus, queue_delay_target_ms=queue_delay_target_ms) as pair:
        yield pair[0], psutil.Process(pair[1].pid)


def _usage(proc: psutil.Process) -> tuple[float, float]:
    """Return the CPU seconds and resident MB of ``proc`` and its descendants."""
    cpu_s, rss = 0.0, 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = p.cpu_times()
            cpu_s += times.user + times.system
            rss += p.memory_info().rss
    return cpu_s, rss / 2**20


def host_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def size_placement(cpus: Sequence[int], vcpus: int) -> Placement:
    """Place the service on the last ``vcpus`` CPUs, the generator on the rest (else the first)."""
    cpus = sorted(cpus)
    cut = max(0, len(cpus) - vcpus)
    return Placement(service=cpus[cut:], generator=cpus[:cut] or cpus[:1])


def sizing_placement(max_vcpus: int | None = None) -> Placement:
    """Return where the sizing's largest service runs (its watched CPUs) and its generator."""
    cpus = host_cpus()
    return size_placement(cpus, min(len(cpus), max_vcpus or len(cpus)))


@dataclass(frozen=True)
class GeneratorCheck:
    """How the load generator fared against a trivial endpoint on a size's CPUs."""

    rps: float  # the rate it held, or the rate it reached when none of those tried held
    send_lag_p95_ms: float
    processes: int
    bound: bool  # it could not send GENERATOR_MARGIN times the size's rate on time


def generator_check(
    images: Sequence[bytes],
    *,
    service_cpus: Sequence[int] | None,
    rate_rps: float,
    latency_slo_ms: float,
    processes: int = 1,
    duration_s: float = STEP_DURATION_S,
) -> GeneratorCheck:
    """Measure whether the generator outruns ``rate_rps`` to a trivial endpoint on a size's CPUs."""
    with loadgen.trivial_endpoint(service_cpus) as url, loadgen.senders(processes) as pool:
        open_loop(url, images, rate_rps=20.0, duration_s=0.5)  # connections and caches warm
        for factor in (GENERATOR_PROBE, GENERATOR_MARGIN):
            run = open_loop(
                url, images, rate_rps=rate_rps * factor, duration_s=duration_s, pool=pool
            )
            bound = not _holds(run, max(latency_slo_ms / 10, GENERATOR_DELAY_FLOOR_MS))
            if not bound:
                break
    return GeneratorCheck(
        rps=round(min(run.achieved_rps, run.rate_rps) if bound else run.rate_rps, 2),
        send_lag_p95_ms=round(run.send_lag_p95_ms, 3),
        processes=processes,
        bound=bound,
    )


@dataclass
class _Search:
    """One search for a size's sustainable rate, and what the service spent on it."""

    best: LoadRun | None
    tried: list[LoadStep]
    cpu_s: float
    rss_mb: float


@dataclass(frozen=True)
class _Sizer:
    """Search one model's sizes, each on its :class:`Placement`, with these settings."""

    model_dir: str
    images: Sequence[bytes]
    latency_slo_ms: float
    step: float
    duration_s: float

    def search(self, place: Placement, start_rps: float | None, processes: int) -> _Search:
        images, slo = self.images, self.latency_slo_ms
        with (
            running_on(place.generator),
            pinned_service(self.model_dir, place.service, slo) as (url, proc),
            loadgen.senders(processes) as pool,  # started once, for every rate of the search
        ):
            open_loop(url, images, rate_rps=5.0, duration_s=1.0)  # warm-up
            before, _ = _usage(proc)
            tried: list[LoadStep] = []
            best = sustainable_rate(
                url,
                images,
                latency_slo_ms=slo,
                start_rps=start_rps,
                step=self.step,
                duration_s=self.duration_s,
                tried=tried,
                pool=pool,
                scout_s=self.duration_s / SCOUT_SHARE,
            )
            cpu_s, rss_mb = _usage(proc)
            return _Search(best, tried, cpu_s - before, rss_mb)

    def check(self, place: Placement, rate_rps: float, processes: int) -> GeneratorCheck:
        with running_on(place.generator):
            return generator_check(
                self.images,
                service_cpus=place.service,
                rate_rps=rate_rps,
                latency_slo_ms=self.latency_slo_ms,
                duration_s=min(self.duration_s, GENERATOR_CHECK_S),
                processes=processes,
            )

    def size(
        self, vcpus: int, place: Placement, start_rps: float | None
    ) -> tuple[SizePoint, float | None]:
        """Measure one size: its point and the rate that held (None: none did). A size the
        generator could not outrun is measured again from one process per generator CPU."""
        search, processes = self.search(place, start_rps, 1), 1
        if search.best is None:
            return SizePoint(
                vcpus=vcpus,
                measured=True,
                sustainable_rps=0.0,
                rss_mb=search.rss_mb,
                steps=search.tried,
            ), None
        check = self.check(place, search.best.rate_rps, processes)
        more = len(place.generator) if place.isolated else 1
        if check.bound and more > processes:
            log.info(
                "sizing: %d vCPU(s): the load generator could not send %g x %.1f req/s on time; "
                "measuring again from %d generator processes",
                vcpus,
                GENERATOR_MARGIN,
                search.best.rate_rps,
                more,
            )
            again = self.search(place, search.best.rate_rps, more)
            if again.best is not None and again.best.rate_rps >= search.best.rate_rps:
                again.tried[:0] = search.tried
                search, processes = again, more
                check = self.check(place, again.best.rate_rps, processes)
        best = search.best
        assert best is not None
        if check.bound:
            log.warning(
                "sizing: %d vCPU(s): %.1f req/s is the load generator's ceiling, not the "
                "service's (it sent at most %.1f req/s to a trivial endpoint): a lower bound",
                vcpus,
                best.rate_rps,
                check.rps,
            )
        requests = sum(s.requests for s in search.tried)
        point = SizePoint(
            vcpus=vcpus,
            measured=True,
            sustainable_rps=round(best.rate_rps, 2),
            p50_ms=round(best.percentile(50), 3),
            p95_ms=round(best.percentile(95), 3),
            p99_ms=round(best.percentile(99), 3),
            # The service's CPU over the whole search, shared by every request it got.
            cpu_s_per_request=round(search.cpu_s / max(1, requests), 5),
            rss_mb=round(search.rss_mb, 1),
            steps=search.tried,
            send_lag_p95_ms=round(best.send_lag_p95_ms, 3),
            generator_rps=check.rps,
            generator_processes=processes,
            generator_bound=check.bound,
            generator_shares_cpus=not place.isolated,
        )
        return point, best.rate_rps


def measure_sizes(
    model_dir: str,
    images: Sequence[bytes],
    *,
    latency_slo_ms: float,
    max_vcpus: int | None = None,
    duration_s: float = STEP_DURATION_S,
    step: float = STEP_FACTOR,
) -> list[SizePoint]:
    """Measure the sustainable rate at 1, 2, ... vCPUs (up to the host's, or ``max_vcpus``)."""
    sizer = _Sizer(model_dir, images, latency_slo_ms, step, duration_s)
    cpus = host_cpus()
    points: list[SizePoint] = []
    start = None
    for vcpus in range(1, min(len(cpus), max_vcpus or len(cpus)) + 1):
        point, held_rps = sizer.size(vcpus, size_placement(cpus, vcpus), start)
        points.append(point)
        if held_rps is not None:
            # The next size sustains at least about as much: its search starts a step below.
            start = held_rps / step
    return flag_falling(points)


def describe_generator(point: SizePoint) -> str:
    """Say how the load generator fared at a size against a trivial endpoint on its CPUs."""
    if point.generator_rps is None:
        return "-"
    text = (
        f"ceiling {point.generator_rps:.0f} req/s: the size's rate is a lower bound"
        if point.generator_bound
        else f"outran it: {point.generator_rps:.0f} req/s on time"
    )
    if (point.generator_processes or 1) > 1:
        text += f" ({point.generator_processes} processes)"
    if point.send_lag_p95_ms is not None:
        text += f"; sent {point.send_lag_p95_ms:.1f} ms late (p95)"
    if point.generator_shares_cpus:
        text += "; shared the service's CPUs"
    return text


def flag_falling(points: Sequence[SizePoint]) -> list[SizePoint]:
    """Mark each measured size whose rate fell below a smaller size's: a measurement error."""
    out: list[SizePoint] = []
    best: SizePoint | None = None
    for p in sorted(points, key=lambda p: p.vcpus):
        if not p.measured:
            out.append(p)
            continue
        if best is not None and p.sustainable_rps < FALLING_SHARE * best.sustainable_rps:
            shared = ", and the load generator shared this size's CPUs"
            why = (
                f"measurement error: {p.sustainable_rps:g} req/s at {p.vcpus} vCPUs is below "
                f"the {best.sustainable_rps:g} req/s measured at {best.vcpus} vCPU(s); a "
                "service does not slow down with more CPUs"
                + (shared if p.generator_shares_cpus else "")
                + f" (priced at {best.vcpus} vCPU(s)'s rate)"
            )
            log.warning("sizing: %s", why)
            p = p.model_copy(update={"anomaly": why})
        if best is None or p.sustainable_rps > best.sustainable_rps:
            best = p
        out.append(p)
    return out


def _basis(points: Sequence[SizePoint], vcpus: int) -> SizePoint | None:
    """Return the measured size a ``vcpus`` figure rests on: the fastest measured at or below
    it (a larger service is at least as fast as a smaller one; a rate that fell is an error)."""
    below = [p for p in points if p.measured and p.vcpus <= vcpus]
    return max(below, key=lambda p: (p.sustainable_rps, -p.vcpus), default=None)


def rate_at(points: Sequence[SizePoint], vcpus: int) -> tuple[float, bool]:
    """Return (sustainable req/s at ``vcpus``, extrapolated?) from the measured sizes."""
    measured = {p.vcpus for p in points if p.measured}
    top = max(measured)
    if vcpus in measured:
        basis = _basis(points, vcpus)
        assert basis is not None
        return basis.sustainable_rps, False
    at_top = _basis(points, top)
    assert at_top is not None
    if vcpus < top or at_top.sustainable_rps <= 0:
        return 0.0, True
    exponent = 1.0
    at_one = _basis(points, 1)
    if top > 1 and at_one is not None and at_one.sustainable_rps > 0:
        exponent = math.log(at_top.sustainable_rps / at_one.sustainable_rps) / math.log(top)
    exponent = min(1.0, max(MIN_SCALING_EXPONENT, exponent))
    return at_top.sustainable_rps * (vcpus / top) ** exponent, True


def generator_bound_at(points: Sequence[SizePoint], vcpus: int) -> bool:
    """Whether the ``vcpus`` figure rests on a size the load generator could not outrun."""
    top = max(p.vcpus for p in points if p.measured)
    basis = _basis(points, min(vcpus, top))
    return basis is not None and basis.generator_bound


@dataclass(frozen=True)
class GateLoad:
    """The open-loop load the latency gate drives each model with, and why that load."""

    rate_rps: float
    requests: int
    note: str


MIN_GATE_REQUESTS = 20  # fewer give a p95 from a handful of samples


def gate_load(
    sizing: SizingReport, vcpus: int, *, requests: int, max_s: float, rate_rps: float | None = None
) -> GateLoad:
    """Return the load the gate measures a model at on a ``vcpus``-CPU staging service, and why."""
    if rate_rps is not None:
        rate, note = rate_rps, f"the rate set (BURSTCV_BENCH_RATE_RPS={rate_rps:g})"
    else:
        sustainable, extrapolated = rate_at(sizing.sizes, vcpus)
        if sustainable <= 0:
            rate = MIN_RATE_RPS
            note = "the sizing's lowest rate: " + (
                f"nothing to extrapolate {vcpus} vCPU(s) from"
                if extrapolated
                else f"no rate held the SLO at {vcpus} vCPU(s)"
            )
        else:
            per_replica = sustainable * (1 - sizing.headroom)
            rate = min(per_replica, sizing.target_rps)
            note = (
                f"the most one replica carries: {sustainable:g} req/s sustainable at "
                f"{vcpus} vCPU(s) ({'extrapolated' if extrapolated else 'measured'}) less "
                f"{round(sizing.headroom * 100)}% headroom"
            )
            if sizing.target_rps < per_replica:
                note += f", capped at the run's expected peak load ({sizing.target_rps:g} req/s)"
    wanted = max(MIN_GATE_REQUESTS, math.ceil(rate * max_s))
    return GateLoad(rate_rps=round(rate, 3), requests=min(requests, wanted), note=note)


def fleet_options(
    points: Sequence[SizePoint],
    *,
    target_rps: float,
    prices: Sequence[PriceQuote],
    headroom: float = DEFAULT_HEADROOM,
    families: Sequence[str] | None = None,
    boxes: Sequence[BoxSizing] = (),
) -> list[FleetOption]:
    """Return every allowed type's fleet for ``target_rps``, best first: a type a sizing box
    measured rests on its box's sizes and ranks first; any other is extrapolated from ``points``."""
    usd = {q.instance_type: q.usd_per_hour for q in prices}
    measured_on = {
        b.instance_type: list(b.sizes)
        for b in boxes
        if b.skipped is None and any(p.measured for p in b.sizes)
    }
    arch = normal_arch(platform.machine())
    options = []
    for instance_type, (vcpus, memory_gib) in sorted(instance_shapes().items()):
        if families is not None and instance_type.split(".")[0] not in families:
            continue
        own = measured_on.get(instance_type)
        basis = own if own is not None else points
        if not any(p.measured for p in basis):
            continue
        rate, extrapolated = rate_at(basis, vcpus)
        peak_rss = max((p.rss_mb or 0.0 for p in basis), default=0.0)
        if rate <= 0 or memory_gib * 1024 < 2 * peak_rss:
            continue
        if own is None and (measured_on or instance_arch(instance_type) != arch):
            extrapolated = True
        replicas = replicas_for(target_rps, rate, headroom)
        bound = generator_bound_at(basis, vcpus)
        hourly = usd.get(instance_type)
        cost = fleet_cost(hourly, replicas, target_rps) if hourly is not None else None
        options.append(
            FleetOption(
                instance_type=instance_type,
                vcpus=vcpus,
                memory_gib=memory_gib,
                replicas=replicas,
                rps_per_replica=round(rate, 2),
                extrapolated=extrapolated,
                generator_bound=bound,
                usd_per_hour=None if cost is None else round(cost.usd_per_hour, 4),
                usd_per_month=None if cost is None else round(cost.usd_per_month, 2),
                usd_per_million=None if cost is None else round(cost.usd_per_million, 4),
                measured_on=instance_type if own is not None else None,
            )
        )
    options.sort(
        key=lambda o: (
            o.usd_per_hour is None,
            bool(measured_on) and o.measured_on is None,
            o.usd_per_hour or 0.0,
            o.extrapolated,
            o.replicas * o.vcpus,
        )
    )
    return options


def box_candidates(
    points: Sequence[SizePoint],
    *,
    count: int,
    target_rps: float,
    prices: Sequence[PriceQuote],
    headroom: float = DEFAULT_HEADROOM,
    families: Sequence[str] | None = None,
) -> list[str]:
    """Return the ``count`` cheapest priced types (any architecture) worth a sizing box."""
    options = fleet_options(
        points, target_rps=target_rps, prices=prices, headroom=headroom, families=families
    )
    return [o.instance_type for o in options if o.usd_per_hour is not None][: max(0, count)]


def recommend(
    points: Sequence[SizePoint],
    *,
    latency_slo_ms: float,
    target_rps: float,
    prices: Sequence[PriceQuote],
    region: str,
    unpriced: str | None = None,
    headroom: float = DEFAULT_HEADROOM,
    host_cores: int | None = None,
    families: Sequence[str] | None = None,
    boxes: Sequence[BoxSizing] = (),
) -> SizingReport:
    """Return the cheapest fleet (and the next two) serving ``target_rps`` within the SLO;
    ``unpriced`` says what to set for the types without a price (still fleets, ranked last)."""
    options = fleet_options(
        points,
        target_rps=target_rps,
        prices=prices,
        headroom=headroom,
        families=families,
        boxes=boxes,
    )
    chosen = options[0] if options else None
    sources = sorted({q.source for q in prices})
    return SizingReport(
        latency_slo_ms=latency_slo_ms,
        target_rps=target_rps,
        headroom=headroom,
        region=region,
        host_cores=host_cores or len(host_cpus()),
        sizes=list(points),
        options=options[:3],
        chosen=chosen,
        reason=_reason(chosen, points, latency_slo_ms, headroom, unpriced),
        families=sorted(families) if families is not None else [],
        price_source={
            "source": "; ".join(sources) or "none",
            "as_of": min((q.as_of for q in prices), default="?"),
        },
        unpriced=unpriced,
        boxes=list(boxes),
    )


def _reason(
    chosen: FleetOption | None,
    points: Sequence[SizePoint],
    latency_slo_ms: float,
    headroom: float,
    unpriced: str | None,
) -> str:
    """Say which fleet was chosen and on what figures, or why there is none."""
    if chosen is None:
        if max((p.sustainable_rps for p in points), default=0.0) <= 0:
            return (
                f"no CPU size meets p95 <= {latency_slo_ms:g} ms at any rate: every size measured "
                "broke the SLO at its lowest load (a smaller or INT8 model, or a looser SLO)"
            )
        return "no CPU type of the allowed families could hold the model"
    ceiling = (
        "; the load generator's ceiling, not the service's: the fleet may be larger than it needs"
    )
    return (
        f"{chosen.replicas} x {chosen.instance_type} at "
        + ("at least " if chosen.generator_bound else "")
        + f"{chosen.rps_per_replica:g} req/s each "
        f"({'extrapolated' if chosen.extrapolated else 'measured'}"
        + (f" on a {chosen.measured_on} box" if chosen.measured_on else "")
        + (ceiling if chosen.generator_bound else "")
        + f"), {round(headroom * 100)}% headroom: "
        + (
            f"${chosen.usd_per_month:,.2f}/month"
            if chosen.usd_per_month is not None
            else f"unpriced ({unpriced or f'no price for {chosen.instance_type}'})"
        )
    )


def size_model(
    model_dir: str,
    images: Sequence[bytes],
    *,
    latency_slo_ms: float,
    target_rps: float,
    prices: Sequence[PriceQuote],
    region: str,
    unpriced: str | None = None,
    headroom: float = DEFAULT_HEADROOM,
    max_vcpus: int | None = None,
    duration_s: float = STEP_DURATION_S,
    families: Sequence[str] | None = None,
) -> SizingReport:
    """Measure the model's sustainable rate per CPU size, then price the cheapest fleet."""
    started = time.monotonic()
    points = measure_sizes(
        model_dir, images, latency_slo_ms=latency_slo_ms, max_vcpus=max_vcpus, duration_s=duration_s
    )
    report = recommend(
        points,
        latency_slo_ms=latency_slo_ms,
        target_rps=target_rps,
        prices=prices,
        region=region,
        unpriced=unpriced,
        headroom=headroom,
        families=families,
    )
    log.info("sizing took %.0f s: %s", time.monotonic() - started, report.reason)
    return report


def _digest(card: ModelCard, **settings: Any) -> str:
    """Return a digest of the graph's shape (not its weights), the versions and ``settings``."""
    facts = {
        **settings,
        "arch": card.arch,
        "classes": len(card.classes),
        "opset": card.opset,
        "input": card.input.model_dump(mode="json"),
        "preprocess": card.preprocess.model_dump(mode="json"),
        "quantization": None
        if card.quantization is None
        else card.quantization.model_dump(mode="json"),
        "onnx_file": card.onnx_file,
        "versions": {name: _version(name) for name in ("burstcv", "onnxruntime", "numpy")},
        "generator": GENERATOR_VERSION,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def speed_key(
    card: ModelCard,
    *,
    latency_slo_ms: float,
    host: dict[str, Any],
    max_vcpus: int | None,
    duration_s: float,
) -> str:
    """Return a digest of everything that sets a model's sizes, and nothing that does not:
    a new version of the same architecture reuses the last one's sizes."""
    return _digest(
        card,
        host=host,
        cpus=host_cpus(),
        latency_slo_ms=latency_slo_ms,
        max_vcpus=max_vcpus,
        duration_s=duration_s,
    )


def box_speed_key(
    card: ModelCard, *, instance_type: str, latency_slo_ms: float, duration_s: float
) -> str:
    """Return :func:`speed_key`'s digest for a sizing box: its instance type stands for its host
    (one CPU model and count), and the serving pins it installs equal this environment's."""
    return _digest(
        card, instance_type=instance_type, latency_slo_ms=latency_slo_ms, duration_s=duration_s
    )


def _version(package: str) -> str | None:
    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(package)
    return None


@dataclass
class SizesMemo:
    """The sizes last measured per speed key, on this host (``SizingReport`` files)."""

    root: Path

    def get(self, key: str) -> SizingReport | None:
        """Return the report measured under ``key`` on a quiet host, or None."""
        try:
            report = read_artifact(str(self.root / f"{key}.json"), SizingReport)
        except (OSError, ArtifactError):  # missing, or damaged: measured again, and rewritten
            return None
        if report.speed_key != key or report.host_load is None or report.host_load.busy:
            return None
        return report

    def put(self, report: SizingReport) -> None:
        if report.speed_key is None or report.host_load is None or report.host_load.busy:
            return
        with contextlib.suppress(OSError):
            write_artifact(str(self.root / f"{report.speed_key}.json"), report)
