"""Size a candidate's CPU fleet for the run's expected load: on this host, or (size_on ec2)
on short-lived boxes of the cheapest candidate types as well. ``size_fleet`` is the one door,
however the sizes were had (measured here, reused by speed key, or measured on boxes)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from burstcv import lineage
from burstcv.links import DAG_ID
from burstcv.params import ResolvedRun
from burstcv.settings import Settings, get_settings
from burstcv.stages.resolve import resolved_run, run_layout
from burstcv_spec import storage
from burstcv_spec.contracts import (
    ArtifactError,
    Billing,
    BoxSizing,
    HostInfo,
    ModelCard,
    RunRef,
    SizingReport,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import MODEL_CARD

if TYPE_CHECKING:
    from burstcv.gate.interference import BusyLimits, QuietFigure

log = logging.getLogger(__name__)


def _with_provenance(report: SizingReport, measured: SizingReport) -> SizingReport:
    """Return ``report`` marked as resting on the sizes ``measured`` records."""
    kept = ("host_load", "speed_key", "measured_in")
    return report.model_copy(update={k: getattr(measured, k) for k in kept})


def size_fleet(
    run: RunRef,
    resolved: ResolvedRun,
    s: Settings,
    model_dir: str,
    images: list[bytes],
    *,
    host: HostInfo,
    limits: BusyLimits,
    quiet: QuietFigure,
) -> SizingReport:
    """Size the candidate's CPU fleet (sizing.json's content): on this host, then on boxes;
    HostBusyError (sizing.json marked busy) when the host stayed busy through every attempt."""
    from burstcv.gate.interference import HostBusyError, measure_quietly
    from burstcv.gate.sizing import SizesMemo, sizing_placement, speed_key

    card = read_artifact(str(Path(model_dir) / MODEL_CARD), ModelCard)
    key = speed_key(
        card,
        latency_slo_ms=resolved.params.latency_slo_ms,
        host=host.model_dump(mode="json"),
        max_vcpus=s.sizing_max_vcpus or None,
        duration_s=s.sizing_step_s,
    )
    memo = SizesMemo(Path(s.home) / "bench" / "sizing")
    earlier = None if s.sizing_remeasure else memo.get(key)
    if earlier is not None:
        sizing = _size_on_host(model_dir, images, resolved, s, earlier)
        log.info(
            "sizing: reused the sizes run %s measured (same speed key %s: architecture, "
            "input, preprocessing, host, SLO); BURSTCV_SIZING_REMEASURE=true measures again",
            earlier.measured_in,
            key,
        )
    else:
        place = sizing_placement(s.sizing_max_vcpus or None)
        try:
            sizing, load = measure_quietly(
                "fleet sizing",
                lambda: _size_on_host(model_dir, images, resolved, s),
                limits=limits,
                quiet=quiet,
                cpus=place.service,
                isolated=place.isolated,
            )
        except HostBusyError as exc:
            # Kept for the report, marked busy: they measured the neighbours.
            busy = exc.last.model_copy(update={"host_load": exc.loads[-1]})
            write_artifact(run_layout(run, s).sizing, busy)
            raise
        sizing = sizing.model_copy(
            update={"host_load": load, "speed_key": key, "measured_in": run.airflow_run_id}
        )
        memo.put(sizing)
    if resolved.costs.sizing is not None:  # size_on ec2: the candidates on their own boxes
        sizing = size_fleet_on_boxes(run, resolved, s, sizing, images)
    return sizing


def _fleet_terms(resolved: ResolvedRun) -> dict[str, Any]:
    """Return what the run's fleet is chosen for: its SLO, load, serving prices and families."""
    params, costs = resolved.params, resolved.costs
    return {
        "latency_slo_ms": params.latency_slo_ms,
        "target_rps": params.target_rps,
        "prices": costs.serving,
        "region": costs.region,
        "unpriced": costs.serving_unpriced,
        "families": params.serving_families,
    }


def _size_on_host(
    model_dir: str,
    images: list[bytes],
    resolved: ResolvedRun,
    s: Settings,
    earlier: SizingReport | None = None,
) -> SizingReport:
    """Size the fleet from this host's figures, or choose it from ``earlier`` sizes (same speed
    key) at this run's load and prices, without measuring."""
    from burstcv.gate.sizing import recommend, size_model

    terms = _fleet_terms(resolved)
    if earlier is not None:
        report = recommend(earlier.sizes, **terms, host_cores=earlier.host_cores)
        report = _with_provenance(report, earlier)
    else:
        vcpus = s.sizing_max_vcpus or None
        report = size_model(model_dir, images, **terms, max_vcpus=vcpus, duration_s=s.sizing_step_s)
    for point in report.sizes:
        log.info(
            "sizing: %d vCPU(s) sustain %.1f req/s within p95 %g ms",
            point.vcpus,
            point.sustainable_rps,
            resolved.params.latency_slo_ms,
        )
    log.info("sizing: %s", report.reason)
    return report


