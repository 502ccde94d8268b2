"""The run report: one self-contained page from what the stages wrote, even for a partial run."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from burstcv_testkit import bench_figures, g6_box_rate, model_card, write_model_dir
from PIL import Image

from burstcv.compute.billing import run_bill
from burstcv.cost.budget import serving_quotes
from burstcv.cost.model import time_budget
from burstcv.cost.quotes import PriceSources, quote
from burstcv.gate.gate import GPU_SERVING_TYPES
from burstcv.params import ResolvedRun, RunParams
from burstcv.registry.registry import Registry
from burstcv.report.render import build_report
from burstcv.training.job import attempt_dir, write_failed, write_rank_failed
from burstcv_spec.contracts import (
    AttemptBill,
    AttemptRecord,
    BenchFigures,
    BoxBill,
    FailedMarker,
    ImageSizeChoice,
    PriceQuote,
    RegistryDecision,
    RunCosts,
    SizingReport,
    TrainingBeat,
    TrainingChoice,
    TrainingMetrics,
    ValidationRecord,
    VerdictRecord,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import ATTEMPT_RECORD, END_RECORD, RunLayout

CLASSES = [str(i) for i in range(10)]


def rng() -> np.random.Generator:
    """Return a generator seeded afresh: each document is the same whatever ran before."""
    return np.random.default_rng(0)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_TIMEOUT_S = 90


def write(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))


def validation_doc(success: bool = True) -> dict[str, Any]:
    """Return a complete validation.json (a ValidationRecord) of the demo digits."""
    doc = {
        "success": success,
        "dataset_uri": "/data/digits",
        "fingerprint": "ab" * 32,
        "counts": {
            "files": 1799,
            "usable": 1797,
            "errors": 2,
            "ignored": 1,
            "per_split": {
                "train": {c: 144 for c in CLASSES},
                "val": {c: 36 for c in CLASSES},
            },
        },
        "expectations": [
            {
                "name": "decodable",
                "description": "every image decodes",
                "expectation_type": "expect_column_values_to_be_in_set",
                "success": success,
                "observed": {"unexpected_count": 0 if success else 2},
                "offending_files": [] if success else ["train/3/bad.png", "val/7/trunc.png"],
            },
            {
                "name": "min_images_per_class",
                "description": "each class has at least 5 images per split",
                "expectation_type": "expect_column_min_to_be_between",
                "success": True,
                "observed": {"min": 36},
                "offending_files": [],
            },
        ],
        "ignored": [{"path": "train/.DS_Store", "reason": "hidden file"}],
        "drift": {"status": "ok", "message": "class proportions within 0.10"},
        "warnings": [],
        "config": {"min_images_per_class": 5},
        "manifest_uri": "/a/runs/r/dataset/manifest.parquet",
        "data_docs_uri": "/a/runs/r/dataset/data_docs/index.html",
        "validated_at": "2025-01-01T10:00:00+00:00",
        "versions": {"great_expectations": "1.0", "pillow": "11.0"},
    }
    return ValidationRecord.model_validate(doc).model_dump(mode="json")


def training_choice(reason: str, warning: str | None = None) -> TrainingChoice:
    """Return validate's training choice (run.json's ``training``) with this reason."""
    return TrainingChoice(
        model="resnet18",
        pretrained="none",
        batch_size=128,
        learning_rate=0.01,
        epochs=8,
        optimizer="adamw",
        warmup_steps=10,
        early_stop_patience=3,
        derived=["model", "batch_size"],
        reason=reason,
        warning=warning,
    )


def metrics_doc() -> dict[str, Any]:
    """Return a complete metrics.json (a TrainingMetrics) of six epochs on the digits."""
    epochs = [
        {
            "epoch": e,
            "train_loss": 2.2 / e,
            "val_loss": 2.0 / e + 0.05,
            "val_accuracy": min(0.985, 0.6 + 0.08 * e),
            "images_per_s": 5400.0 + 10 * e,
            "lr": 0.2 / e,
            "elapsed_s": 1.6 * e,
        }
        for e in range(1, 7)
    ]
    confusion = np.diag(rng().integers(33, 37, size=10))
    confusion[3, 5] = 2
    confusion[8, 1] = 1
    doc = {
        "val_accuracy": 0.9806,
        "val_loss": 0.071,
        "epochs": epochs,
        "confusion": confusion.tolist(),
        "classes": CLASSES,
        "arch": "resnet10",
        "best_epoch": 6,
        "epochs_asked": 6,
        "epochs_run": 6,
        "seconds_saved": 0.0,
        "stop_reason": "all epochs run",
        "recoveries": [],
        "optimizer": {
            "name": "sgd",
            "learning_rate": 0.2,
            "lr_scale": 1.0,
            "weight_decay": 5e-5,
            "batch_size": 128,
            "warmup_steps": 10,
            "steps_per_epoch": 11,
            "total_steps": 66,
            "schedule": "linear warm-up, cosine decay",
        },
        "wall_s": {"setup": 2.1, "data": 0.4, "compute": 8.9, "eval": 0.6},
        "device": "cuda:0",
        "device_name": "NVIDIA L4",
        "world_size": 1,
        "pretrained": "none",
        "amp_dtype": "torch.bfloat16",
        "precision": "bf16",
        "versions": {"torch": "2.14.1"},
        "host": HOST,
        "train_images": 1437,
        "val_images": 360,
        "source_commit": "abc",
        "dataset_fingerprint": "ab" * 32,
        "finished_at": "2025-01-01T10:06:40+00:00",
        "attempt": 1,
    }
    return TrainingMetrics.model_validate(doc).model_dump(mode="json")


HOST = {
    "machine": "x86_64",
    "processor": "x86_64",
    "cpu_count": 2,
    "python": "3.11",
    "platform": "Linux",
}
RUN_ID = "manual__2025-01-01T10:00:00"  # its folder: manual__2025-01-01T10_00_00
# The priciest box the run may get, as resolved: g6.xlarge on-demand, its 100 GB gp3 root
# volume ($8/month: $0.010959/h) and its public IPv4 address: $0.820759/h a box.
BOX_RATE = g6_box_rate()
# The boxes it got: spot, $0.3548/h the instance, the same volume and address.
SPOT_RATE = BOX_RATE.model_copy(
    update={"market": "spot", "usd_per_hour": 0.3548, "price_source": "spot price history"}
)
ATTACHED_USD_PER_S = (100 * 0.08 / 730 + 0.005) / 3600  # the volume and the address
# Attempt 1: two boxes reclaimed 40 s after running: each part billed its 60 s minimum.
# Attempt 2: two boxes running 420 s, attached 450 s (30 s pending).
SHORT_BOX_USD = 60 * 0.3548 / 3600 + 60 * ATTACHED_USD_PER_S
LONG_BOX_USD = 420 * 0.3548 / 3600 + 450 * ATTACHED_USD_PER_S
RUN_USD = 2 * SHORT_BOX_USD + 2 * LONG_BOX_USD


def write_billing(run: Path) -> None:
    """Write the two attempts' records and the bill teardown makes of them (billing.json)."""
    job = str(run / "job")

    def boxes(launched: str, running: str, ended: str, *ids: str) -> list[BoxBill]:
        return [
            BoxBill(
                **dict(SPOT_RATE),
                instance_id=instance_id,
                zone="us-east-1a",
                launched_at=f"2025-01-01T{launched}+00:00",
                running_at=f"2025-01-01T{running}+00:00",
                ended_at=f"2025-01-01T{ended}+00:00",
            )
            for instance_id in ids
        ]

    for attempt, launched, running, ended, ids in (
        (1, "10:00:00", "10:00:20", "10:01:00", ("i-0a", "i-0b")),
        (2, "10:02:00", "10:02:30", "10:09:30", ("i-0c", "i-0d")),
    ):
        record = AttemptBill(
            attempt=attempt,
            run_key="manual__2025-01-01T10_00_00",
            dag_id="burstcv_pipeline",
            backend="ec2",
            region="us-east-1",
            boxes=boxes(launched, running, ended, *ids),
        )
        write_artifact(attempt_dir(job, attempt, END_RECORD), record)
    now = datetime(2025, 1, 1, 10, 10, tzinfo=UTC)
    bill = run_bill(job, 2, now, backend="ec2", airflow_run_id=RUN_ID)
    write_artifact(
        RunLayout(str(run)).billing,
        bill.model_copy(update={"terminated_at": "2025-01-01T10:09:31+00:00"}),
    )


