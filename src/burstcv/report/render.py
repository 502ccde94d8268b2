"""Assemble one self-contained HTML page about a pipeline run from what its stages recorded.

Figures are ``data:`` URIs and the CSS inline: no script, no external resource. A file a stage
did not write becomes a "not reached" note (a view's ``missing``), never an error.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import jinja2

from burstcv import links
from burstcv.compute.attempts import current_attempt
from burstcv.compute.billing import attempt_bills
from burstcv.compute.liveness import read_beat
from burstcv.cost.model import box_usd_per_hour
from burstcv.gate.gate import format_figure
from burstcv.gate.sizing import describe_generator
from burstcv.params import ResolvedRun
from burstcv.report import charts
from burstcv.training.job import STAGE_STALLED, attempt_failure
from burstcv_spec import storage
from burstcv_spec.contracts import (
    Artifact,
    ArtifactError,
    BenchFigures,
    Billing,
    BoxSizing,
    FailedMarker,
    HostLoad,
    LatencyRecord,
    ModelCard,
    RangeTest,
    SizingReport,
    SkipRecord,
    TrainingMetrics,
    ValidationRecord,
    VerdictRecord,
    read_artifact,
)
from burstcv_spec.layout import RunLayout

log = logging.getLogger(__name__)

# Relative to report/index.html: the same link opened from the store or through the plugin.
DATA_DOCS_LINK = links.link_between("report", "data-docs")
MAX_OFFENDING_SHOWN = 5

# Each file the report reads: its contract, its RunLayout name, and the stage that writes it.
READS: dict[str, tuple[type[Artifact], str, str]] = {
    "run": (ResolvedRun, "record", "plan_scan"),
    "validation": (ValidationRecord, "validation", "validate"),
    "metrics": (TrainingMetrics, "metrics", "train"),
    "billing": (Billing, "billing", "terminate"),
    "model": (ModelCard, "model_card", "export"),
    "latency": (LatencyRecord, "latency", "benchmark"),
    "sizing": (SizingReport, "sizing", "benchmark"),
    "verdict": (VerdictRecord, "verdict", "gate"),
}


@dataclass
class RunDocs:
    """Hold what one run's stages wrote (each read through its contract) and why any is missing."""

    root: str
    skip: SkipRecord | None = None
    run: ResolvedRun | None = None
    validation: ValidationRecord | None = None
    metrics: TrainingMetrics | None = None
    billing: Billing | None = None
    model: ModelCard | None = None
    latency: LatencyRecord | None = None
    sizing: SizingReport | None = None
    verdict: VerdictRecord | None = None
    failure: FailedMarker | None = None  # the last attempt's, when training wrote no metrics
    stalls: list[str] = field(default_factory=list)  # each attempt ended for want of progress
    missing: dict[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, run_root: str) -> RunDocs:
        """Read every artifact the report uses; note those absent or unreadable."""
        layout = RunLayout(run_root.rstrip("/"))
        docs = cls(run_root)
        if storage.exists(layout.skip):
            with contextlib.suppress(ArtifactError):
                docs.skip = read_artifact(layout.skip, SkipRecord)
        for key, (model, name, stage) in READS.items():
            uri = getattr(layout, name)
            rel = uri.removeprefix(layout.root).lstrip("/")
            try:
                setattr(docs, key, read_artifact(uri, model))
            except storage.ArtifactNotFoundError:
                docs.missing[key] = (
                    f"Skipped: nothing new to train on, so the {stage} stage did not run."
                    if docs.skip is not None
                    else f"Not reached: {rel} was not written; the run stopped before the "
                    f"{stage} stage finished."
                )
            except ArtifactError as exc:  # a stage wrote a broken file: say which, and why
                log.warning("cannot read %s: %s", uri, exc)
                docs.missing[key] = f"{rel} exists but cannot be read ({exc})."
        if docs.skip is None:
            with contextlib.suppress(ArtifactError):
                last = current_attempt(layout.job)
                if docs.metrics is None:
                    docs.failure = attempt_failure(layout.job, last)
                ended = (attempt_failure(layout.job, n) for n in range(1, last + 1))
                docs.stalls = [
                    stall_line(layout.job, m, docs.billing)
                    for m in ended
                    if m is not None and m.stage == STAGE_STALLED
                ]
        return docs