def size_fleet_on_boxes(
    run: RunRef, resolved: ResolvedRun, s: Settings, host: SizingReport, images: list[bytes]
) -> SizingReport:
    """Measure the cheapest candidate CPU types on boxes of their own (size_on ec2); return
    the fleet chosen from their figures, the host's ``host`` report standing for the rest."""
    from burstcv.gate.sizing import box_candidates, box_speed_key, recommend

    budget, params = resolved.costs.sizing, resolved.params
    assert budget is not None
    types = box_candidates(
        host.sizes,
        count=budget.boxes,
        target_rps=params.target_rps,
        prices=resolved.costs.serving,
        headroom=host.headroom,
        families=params.serving_families,
    )
    if not types:
        log.warning("sizing boxes: no priced CPU type could serve the load; the host's sizes stand")
        return host
    paths = run_layout(run, s)
    card = read_artifact(paths.model_card, ModelCard)
    keys = {
        t: box_speed_key(
            card, instance_type=t, latency_slo_ms=params.latency_slo_ms, duration_s=s.sizing_step_s
        )
        for t in types
    }
    # A type measured before for a model of the same speed key (any run): its figures stand.
    earlier = {} if s.sizing_remeasure else _box_memo(s, keys)
    if earlier:
        log.info(
            "sizing boxes: reused %s (same speed key: architecture, input, preprocessing, SLO; "
            "BURSTCV_SIZING_REMEASURE=true measures again)",
            ", ".join(f"{t} of run {b.measured_in}" for t, b in earlier.items()),
        )
    fresh = [t for t in types if t not in earlier]
    measured = _measure_on_boxes(run, resolved, s, fresh, keys, images) if fresh else {}
    boxes = [earlier.get(t) or measured[t] for t in types if t in earlier or t in measured]
    report = recommend(
        host.sizes,
        **_fleet_terms(resolved),
        headroom=host.headroom,
        host_cores=host.host_cores,
        boxes=boxes,
    )
    log.info("sizing boxes: %s", report.reason)
    return _with_provenance(report, host)


def _measure_on_boxes(
    run: RunRef,
    resolved: ResolvedRun,
    s: Settings,
    types: list[str],
    keys: dict[str, str],
    images: list[bytes],
) -> dict[str, BoxSizing]:
    """Measure ``types`` on boxes of their own, bill the boxes, and keep each box's figures
    under its speed key (``keys``); return {type: its figures, or why it was skipped}."""
    from burstcv.compute.ec2 import Ec2Backend
    from burstcv.compute.sizing_boxes import SizingRequest, size_on_boxes

    budget, paths = resolved.costs.sizing, run_layout(run, s)
    assert budget is not None
    log.info("sizing boxes: measuring %s on boxes of their own", ", ".join(types))
    try:
        found = size_on_boxes(
            Ec2Backend(s.ec2),
            SizingRequest(
                run=run,
                dag_id=DAG_ID,
                model_uri=paths.model,
                instance_types=types,
                latency_slo_ms=resolved.params.latency_slo_ms,
                step_s=s.sizing_step_s,
                max_s=budget.max_s,
                parallel=s.sizing_parallel,
                bound_rate=budget.box_rate,
            ),
            paths,
            images,
            artifact_root=s.artifact_root,
        )
    finally:
        bill_sizing_boxes(run, s)
    measured: dict[str, BoxSizing] = {}
    for box in found:
        if box.skipped is None:
            box = box.model_copy(
                update={"speed_key": keys[box.instance_type], "measured_in": run.airflow_run_id}
            )
            write_artifact(paths.box_sizing(box.instance_type), box)
            write_artifact(_box_memo_uri(s, keys[box.instance_type]), box)
        measured[box.instance_type] = box
    return measured


def _box_memo_uri(s: Settings, key: str) -> str:
    """Return where a sizing box's figures are kept for its speed key (any run reuses them)."""
    return storage.join(s.artifact_root, "sizing", "boxes", f"{key}.json")


def _box_memo(s: Settings, keys: dict[str, str]) -> dict[str, BoxSizing]:
    """Return {type: its figures measured before under the same speed key}."""
    found = {}
    for instance_type, key in keys.items():
        try:
            box = read_artifact(_box_memo_uri(s, key), BoxSizing)
        except (storage.ArtifactNotFoundError, ArtifactError):  # none, or damaged: measured
            continue
        if box.speed_key == key and box.skipped is None:
            found[instance_type] = box
    return found


def bill_sizing_boxes(run: RunRef, settings: Settings | None = None) -> Billing:
    """Write the run's whole bill (billing.json) with its sizing boxes: every box of the run,
    training and sizing, from their records, as teardown writes it. Whichever of the two
    writes last writes everything; no box is counted twice."""
    from burstcv.compute.billing import whole_bill

    s = settings or get_settings()
    paths = run_layout(run, s)
    backend = resolved_run(run, s).params.compute_backend
    billing = whole_bill(
        paths, lineage.utc_now(), backend=backend, airflow_run_id=run.airflow_run_id
    ).model_copy(update={"terminated_at": lineage.utc_now_iso()})
    write_artifact(paths.billing, billing)
    sized = sum(i.cost_usd or 0.0 for i in billing.instances if i.run_id != run.run_key)
    log.info("billing: the sizing boxes cost $%.4f", sized)
    return billing
