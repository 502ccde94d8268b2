"""Assemble one self-contained HTML page about a pipeline run from what its stages recorded.

The page (``<run_root>/report/index.html``) needs nothing else to display: figures are PNGs
embedded as ``data:`` URIs, the CSS is inline, there is no script and no external resource.
The one link is relative, to the Data Docs the validate stage wrote beside it. A file a stage
did not write (the run stopped early) becomes a "not reached" note, never an error.

This module reads the run and works out what each section says (a view: a dict of plain
values, with ``missing`` set to the reason when the section has nothing to show); the
markup is ``report.html.j2`` beside this module, rendered by Jinja with autoescape on, so a class
name or a file path from a dataset is always shown as text.
"""

from __future__ import annotations

import base64
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
from burstcv.gate.gate import format_figure
from burstcv_spec import storage
from burstcv_spec.layout import SKIP_RECORD

log = logging.getLogger(__name__)

DEFAULT_SERVING_INSTANCE = "c7i.large"  # 2 vCPUs: the small CPU box the service is sized for
DEFAULT_SERVING_REGION = "us-east-1"
# Relative to report/index.html: the same link opened from the store or through the plugin.
DATA_DOCS_LINK = links.link_between("report", "data-docs")
MAX_OFFENDING_SHOWN = 5
SKIP_FILE = SKIP_RECORD  # written by the pipeline when a run had nothing new to train on

# Each file the report reads, and the stage that writes it (for "not reached" notes).
ARTIFACTS: dict[str, tuple[str, str]] = {
    "validation": ("dataset/validation.json", "validate"),
    "metrics": ("job/metrics.json", "train"),
    "billing": ("job/billing.json", "terminate"),
    "model": ("model/model.json", "export"),
    "latency": ("bench/latency.json", "benchmark"),
    "verdict": ("bench/verdict.json", "gate"),
}


@dataclass
class RunRecord:
    """Hold what one run's stages wrote, and why each missing document is missing."""

    root: str
    docs: dict[str, Any] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, run_root: str) -> RunRecord:
        """Read every artifact the report uses; note those absent or unreadable."""
        record = cls(run_root)
        skip_uri = storage.join(run_root, SKIP_FILE)
        if storage.exists(skip_uri):
            record.docs["skip"] = storage.read_json(skip_uri)
        for key, (rel, stage) in ARTIFACTS.items():
            uri = storage.join(run_root, rel)
            try:
                record.docs[key] = storage.read_json(uri)
            except storage.ArtifactNotFoundError:
                record.missing[key] = (
                    f"Skipped: nothing new to train on, so the {stage} stage did not run."
                    if "skip" in record.docs
                    else f"Not reached: {rel} was not written; the run stopped before the "
                    f"{stage} stage finished."
                )
            except ValueError as exc:  # json.JSONDecodeError: a stage wrote a broken file
                log.warning("cannot parse %s: %s", uri, exc)
                record.missing[key] = f"{rel} exists but is not valid JSON ({exc})."
        return record

    def get(self, key: str) -> Any:
        """Return a document, or None when it is missing."""
        return self.docs.get(key)


# ---------------------------------------------------------------------------------------------
# formatting helpers (plain text: the template escapes)


def fmt(value: Any, spec: str = "", suffix: str = "") -> str:
    """Format a number (or pass text through), with an em dash for a missing value."""
    if value is None or value == "":
        return "—"
    if isinstance(value, int | float) and not isinstance(value, bool) and spec:
        return f"{value:{spec}}{suffix}"
    return f"{value}{suffix}"


def usd(value: float | None, digits: int = 4) -> str:
    """Format dollars, or an em dash."""
    return "—" if value is None else f"${value:,.{digits}f}"


def short_json(value: Any, limit: int = 140) -> str:
    """Return compact JSON of a value, cut to ``limit`` characters."""
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
    """Return the Jinja environment of the report template (package data)."""
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


# ---------------------------------------------------------------------------------------------
# section views: what each section says, as plain values