def resolved_run(store: Path, **fields: Any) -> ResolvedRun:
    """Return run.json as an asset-triggered EC2 run of 2 boxes in us-east-1 resolves it."""
    params = RunParams.resolve(
        {
            "dataset_uri": "s3://bucket/digits/v7",
            "compute_backend": "ec2",
            "instance_types": ["g6.xlarge"],
            "num_nodes": 2,
            "max_cost_usd": 1.0,
            "time_budget_s": 3600,
            "latency_slo_ms": 50.0,
            "target_rps": 500.0,
        }
    )
    budget_s, reason = time_budget(1.0, 3600, boxes=2, rate=BOX_RATE, margin_s=360)
    # Priced as a run resolves them (burstcv.cost.budget), from the bundled table: the
    # serving families' CPU types and the GPU types the gate may advise.
    sources = PriceSources(artifact_root=str(store))
    serving, unpriced = serving_quotes(list(params.serving_families), "us-east-1", sources)
    gpus = [q for t in GPU_SERVING_TYPES if (q := quote(t, "us-east-1", "on-demand", sources))]
    run = ResolvedRun(
        run_id=RUN_ID,
        trigger="asset_triggered",
        started_at="2025-01-01T09:59:58+00:00",
        params=params,
        costs=RunCosts(
            region="us-east-1",
            boxes=2,
            max_cost_usd=1.0,
            box_rate=BOX_RATE,
            time_budget_s=budget_s,
            margin_s=360,
            budget_reason=reason,
            serving=serving + gpus,
            serving_unpriced=unpriced,
        ),
        image_size=ImageSizeChoice(px=32, reason="the run asked for 32 px"),
    )
    return run.model_copy(update=fields)


