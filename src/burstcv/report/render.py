"""Assemble one self-contained HTML page about a pipeline run from what its stages recorded.

The page (``<run_root>/report/index.html``) needs nothing else to display: figures are PNGs
embedded as ``data:`` URIs, the CSS is inline, there is no script and no external resource.
The one link is relative, to the Data Docs the validate stage wrote beside it. A file a stage
did not write (the run stopped early) becomes a "not reached" note, never an error.
"""

from __future__ import annotations

import base64
import html
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from burstcv import links
from burstcv_spec import storage

log = logging.getLogger(__name__)

DEFAULT_SERVING_INSTANCE = "c7i.large"  # 2 vCPUs: the small CPU box the service is sized for
DEFAULT_SERVING_REGION = "us-east-1"
# Relative to report/index.html: the same link opened from the store or through the plugin.
DATA_DOCS_LINK = links.link_between("report", "data-docs")
MAX_OFFENDING_SHOWN = 5
SKIP_FILE = "skip.json"  # written by the pipeline when a run had nothing new to train on

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
# formatting helpers


def esc(value: Any) -> str:
    """Return a value as HTML-escaped text."""
    return html.escape(str(value), quote=True)


def fmt(value: Any, spec: str = "", suffix: str = "") -> str:
    """Format a number (or pass text through), with an em dash for a missing value."""
    if value is None or value == "":
        return "—"
    if isinstance(value, int | float) and not isinstance(value, bool) and spec:
        return esc(f"{value:{spec}}{suffix}")
    return esc(f"{value}{suffix}")


def usd(value: float | None, digits: int = 4) -> str:
    """Format dollars, or an em dash."""
    return "—" if value is None else f"${value:,.{digits}f}"


def badge(ok: bool | None, yes: str = "passed", no: str = "failed") -> str:
    """Return a coloured pass/fail label."""
    if ok is None:
        return '<span class="badge na">n/a</span>'
    return f'<span class="badge {"ok" if ok else "bad"}">{esc(yes if ok else no)}</span>'


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], cls: str = "") -> str:
    """Return an HTML table; cells are trusted HTML (escape before passing)."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def image(png: bytes, alt: str) -> str:
    """Return an <img> embedding PNG bytes as a base64 data URI."""
    data = base64.b64encode(png).decode("ascii")
    return f'<img class="chart" alt="{esc(alt)}" src="data:image/png;base64,{data}">'


def note(text: str, cls: str = "missing") -> str:
    """Return a highlighted note paragraph."""
    return f'<p class="note {cls}">{esc(text)}</p>'


def short_json(value: Any, limit: int = 140) -> str:
    """Return compact JSON of a value, cut to ``limit`` characters."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return esc(text if len(text) <= limit else text[: limit - 1] + "…")


def _chart(draw: Callable[[], bytes], alt: str) -> str:
    """Draw a figure; on bad data show why instead of failing the whole page."""
    try:
        return image(draw(), alt)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        log.warning("could not draw %s: %s", alt, exc)
        return note(f"Could not draw the {alt}: {type(exc).__name__}: {exc}", "warn")


# ---------------------------------------------------------------------------------------------
# sections


def section(anchor: str, title: str, body: str) -> str:
    """Wrap a section body with its heading."""
    return f'<section id="{anchor}"><h2>{esc(title)}</h2>{body}</section>'


def skip_section(record: RunRecord) -> str:
    """Say, first thing, that the run ended after validation and why (or nothing)."""
    skip = record.get("skip")
    if skip is None:
        return ""
    return section(
        "skipped",
        "Skipped: nothing new to train on",
        f'<p class="note warn">{esc(skip.get("reason", "no reason recorded"))}</p>'
        f"<p>Decided at {fmt(skip.get('decided_at'))}; production stays version "
        f"{fmt(skip.get('production_version'))}.</p>",
    )