def _skip_view(record: RunRecord) -> dict[str, Any] | None:
    """Say, first thing, that the run ended after validation and why (or None)."""
    skip = record.get("skip")
    if skip is None:
        return None
    return {
        "reason": skip.get("reason", "no reason recorded"),
        "decided_at": skip.get("decided_at"),
        "production_version": skip.get("production_version"),
    }


def _data_view(record: RunRecord) -> dict[str, Any]:
    """Describe the dataset checks: verdict, counts, each expectation, a link to Data Docs."""
    doc = record.get("validation")
    if doc is None:
        return {"missing": record.missing["validation"]}
    counts = doc.get("counts", {})
    expectations = doc.get("expectations", [])
    failed = [e for e in expectations if not e.get("success")]
    docs_rel = f"{links.tree_path('data-docs')}/{links.INDEX}"
    per_split = counts.get("per_split") or {}
    classes = sorted({c for split in per_split.values() for c in split})
    drift = doc.get("drift") or {}
    rows = []
    for e in expectations:
        offending = list(e.get("offending_files") or [])
        rows.append(
            {
                "name": e.get("name", "?"),
                "description": e.get("description", ""),
                "success": bool(e.get("success")),
                "observed": short_json(e.get("observed")),
                "shown": offending[:MAX_OFFENDING_SHOWN],
                "more": max(0, len(offending) - MAX_OFFENDING_SHOWN),
            }
        )
    return {
        "missing": None,
        "success": bool(doc.get("success")),
        "met": len(expectations) - len(failed),
        "total": len(expectations),
        "dataset_uri": doc.get("dataset_uri", "?"),
        "usable": counts.get("usable"),
        "files": counts.get("files"),
        "errors": counts.get("errors", 0),
        "ignored": counts.get("ignored", 0),
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
        "expectations": rows,
        "drift_status": drift.get("status"),
        "drift_message": drift.get("message"),
        "warnings": doc.get("warnings") or [],
    }


# Validation accuracy within this much of the better of chance and the majority-class rate is
# "near chance": the model has learned little beyond guessing the most common class.
NEAR_CHANCE_MARGIN = 0.1
WORST_CLASSES = 3  # per-class accuracy shown for this many of the worst classes


def model_quality(metrics: dict[str, Any]) -> dict[str, Any]:
    """Return chance, the majority-class rate, the worst classes and warnings of a run's model.

    From metrics.json: the confusion matrix (rows: true class) of the exported model, and the
    per-epoch losses. A warning when the model is near chance, or when the loss diverged
    (a recovery, or a validation loss that is not finite or far above chance).
    """
    confusion, classes = metrics.get("confusion"), metrics.get("classes") or []
    accuracy = metrics.get("val_accuracy")
    out: dict[str, Any] = {
        "chance": None,
        "majority": None,
        "worst_classes": [],
        "quality_warnings": [],
    }
    if not confusion or not classes or accuracy is None:
        return out
    totals = [sum(row) for row in confusion]
    n = sum(totals) or 1
    chance, majority = 1 / len(classes), max(totals) / n
    out["chance"], out["majority"] = chance, majority
    per_class: list[tuple[str, float, int]] = [
        (str(name), row[i] / total, total)
        for i, (name, row, total) in enumerate(zip(classes, confusion, totals, strict=False))
        if total
    ]
    ranked = sorted(per_class, key=lambda c: c[1])
    out["worst_classes"] = [
        [name, f"{acc:.1%}", f"{total:,}"] for name, acc, total in ranked[:WORST_CLASSES]
    ]
    warnings = out["quality_warnings"]
    floor = max(chance, majority)
    if accuracy < floor + NEAR_CHANCE_MARGIN:
        warnings.append(
            f"the model is near chance: validation accuracy {accuracy:.1%} against chance "
            f"{chance:.1%} and the majority-class rate {majority:.1%}; it has learned little "
            "(see the training details: more data, pretrained weights, or more epochs)"
        )
    limit = 10 * max(1.0, math.log(len(classes)))
    val_losses = [e.get("val_loss") for e in metrics.get("epochs") or []]
    blown = [
        v for v in val_losses if isinstance(v, (int, float)) and (not math.isfinite(v) or v > limit)
    ]
    if metrics.get("recoveries") or blown:
        what = []
        if metrics.get("recoveries"):
            what.append(f"training diverged {len(metrics['recoveries'])} time(s) and recovered")
        if blown:
            what.append(f"the validation loss reached {max(blown):.4g} (chance: {limit / 10:.3g})")
        warnings.append(
            "the loss curve diverged: " + "; ".join(what) + "; a lower learning rate or a "
            "larger batch may train better"
        )
    return out