def write_run(run: Path, record: ResolvedRun) -> None:
    write_artifact(RunLayout(str(run)).record, record)


def read_run(run: Path) -> ResolvedRun:
    return read_artifact(RunLayout(str(run)).record, ResolvedRun)


CANDIDATE_RPS = 412.5


def latency_doc() -> dict[str, Any]:
    """Return a complete latency.json (a LatencyRecord): candidate and production v1."""
    draws = rng()
    cand = draws.gamma(6.0, 0.9, size=200) + 3.0
    prod = draws.gamma(6.0, 1.3, size=200) + 3.5

    def figures(label: str, samples: np.ndarray, **fields: Any) -> dict[str, Any]:
        return bench_figures(
            label=label,
            requests=len(samples),
            p50_ms=float(np.percentile(samples, 50)),
            p95_ms=float(np.percentile(samples, 95)),
            p99_ms=float(np.percentile(samples, 99)),
            mean_ms=float(samples.mean()),
            latencies_ms=samples.round(3).tolist(),
            **fields,
        ).model_dump(mode="json")

    return {
        "measured_at": "2025-01-01T10:09:00Z",
        "host": HOST,
        "requests": 200,
        "concurrency": 4,
        "offered_rps": 105.0,
        "load_note": "the most one replica carries: 150 req/s sustainable at 1 vCPU(s) "
        "(measured) less 30% headroom",
        "candidate": figures(
            "candidate",
            cand,
            throughput_rps=CANDIDATE_RPS,
            accuracy=0.9806,
            bare_onnxruntime_p50_ms=1.2,
        ),
        "production": figures("production", prod, throughput_rps=301.0, accuracy=0.975, version=1),
    }


VERDICT = VerdictRecord.model_validate(
    {
        "version": 2,
        "promote": True,
        "reasons": [],
        "summary": "promote",
        "checks": [
            {"name": "latency_p95", "passed": True, "observed": 12.1, "limit": 50.0},
            {"name": "error_rate", "passed": True, "observed": 0.0, "limit": 0.0},
            {"name": "accuracy_floor", "passed": True, "observed": 0.9806, "limit": 0.9},
            {"name": "no_regression", "passed": True, "observed": 0.9806, "limit": 0.955},
        ],
        "suggestions": [],
        "failed_figures": [],
    }
).model_dump(mode="json")


def register(registry_root: Path, tmp: Path, versions: int) -> Registry:
    """Register ``versions`` versions and promote the last one, as deploy would."""
    registry = Registry(str(registry_root), "digits")
    for n in range(1, versions + 1):
        folder = write_model_dir(tmp / f"model{n}", f"onnx-{n}".encode())
        registry.register(str(folder), RegistryDecision(status="accepted"))
        registry.promote(n)
    return registry


@pytest.fixture
def full_run(tmp_path: Path) -> tuple[Path, Path]:
    """Write every file a complete run leaves behind; return (run root, registry root)."""
    run = tmp_path / "runs" / "manual__2025-01-01T10_00_00"
    write_run(run, resolved_run(tmp_path / "store"))
    write(run / "dataset" / "validation.json", validation_doc())
    (run / "dataset" / "data_docs").mkdir(parents=True)
    (run / "dataset" / "data_docs" / "index.html").write_text("<html>docs</html>")
    write(run / "job" / "metrics.json", metrics_doc())
    write_billing(run)
    parity = {"images": 64, "max_abs_diff": 3.1e-6, "worst_input": "v.png", "top1_mismatches": []}
    write(run / "model" / "model.json", model_card(b"onnx", parity=parity))
    write(run / "bench" / "latency.json", latency_doc())
    write(run / "bench" / "verdict.json", VERDICT)
    write_artifact(str(run / "bench" / "sizing.json"), sizing_doc(read_run(run).costs.serving))
    register(tmp_path / "registry", tmp_path, versions=2)
    return run, tmp_path / "registry"


def sizing_doc(prices: list[PriceQuote], unpriced: str | None = None) -> SizingReport:
    """Return the benchmark's sizing (sizing.json) of two measured sizes at these prices."""
    from burstcv.gate.sizing import recommend
    from burstcv_spec.contracts import LoadStep, SizePoint

    def size(vcpus: int, rps: float) -> SizePoint:
        steps = [
            LoadStep(rate_rps=rps / 1.5, p95_ms=8.0, errors=0, held=True),
            LoadStep(rate_rps=rps, p95_ms=30.0, errors=0, held=True),
            LoadStep(rate_rps=rps * 1.5, p95_ms=900.0, errors=0, held=False),
        ]
        return SizePoint(vcpus=vcpus, measured=True, sustainable_rps=rps, p95_ms=30.0, steps=steps)

    return recommend(
        [size(1, 150.0), size(2, 270.0)],
        latency_slo_ms=50.0,
        target_rps=500.0,
        prices=prices,
        region="us-east-1",
        unpriced=unpriced,
        host_cores=2,
    )


def render(run: Path, registry: Path) -> str:
    uri = build_report(
        str(run),
        registry_uri=str(registry),
        model_name="digits",
        serving_url="http://127.0.0.1:8000",
    )
    assert uri == str(run / "report" / "index.html")
    return Path(uri).read_text()


