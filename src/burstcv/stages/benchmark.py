"""Benchmark a candidate: size its CPU fleet (``burstcv.stages.sizing``), measure its latency
beside production's through staging copies of the real service under one open-loop load, and
``score`` its accuracy on the validation shards. The gate stage judges what they wrote."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from burstcv import lineage
from burstcv.settings import Settings, get_settings
from burstcv.stages.data import val_arrays, val_rows
from burstcv.stages.resolve import resolved_run, run_layout
from burstcv.stages.sizing import size_fleet
from burstcv_spec import storage
from burstcv_spec.contracts import (
    BenchFigures,
    Benchmarked,
    HostInfo,
    HostLoad,
    LatencyRecord,
    RunRef,
    SizingReport,
    write_artifact,
)
from burstcv_spec.preprocess import PreprocessSpec

if TYPE_CHECKING:
    from burstcv.gate.interference import BusyLimits, HostBusyError, QuietFigure
    from burstcv.gate.sizing import GateLoad

log = logging.getLogger(__name__)


class GateInconclusive(RuntimeError):
    """The host stayed busy: nothing was judged, and the task fails to be retried later."""


@dataclasses.dataclass
class LatencyLog:
    """What latency.json records, filled in as the benchmark goes (written on every exit)."""

    uri: str
    host: HostInfo
    measured_at: str = dataclasses.field(default_factory=lineage.utc_now_iso)
    results: dict[str, BenchFigures] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    load_at: GateLoad | None = None

    def write(self, inconclusive: str | None = None) -> str:
        """Write latency.json as measured so far; return its URI."""
        load_at, results = self.load_at, self.results
        return write_artifact(
            self.uri,
            LatencyRecord(
                measured_at=self.measured_at,
                host=self.host,
                requests=load_at.requests if load_at else 0,
                concurrency=max((f.concurrency for f in results.values()), default=0),
                offered_rps=load_at.rate_rps if load_at else None,
                load_note=load_at.note if load_at else None,
                candidate=results.get("candidate"),
                production=results.get("production"),
                inconclusive=inconclusive,
                bench_s=self.timings.get("bench_s"),
                sizing_s=self.timings.get("sizing_s"),
            ),
        )

    @contextlib.contextmanager
    def step(self, timing: str) -> Iterator[None]:
        """Time one step into ``timings``; a host busy throughout makes it inconclusive."""
        from burstcv.gate.interference import HostBusyError

        started = time.monotonic()
        try:
            yield
        except HostBusyError as exc:
            self.timings[timing] = round(time.monotonic() - started, 1)
            raise self.inconclusive(exc) from None
        self.timings[timing] = round(time.monotonic() - started, 1)

    def inconclusive(self, exc: HostBusyError[Any]) -> GateInconclusive:
        """Record a measurement the host's load spoilt; return the error the task raises."""
        reason = str(exc)
        self.write(reason)
        log.error("gate inconclusive, nothing judged: %s", reason)
        return GateInconclusive(
            f"gate inconclusive: {reason}. The model was not judged; the benchmark is tried "
            "again (BURSTCV_BENCH_ATTEMPTS, BURSTCV_BENCH_BUSY_SHARE set how hard)"
        )


def benchmark(run: RunRef, settings: Settings | None = None) -> Benchmarked:
    """Size the candidate's fleet, then measure it beside production (latency.json); a host
    busy through every attempt makes it inconclusive (GateInconclusive), never a rejection."""
    from burstcv.gate.interference import BusyLimits, QuietFigure
    from burstcv.gate.latency import materialise_model
    from burstcv.registry.registry import PRODUCTION, Registry
    from burstcv.training.job import load_job

    s = settings or get_settings()
    paths = run_layout(run, s)
    resolved = resolved_run(run, s)
    job = load_job(paths.job_spec)
    request_images = [storage.read_bytes(uri) for _, uri, _ in val_rows(paths.manifest, 64)]
    val_x, val_labels = val_arrays(job.val_shards, job.classes, s.eval_max_images)
    registry = Registry(s.registry_uri, s.model_name)
    prod_alias = registry.get_alias(PRODUCTION)
    latency = LatencyLog(paths.latency, HostInfo.model_validate(lineage.host_description()))
    limits = BusyLimits(
        others_share=s.bench_busy_share,
        slowdown=s.bench_busy_slowdown,
        attempts=s.bench_attempts,
        backoff_s=s.bench_busy_backoff_s,
    )
    quiet = QuietFigure(Path(s.home) / "bench" / "calibration.json")
    with tempfile.TemporaryDirectory() as tmp:
        with latency.step("sizing_s"):
            models = {"candidate": materialise_model(paths.model, Path(tmp) / "candidate")}
            if prod_alias is not None:
                models["production"] = materialise_model(
                    registry.version_uri(prod_alias.version), Path(tmp) / "production"
                )
            sizing = size_fleet(
                run,
                resolved,
                s,
                str(models["candidate"]),
                request_images,
                host=latency.host,
                limits=limits,
                quiet=quiet,
            )
        with latency.step("bench_s"):
            paired, host_load = measure_latency(
                models,
                request_images,
                sizing,
                s,
                resolved.params.latency_slo_ms,
                latency,
                limits=limits,
                quiet=quiet,
            )
            spec = PreprocessSpec.from_dict(job.preprocess)
            for label, folder in models.items():
                version = prod_alias.version if prod_alias and label == "production" else None
                latency.results[label] = score(
                    label, folder, paired[label], host_load, val_x, val_labels, spec, version
                )
    log.info(
        "the gate's measurements took %.0f s: fleet sizing %.0f s, latency benchmark %.0f s",
        latency.timings["bench_s"] + latency.timings["sizing_s"],
        latency.timings["sizing_s"],
        latency.timings["bench_s"],
    )
    candidate, production = latency.results["candidate"], latency.results.get("production")
    uri = latency.write()
    write_artifact(paths.sizing, sizing)
    return Benchmarked(
        latency_uri=uri,
        host=latency.host,
        candidate=candidate.summary(),
        production=production.summary() if production else None,
        sizing=sizing,
    )