def data_section(record: RunRecord) -> str:
    """Describe the dataset checks: verdict, counts, each expectation, a link to Data Docs."""
    doc = record.get("validation")
    if doc is None:
        return section("data", "Data checks", note(record.missing["validation"]))
    counts = doc.get("counts", {})
    expectations = doc.get("expectations", [])
    failed = [e for e in expectations if not e.get("success")]
    parts = [
        f"<p>{badge(bool(doc.get('success')))} {len(expectations) - len(failed)} of "
        f"{len(expectations)} expectations met on <code>{esc(doc.get('dataset_uri', '?'))}</code>"
        f": {fmt(counts.get('usable'))} usable of {fmt(counts.get('files'))} files, "
        f"{fmt(counts.get('errors', 0))} unreadable, {fmt(counts.get('ignored', 0))} ignored.</p>"
    ]
    docs_rel = f"{links.tree_path('data-docs')}/{links.INDEX}"
    if storage.exists(storage.join(record.root, docs_rel)):
        parts.append(
            f'<p>Great Expectations Data Docs: <a href="{DATA_DOCS_LINK}">{esc(docs_rel)}</a></p>'
        )
    else:
        parts.append(note(f"The Data Docs ({docs_rel}) were not written.", "warn"))
    per_split = counts.get("per_split") or {}
    if per_split:
        classes = sorted({c for split in per_split.values() for c in split})
        splits = list(per_split)
        parts.append(
            table(
                ["split", *classes, "total"],
                [
                    [
                        esc(s),
                        *(fmt(per_split[s].get(c, 0)) for c in classes),
                        fmt(sum(per_split[s].values())),
                    ]
                    for s in splits
                ],
                "compact",
            )
        )
    rows = []
    for e in expectations:
        offending = list(e.get("offending_files") or [])
        shown = ", ".join(f"<code>{esc(p)}</code>" for p in offending[:MAX_OFFENDING_SHOWN])
        if len(offending) > MAX_OFFENDING_SHOWN:
            shown += f" and {len(offending) - MAX_OFFENDING_SHOWN} more"
        rows.append(
            [
                f"<b>{esc(e.get('name', '?'))}</b><br><small>{esc(e.get('description', ''))}"
                "</small>",
                badge(bool(e.get("success"))),
                short_json(e.get("observed")),
                shown or "—",
            ]
        )
    parts.append(table(["expectation", "result", "observed", "offending files"], rows))
    drift = doc.get("drift") or {}
    if drift.get("status"):
        parts.append(
            f"<p>Drift against the last passing dataset: {esc(drift.get('status'))}"
            f"{' — ' + esc(drift['message']) if drift.get('message') else ''}</p>"
        )
    for warning in doc.get("warnings") or []:
        parts.append(note(f"warning: {warning}", "warn"))
    return section("data", "Data checks", "".join(parts))