def test_a_complete_run_renders_every_section_in_one_self_contained_page(
    full_run: tuple[Path, Path],
) -> None:
    page = render(*full_run)
    for heading in (
        "Data checks",
        "Training",
        "Confusion matrix",
        "Latency benchmark",
        "CPU fleet at the expected load",
        "Gate verdict",
        "Cost",
    ):
        assert f">{heading}</h" in page
    # Four figures (curves, confusion matrix, latency histogram, p95 under load per CPU
    # size), each a decodable PNG.
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 4
    assert all(base64.b64decode(data).startswith(b"\x89PNG") for data in images)
    # Self-contained: no script, no resource fetched from anywhere; relative links only: the
    # run's Airflow page (run.json names it) and the Models page (in Airflow, opened at the
    # top level, not in the plugin's frame), and the run's Data Docs.
    assert "<script" not in page and 'src="http' not in page and "<link" not in page
    airflow_run = "../../../../dags/burstcv_pipeline/runs/manual__2025-01-01T10%3A00%3A00"
    assert re.findall(r'href="([^"#]+)"', page) == [
        airflow_run,
        "../../../",
        "../dataset/data_docs/index.html",
    ]
    assert f'<a href="{airflow_run}" target="_top">its Airflow run</a>' in page
    assert '<a href="../../../" target="_top">Models page</a>' in page
    assert "PROMOTE: version 2" in page
    # Every gate figure with its unit: observed and limit read as what they measure.
    assert "<td>12.10 ms</td><td>50.00 ms</td>" in page
    assert "<td>0.0%</td><td>0.0%</td>" in page and "<td>0.9806</td><td>0.9000</td>" in page
    assert "version 2 is <b>accepted</b>; production points at version 2 (this run)" in page
    assert "production v1" in page and "Not reached" not in page
    assert "32×32 RGB (resized); size: the run asked for 32 px" in page
    # The fleet: the chosen one with its monthly cost, and the rate per size it rests on.
    assert (
        "For 500 req/s: 3 x c7i.large at 270 req/s each (measured), 30% headroom: "
        "$195.46/month" in page
    )
    assert "<td>1</td><td>measured</td><td>150.0 req/s</td>" in page
    # 500 req/s at 70% of 270 req/s: 3 x c7i.large at $0.08925/h, $0.26775/h.
    assert "<td>c7i.large</td><td>2 vCPU, 4 GiB</td><td>3</td>" in page
    assert "<td>$195.46</td><td>$0.1487</td></tr>" in page
    assert "On-demand prices, us-east-1: " in page and "Unpriced" not in page
    # The load the latency was measured at, and why that load.
    assert (
        "200 requests per model, open loop at 105 req/s (at most 4 in flight): the most one "
        "replica carries: 150 req/s sustainable at 1 vCPU(s) (measured) less 30% headroom, "
        "one image per request" in page
    )


def test_a_sizing_the_host_spoiled_leaves_no_latency_and_says_inconclusive(
    full_run: tuple[Path, Path],
) -> None:
    run, registry = full_run
    reason = "fleet sizing: inconclusive, the host was busy through 2 attempt(s) (...)"
    doc = {**latency_doc(), "inconclusive": reason, "requests": 0, "concurrency": 0}
    for field in ("candidate", "production", "offered_rps", "load_note"):
        del doc[field]
    write(run / "bench" / "latency.json", doc)
    (run / "bench" / "verdict.json").unlink()
    page = render(run, registry)
    assert f"Inconclusive, nothing judged: {reason}" in page
    assert "nothing was measured, one image per request" in page
    assert "<small>Candidate p95</small><div>inconclusive</div>" in page


def cost_section(page: str) -> str:
    return page[page.index('<section id="cost">') :]


def test_the_cost_section_shows_the_run_as_resolved_its_bill_and_its_serving_fleet(
    full_run: tuple[Path, Path],
) -> None:
    cost = cost_section(render(*full_run))
    # The run as resolved (run.json): what started it, on which data, how many boxes, the
    # budget and the deadline it buys: 2 boxes at $0.820759/h, $1.00 lasts them 2193 s, less
    # the watchdog's 360 s margin.
    assert (
        "<p>Started by <b>asset_triggered</b> on <code>s3://bucket/digits/v7</code>; "
        "<code>ec2</code> compute in us-east-1, <b>2</b> boxes a launch. Budget $1.00 for every "
        "box of every attempt; the deadline is 1833 s: what $1.00 buys 2 x g6.xlarge on-demand "
        "at $0.8208/h a box, less the watchdog&#39;s 360 s margin (the time budget was "
        "3600 s).</p>"
    ) in cost
    assert (
        "Priciest box the run may get: g6.xlarge on-demand $0.8208/h (instance $0.8048, 100 GB "
        "volume, public IPv4; bundled table, 2024-06-01)."
    ) in cost
    # The bill: every box of every attempt, each part billed from its own start.
    assert f"<b>${RUN_USD:,.4f}</b> for 960 billed instance seconds on the <code>ec2</code>" in cost
    for box, seconds, usd in (
        ("i-0a", "60 s", SHORT_BOX_USD),
        ("i-0b", "60 s", SHORT_BOX_USD),
        ("i-0c", "420 s", LONG_BOX_USD),
        ("i-0d", "420 s", LONG_BOX_USD),
    ):
        assert (
            f"<tr><td><code>{box}</code></td><td>g6.xlarge</td><td>spot</td><td>{seconds}</td>"
            f"<td>$0.3708/h</td><td>${usd:,.4f}</td></tr>"
        ) in cost
    # Serving: the sizing's chosen fleet at the run's expected load.
    assert (
        '<p class="cost"><b>$0.1487 per 1M predictions</b>, $195.46 a month: 3 x c7i.large '
        "(on-demand, us-east-1) serving the expected 500 req/s, as the CPU fleet section sized "
        "it.</p>"
    ) in cost