def measure_latency(
    models: dict[str, Path],
    images: list[bytes],
    sizing: SizingReport,
    s: Settings,
    slo_ms: float,
    latency: LatencyLog,
    *,
    limits: BusyLimits,
    quiet: QuietFigure,
) -> tuple[dict[str, BenchFigures], HostLoad]:
    """Measure every model through a staging service of its own, side by side, open loop,
    at the load one replica of the sized fleet carries; raise HostBusyError when busy."""
    from burstcv.gate.interference import HostBusyError, Placement, measure_quietly, running_on
    from burstcv.gate.latency import drive_paired, staging_process
    from burstcv.gate.sizing import gate_load, host_cpus

    # The staging services run on CPUs of their own, the load generator (this process)
    # on another: the window counts whatever else ran on the services' CPUs.
    place = Placement.split(host_cpus())
    load_at = latency.load_at = gate_load(
        sizing,
        len(place.service),
        requests=s.bench_requests,
        max_s=s.bench_max_s,
        rate_rps=s.bench_rate_rps,
    )
    log.info(
        "latency benchmark: %d requests per model at %.1f req/s, open loop: %s",
        load_at.requests,
        load_at.rate_rps,
        load_at.note,
    )
    with contextlib.ExitStack() as services:
        urls, pids = {}, []
        for label, folder in models.items():
            urls[label], proc = services.enter_context(
                staging_process(str(folder), cpus=place.service, queue_delay_target_ms=slo_ms)
            )
            pids.append(proc.pid)

        def load() -> dict[str, BenchFigures]:
            with running_on(place.generator):
                return drive_paired(
                    urls,
                    images,
                    requests=load_at.requests,
                    rate_rps=load_at.rate_rps,
                    warmup=s.bench_warmup_requests,
                )

        def passes(paired: dict[str, BenchFigures]) -> bool:
            # The latency checks the gate makes of the candidate (neighbours only slow
            # it down: a pass measured beside them is a pass).
            candidate = paired["candidate"]
            return candidate.p95_ms <= slo_ms and candidate.errors == 0

        what = "latency of the candidate" + (" and production" if len(urls) > 1 else "")
        try:
            return measure_quietly(
                what,
                load,
                limits=limits,
                quiet=quiet,
                cpus=place.service,
                own_pids=pids,
                isolated=place.isolated,
                passes=passes,
            )
        except HostBusyError as exc:
            for label, figures in exc.last.items():
                latency.results[label] = figures.model_copy(update={"host_load": exc.loads[-1]})
            raise


def score(
    label: str,
    folder: Path,
    figures: BenchFigures,
    host_load: HostLoad,
    val_x: np.ndarray,
    val_labels: list[str],
    spec: PreprocessSpec,
    version: int | None,
) -> BenchFigures:
    """Return one model's latency figures with its accuracy (and, for the candidate, the
    bare onnxruntime floor); ``version`` is production's."""
    from burstcv.gate.accuracy import onnx_accuracy
    from burstcv.gate.latency import bare_onnxruntime_p50
    from burstcv_spec.preprocess import eval_view, normalize

    measured: dict[str, Any] = {"accuracy_note": None, "host_load": host_load}
    try:
        measured["accuracy"] = onnx_accuracy(folder, val_x, val_labels)
    except ValueError as exc:  # production expects another input size: not comparable
        measured["accuracy_note"] = str(exc)
    if label == "production":
        measured["version"] = version
    else:
        measured["bare_onnxruntime_p50_ms"] = bare_onnxruntime_p50(
            str(folder), normalize(eval_view(val_x[:1], spec), spec)
        )
    figures = figures.model_copy(update=measured)
    log.info(
        "%s: p50 %.2f ms p95 %.2f ms p99 %.2f ms, %.1f req/s, errors %d, shed %d, "
        "accuracy %s; others took %.0f%% of the service's CPUs",
        label,
        figures.p50_ms,
        figures.p95_ms,
        figures.p99_ms,
        figures.throughput_rps,
        figures.errors,
        figures.shed,
        figures.accuracy,
        host_load.others_share * 100,
    )
    return figures