def stall_line(job_dir: str, marker: FailedMarker, billing: Billing | None) -> str:
    """Say why an attempt was ended as stalled and for how many of its billed seconds its
    boxes sat stopped (from its last progress beat to each box's end)."""
    line = f"Attempt {marker.attempt} was ended as stalled: {marker.reason}"
    beat = read_beat(job_dir, marker.attempt)
    mine = [
        b
        for bill in attempt_bills(job_dir, marker.attempt)
        if bill.attempt == marker.attempt
        for b in bill.boxes
        if b.ended_at
    ]
    if beat is None or billing is None or not mine:
        return line + "."
    last_beat = datetime.fromisoformat(beat.written_at)
    billed = sum(billing.billed_seconds.get(b.instance_id, 0.0) for b in mine)
    stopped = sum(
        max(0.0, (datetime.fromisoformat(str(b.ended_at)) - last_beat).total_seconds())
        for b in mine
    )
    boxes = "boxes" if len(mine) > 1 else "box"
    return (
        f"{line}. Its {boxes} sat stopped for {min(stopped, billed):,.0f} of its "
        f"{billed:,.0f} billed seconds."
    )


def fmt(value: Any, spec: str = "", suffix: str = "") -> str:
    """Format a number (or pass text through), with an em dash for a missing value."""
    if value is None or value == "":
        return "—"
    if isinstance(value, int | float) and not isinstance(value, bool) and spec:
        return f"{value:{spec}}{suffix}"
    return f"{value}{suffix}"


def usd(value: float | None, digits: int = 4) -> str:
    return "—" if value is None else f"${value:,.{digits}f}"


def short_json(value: Any, limit: int = 140) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class Chart:
    """Hold a drawn figure as base64 PNG, or why it could not be drawn."""

    alt: str
    png_base64: str = ""
    error: str = ""


def _chart(draw: Callable[[], bytes], alt: str) -> Chart:
    """Draw a figure; on bad data say why instead of failing the whole page."""
    try:
        return Chart(alt, png_base64=base64.b64encode(draw()).decode("ascii"))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        log.warning("could not draw %s: %s", alt, exc)
        return Chart(alt, error=f"Could not draw the {alt}: {type(exc).__name__}: {exc}")