def _range_test_line(test: dict[str, Any] | None) -> str | None:
    """Return the learning-rate range test in one line, or None when the run had none."""
    if not test:
        return None
    return (
        f"{test.get('steps')} steps in {fmt(test.get('seconds'), '.1f', ' s')}, the lowest loss "
        f"at {fmt(test.get('min_loss_lr'), '.3g')}: trained at {fmt(test.get('chosen_lr'), '.3g')} "
        f"(instead of {fmt(test.get('fallback_lr'), '.3g')})"
    )


def _training_view(record: RunRecord) -> dict[str, Any]:
    """Show the training curves, the per-epoch table and where the time went."""
    metrics = record.get("metrics")
    if metrics is None:
        return {"missing": record.missing["metrics"]}
    epochs = metrics.get("epochs") or []
    wall = metrics.get("wall_s") or {}
    curves = confusion_chart = None
    if epochs:
        from burstcv.report.charts import training_curves

        curves = _chart(lambda: training_curves(epochs), "training curves")
    confusion, classes = metrics.get("confusion"), metrics.get("classes")
    if confusion and classes:
        from burstcv.report.charts import confusion_matrix

        confusion_chart = _chart(lambda: confusion_matrix(confusion, classes), "confusion matrix")
    recipe = (record.get("validation") or {}).get("training") or {}
    return {
        "missing": None,
        "recipe": recipe.get("reason"),
        "recipe_warning": recipe.get("warning"),
        "best_epoch": metrics.get("best_epoch"),
        "epochs_asked": metrics.get("epochs_asked"),
        "seconds_saved": metrics.get("seconds_saved") or 0.0,
        "recoveries": [
            f"epoch {r.get('epoch')} step {r.get('step')}: {r.get('reason')}; restored the last "
            f"good state, learning rate x{float(r.get('lr_scale', 1.0)):.3g}"
            for r in metrics.get("recoveries") or []
        ],
        "range_test": _range_test_line(metrics.get("lr_range_test")),
        **model_quality(metrics),
        "val_accuracy": metrics.get("val_accuracy"),
        "val_loss": metrics.get("val_loss"),
        "epoch_count": len(epochs),
        "device": metrics.get("device", "?"),
        "device_name": metrics.get("device_name"),
        "precision": metrics.get("precision"),
        "stop_reason": metrics.get("stop_reason"),
        "wall": [(stage, float(seconds)) for stage, seconds in wall.items()],
        "total_wall": sum(float(v) for v in wall.values()) if wall else None,
        "curves": curves,
        "epoch_rows": [
            [
                fmt(e.get("epoch")),
                fmt(e.get("train_loss"), ".4f"),
                fmt(e.get("val_loss"), ".4f"),
                fmt(e.get("val_accuracy"), ".4f"),
                fmt(e.get("images_per_s"), ",.0f"),
                fmt(e.get("lr"), ".4g"),
                fmt(e.get("elapsed_s"), ".1f", " s"),
            ]
            for e in epochs
        ],
        "confusion": confusion_chart,
    }


def _model_view(record: RunRecord) -> dict[str, Any]:
    """Describe the exported model: architecture, input, opset, hash, lineage."""
    meta = record.get("model")
    if meta is None:
        return {"missing": record.missing["model"]}
    pre = meta.get("preprocess") or {}
    size = (record.get("validation") or {}).get("image_size") or {}
    return {
        "missing": None,
        "image_size_reason": size.get("reason") if size.get("px") == pre.get("height") else None,
        "arch": meta.get("arch", "?"),
        "classes": ", ".join(map(str, meta.get("classes") or [])),
        "height": pre.get("height"),
        "width": pre.get("width"),
        "resize_short": pre.get("resize_short"),
        "color_mode": pre.get("color_mode"),
        "onnx_file": meta.get("onnx_file", "?"),
        "opset": meta.get("opset"),
        "sha256": meta.get("sha256", "?"),
        "parity_max_abs_diff": (meta.get("parity") or {}).get("max_abs_diff"),
        "dataset_fingerprint": meta.get("dataset_fingerprint", "?"),
        "source_commit": meta.get("source_commit", "?"),
    }