def test_a_fleet_without_a_price_says_unpriced_and_what_to_set(
    full_run: tuple[Path, Path],
) -> None:
    run, registry = full_run
    unpriced = (
        "no on-demand price for c7i.2xlarge, c7i.large, c7i.xlarge, m7i.large in eu-west-9: "
        "set BURSTCV_PRICE_TABLE to a table that prices them in eu-west-9"
    )
    write_artifact(str(run / "bench" / "sizing.json"), sizing_doc([], unpriced))
    page = render(run, registry)
    assert (
        "For 500 req/s: 3 x c7i.large at 270 req/s each (measured), 30% headroom: "
        f"unpriced ({unpriced})" in page
    )
    assert (
        "<td>3</td><td>270.0 req/s</td><td>the benchmark host</td><td>unpriced</td>"
        "<td>unpriced</td></tr>"
    ) in page
    assert f"Unpriced: {unpriced}" in page
    cost = cost_section(page)
    assert f"3 x c7i.large serve 500 req/s, unpriced: {unpriced}" in cost
    assert "per 1M predictions" not in cost


def test_the_serving_cost_says_why_there_is_none(full_run: tuple[Path, Path]) -> None:
    run, registry = full_run
    unservable = sizing_doc([]).model_copy(
        update={"options": [], "chosen": None, "reason": "no CPU size meets p95 <= 50 ms"}
    )
    write_artifact(str(run / "bench" / "sizing.json"), unservable)
    assert "No serving fleet: no CPU size meets p95 &lt;= 50 ms" in cost_section(
        render(run, registry)
    )
    (run / "bench" / "sizing.json").unlink()
    assert (
        "Not reached: bench/sizing.json was not written; the run stopped before the benchmark "
        "stage finished." in cost_section(render(run, registry))
    )


def test_a_run_folder_without_run_json_says_so_and_renders_the_rest(
    full_run: tuple[Path, Path],
) -> None:
    run, registry = full_run
    (run / "run.json").unlink()
    page = render(run, registry)
    assert (
        "Not reached: run.json was not written; the run stopped before the plan_scan stage "
        "finished." in cost_section(page)
    )
    assert "its Airflow run" not in page  # no run it can name
    assert "32×32 RGB (resized)</td>" in page  # no size reason without run.json
    assert "PROMOTE: version 2" in page and f"${RUN_USD:,.4f}" in page


def test_the_latency_histogram_marks_the_runs_slo(full_run: tuple[Path, Path]) -> None:
    from burstcv.report.charts import latency_histogram

    run, registry = full_run
    latency = json.loads((run / "bench" / "latency.json").read_text())

    def drawn(page: str) -> bytes:
        (png,) = re.findall(r'alt="latency histogram" src="data:image/png;base64,([^"]+)"', page)
        return base64.b64decode(png)

    def expected(slo_ms: float | None) -> bytes:
        return latency_histogram(
            latency["candidate"]["latencies_ms"],
            latency["production"]["latencies_ms"],
            slo_ms=slo_ms,
            production_label="production v1",
        )

    assert drawn(render(run, registry)) == expected(50.0)
    # The SLO is the run's (run.json), not a figure copied elsewhere.
    record = read_run(run)
    write_run(
        run,
        record.model_copy(
            update={"params": record.params.model_copy(update={"latency_slo_ms": 20.0})}
        ),
    )
    assert drawn(render(run, registry)) == expected(20.0)
    (run / "run.json").unlink()
    assert drawn(render(run, registry)) == expected(None)


def test_a_photo_model_shows_its_eval_transform(full_run: tuple[Path, Path]) -> None:
    run = full_run[0]
    model = json.loads((run / "model" / "model.json").read_text())
    photo = {**model["preprocess"], "height": 224, "width": 224, "resize_short": 256}
    write(run / "model" / "model.json", {**model, "preprocess": photo})
    page = render(*full_run)
    # run.json's size (32 px) is not this model's: no reason shown for it.
    assert "224×224 RGB (short side resized to 256 px, centre crop)</td>" in page
    # Why that size, as validate chose it (run.json).
    reason = "median short side 612 px of the training images, capped at 224"
    size = ImageSizeChoice(px=224, reason=reason, resize_short=256)
    write_run(run, read_run(run).model_copy(update={"image_size": size}))
    assert f"centre crop); size: {reason}</td>" in render(*full_run)