def training_section(record: RunRecord) -> str:
    """Show the training curves, the per-epoch table and where the time went."""
    metrics = record.get("metrics")
    if metrics is None:
        return section("training", "Training", note(record.missing["metrics"]))
    epochs = metrics.get("epochs") or []
    wall = metrics.get("wall_s") or {}
    total_wall = sum(float(v) for v in wall.values()) if wall else None
    parts = [
        f"<p>Final validation accuracy <b>{fmt(metrics.get('val_accuracy'), '.4f')}</b> "
        f"(loss {fmt(metrics.get('val_loss'), '.4f')}) after {len(epochs)} epochs on "
        f"<code>{esc(metrics.get('device', '?'))}</code>"
        f"{' (' + esc(metrics['device_name']) + ')' if metrics.get('device_name') else ''}"
        f"{'; stopped: ' + esc(metrics['stop_reason']) if metrics.get('stop_reason') else ''}"
        ".</p>"
    ]
    if wall:
        parts.append(
            "<p>Wall time "
            + fmt(total_wall, ".1f", " s")
            + ": "
            + ", ".join(f"{esc(k)} {fmt(float(v), '.1f', ' s')}" for k, v in wall.items())
            + ".</p>"
        )
    if epochs:
        from burstcv.report.charts import training_curves

        parts.append(_chart(lambda: training_curves(epochs), "training curves"))
        parts.append(
            table(
                ["epoch", "train loss", "val loss", "val accuracy", "images/s", "lr", "elapsed"],
                [
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
                "compact",
            )
        )
    else:
        parts.append(note("metrics.json lists no epochs: there are no curves to draw.", "warn"))
    confusion, classes = metrics.get("confusion"), metrics.get("classes")
    parts.append("<h3>Confusion matrix</h3>")
    if confusion and classes:
        from burstcv.report.charts import confusion_matrix

        parts.append(_chart(lambda: confusion_matrix(confusion, classes), "confusion matrix"))
    else:
        parts.append(note("metrics.json holds no confusion matrix.", "warn"))
    return section("training", "Training", "".join(parts))


def _latency_sources(latency: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = [("candidate", latency["candidate"])] if "candidate" in latency else []
    if latency.get("production"):
        prod = latency["production"]
        out.append((f"production v{prod.get('version', '?')}", prod))
    return out


def latency_section(record: RunRecord) -> str:
    """Compare candidate and production latency over HTTP: table and overlaid histogram."""
    latency = record.get("latency")
    if latency is None:
        return section("latency", "Latency benchmark", note(record.missing["latency"]))
    sources = _latency_sources(latency)
    if not sources:
        return section("latency", "Latency benchmark", note("latency.json has no candidate."))
    host = latency.get("host") or {}
    parts = [
        f"<p>Measured {fmt(latency.get('measured_at'))} through a staging copy of the service "
        f"on {fmt(host.get('cpu_count'))} CPUs (<code>{esc(host.get('processor', '?'))}</code>), "
        f"{fmt(latency.get('requests'))} requests at concurrency "
        f"{fmt(latency.get('concurrency'))}, one image per request.</p>"
    ]
    rows_spec: list[tuple[str, str, str, str]] = [
        ("p50", "p50_ms", ".2f", " ms"),
        ("p95", "p95_ms", ".2f", " ms"),
        ("p99", "p99_ms", ".2f", " ms"),
        ("throughput", "throughput_rps", ".1f", " req/s"),
        ("error rate", "error_rate", ".2%", ""),
        ("accuracy", "accuracy", ".4f", ""),
        ("bare onnxruntime p50 (floor)", "bare_onnxruntime_p50_ms", ".3f", " ms"),
    ]
    parts.append(
        table(
            ["", *(label for label, _ in sources)],
            [
                [esc(name), *(fmt(figs.get(key), spec, suffix) for _, figs in sources)]
                for name, key, spec, suffix in rows_spec
            ],
            "compact",
        )
    )
    candidate_ms = latency.get("candidate", {}).get("latencies_ms") or []
    if candidate_ms:
        from burstcv.report.charts import latency_histogram

        prod = latency.get("production") or {}
        prod_ms = prod.get("latencies_ms") or None
        slo = _slo_ms(record)
        parts.append(
            _chart(
                lambda: latency_histogram(
                    candidate_ms,
                    prod_ms,
                    slo_ms=slo,
                    production_label=f"production v{prod.get('version', '?')}",
                ),
                "latency histogram",
            )
        )
        if not prod_ms:
            parts.append(note("No production model to compare with: only the candidate.", "info"))
    else:
        parts.append(note("latency.json holds no per-request samples to draw.", "warn"))
    return section("latency", "Latency benchmark", "".join(parts))


def _slo_ms(record: RunRecord) -> float | None:
    verdict = record.get("verdict") or {}
    for check in verdict.get("checks") or []:
        if check.get("name") == "latency_p95":
            return float(check["limit"])
    return None


def gate_section(record: RunRecord, *, registry_uri: str, model_name: str, serving_url: str) -> str:
    """Show the gate's verdict, each check, priced suggestions, and where production points."""
    verdict = record.get("verdict")
    if verdict is None:
        return section("gate", "Gate verdict", note(record.missing["verdict"]))
    promote = bool(verdict.get("promote"))
    parts = [
        f'<p class="verdict {"ok" if promote else "bad"}">'
        f"{'PROMOTE' if promote else 'NOT PROMOTED'}: version {fmt(verdict.get('version'))} "
        f"— {esc(str(verdict.get('summary', '')).removeprefix('not promoted: '))}</p>"
    ]
    parts.append(
        table(
            ["check", "result", "observed", "limit", "reason"],
            [
                [
                    esc(c.get("name")),
                    badge(bool(c.get("passed"))),
                    fmt(c.get("observed"), ".4g"),
                    fmt(c.get("limit"), ".4g"),
                    esc(c.get("reason", "")),
                ]
                for c in verdict.get("checks") or []
            ],
        )
    )
    suggestions = verdict.get("suggestions") or []
    if suggestions:
        parts.append("<h3>What would meet the latency SLO</h3>")
        parts.append(
            table(
                ["option", "est. p95", "meets SLO", "instance", "cost per 1M", "assumption"],
                [
                    [
                        esc(s.get("title")),
                        fmt(s.get("estimated_p95_ms"), ".1f", " ms"),
                        badge(s.get("meets_slo"), "yes", "no"),
                        f"{esc(s.get('instance_type'))} ({esc(s.get('region'))})",
                        usd(s.get("cost_per_million_usd"))
                        if s.get("cost_per_million_usd") is not None
                        else esc(s.get("price_note", "—")),
                        f"<small>{esc(s.get('assumption', ''))}</small>",
                    ]
                    for s in suggestions
                ],
            )
        )
    parts.append(_registry_html(verdict, registry_uri, model_name, serving_url))
    return section("gate", "Gate verdict", "".join(parts))


def _registry_html(verdict: dict[str, Any], registry_uri: str, model_name: str, url: str) -> str:
    from burstcv.registry.registry import PRODUCTION, Registry, RegistryError

    version = verdict.get("version")
    try:
        registry = Registry(registry_uri, model_name)
        alias = registry.get_alias(PRODUCTION)
        status = registry.entry(int(version)).get("status") if version is not None else None
    except (RegistryError, storage.ArtifactNotFoundError, ValueError) as exc:
        return note(f"Registry {registry_uri} could not be read: {exc}", "warn")
    live = alias is not None and alias.version == version
    where = f"served at <code>{esc(url)}</code>" if url else "no serving URL is configured"
    return (
        f"<p>Registry <code>{esc(registry_uri)}</code>, model <code>{esc(model_name)}</code>: "
        f"version {fmt(version)} is <b>{esc(status or 'unknown')}</b>; production points at "
        f"version {fmt(alias.version if alias else None)}"
        f"{' (this run)' if live else ''}; {where}.</p>"
    )


def cost_section(
    record: RunRecord, *, serving_instance_type: str, serving_region: str, training_region: str
) -> str:
    """Price this run's GPU time and one million predictions at the measured throughput."""
    from burstcv.cost.pricing import (
        UnknownPriceError,
        hourly_price,
        price_source,
        serving_cost_per_million,
    )

    parts = ["<h3>Training compute</h3>"]
    billing = record.get("billing")
    if billing is None:
        parts.append(note(record.missing["billing"]))
    else:
        backend = billing.get("backend", "?")
        billed = billing.get("billed_seconds") or {}
        total_s = sum(float(s) for s in billed.values())
        cost = float(billing.get("cost_usd") or 0.0)
        rows = []
        for inst in billing.get("instances") or []:
            iid = inst.get("instance_id", "?")
            itype, life = inst.get("instance_type", ""), inst.get("lifecycle", "")
            try:
                rate: float | None = hourly_price(itype, training_region, life)
            except UnknownPriceError:
                rate = None
            seconds = billed.get(iid)
            rows.append(
                [
                    f"<code>{esc(iid)}</code>",
                    esc(itype or "?"),
                    esc(life or "?"),
                    fmt(seconds, ",.0f", " s"),
                    "—" if rate is None else f"${rate:.4f}/h",
                    usd(None if rate is None or seconds is None else rate * float(seconds) / 3600),
                ]
            )
        if backend == "local":
            parts.append(
                f'<p class="cost"><b>$0.00</b>: the <code>local</code> backend trained on this '
                f"machine ({total_s:,.0f} s), so no GPU was rented and nothing was billed.</p>"
            )
        else:
            parts.append(
                f'<p class="cost"><b>{usd(cost)}</b> for {total_s:,.0f} billed GPU-instance '
                f"seconds on the <code>{esc(backend)}</code> backend (billed seconds × the "
                f"{esc(training_region)} hourly price; per second, 60 s minimum per start).</p>"
            )
        if rows:
            parts.append(
                table(["instance", "type", "lifecycle", "billed", "price", "cost"], rows, "compact")
            )
    parts.append("<h3>Serving</h3>")
    latency = record.get("latency")
    rps = ((latency or {}).get("candidate") or {}).get("throughput_rps")
    if latency is None:
        parts.append(note(record.missing["latency"]))
    elif not rps:
        parts.append(note("The benchmark measured no throughput: serving cost is unknown.", "warn"))
    else:
        try:
            per_million = serving_cost_per_million(serving_instance_type, serving_region, rps)
            rate = hourly_price(serving_instance_type, serving_region, "on-demand")
        except UnknownPriceError as exc:
            parts.append(note(f"Serving cost unknown: {exc}", "warn"))
        else:
            host = latency.get("host") or {}
            line = (
                f'<p class="cost"><b>{usd(per_million)} per 1M predictions</b> on one '
                f"<code>{esc(serving_instance_type)}</code> (on-demand, {esc(serving_region)}, "
                f"${rate:.4f}/h) at the candidate's measured {float(rps):.1f} req/s"
            )
            prod = latency.get("production") or {}
            if prod.get("throughput_rps"):
                prod_cost = serving_cost_per_million(
                    serving_instance_type, serving_region, float(prod["throughput_rps"])
                )
                line += f" (production v{esc(prod.get('version', '?'))}: {usd(prod_cost)})"
            parts.append(
                line + ".</p>"
                f"<p><small>The throughput was measured on the benchmark host "
                f"({fmt(host.get('cpu_count'))} CPUs, concurrency "
                f"{fmt(latency.get('concurrency'))}), not on a {esc(serving_instance_type)}: "
                "treat the figure as an estimate of one instance kept busy.</small></p>"
            )
    source = price_source()
    parts.append(
        f"<p><small>Prices as of {esc(source['as_of'])}: {esc(source['source'])}</small></p>"
    )
    return section("cost", "Cost", "".join(parts))


def model_section(record: RunRecord) -> str:
    """Describe the exported model: architecture, input, opset, hash, lineage."""
    meta = record.get("model")
    if meta is None:
        return section("model", "Exported model", note(record.missing["model"]))
    pre = meta.get("preprocess") or {}
    rows = [
        ["architecture", esc(meta.get("arch", "?"))],
        ["classes", esc(", ".join(map(str, meta.get("classes") or [])))],
        ["input", f"{fmt(pre.get('height'))}×{fmt(pre.get('width'))} {esc(pre.get('color_mode'))}"],
        ["ONNX", f"<code>{esc(meta.get('onnx_file', '?'))}</code>, opset {fmt(meta.get('opset'))}"],
        ["sha256", f"<code>{esc(meta.get('sha256', '?'))}</code>"],
        ["parity vs torch", fmt((meta.get("parity") or {}).get("max_abs_diff"), ".2e")],
        ["dataset fingerprint", f"<code>{esc(meta.get('dataset_fingerprint', '?'))}</code>"],
        ["source commit", f"<code>{esc(meta.get('source_commit', '?'))}</code>"],
    ]
    return section("model", "Exported model", table(["", ""], rows, "compact kv"))


# ---------------------------------------------------------------------------------------------
# the page

CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:0;
 background:#f4f5f7;color:#1d2330;line-height:1.45}
main{max-width:1080px;margin:0 auto;padding:24px}
header{background:#1d2330;color:#fff;padding:20px 24px}
header h1{margin:0 0 4px;font-size:22px}header p{margin:0;color:#c5cad6}
section{background:#fff;border-radius:8px;padding:16px 20px;margin:0 0 18px;
 box-shadow:0 1px 2px rgba(0,0,0,.08)}
h2{margin:0 0 10px;font-size:18px}h3{font-size:15px;margin:16px 0 8px}
table{border-collapse:collapse;width:100%;margin:8px 0;font-size:13px}
th,td{border-bottom:1px solid #e3e6eb;padding:5px 8px;text-align:left;vertical-align:top}
th{background:#f0f2f5}table.compact{width:auto}table.kv th{display:none}
code{font-size:12px;background:#f0f2f5;padding:1px 4px;border-radius:3px}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600}
.badge.ok{background:#dff3e4;color:#1a7f37}.badge.bad{background:#fde2e1;color:#b42318}
.badge.na{background:#eceff3;color:#5b6472}
.verdict{font-size:16px;font-weight:600;padding:10px 14px;border-radius:6px}
.verdict.ok{background:#dff3e4;color:#1a7f37}.verdict.bad{background:#fde2e1;color:#b42318}
.note{padding:8px 12px;border-radius:6px;border-left:4px solid}
.note.missing{background:#f0f2f5;border-color:#8a94a6;color:#3b4351}
.note.warn{background:#fff6e0;border-color:#e3a008}.note.info{background:#e8f1fb;border-color:#1f77b4}
.cost b{font-size:16px}img.chart{max-width:100%;display:block;margin:10px 0}
nav a{color:#c5cad6;margin-right:14px;font-size:13px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:0 0 18px}
.card{flex:1 1 140px;background:#fff;border-radius:8px;padding:12px 14px;
 box-shadow:0 1px 2px rgba(0,0,0,.08)}.card small{color:#5b6472}
.card div{font-size:18px;font-weight:600}
"""


def _cards(record: RunRecord) -> str:
    """Return the one-glance summary: data, accuracy, latency, gate, run cost."""
    validation = record.get("validation")
    metrics = record.get("metrics")
    verdict = record.get("verdict")
    billing = record.get("billing")
    latency = record.get("latency")
    unreached = "skipped" if record.get("skip") else "not reached"
    cards = [
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
    return (
        '<div class="cards">'
        + "".join(
            # Every value above is a literal or already escaped by fmt/usd.
            f"<div class=card><small>{esc(k)}</small><div>{v}</div></div>"
            for k, v in cards
        )
        + "</div>"
    )


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
    run_id = record.root.rstrip("/").rsplit("/", 1)[-1]
    generated = datetime.now(UTC).isoformat(timespec="seconds")
    body = "".join(
        [
            _cards(record),
            skip_section(record),
            data_section(record),
            training_section(record),
            model_section(record),
            latency_section(record),
            gate_section(
                record, registry_uri=registry_uri, model_name=model_name, serving_url=serving_url
            ),
            cost_section(
                record,
                serving_instance_type=serving_instance_type,
                serving_region=serving_region,
                training_region=training_region,
            ),
        ]
    )
    nav = "".join(
        f'<a href="#{a}">{t}</a>'
        for a, t in (
            ("data", "Data"),
            ("training", "Training"),
            ("latency", "Latency"),
            ("gate", "Gate"),
            ("cost", "Cost"),
        )
    )
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        f"<title>burstcv run {esc(run_id)}</title><style>{CSS}</style></head><body>"
        f"<header><h1>burstcv run {esc(run_id)}</h1><p>model <b>{esc(model_name)}</b> · "
        f"report generated {esc(generated)} · <code>{esc(record.root)}</code></p>"
        f"<nav>{nav}</nav></header><main>{body}</main></body></html>\n"
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
    from burstcv.compute.ec2 import Ec2Settings

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
