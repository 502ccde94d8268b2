"""The whole DAG, run for real with dag.test(), against a real service process.

One service runs for the module, as in `make demo`; each pipeline run must either deploy a
new version that the service then answers with, or leave the service on the version it had.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog.testing

# Airflow is imported at module level (collection), not lazily in run_dag: its first import runs
# airflow.settings.initialize(), whose configure_logging() calls structlog.configure() with a
# new processor list. Inside a structlog.testing.capture_logs() block that replaces the capture,
# so a test that ran first (or alone) recorded none of the trigger's lines.
from airflow.dag_processing.dagbag import DagBag
from localserver import prediction_service

from burstcv.registry.registry import PRODUCTION, Registry
from burstcv.settings import get_settings
from burstcv.stages.resolve import run_layout
from burstcv_spec import storage
from burstcv_spec.contracts import LatencyRecord, SkipRecord, read_artifact
from burstcv_spec.storage import safe_run_id

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def service() -> Iterator[str]:
    """Start the real prediction service on a free port, reading the session's registry."""
    settings = {"REGISTRY_URI": os.environ["BURSTCV_REGISTRY_URI"], "POLL_INTERVAL_S": 0.5}
    # /healthz: the registry has no production model until the first run deploys one.
    with prediction_service(settings, ready_path="/healthz") as server:
        os.environ["BURSTCV_SERVING_URL"] = server.url
        get_settings.cache_clear()
        try:
            yield server.url
        finally:
            os.environ["BURSTCV_SERVING_URL"] = ""
            get_settings.cache_clear()


def run_dag(conf: dict[str, object]) -> tuple[str, dict[str, str], str]:
    """Run burstcv_pipeline once; return (state, task states, run id)."""
    get_settings.cache_clear()
    dag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags")).dags[
        "burstcv_pipeline"
    ]
    dag_run = dag.test(run_conf=conf)
    states = {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}
    return str(dag_run.state), states, dag_run.run_id