def test_a_run_that_stopped_after_validation_says_what_was_not_reached(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_run(run, resolved_run(tmp_path / "store", image_size=None))
    write(run / "dataset" / "validation.json", validation_doc(success=False))
    page = render(run, tmp_path / "registry")
    assert "failed" in page and "train/3/bad.png" in page
    for rel in (
        "job/metrics.json",
        "bench/latency.json",
        "bench/sizing.json",
        "bench/verdict.json",
        "job/billing.json",
    ):
        assert f"Not reached: {rel} was not written" in page
    # What the run was to be is known from the start: run.json.
    assert "Started by <b>asset_triggered</b> on <code>s3://bucket/digits/v7</code>" in page
    assert "data:image/png;base64," not in page
    assert "Data Docs (dataset/data_docs/index.html) were not written" in page


def test_a_failed_training_says_whose_error_ended_it_and_where(tmp_path: Path) -> None:
    # Two boxes: rank 1 read a corrupt shard; rank 0 saw its peer go ("resumable" alone).
    run = tmp_path / "run"
    write_run(run, resolved_run(tmp_path / "store"))
    write(run / "dataset" / "validation.json", validation_doc())
    job = str(run / "job")
    write_failed(job, 1, "train", "a peer box was lost", resumable=True)
    for rank, reason, resumable in (
        (0, "a peer box was lost", True),
        (1, "JobSpecError: shard train-003.npz is corrupt", False),
    ):
        write_rank_failed(
            job,
            FailedMarker(
                stage="train",
                reason=reason,
                resumable=resumable,
                attempt=1,
                rank=rank,
                node=rank,
                traceback=["Traceback (most recent call last):", f"<rank {rank}>", reason],
            ),
        )
    page = render(run, tmp_path / "registry")
    assert "Not reached: job/metrics.json was not written" in page
    assert (
        "Training failed in attempt 1, rank 1 (node 1), at the train stage: JobSpecError: shard "
        "train-003.npz is corrupt (not resumable: a relaunch would fail the same way)." in page
    )
    # Its traceback, as text: the lines were only on its box.
    assert '<pre class="traceback">Traceback (most recent call last):\n&lt;rank 1&gt;' in page
    assert "&lt;rank 0&gt;" not in page


def test_the_last_attempt_s_own_failure_is_shown_when_no_rank_owns_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_run(run, resolved_run(tmp_path / "store"))
    job = str(run / "job")
    write_failed(job, 1, "interrupted", "spot interruption; checkpoint saved", resumable=True)
    write_failed(job, 2, "boot", "no route to S3 from subnet-1", resumable=False)
    write_artifact(
        f"{job}/{ATTEMPT_RECORD}", AttemptRecord(attempt=2, instance_ids=["i-2"], launched_at="now")
    )
    page = render(run, tmp_path / "registry")
    assert "Training failed in attempt 2, at the boot stage: no route to S3" in page
    assert "spot interruption" not in page and "<pre class" not in page


def test_a_stalled_attempt_says_how_long_its_box_sat_stopped_of_its_billed_seconds(
    tmp_path: Path,
) -> None:
    """Attempt 1 stalled (its trigger's verdict kept), attempt 2 trained on: the report says
    the stall and the seconds the box sat stopped, from its last beat to its end."""
    run = tmp_path / "run"
    write_run(run, resolved_run(tmp_path / "store"))
    job = str(run / "job")
    reason = "no progress for 301 s at epoch 2 step 14 (train); the trainer is alive but stalled"
    write_failed(job, 1, "stalled", reason, resumable=True)
    write_failed(job, 1, "interrupted", "SIGTERM: checkpoint saved", resumable=True)  # kept out
    beat = TrainingBeat(
        attempt=1, beats=7, epoch=1, step=14, phase="train", written_at="2025-01-01T10:01:01+00:00"
    )
    write_artifact(attempt_dir(job, 1, "beat.json"), beat)
    for attempt, box, launched, ended in (
        (1, "local-1", "10:00:00", "10:06:10"),
        (2, "local-2", "10:06:20", "10:08:00"),
    ):
        record = AttemptBill(
            attempt=attempt,
            run_key="r",
            dag_id="burstcv_pipeline",
            backend="local",
            boxes=[
                BoxBill(
                    market="local",
                    usd_per_hour=0.0,
                    price_source="local",
                    instance_id=box,
                    launched_at=f"2025-01-01T{launched}+00:00",
                    ended_at=f"2025-01-01T{ended}+00:00",
                )
            ],
        )
        write_artifact(attempt_dir(job, attempt, END_RECORD), record)
    write_artifact(
        f"{job}/{ATTEMPT_RECORD}",
        AttemptRecord(attempt=2, instance_ids=["local-2"], launched_at="now"),
    )
    now = datetime(2025, 1, 1, 10, 9, tzinfo=UTC)
    write_artifact(RunLayout(str(run)).billing, run_bill(job, 2, now, backend="local"))
    page = render(run, tmp_path / "registry")
    assert f"Attempt 1 was ended as stalled: {reason}." in page
    assert "Its box sat stopped for 309 of its 370 billed seconds." in page
    assert "SIGTERM: checkpoint saved" not in page


def test_a_run_with_nothing_new_to_train_on_says_it_skipped_and_why(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_run(run, resolved_run(tmp_path / "store"))
    write(run / "dataset" / "validation.json", validation_doc())
    reason = "nothing new to train on: the validated dataset ... are those of production version 3"
    skip = {"reason": reason, "production_version": 3, "fingerprint": "f", "decided_at": "now"}
    write(run / "skip.json", skip)
    page = render(run, tmp_path / "registry")
    assert '<section id="skipped"><h2>Skipped: nothing new to train on</h2>' in page
    assert reason in page and "production stays version 3" in page
    assert "Skipped: nothing new to train on, so the train stage did not run." in page
    assert "Not reached" not in page
    assert "<small>Run cost</small><div>skipped</div>" in page


def test_a_failed_gate_shows_each_failed_check_and_the_priced_options(
    full_run: tuple[Path, Path],
) -> None:
    from burstcv.gate.gate import GateThresholds, ServingContext, judge

    run, registry = full_run
    latency = json.loads((run / "bench" / "latency.json").read_text())
    costs = read_run(run).costs
    verdict = judge(
        BenchFigures.model_validate(latency["candidate"]),
        BenchFigures.model_validate(latency["production"]),
        GateThresholds(latency_slo_ms=5.0, accuracy_floor=0.9, max_accuracy_drop=0.02),
        ServingContext(
            arch="resnet18",
            measured_vcpus=2,
            region=costs.region,
            prices={q.instance_type: q.usd_per_hour for q in costs.serving},
            target_rps=500.0,
        ),
    )
    write(run / "bench" / "verdict.json", {"version": 2, **verdict.model_dump(mode="json")})
    billing = json.loads((run / "job" / "billing.json").read_text())
    write(run / "job" / "billing.json", {**billing, "backend": "local", "cost_usd": 0.0})
    page = render(run, registry)
    assert "NOT PROMOTED: version 2" in page and "exceeds the SLO 5 ms" in page
    assert "What would meet the latency SLO" in page
    # Each option priced with the run's prices at its expected load: a cost per 1M.
    assert {s.action for s in verdict.suggestions} == {
        "int8",
        "smaller_model",
        "larger_instance",
        "gpu_serving",
    }
    for s in verdict.suggestions:
        assert s.title.split(" (")[0] in page
        assert s.cost_per_million_usd is not None
        cost = f"${s.cost_per_million_usd:,.4f}"
        assert f"<td>{s.instance_type} (us-east-1)</td><td>{cost}</td>" in page
    assert "<b>$0.00</b>: the <code>local</code> backend" in page and "no GPU was rented" in page


def test_text_from_the_run_is_shown_as_text_never_as_markup(
    full_run: tuple[Path, Path],
) -> None:
    """A class folder, a file path or a gate reason is whatever the dataset and run say."""
    run, registry = full_run
    hostile = '<script>alert("x")</script>'
    escaped = "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;"
    doc = validation_doc(success=False)
    doc["counts"]["per_split"]["train"][hostile] = 5
    doc["expectations"][0]["offending_files"] = [f"train/{hostile}/1.png"]
    write(run / "dataset" / "validation.json", doc)
    model = json.loads((run / "model" / "model.json").read_text())
    write(run / "model" / "model.json", {**model, "classes": [*CLASSES, hostile]})
    verdict = {**VERDICT, "checks": [{**VERDICT["checks"][0], "reason": hostile}]}
    write(run / "bench" / "verdict.json", verdict)
    page = render(run, registry)
    assert "<script" not in page
    assert f"<th>{escaped}</th>" in page  # the class, as a column of the split table
    assert f"<code>train/{escaped}/1.png</code>" in page  # the offending file
    assert f"9, {escaped}</td>" in page  # the model's classes
    assert f"<td>{escaped}</td></tr>" in page  # the gate check's reason


def test_the_page_renders_in_headless_chromium(full_run: tuple[Path, Path], tmp_path: Path) -> None:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    run, registry = full_run
    render(run, registry)
    shot = tmp_path / "report.png"
    result = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'chromium-profile'}",
            f"--screenshot={shot}",
            "--window-size=1200,3000",
            (run / "report" / "index.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=CHROMIUM_TIMEOUT_S,
    )
    assert shot.is_file(), f"no screenshot; chromium said:\n{result.stderr[-3000:]}"
    with Image.open(shot) as img:
        assert img.size == (1200, 3000)
        pixels = np.asarray(img.convert("RGB"))
    # Drawn, not blank: many distinct colours (charts, badges, text) across the page.
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 200
    if target := os.environ.get("BURSTCV_REPORT_SCREENSHOT"):
        shutil.copy(shot, target)


def test_a_good_run_shows_its_recipe_and_best_epoch_without_a_warning(
    full_run: tuple[Path, Path],
) -> None:
    run, _ = full_run
    recipe = "batch 128 (1437 training images: 11 steps an epoch); AdamW (66 steps: under 10,000)"
    write_run(run, read_run(run).model_copy(update={"training": training_choice(recipe)}))
    metrics = json.loads((run / "job" / "metrics.json").read_text())
    metrics.update(best_epoch=5, epochs_asked=8, seconds_saved=3.2, stop_reason="early stop")
    write(run / "job" / "metrics.json", metrics)
    page = render(*full_run)
    assert f"Training recipe: {recipe}." in page
    assert "the best epoch (5), exported, after 6 of 8 epochs" in page
    assert "(about 3 s saved)" in page
    assert "Chance: 10.0%; the majority class: 10." in page
    assert "worst classes" in page
    assert "near chance" not in page and "diverged" not in page
    assert "Batch: 128 images a step, 11 steps an epoch; peak rate" in page
    assert " GPUs)" not in page and "rule" not in page  # one GPU: nothing scaled


def test_a_per_gpu_run_shows_its_step_batch_per_gpu_and_the_rate_rule(
    full_run: tuple[Path, Path],
) -> None:
    run, _ = full_run
    metrics = json.loads((run / "job" / "metrics.json").read_text())
    metrics["world_size"] = 4
    metrics["optimizer"].update(
        name="sgd",
        batch_size=512,
        batch_scaling="per_gpu",
        batch_per_rank=128,
        lr_world_factor=4.0,
        learning_rate=0.2,
        steps_per_epoch=976,
    )
    write(run / "job" / "metrics.json", metrics)
    page = render(*full_run)
    assert (
        "Batch: 512 images a step, 976 steps an epoch (128 on each of 4 GPUs); peak rate 0.2 "
        "(sgd), the one-GPU rate x4 by the linear rule." in page
    )


def test_a_near_chance_model_that_diverged_is_not_shown_without_a_word(
    full_run: tuple[Path, Path],
) -> None:
    run, _ = full_run
    fallback = "pretrained auto: the ImageNet weights of resnet18 could not be fetched"
    choice = training_choice("weights from scratch", fallback)
    write_run(run, read_run(run).model_copy(update={"training": choice}))
    metrics = json.loads((run / "job" / "metrics.json").read_text())
    # The run: every photo predicted as one class, the validation loss in thousands.
    confusion = [[0] * 5 for _ in range(5)]
    for row in range(5):
        confusion[row][2] = 15
    metrics.update(
        classes=["a", "b", "c", "d", "e"],
        confusion=confusion,
        val_accuracy=0.2,
        recoveries=[
            {"epoch": 1, "step": 10, "reason": "training loss 9.1 is over 4.83", "lr_scale": 0.3}
        ],
    )
    metrics["epochs"][-1]["val_loss"] = 2113.0
    write(run / "job" / "metrics.json", metrics)
    page = render(*full_run)
    assert (
        "warning: the model is near chance: validation accuracy 20.0% against chance 20.0%" in page
    )
    assert "warning: the loss curve diverged: training diverged 1 time(s) and recovered" in page
    assert "the validation loss reached 2113" in page
    assert f"warning: {fallback}" in page
    assert "divergence caught at epoch 1 step 10: training loss 9.1 is over 4.83" in page
    assert "<td>a</td><td>0.0%</td>" in page  # the worst classes, with their accuracy


def test_a_file_that_does_not_fit_its_contract_is_named_not_fatal(
    full_run: tuple[Path, Path],
) -> None:
    run, registry = full_run
    broken = {k: v for k, v in VERDICT.items() if k != "checks"}
    write(run / "bench" / "verdict.json", broken)
    page = render(run, registry)
    assert "bench/verdict.json exists but cannot be read" in page
    assert "field &#39;checks&#39;: Field required" in page  # which field, escaped as text
    assert "Latency benchmark" in page and "Not reached" not in page  # the rest renders


def test_the_fleet_says_where_the_load_generator_was_the_limit(
    full_run: tuple[Path, Path],
) -> None:
    from burstcv.gate.sizing import flag_falling, recommend
    from burstcv_spec.contracts import SizePoint

    run, registry = full_run
    one = SizePoint(
        vcpus=1,
        measured=True,
        sustainable_rps=333.0,
        p95_ms=20.0,
        generator_rps=340.0,
        generator_processes=1,
        generator_bound=True,
        send_lag_p95_ms=42.5,
    )
    two = SizePoint(
        vcpus=2,
        measured=True,
        sustainable_rps=222.0,
        p95_ms=30.0,
        generator_rps=444.0,
        generator_processes=1,
        send_lag_p95_ms=1.2,
        generator_shares_cpus=True,
    )
    sizing = recommend(
        flag_falling([one, two]),
        latency_slo_ms=50.0,
        target_rps=500.0,
        prices=read_run(run).costs.serving,
        region="us-east-1",
        host_cores=2,
    )
    write_artifact(str(run / "bench" / "sizing.json"), sizing)
    page = render(run, registry)
    assert "ceiling 340 req/s: the size&#39;s rate is a lower bound; sent 42.5 ms late" in page
    assert "outran it: 444 req/s on time; sent 1.2 ms late (p95); shared the service" in page
    assert "measurement error: 222 req/s at 2 vCPUs is below the 333 req/s" in page
    assert "at least 333.0 req/s (the load generator&#39;s ceiling)" in page
    assert "at least 333 req/s each (measured; the load generator&#39;s ceiling" in page
