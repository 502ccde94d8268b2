"""The run report: one self-contained page from what the stages wrote, even for a partial run."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from burstcv_testkit import bench_figures, model_card, write_model_dir
from PIL import Image

from burstcv.cost.pricing import serving_cost_per_million
from burstcv.registry.registry import Registry
from burstcv.report.render import build_report
from burstcv_spec.contracts import (
    BenchFigures,
    Billing,
    RegistryDecision,
    TrainingChoice,
    TrainingMetrics,
    ValidationRecord,
    VerdictRecord,
)

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


def training_choice(reason: str, warning: str | None = None) -> dict[str, Any]:
    """Return validate's training choice (a TrainingChoice) with this reason."""
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
    ).model_dump(mode="json")


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
BILLING = Billing.model_validate(
    {
        "backend": "ec2",
        "instance_ids": ["i-0abc123"],
        "billed_seconds": {"i-0abc123": 412.0},
        "cost_usd": 412.0 * 0.3548 / 3600,
        "instances": [
            {
                "instance_id": "i-0abc123",
                "run_id": "manual__2025-01-01T10_00_00",
                "dag_id": "burstcv_pipeline",
                "state": "stopped",
                "instance_type": "g6.xlarge",
                "lifecycle": "spot",
                "launched_at": "2025-01-01T10:00:00+00:00",
                "stopped_at": "2025-01-01T10:06:52+00:00",
                "usd_per_hour": 0.3548,
                "cost_usd": 412.0 * 0.3548 / 3600,
            }
        ],
        "terminated_at": "2025-01-01T10:06:53+00:00",
    }
).model_dump(mode="json")
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
    write(run / "dataset" / "validation.json", validation_doc())
    (run / "dataset" / "data_docs").mkdir(parents=True)
    (run / "dataset" / "data_docs" / "index.html").write_text("<html>docs</html>")
    write(run / "job" / "metrics.json", metrics_doc())
    write(run / "job" / "billing.json", BILLING)
    parity = {"images": 64, "max_abs_diff": 3.1e-6, "worst_input": "v.png", "top1_mismatches": []}
    write(run / "model" / "model.json", model_card(b"onnx", parity=parity))
    write(run / "bench" / "latency.json", latency_doc())
    write(run / "bench" / "verdict.json", VERDICT)
    write(run / "bench" / "sizing.json", sizing_doc())
    register(tmp_path / "registry", tmp_path, versions=2)
    return run, tmp_path / "registry"


def sizing_doc() -> dict[str, Any]:
    """Return a sizing.json (a SizingReport) of two measured sizes, priced from the table."""
    from burstcv.gate.sizing import recommend
    from burstcv_spec.contracts import LoadStep, SizePoint

    def size(vcpus: int, rps: float) -> SizePoint:
        steps = [
            LoadStep(rate_rps=rps / 1.5, p95_ms=8.0, errors=0, held=True),
            LoadStep(rate_rps=rps, p95_ms=30.0, errors=0, held=True),
            LoadStep(rate_rps=rps * 1.5, p95_ms=900.0, errors=0, held=False),
        ]
        return SizePoint(vcpus=vcpus, measured=True, sustainable_rps=rps, p95_ms=30.0, steps=steps)

    report = recommend(
        [size(1, 150.0), size(2, 270.0)],
        slo_ms=50.0,
        target_rps=500.0,
        region="us-east-1",
        host_cores=2,
    )
    return report.model_dump(mode="json")


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
    # Models page (in Airflow, opened at the top level, not in the plugin's frame) and the
    # run's Data Docs. This run has no run.json: no link to an Airflow run it cannot name.
    assert "<script" not in page and 'src="http' not in page and "<link" not in page
    assert re.findall(r'href="([^"#]+)"', page) == ["../../../", "../dataset/data_docs/index.html"]
    assert '<a href="../../../" target="_top">Models page</a>' in page
    assert "PROMOTE: version 2" in page
    # Every gate figure with its unit: observed and limit read as what they measure.
    assert "<td>12.10 ms</td><td>50.00 ms</td>" in page
    assert "<td>0.0%</td><td>0.0%</td>" in page and "<td>0.9806</td><td>0.9000</td>" in page
    assert "version 2 is <b>accepted</b>; production points at version 2 (this run)" in page
    # Run cost from billing.json, and serving cost per 1M at the measured throughput.
    assert f"${BILLING['cost_usd']:,.4f}" in page and "412 billed GPU-instance seconds" in page
    per_million = serving_cost_per_million("c7i.large", "us-east-1", CANDIDATE_RPS)
    assert f"${per_million:,.4f} per 1M predictions" in page
    assert "c7i.large</code> (on-demand, us-east-1" in page
    assert "production v1" in page and "Not reached" not in page
    assert "32×32 RGB (resized)" in page
    # The fleet: the chosen one with its monthly cost, and the rate per size it rests on.
    assert "For 500 req/s: 3 x c7i.large at 270 req/s each (measured), 30% headroom" in page
    assert "<td>1</td><td>measured</td><td>150.0 req/s</td>" in page


