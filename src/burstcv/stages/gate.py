"""Judge a benchmarked candidate and register it, accepted or rejected."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from burstcv.settings import Settings, get_settings
from burstcv.stages.resolve import resolved_run, run_layout
from burstcv_spec import storage
from burstcv_spec.contracts import (
    Benchmarked,
    Exported,
    ModelCard,
    RegistryDecision,
    RunRef,
    SizingReport,
    VerdictRecord,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import MODEL_CARD

if TYPE_CHECKING:
    from burstcv.registry.registry import Registry

log = logging.getLogger(__name__)


def capacity_rps(sizing: SizingReport | None, vcpus: int | None) -> float | None:
    """Return the rate the sizing found a ``vcpus``-CPU service sustains; None: none held."""
    from burstcv.gate.sizing import rate_at

    if sizing is None or not vcpus or not any(p.measured for p in sizing.sizes):
        return None
    rate, _ = rate_at(sizing.sizes, vcpus)
    return rate if rate > 0 else None


def gate(
    run: RunRef, exported: Exported, bench: Benchmarked, settings: Settings | None = None
) -> VerdictRecord:
    """Judge the candidate, register it (promotable or rejected) with the run's params as
    resolved (the dataset an asset event named among them), and return the verdict."""
    from burstcv.gate.gate import GateThresholds, ServingContext, check_lines, judge
    from burstcv.registry.registry import Registry

    s = settings or get_settings()
    resolved = resolved_run(run, s)
    params = resolved.params
    card = read_artifact(storage.join(exported.model_dir, MODEL_CARD), ModelCard)
    registry = Registry(s.registry_uri, s.model_name)
    if (earlier := _registered_by(registry, card)) is not None:
        # A retried gate (its worker lost, say, after the version was registered): the
        # verdict stands, and no second version of the same model is registered.
        log.info(
            "version %d of this model was registered by an earlier try of this run; its "
            "verdict stands",
            earlier.version,
        )
        write_artifact(run_layout(run, s).verdict, earlier)
        return earlier
    verdict = judge(
        bench.candidate,
        bench.production,
        GateThresholds(
            latency_slo_ms=params.latency_slo_ms,
            accuracy_floor=params.accuracy_floor,
            max_accuracy_drop=params.max_accuracy_drop,
        ),
        ServingContext(
            # The exported model's: a run's model may have been auto.
            arch=card.arch,
            input_px=card.input.shape[-1],
            int8_tried=bool(exported.quantization and exported.quantization.int8_tried),
            region=resolved.costs.region,
            prices={q.instance_type: q.usd_per_hour for q in resolved.costs.serving},
            target_rps=params.target_rps,
            measured_vcpus=bench.host.cpu_count or None,
            capacity_rps=capacity_rps(bench.sizing, bench.host.cpu_count),
        ),
        bench.sizing,
    )
    figures = {"candidate": bench.candidate, "production": bench.production}
    version = registry.register(
        exported.model_dir,
        RegistryDecision(
            status="accepted" if verdict.promote else "rejected",
            reason=verdict.summary,
            gate=verdict,
            benchmark={k: f for k, f in figures.items() if f},
            params=params.model_dump(mode="json"),
            fleet=bench.sizing.chosen if bench.sizing else None,
            fleet_measured_in=bench.sizing.measured_in if bench.sizing else None,
        ),
        dataset_uri=params.dataset_uri,
    )
    record = VerdictRecord(version=version, **dict(verdict))
    write_artifact(run_layout(run, s).verdict, record)
    for line in check_lines(verdict):
        log.info("version %d: %s", version, line)
    return record


# How many of the newest versions a retried gate looks through for the one it registered.
RECENT_VERSIONS = 10


def _registered_by(registry: Registry, card: ModelCard) -> VerdictRecord | None:
    """Return the verdict this run registered for this very model file (same sha256), or None."""
    for version in reversed(registry.versions()[-RECENT_VERSIONS:]):
        entry = registry.entry(version)
        if entry.lineage.run_id == card.run_id and entry.sha256 == card.sha256 and entry.gate:
            return VerdictRecord(version=version, **dict(entry.gate))
    return None