@functools.cache
def _templates() -> jinja2.Environment:
    env = jinja2.Environment(
        # Beside this module: a templates/ folder would be a data-only "package" that
        # setuptools warns about on every build.
        loader=jinja2.PackageLoader("burstcv.report", ""),
        autoescape=True,  # every value comes from a run's files: text, never markup
        undefined=jinja2.StrictUndefined,  # a misspelt name fails the render, not blanks
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["fmt"] = fmt
    env.filters["usd"] = usd
    return env


def _data_view(record: RunDocs) -> dict[str, Any]:
    """Describe the dataset checks: verdict, counts, each expectation, a link to Data Docs."""
    doc = record.validation
    if doc is None:
        return {"missing": record.missing["validation"]}
    docs_rel = f"{links.tree_path('data-docs')}/{links.INDEX}"
    per_split = doc.counts.per_split
    classes = sorted({c for split in per_split.values() for c in split})
    return {
        "missing": None,
        "doc": doc,
        "met": sum(e.success for e in doc.expectations),
        "docs_rel": docs_rel,
        "docs_link": DATA_DOCS_LINK,
        "docs_written": storage.exists(storage.join(record.root, docs_rel)),
        "classes": classes,
        "split_rows": [
            [
                split,
                *(fmt(per_split[split].get(c, 0)) for c in classes),
                fmt(sum(per_split[split].values())),
            ]
            for split in per_split
        ],
        "expectations": [
            {
                "name": e.name,
                "description": e.description,
                "success": e.success,
                "observed": short_json(e.observed),
                "shown": e.offending_files[:MAX_OFFENDING_SHOWN],
                "more": max(0, len(e.offending_files) - MAX_OFFENDING_SHOWN),
            }
            for e in doc.expectations
        ],
    }


# Validation accuracy within this much of the better of chance and the majority-class rate is
# "near chance": the model has learned little beyond guessing the most common class.
NEAR_CHANCE_MARGIN = 0.1
WORST_CLASSES = 3  # per-class accuracy shown for this many of the worst classes


def model_quality(metrics: TrainingMetrics) -> dict[str, Any]:
    """Return chance, the majority-class rate, the worst classes and warnings of a run's model."""
    confusion, classes, accuracy = metrics.confusion, metrics.classes, metrics.val_accuracy
    if not confusion or not classes:
        return {"chance": None, "majority": None, "worst_classes": [], "quality_warnings": []}
    totals = [sum(row) for row in confusion]
    chance, majority = 1 / len(classes), max(totals) / (sum(totals) or 1)
    per_class: list[tuple[str, float, int]] = [
        (name, row[i] / total, total)
        for i, (name, row, total) in enumerate(zip(classes, confusion, totals, strict=False))
        if total
    ]
    ranked = sorted(per_class, key=lambda c: c[1])
    warnings: list[str] = []
    if accuracy < max(chance, majority) + NEAR_CHANCE_MARGIN:
        warnings.append(
            f"the model is near chance: validation accuracy {accuracy:.1%} against chance "
            f"{chance:.1%} and the majority-class rate {majority:.1%}; it has learned little "
            "(see the training details: more data, pretrained weights, or more epochs)"
        )
    limit = 10 * max(1.0, math.log(len(classes)))
    blown = [
        e.val_loss for e in metrics.epochs if not math.isfinite(e.val_loss) or e.val_loss > limit
    ]
    if metrics.recoveries or blown:
        what = []
        if metrics.recoveries:
            what.append(f"training diverged {len(metrics.recoveries)} time(s) and recovered")
        if blown:
            what.append(f"the validation loss reached {max(blown):.4g} (chance: {limit / 10:.3g})")
        warnings.append(
            "the loss curve diverged: " + "; ".join(what) + "; a lower learning rate or a "
            "larger batch may train better"
        )
    worst = [[name, f"{acc:.1%}", f"{total:,}"] for name, acc, total in ranked[:WORST_CLASSES]]
    return dict(chance=chance, majority=majority, worst_classes=worst, quality_warnings=warnings)


def _batch_line(metrics: TrainingMetrics) -> str:
    """Return the step's batch and rate in one line: per GPU, over the GPUs, and the rule."""
    o = metrics.optimizer
    line = f"{o.batch_size:,} images a step, {o.steps_per_epoch:,} steps an epoch"
    if metrics.world_size > 1 and o.batch_per_rank:
        line += f" ({o.batch_per_rank:,} on each of {metrics.world_size} GPUs)"
    line += f"; peak rate {o.learning_rate:.3g} ({o.name})"
    if o.batch_scaling == "per_gpu" and o.lr_world_factor != 1:
        rule = "linear" if o.name == "sgd" else "square-root"
        line += f", the one-GPU rate x{o.lr_world_factor:.3g} by the {rule} rule"
    return line


def _range_test_line(test: RangeTest | None) -> str | None:
    """Return the learning-rate range test in one line, or None when the run had none."""
    if test is None:
        return None
    return (
        f"{test.steps} steps in {fmt(test.seconds, '.1f', ' s')}, the lowest loss "
        f"at {fmt(test.min_loss_lr, '.3g')}: trained at {fmt(test.chosen_lr, '.3g')} "
        f"(instead of {fmt(test.fallback_lr, '.3g')})"
    )


def _failure_view(marker: FailedMarker | None) -> dict[str, Any] | None:
    """Say where and why the last training attempt failed, and whose error it was."""
    if marker is None:
        return None
    owner = f"rank {marker.rank} (node {marker.node}), " if marker.rank is not None else ""
    then = (
        "resumable, but not resumed (its relaunches were spent, or the run was stopped)"
        if marker.resumable
        else "not resumable: a relaunch would fail the same way"
    )
    return {
        "line": f"Training failed in attempt {marker.attempt}, {owner}at the {marker.stage} "
        f"stage: {marker.reason} ({then}).",
        "traceback": marker.traceback or [],
    }


def _training_view(record: RunDocs) -> dict[str, Any]:
    """Show the training curves, the per-epoch table and where the time went."""
    metrics = record.metrics
    if metrics is None:
        return {
            "missing": record.missing["metrics"],
            "failure": _failure_view(record.failure),
            "stalls": record.stalls,
        }
    epochs, confusion, classes = metrics.epochs, metrics.confusion, metrics.classes
    curves = _chart(lambda: charts.training_curves(epochs), "training curves") if epochs else None
    draw_confusion = functools.partial(charts.confusion_matrix, confusion, classes)
    confusion_chart = _chart(draw_confusion, "confusion matrix") if confusion and classes else None
    recipe = record.run.training if record.run else None
    return {
        "missing": None,
        "stalls": record.stalls,
        "metrics": metrics,
        "recipe": recipe.reason if recipe else None,
        "recipe_warning": recipe.warning if recipe else None,
        "recoveries": [
            f"epoch {r.epoch} step {r.step}: {r.reason}; restored the last "
            f"good state, learning rate x{r.lr_scale:.3g}"
            for r in metrics.recoveries
        ],
        "range_test": _range_test_line(metrics.lr_range_test),
        "batch": _batch_line(metrics),
        **model_quality(metrics),
        "wall": list(metrics.wall_s.model_dump().items()),
        "curves": curves,
        "epoch_rows": [
            [
                fmt(e.epoch),
                fmt(e.train_loss, ".4f"),
                fmt(e.val_loss, ".4f"),
                fmt(e.val_accuracy, ".4f"),
                fmt(e.images_per_s, ",.0f"),
                fmt(e.lr, ".4g"),
                fmt(e.elapsed_s, ".1f", " s"),
            ]
            for e in epochs
        ],
        "confusion": confusion_chart,
    }


def _model_view(record: RunDocs) -> dict[str, Any]:
    """Describe the exported model: its card, and why its input is that size."""
    card = record.model
    if card is None:
        return {"missing": record.missing["model"]}
    size = record.run.image_size if record.run else None
    return {
        "missing": None,
        "card": card,
        "image_size_reason": size.reason if size and size.px == card.preprocess.height else None,
    }


# The latency table's rows: label, BenchFigures field, number format, unit.
LATENCY_ROWS: tuple[tuple[str, str, str, str], ...] = (
    ("p50", "p50_ms", ".2f", " ms"),
    ("p95", "p95_ms", ".2f", " ms"),
    ("p99", "p99_ms", ".2f", " ms"),
    ("throughput", "throughput_rps", ".1f", " req/s"),
    ("error rate", "error_rate", ".2%", ""),
    ("shed (503, queued past the SLO)", "shed", "d", ""),
    ("accuracy", "accuracy", ".4f", ""),
    ("bare onnxruntime p50 (floor)", "bare_onnxruntime_p50_ms", ".3f", " ms"),
)
assert {row[1] for row in LATENCY_ROWS} <= set(BenchFigures.model_fields)


def _latency_view(record: RunDocs) -> dict[str, Any]:
    """Compare candidate and production latency over HTTP: table and overlaid histogram."""
    latency = record.latency
    if latency is None:
        return {"missing": record.missing["latency"]}
    sources = [] if latency.candidate is None else [("candidate", latency.candidate)]
    if (prod := latency.production) is not None:
        sources.append((f"production v{prod.version or '?'}", prod))
    histogram = None
    prod_ms = (prod.latencies_ms if prod else None) or None
    candidate_ms = (latency.candidate.latencies_ms if latency.candidate else None) or []
    if candidate_ms:
        slo = record.run.params.latency_slo_ms if record.run else None
        label = f"production v{prod.version if prod else '?'}"
        draw = functools.partial(
            charts.latency_histogram, candidate_ms, prod_ms, slo_ms=slo, production_label=label
        )
        histogram = _chart(draw, "latency histogram")
    return {
        "missing": None,
        "record": latency,
        "load": _load_line(latency),
        "labels": [label for label, _ in sources],
        "rows": [
            [name, *(fmt(getattr(figures, key), spec, suffix) for _, figures in sources)]
            for name, key, spec, suffix in LATENCY_ROWS
        ],
        "histogram": histogram,
        "production_sampled": bool(prod_ms),
        "host_load": [
            f"{label}: {_host_load_line(figures.host_load)}"
            for label, figures in sources
            if figures.host_load is not None
        ],
        "timings": _timings_line(latency),
    }


def _host_load_line(load: HostLoad) -> str:
    line = f"other processes took {load.others_share:.0%} of CPUs {load.cpus}"
    line += f" over {load.wall_s:.1f} s"
    if load.calibration_ms is not None:
        line += f"; calibration kernel {load.calibration_ms:.1f} ms"
        if load.calibration_quiet_ms is not None:
            line += f" (quiet: {load.calibration_quiet_ms:.1f} ms)"
    if load.psi_some_share is not None:
        line += f"; CPU pressure {load.psi_some_share:.0%}"
    if load.throttled_s:
        line += f"; throttled {load.throttled_s:.1f} s"
    return line + (f": BUSY ({load.reason})" if load.busy else ": quiet")


def _load_line(latency: LatencyRecord) -> str:
    """Say the load the models were measured at: open-loop rate and why, or closed-loop."""
    if latency.candidate is None:
        return "nothing was measured"
    if latency.offered_rps is None:
        return f"{latency.requests} requests at concurrency {latency.concurrency}"
    line = (
        f"{latency.requests} requests per model, open loop at {latency.offered_rps:g} req/s "
        f"(at most {latency.concurrency} in flight)"
    )
    return line + (f": {latency.load_note}" if latency.load_note else "")


def _timings_line(latency: LatencyRecord) -> str | None:
    """Say the seconds the gate's measurements took (None for records that do not say)."""
    steps = (("fleet sizing", latency.sizing_s), ("latency benchmark", latency.bench_s))
    return "; ".join(f"{step} {s:.0f} s" for step, s in steps if s is not None) or None


def _fleet_view(record: RunDocs) -> dict[str, Any]:
    """Show the sustainable rate per CPU size (table and p95-under-load chart) and the fleets."""
    sizing = record.sizing
    if sizing is None:
        return {"missing": record.missing["sizing"]}
    run_id = record.run.run_id if record.run else None
    chart = None
    if any(p.steps for p in sizing.sizes):
        draw = functools.partial(charts.sizing_curves, sizing.sizes, sizing.latency_slo_ms)
        chart = _chart(draw, "p95 under load")
    return {
        "missing": None,
        "sizing": sizing,
        "provenance": _sizing_provenance(sizing, run_id),
        "sizes": [
            [
                str(p.vcpus),
                "measured" if p.measured else "extrapolated",
                fmt(p.sustainable_rps, ".1f", " req/s"),
                fmt(p.p95_ms, ".2f", " ms"),
                fmt(p.cpu_s_per_request * 1000 if p.cpu_s_per_request else None, ".2f", " ms"),
                describe_generator(p),
            ]
            for p in sizing.sizes
        ],
        "anomalies": [p.anomaly for p in sizing.sizes if p.anomaly],
        "options": [
            [
                o.instance_type,
                f"{o.vcpus} vCPU, {o.memory_gib:g} GiB",
                str(o.replicas),
                ("at least " if o.generator_bound else "")
                + fmt(o.rps_per_replica, ".1f", " req/s")
                + (" (extrapolated)" if o.extrapolated else "")
                + (" (the load generator's ceiling)" if o.generator_bound else ""),
                f"its own {o.measured_on} box" if o.measured_on else "the benchmark host",
                usd(o.usd_per_month, 2) if o.usd_per_month is not None else "unpriced",
                usd(o.usd_per_million) if o.usd_per_million is not None else "unpriced",
            ]
            for o in sizing.options
        ],
        "chart": chart,
        "boxes": [_box_view(b, sizing.latency_slo_ms, run_id) for b in sizing.boxes],
        "prices": "{source} (as of {as_of})".format_map(
            {"source": "", "as_of": "?", **sizing.price_source}
        ),
    }


def _box_view(box: BoxSizing, slo_ms: float, run_id: str | None) -> dict[str, Any]:
    """Show one type's sizing box: what it measured on its own CPUs, or why it did not."""
    where = box.instance_id or "no box"
    if box.host is not None:
        where += f", {box.host.processor} ({box.host.machine}, {box.host.cpu_count} vCPU)"
    if box.measured_in is not None and box.measured_in != run_id:
        where += f"; reused from run {box.measured_in} (same speed key)"
    measured = [p for p in box.sizes if p.measured]
    chart = None
    if any(p.steps for p in measured):
        draw = functools.partial(charts.sizing_curves, box.sizes, slo_ms)
        chart = _chart(draw, f"p95 under load on {box.instance_type}")
    return {
        "instance_type": box.instance_type,
        "where": where,
        "skipped": box.skipped,
        "seconds": box.seconds,
        "sizes": "; ".join(
            f"{p.vcpus} vCPU: {p.sustainable_rps:g} req/s, p95 {fmt(p.p95_ms, '.2f', ' ms')}"
            for p in measured
        ),
        "chart": chart,
    }


def _sizing_provenance(sizing: SizingReport, run_id: str | None) -> str | None:
    """Say where the sizes come from: this run's measurement, or an earlier run's reused."""
    parts = []
    if sizing.measured_in is not None and sizing.measured_in != run_id:
        parts.append(
            f"Sizes reused from run {sizing.measured_in}: the same architecture, input, "
            "preprocessing, host and SLO (BURSTCV_SIZING_REMEASURE=true measures again)."
        )
    if sizing.host_load is not None:
        parts.append(f"Host while measured: {_host_load_line(sizing.host_load)}.")
    return " ".join(parts) or None


def _gate_view(
    record: RunDocs, registry_uri: str, model_name: str, serving_url: str
) -> dict[str, Any]:
    """Show the gate's verdict, each check, priced suggestions, and where production points."""
    verdict = record.verdict
    if verdict is None:
        return {"missing": record.missing["verdict"]}
    return {
        "missing": None,
        "verdict": verdict,
        "summary": verdict.summary.removeprefix("not promoted: "),
        "checks": [
            {
                "name": c.name,
                "passed": c.passed,
                # With the check's unit: "4.85 ms" vs "50.00 ms", not 4.854 vs 50.
                "observed": format_figure(c.name, c.observed),
                "limit": format_figure(c.name, c.limit),
                "reason": c.reason or "",
            }
            for c in verdict.checks
        ],
        "suggestions": [
            {
                "title": s.title,
                "estimated_p95_ms": s.estimated_p95_ms,
                "meets_slo": s.meets_slo,
                "instance_type": s.instance_type,
                "region": s.region,
                "cost": usd(s.cost_per_million_usd)
                if s.cost_per_million_usd is not None
                else s.price_note,
                "assumption": s.assumption,
                "basis": "measured" if s.measured else "unmeasured: an assumed factor",
            }
            for s in verdict.suggestions
        ],
        "registry": _registry_view(verdict.version, registry_uri, model_name, serving_url),
    }


def _registry_view(version: int, registry_uri: str, model_name: str, url: str) -> dict[str, Any]:
    from burstcv.registry.registry import PRODUCTION, Registry, RegistryError

    try:
        registry = Registry(registry_uri, model_name)
        alias = registry.get_alias(PRODUCTION)
        status = registry.entry(version).status
    except (RegistryError, storage.ArtifactNotFoundError, ArtifactError, ValueError) as exc:
        return {"error": f"Registry {registry_uri} could not be read: {exc}"}
    return {
        "error": None,
        "uri": registry_uri,
        "model_name": model_name,
        "version": version,
        "status": status or "unknown",
        "production_version": alias.version if alias else None,
        "live": alias is not None and alias.version == version,
        "serving_url": url,
    }


def _cost_view(record: RunDocs) -> dict[str, Any]:
    """Show the run as resolved (boxes, budget, deadline), its bill, and what serving costs."""
    run, billing = record.run, record.billing
    view: dict[str, Any] = {
        "billing_missing": record.missing.get("billing"),
        "run_missing": record.missing.get("run"),
        "serving": _serving_cost_view(record),
    }
    if run is not None:
        rate = run.costs.box_rate
        view.update(
            run=run,
            box_rate=(
                "a process on the worker: free"
                if rate.market == "local"
                else f"{rate.instance_type} {rate.market} ${box_usd_per_hour(rate):.4f}/h "
                f"(instance ${rate.usd_per_hour:.4f}, {rate.volume_gb} GB volume"
                + (", public IPv4" if rate.public_ipv4_usd_per_hour else "")
                + f"; {rate.price_source})"
            ),
        )
    if billing is not None:
        view.update(
            billing=billing,
            billed_seconds=f"{sum(billing.billed_seconds.values()):,.0f}",
            instances=[
                {
                    "instance_id": inst.instance_id,
                    "instance_type": inst.instance_type or "?",
                    "lifecycle": inst.lifecycle or "?",
                    "billed_seconds": billing.billed_seconds.get(inst.instance_id),
                    "price": "—" if inst.usd_per_hour is None else f"${inst.usd_per_hour:.4f}/h",
                    "cost_usd": inst.cost_usd,
                }
                for inst in billing.instances
            ],
        )
    return view


def _serving_cost_view(record: RunDocs) -> dict[str, Any]:
    """Show what serving the run's expected load costs: the sizing's chosen fleet."""
    sizing = record.sizing
    if sizing is None:
        return {"note": record.missing["sizing"], "note_class": "missing"}
    chosen = sizing.chosen
    if chosen is None:
        return {"note": f"No serving fleet: {sizing.reason}", "note_class": "warn"}
    if chosen.usd_per_million is None or chosen.usd_per_month is None:
        return {
            "note": f"{chosen.replicas} x {chosen.instance_type} serve {sizing.target_rps:g} "
            f"req/s, unpriced: {sizing.unpriced or 'no price for the type'}",
            "note_class": "warn",
        }
    return {
        "note": None,
        "per_million_usd": chosen.usd_per_million,
        "per_month_usd": chosen.usd_per_month,
        "fleet": f"{chosen.replicas} x {chosen.instance_type}",
        "target_rps": f"{sizing.target_rps:g}",
        "region": sizing.region,
    }


def _cards(record: RunDocs) -> list[tuple[str, str]]:
    validation, metrics, verdict = record.validation, record.metrics, record.verdict
    billing, latency = record.billing, record.latency
    unreached = "skipped" if record.skip else "not reached"
    p95 = unreached
    if latency is not None:
        candidate = latency.candidate
        p95 = "inconclusive" if candidate is None else fmt(candidate.p95_ms, ".2f", " ms")
    checks = ("passed" if validation.success else "failed") if validation else unreached
    gate = ("promote" if verdict.promote else "not promoted") if verdict else unreached
    return [
        ("Data checks", checks),
        ("Validation accuracy", fmt(metrics.val_accuracy, ".4f") if metrics else unreached),
        ("Candidate p95", p95),
        ("Gate", gate),
        ("Run cost", usd(billing.cost_usd) if billing else unreached),
    ]


NAV = (
    ("data", "Data"),
    ("training", "Training"),
    ("latency", "Latency"),
    ("fleet", "CPU fleet"),
    ("gate", "Gate"),
    ("cost", "Cost"),
)


def render_html(record: RunDocs, *, registry_uri: str, model_name: str, serving_url: str) -> str:
    run_key = record.root.rstrip("/").rsplit("/", 1)[-1]
    # Back to Airflow: the run's page (when run.json names it) and the Models page.
    run_id = record.run.run_id if record.run else None
    airflow_run = links.airflow_run_path(run_id) if run_id else None
    template = _templates().get_template("report.html.j2")
    return template.render(
        run_id=run_key,
        airflow_run_link=airflow_run and links.from_page(run_key, "report", airflow_run),
        models_link=links.from_page(run_key, "report", links.MODELS_PAGE),
        run_root=record.root,
        model_name=model_name,
        generated=datetime.now(UTC).isoformat(timespec="seconds"),
        nav=NAV,
        cards=_cards(record),
        skip=record.skip,
        data=_data_view(record),
        training=_training_view(record),
        model=_model_view(record),
        latency=_latency_view(record),
        fleet=_fleet_view(record),
        gate=_gate_view(record, registry_uri, model_name, serving_url),
        cost=_cost_view(record),
    )


def build_report(run_root: str, *, registry_uri: str, model_name: str, serving_url: str) -> str:
    """Write ``<run_root>/report/index.html`` from what the run recorded; return its URI."""
    record = RunDocs.read(run_root)
    page = render_html(
        record, registry_uri=registry_uri, model_name=model_name, serving_url=serving_url
    )
    uri = storage.write_bytes(storage.join(run_root, "report", "index.html"), page.encode())
    missing = ", ".join(sorted(record.missing)) or "nothing"
    log.info("report written to %s (%d KiB; missing: %s)", uri, len(page) // 1024, missing)
    return uri