def test_a_photo_model_shows_its_eval_transform(full_run: tuple[Path, Path]) -> None:
    run = full_run[0]
    model = json.loads((run / "model" / "model.json").read_text())
    photo = {**model["preprocess"], "height": 224, "width": 224, "resize_short": 256}
    write(run / "model" / "model.json", {**model, "preprocess": photo})
    assert "224×224 RGB (short side resized to 256 px, centre crop)" in render(*full_run)
    # Why that size, as validate chose it (validation.json).
    reason = "median short side 612 px of the training images, capped at 224"
    doc = json.loads((run / "dataset" / "validation.json").read_text())
    doc["image_size"] = {"px": 224, "reason": reason, "resize_short": 256}
    write(run / "dataset" / "validation.json", doc)
    assert f"centre crop); size: {reason}" in render(*full_run)


def test_a_run_that_stopped_after_validation_says_what_was_not_reached(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write(run / "dataset" / "validation.json", validation_doc(success=False))
    page = render(run, tmp_path / "registry")
    assert "failed" in page and "train/3/bad.png" in page
    for rel in ("job/metrics.json", "bench/latency.json", "bench/verdict.json", "job/billing.json"):
        assert f"Not reached: {rel} was not written" in page
    assert "data:image/png;base64," not in page
    assert "Data Docs (dataset/data_docs/index.html) were not written" in page


def test_a_run_with_nothing_new_to_train_on_says_it_skipped_and_why(tmp_path: Path) -> None:
    run = tmp_path / "run"
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
    verdict = judge(
        BenchFigures.model_validate(latency["candidate"]),
        BenchFigures.model_validate(latency["production"]),
        GateThresholds(latency_slo_ms=5.0, accuracy_floor=0.9, max_accuracy_drop=0.02),
        ServingContext(arch="resnet18", measured_vcpus=2),
    )
    write(run / "bench" / "verdict.json", {"version": 2, **verdict.model_dump(mode="json")})
    write(run / "job" / "billing.json", {**BILLING, "backend": "local", "cost_usd": 0.0})
    page = render(run, registry)
    assert "NOT PROMOTED: version 2" in page and "exceeds the SLO 5 ms" in page
    assert "What would meet the latency SLO" in page
    for s in verdict.suggestions:
        assert s.title.split(" (")[0] in page
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
    doc = json.loads((run / "dataset" / "validation.json").read_text())
    recipe = "batch 128 (1437 training images: 11 steps an epoch); AdamW (66 steps: under 10,000)"
    doc["training"] = training_choice(recipe)
    write(run / "dataset" / "validation.json", doc)
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


def test_a_near_chance_model_that_diverged_is_not_shown_without_a_word(
    full_run: tuple[Path, Path],
) -> None:
    run, _ = full_run
    doc = json.loads((run / "dataset" / "validation.json").read_text())
    fallback = "pretrained auto: the ImageNet weights of resnet18 could not be fetched"
    doc["training"] = training_choice("weights from scratch", fallback)
    write(run / "dataset" / "validation.json", doc)
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