def _latency_sources(latency: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = [("candidate", latency["candidate"])] if "candidate" in latency else []
    if latency.get("production"):
        prod = latency["production"]
        out.append((f"production v{prod.get('version', '?')}", prod))
    return out


# The latency table's rows: label, latency.json key, number format, unit.
LATENCY_ROWS: tuple[tuple[str, str, str, str], ...] = (
    ("p50", "p50_ms", ".2f", " ms"),
    ("p95", "p95_ms", ".2f", " ms"),
    ("p99", "p99_ms", ".2f", " ms"),
    ("throughput", "throughput_rps", ".1f", " req/s"),
    ("error rate", "error_rate", ".2%", ""),
    ("accuracy", "accuracy", ".4f", ""),
    ("bare onnxruntime p50 (floor)", "bare_onnxruntime_p50_ms", ".3f", " ms"),
)


def _latency_view(record: RunRecord) -> dict[str, Any]:
    """Compare candidate and production latency over HTTP: table and overlaid histogram."""
    latency = record.get("latency")
    if latency is None:
        return {"missing": record.missing["latency"]}
    sources = _latency_sources(latency)
    if not sources:
        return {"missing": "latency.json has no candidate."}
    host = latency.get("host") or {}
    histogram = None
    prod = latency.get("production") or {}
    prod_ms = prod.get("latencies_ms") or None
    candidate_ms = latency.get("candidate", {}).get("latencies_ms") or []
    if candidate_ms:
        from burstcv.report.charts import latency_histogram

        slo = _slo_ms(record)
        histogram = _chart(
            lambda: latency_histogram(
                candidate_ms,
                prod_ms,
                slo_ms=slo,
                production_label=f"production v{prod.get('version', '?')}",
            ),
            "latency histogram",
        )
    return {
        "missing": None,
        "measured_at": latency.get("measured_at"),
        "cpu_count": host.get("cpu_count"),
        "processor": host.get("processor", "?"),
        "requests": latency.get("requests"),
        "concurrency": latency.get("concurrency"),
        "labels": [label for label, _ in sources],
        "rows": [
            [name, *(fmt(figures.get(key), spec, suffix) for _, figures in sources)]
            for name, key, spec, suffix in LATENCY_ROWS
        ],
        "histogram": histogram,
        "production_sampled": bool(prod_ms),
    }


def _slo_ms(record: RunRecord) -> float | None:
    verdict = record.get("verdict") or {}
    for check in verdict.get("checks") or []:
        if check.get("name") == "latency_p95":
            return float(check["limit"])
    return None


def _gate_view(
    record: RunRecord, *, registry_uri: str, model_name: str, serving_url: str
) -> dict[str, Any]:
    """Show the gate's verdict, each check, priced suggestions, and where production points."""
    verdict = record.get("verdict")
    if verdict is None:
        return {"missing": record.missing["verdict"]}
    return {
        "missing": None,
        "promote": bool(verdict.get("promote")),
        "version": verdict.get("version"),
        "summary": str(verdict.get("summary", "")).removeprefix("not promoted: "),
        "checks": [
            {
                "name": c.get("name"),
                "passed": bool(c.get("passed")),
                # With the check's unit: "4.85 ms" vs "50.00 ms", not 4.854 vs 50.
                "observed": format_figure(str(c.get("name")), c.get("observed")),
                "limit": format_figure(str(c.get("name")), c.get("limit")),
                "reason": c.get("reason", ""),
            }
            for c in verdict.get("checks") or []
        ],
        "suggestions": [
            {
                "title": s.get("title"),
                "estimated_p95_ms": s.get("estimated_p95_ms"),
                "meets_slo": s.get("meets_slo"),
                "instance_type": s.get("instance_type"),
                "region": s.get("region"),
                "cost": usd(s.get("cost_per_million_usd"))
                if s.get("cost_per_million_usd") is not None
                else s.get("price_note", "—"),
                "assumption": s.get("assumption", ""),
            }
            for s in verdict.get("suggestions") or []
        ],
        "registry": _registry_view(verdict, registry_uri, model_name, serving_url),
    }


def _registry_view(
    verdict: dict[str, Any], registry_uri: str, model_name: str, url: str
) -> dict[str, Any]:
    from burstcv.registry.registry import PRODUCTION, Registry, RegistryError

    version = verdict.get("version")
    try:
        registry = Registry(registry_uri, model_name)
        alias = registry.get_alias(PRODUCTION)
        status = registry.entry(int(version)).status if version is not None else None
    except (RegistryError, storage.ArtifactNotFoundError, ValueError) as exc:
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


def _cost_view(
    record: RunRecord, *, serving_instance_type: str, serving_region: str, training_region: str
) -> dict[str, Any]:
    """Price this run's GPU time and one million predictions at the measured throughput."""
    from burstcv.cost.pricing import UnknownPriceError, hourly_price, price_source

    source = price_source()
    view: dict[str, Any] = {
        "billing_missing": record.missing.get("billing"),
        "training_region": training_region,
        "serving": _serving_cost_view(record, serving_instance_type, serving_region),
        "prices_as_of": source["as_of"],
        "prices_source": source["source"],
    }
    billing = record.get("billing")
    if billing is None:
        return view
    billed = billing.get("billed_seconds") or {}
    instances = []
    for inst in billing.get("instances") or []:
        iid = inst.get("instance_id", "?")
        itype, life = inst.get("instance_type", ""), inst.get("lifecycle", "")
        try:
            rate: float | None = hourly_price(itype, training_region, life)
        except UnknownPriceError:
            rate = None
        seconds = billed.get(iid)
        instances.append(
            {
                "instance_id": iid,
                "instance_type": itype or "?",
                "lifecycle": life or "?",
                "billed_seconds": seconds,
                "price": "—" if rate is None else f"${rate:.4f}/h",
                "cost_usd": None
                if rate is None or seconds is None
                else rate * float(seconds) / 3600,
            }
        )
    view.update(
        backend=billing.get("backend", "?"),
        billed_seconds=f"{sum(float(s) for s in billed.values()):,.0f}",
        cost_usd=float(billing.get("cost_usd") or 0.0),
        instances=instances,
    )
    return view


def _serving_cost_view(record: RunRecord, instance_type: str, region: str) -> dict[str, Any]:
    """Price one million predictions on one serving instance at the measured throughput."""
    from burstcv.cost.pricing import UnknownPriceError, hourly_price, serving_cost_per_million

    latency = record.get("latency")
    rps = ((latency or {}).get("candidate") or {}).get("throughput_rps")
    if latency is None:
        return {"note": record.missing["latency"], "note_class": "missing"}
    if not rps:
        return {
            "note": "The benchmark measured no throughput: serving cost is unknown.",
            "note_class": "warn",
        }
    try:
        per_million = serving_cost_per_million(instance_type, region, rps)
        rate = hourly_price(instance_type, region, "on-demand")
    except UnknownPriceError as exc:
        return {"note": f"Serving cost unknown: {exc}", "note_class": "warn"}
    prod = latency.get("production") or {}
    production = None
    if prod.get("throughput_rps"):
        production = {
            "version": prod.get("version", "?"),
            "per_million_usd": serving_cost_per_million(
                instance_type, region, float(prod["throughput_rps"])
            ),
        }
    host = latency.get("host") or {}
    return {
        "note": None,
        "per_million_usd": per_million,
        "instance_type": instance_type,
        "region": region,
        "hourly": f"${rate:.4f}/h",
        "throughput_rps": f"{float(rps):.1f}",
        "production": production,
        "cpu_count": host.get("cpu_count"),
        "concurrency": latency.get("concurrency"),
    }


def _cards(record: RunRecord) -> list[tuple[str, str]]:
    """Return the one-glance summary: data, accuracy, latency, gate, run cost."""
    validation = record.get("validation")
    metrics = record.get("metrics")
    verdict = record.get("verdict")
    billing = record.get("billing")
    latency = record.get("latency")
    unreached = "skipped" if record.get("skip") else "not reached"
    return [
        (
            "Data checks",
            "passed"
            if validation and validation.get("success")
            else ("failed" if validation else unreached),
        ),
        (
            "Validation accuracy",
            fmt((metrics or {}).get("val_accuracy"), ".4f") if metrics else unreached,
        ),
        (
            "Candidate p95",
            fmt(((latency or {}).get("candidate") or {}).get("p95_ms"), ".2f", " ms")
            if latency
            else unreached,
        ),
        (
            "Gate",
            ("promote" if verdict.get("promote") else "not promoted") if verdict else unreached,
        ),
        ("Run cost", usd(float(billing.get("cost_usd") or 0.0)) if billing else unreached),
    ]


# ---------------------------------------------------------------------------------------------
# the page

NAV = (
    ("data", "Data"),
    ("training", "Training"),
    ("latency", "Latency"),
    ("gate", "Gate"),
    ("cost", "Cost"),
)


def _airflow_run_id(run_root: str) -> str | None:
    """Return the Airflow run id run.json records for the run folder, or None without one."""
    from burstcv_spec.contracts import ArtifactError, read_artifact
    from burstcv_spec.contracts import RunRecord as RunJson
    from burstcv_spec.layout import RunLayout

    try:
        return read_artifact(RunLayout(run_root.rstrip("/")).record, RunJson).run_id
    except (storage.ArtifactNotFoundError, ArtifactError):
        return None


def render_html(
    record: RunRecord,
    *,
    registry_uri: str,
    model_name: str,
    serving_url: str,
    serving_instance_type: str = DEFAULT_SERVING_INSTANCE,
    serving_region: str = DEFAULT_SERVING_REGION,
    training_region: str = DEFAULT_SERVING_REGION,
) -> str:
    """Return the whole report page for a run record."""
    run_key = record.root.rstrip("/").rsplit("/", 1)[-1]
    airflow_run_id = _airflow_run_id(record.root)
    return (
        _templates()
        .get_template("report.html.j2")
        .render(
            run_id=run_key,
            # Back to Airflow: the run's page (when run.json names it) and the Models page.
            airflow_run_link=links.from_page(
                run_key, "report", links.airflow_run_path(airflow_run_id)
            )
            if airflow_run_id
            else None,
            models_link=links.from_page(run_key, "report", links.MODELS_PAGE),
            run_root=record.root,
            model_name=model_name,
            generated=datetime.now(UTC).isoformat(timespec="seconds"),
            nav=NAV,
            cards=_cards(record),
            skip=_skip_view(record),
            data=_data_view(record),
            training=_training_view(record),
            model=_model_view(record),
            latency=_latency_view(record),
            gate=_gate_view(
                record, registry_uri=registry_uri, model_name=model_name, serving_url=serving_url
            ),
            cost=_cost_view(
                record,
                serving_instance_type=serving_instance_type,
                serving_region=serving_region,
                training_region=training_region,
            ),
        )
    )


def build_report(
    run_root: str,
    *,
    registry_uri: str,
    model_name: str,
    serving_url: str,
    serving_instance_type: str = DEFAULT_SERVING_INSTANCE,
    serving_region: str = DEFAULT_SERVING_REGION,
) -> str:
    """Write ``<run_root>/report/index.html`` from what the run recorded; return its URI."""
    from burstcv.settings import Ec2Settings

    record = RunRecord.read(run_root)
    page = render_html(
        record,
        registry_uri=registry_uri,
        model_name=model_name,
        serving_url=serving_url,
        serving_instance_type=serving_instance_type,
        serving_region=serving_region,
        training_region=Ec2Settings().region,
    )
    uri = storage.write_bytes(storage.join(run_root, "report", "index.html"), page.encode())
    log.info(
        "report written to %s (%d KiB; missing: %s)",
        uri,
        len(page) // 1024,
        ", ".join(sorted(record.missing)) or "nothing",
    )
    return uri