def predict(url: str, image: Path) -> dict[str, object]:
    response = httpx.post(
        f"{url}/v1/predict",
        files={"file": (image.name, image.read_bytes(), "image/png")},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def deployed(service: str, demo_dataset: Path) -> dict[str, Any]:
    """Run the pipeline once on the demo digits: the version it deploys is the module's production.

    The later runs (unchanged data, a forced run) need a production to compare with; as a
    fixture, each of them also runs alone or in any order.
    """
    # What the triggerer writes into the train task's log (structlog, as Airflow routes it).
    with structlog.testing.capture_logs() as trigger_log:
        state, tasks, run_id = run_dag({"dataset_uri": str(demo_dataset), "epochs": 3})
    return {"state": state, "tasks": tasks, "run_id": run_id, "trigger_log": list(trigger_log)}


def test_pipeline_deploys_a_version_the_running_service_answers_with(
    service: str, demo_dataset: Path, deployed: dict[str, Any]
) -> None:
    state, tasks, run_id = deployed["state"], dict(deployed["tasks"]), deployed["run_id"]
    trigger_log = deployed["trigger_log"]
    assert state == "success", tasks
    progress = [
        str(e["event"]) for e in trigger_log if str(e.get("event", "")).startswith("epoch ")
    ]
    assert [line.split(" val_accuracy")[0] for line in progress] == [
        "epoch 1/3",
        "epoch 2/3",
        "epoch 3/3",
    ]
    for line in progress:
        assert re.match(
            r"epoch \d/3 val_accuracy [\d.]+ val_loss [\d.]+ \| \$[\d.]+ of \$[\d.]+, "
            r"\$[\d.]+ left \| [\d.]+ min to the deadline \| train_loss [\d.]+, "
            r"\d+ images/s, \d+ s, billed \d+ s, attempt 1$",
            line,
        ), line
    # The clean-up path of a failed provision has nothing to do on a good run.
    assert tasks.pop("clean_up_failed_provision") == "skipped", tasks
    assert all(s == "success" for s in tasks.values()), tasks
    reg = Registry(os.environ["BURSTCV_REGISTRY_URI"], "digits")
    version = reg.get_alias(PRODUCTION).version
    assert reg.entry(version).lineage.run_id == run_id
    info = httpx.get(f"{service}/v1/model", timeout=10).json()
    assert info["version"] == version
    image = sorted((demo_dataset / "val" / "7").glob("*.png"))[0]
    answer = predict(service, image)
    assert answer["version"] == version
    assert answer["predictions"][0]["label"] == "7"
    # The teardown ran: nothing of this run is still alive.
    from burstcv.compute.local import LocalBackend

    assert [i for i in LocalBackend().describe(safe_run_id(run_id)) if i.state != "stopped"] == []
    paths = run_layout(run_id)
    for artifact in (
        "dataset/validation.json",
        "dataset/manifest.parquet",
        "job/metrics.json",
        "model/model.onnx",
        "model/model.json",
        "bench/latency.json",
        "bench/verdict.json",
    ):
        assert storage.exists(storage.join(paths.root, artifact)), artifact
    # The report says the size the model trains and serves at, and why validate chose it.
    report = storage.read_bytes(storage.join(paths.report, "index.html")).decode()
    assert re.search(r"32×32 RGB \(resized\); size: the median short side of \d+ images", report)


def billing_and_boxes(run_id: str) -> tuple[bool, list[Path]]:
    """Return whether the run has a billing record, and the compute records of its boxes."""
    compute_dir = Path(os.environ["BURSTCV_COMPUTE_STATE_DIR"]) / safe_run_id(run_id)
    billed = storage.exists(run_layout(run_id).billing)
    return billed, sorted(compute_dir.glob("*.json")) if compute_dir.exists() else []


def test_a_run_on_unchanged_data_rents_nothing_and_is_shown_as_skipped(
    service: str, demo_dataset: Path, deployed: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    reg = Registry(os.environ["BURSTCV_REGISTRY_URI"], "digits")
    production = reg.get_alias(PRODUCTION)
    assert production is not None, deployed["tasks"]  # the same data, the same params
    versions = reg.versions()
    with caplog.at_level(logging.INFO, logger="burstcv"):
        state, tasks, run_id = run_dag({"dataset_uri": str(demo_dataset), "epochs": 3})
    assert state == "success", tasks  # a skip, not a failure
    assert tasks["validate"] == "success" and tasks["report"] == "success", tasks
    assert tasks["plan_scan"] == tasks["scan"] == "success", tasks
    for task in (
        "plan_pack",
        "pack_shards",
        "pack",
        "provision",
        "train",
        "terminate",
        "export",
        "gate",
        "deploy",
    ):
        assert tasks[task] == "skipped", tasks
    assert billing_and_boxes(run_id) == (False, [])  # no box launched, nothing billed
    assert reg.versions() == versions and reg.get_alias(PRODUCTION) == production
    (reason,) = [
        r.getMessage() for r in caplog.records if "nothing new to train on" in r.getMessage()
    ]
    assert f"production version {production.version}" in reason and "force_train" in reason
    paths = run_layout(run_id)
    skip = read_artifact(paths.skip, SkipRecord)
    assert skip.production_version == production.version and skip.schema_version == 1
    report = storage.read_bytes(storage.join(paths.report, "index.html")).decode()
    assert "Skipped: nothing new to train on" in report
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
    import burstcv_views

    (row,) = [r for r in burstcv_views.run_costs(get_settings()) if r["run_id"] == run_id]
    assert row["skipped"] and row["summary"] == reason and row["cost_usd"] is None


def test_a_forced_run_trains_and_a_rejected_candidate_is_not_deployed_saying_why(
    service: str, demo_dataset: Path, deployed: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    reg = Registry(os.environ["BURSTCV_REGISTRY_URI"], "digits")
    before = reg.get_alias(PRODUCTION)
    assert before is not None, deployed["tasks"]
    # The data and params of production: only force_train makes this run train.
    conf = {"dataset_uri": str(demo_dataset), "epochs": 3, "latency_slo_ms": 0.001}
    with caplog.at_level(logging.INFO, logger="burstcv"):
        state, tasks, run_id = run_dag({**conf, "force_train": True})
    assert reg.entry(max(reg.versions())).lineage.run_id == run_id
    assert tasks["train"] == "success" and billing_and_boxes(run_id)[1], tasks
    assert tasks["gate"] == "success" and tasks["deploy"] == "skipped", tasks
    assert state == "success"
    rejected = max(reg.versions())
    entry = reg.entry(rejected)
    assert entry.status == "rejected"
    assert (
        entry.reason.startswith("not promoted: p95") and "exceeds the SLO 0.001 ms" in entry.reason
    )
    # The deploy task's log names the failed check with what was observed and the limit.
    deploy_lines = [r.getMessage() for r in caplog.records if r.funcName == "deploy_skip_reason"]
    # No CPU size serves within that SLO at any rate either: the fleet check says so too.
    assert re.fullmatch(
        rf"version {rejected} not promoted: p95 \d+\.\d\d ms > SLO 0\.001 ms; "
        r"best rate within the SLO 0\.0 req/s < at least 1 req/s",
        deploy_lines[0],
    ), deploy_lines
    assert "no CPU size meets p95 <= 0.001 ms" in entry.reason
    # Production was measured beside the candidate, interleaved in one watched window.
    latency = read_artifact(run_layout(run_id).latency, LatencyRecord)
    assert latency.production is not None and latency.production.version == before.version
    assert latency.production.requests == latency.candidate.requests
    assert latency.candidate.host_load is not None
    assert latency.production.host_load == latency.candidate.host_load
    gate_lines = [m for m in caplog.messages if "gate check " in m]
    assert [line.split(":")[1].split()[-1] for line in gate_lines[:3]] == [
        "latency_p95",
        "error_rate",
        "accuracy_floor",
    ], gate_lines
    assert reg.get_alias(PRODUCTION) == before
    time.sleep(1.5)  # two poll periods: the service must still be on the old version
    assert httpx.get(f"{service}/v1/model", timeout=10).json()["version"] == before.version
    image = sorted((demo_dataset / "val" / "3").glob("*.png"))[0]
    assert predict(service, image)["version"] == before.version


def test_a_corrupt_png_stops_the_run_at_validate_naming_it(
    demo_dataset: Path, tmp_path: Path
) -> None:
    data = tmp_path / "digits"
    for split, per_class in (("train", 20), ("val", 8)):
        for cls in range(10):
            src = sorted((demo_dataset / split / str(cls)).glob("*.png"))[:per_class]
            (data / split / str(cls)).mkdir(parents=True)
            for f in src:
                shutil.copy(f, data / split / str(cls) / f.name)
    victim = sorted((data / "train" / "4").glob("*.png"))[0]
    victim.write_bytes(victim.read_bytes()[:60])  # a truncated PNG
    state, tasks, run_id = run_dag({"dataset_uri": str(data), "epochs": 1})
    assert state == "failed"
    assert tasks["validate"] == "failed"
    # The report still says what went wrong; the outcome teardown makes the run's state say it.
    assert tasks["report"] == "success" and tasks["outcome"] == "failed", tasks
    page = storage.read_bytes(storage.join(run_layout(run_id).root, "report", "index.html"))
    assert victim.name in page.decode()
    assert all(
        tasks[t] in ("upstream_failed", "skipped", "None")
        for t in ("plan_pack", "pack_shards", "pack", "provision", "train", "export", "deploy")
    ), tasks
    # No training process was ever started for this run.
    compute_dir = Path(os.environ["BURSTCV_COMPUTE_STATE_DIR"]) / safe_run_id(run_id)
    assert not compute_dir.exists() or not list(compute_dir.glob("*.json"))
    validation = storage.read_json(storage.join(run_layout(run_id).dataset, "validation.json"))
    assert validation["success"] is False
    named = io.StringIO()
    for expectation in validation["expectations"]:
        named.write(" ".join(expectation.get("offending_files", [])))
    assert f"train/4/{victim.name}" in named.getvalue()
