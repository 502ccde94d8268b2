"""Run burstcv_pipeline on a distributed Airflow: CeleryExecutor, PostgreSQL, Redis, 6 processes.

The run is triggered the way the UI's trigger form does it (POST /api/v2/dags/{id}/dagRuns
with ``conf``), its tasks execute on two Celery worker processes, ``train`` defers to the
triggerer, and the run must end with a production version in the registry. The dataset is
cut into several chunks: their scan and pack tasks run on both workers, and the joined
manifest, validation and shards are those of a one-chunk run on the same data. The plugin's
task links and models page are then read from the same api-server.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from burstcv_airflow_stack import AirflowStack, airflow_stack, burstcv_env, end_every_box
from burstcv_testkit import chromium_screenshot

from burstcv.registry.registry import PRODUCTION, Registry

pytestmark = pytest.mark.e2e

DAG_ID = "burstcv_pipeline"
RUN_TIMEOUT_S = 15 * 60
CHUNK_FILES = 300  # the 1,797 digits: 6 scan chunks; and a pack chunk per shard
SCAN_CHUNKS = 6


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return an empty folder for this stack's artifact store, registry and compute state."""
    return tmp_path_factory.mktemp("celery-stack")


@pytest.fixture(scope="module")
def stack(store: Path, demo_dataset: Path) -> Iterator[AirflowStack]:
    """Run the Celery stack with burstcv's settings pointing into ``store``."""
    env = burstcv_env(store, demo_dataset)  # deploys to the registry only
    try:
        # The Airflow home (component and task logs) stays in pytest's tmp dir for inspection.
        home = store / "airflow"
        home.mkdir()
        with airflow_stack(env, executor="CeleryExecutor", home=home, celery_workers=2) as running:
            yield running
    finally:
        # A failed run must not leave a training process behind (the teardown normally does).
        end_every_box(store)


def wait_for_dag(client: httpx.Client, timeout_s: float = 180) -> None:
    """Wait until the dag-processor has serialized the DAG into the metadata database."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.get(f"/api/v2/dags/{DAG_ID}").status_code == 200:
            return
        time.sleep(2)
    raise AssertionError(f"{DAG_ID} never appeared in the api-server")


def wait_for_run(
    stack: AirflowStack, client: httpx.Client, run_id: str, timeout_s: float
) -> dict[str, Any]:
    """Poll the run until it finishes; fail with task states and component logs otherwise."""
    deadline = time.monotonic() + timeout_s
    run: dict[str, Any] = {}
    while time.monotonic() < deadline:
        stack.assert_running()
        run = client.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}").json()
        if run["state"] in ("success", "failed"):
            break
        time.sleep(5)
    tis = client.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances").json()
    states = {ti["task_id"]: ti["state"] for ti in tis["task_instances"]}
    if run.get("state") != "success":
        failed_logs = [
            task_log(client, run_id, ti["task_id"], ti["try_number"])
            for ti in tis["task_instances"]
            if ti["state"] == "failed"
        ]
        raise AssertionError(
            f"run {run_id}: {run.get('state')} {states}\n"
            + "\n".join(failed_logs)
            + "\n"
            + stack.all_log_tails()
        )
    return run


def task_log(client: httpx.Client, run_id: str, task_id: str, try_number: int) -> str:
    """Return the end of a task's log, read through the REST API as the UI does."""
    response = client.get(
        f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
        headers={"Accept": "application/json"},
    )
    lines = [
        f"{event.get('level', '')} {event.get('event', '')} {event.get('error_detail', '')}"
        for event in response.json().get("content", [])
        if isinstance(event, dict)
    ]
    return f"----- task {task_id} try {try_number} -----\n" + "\n".join(lines)[-6000:]


def test_ui_triggered_run_trains_gates_and_deploys_on_celery(
    stack: AirflowStack, store: Path, demo_dataset: Path
) -> None:
    started = time.monotonic()
    with stack.client() as client:
        wait_for_dag(client)
        assert client.patch(f"/api/v2/dags/{DAG_ID}", json={"is_paused": False}).is_success
        # Two epochs reach 0.45-0.7 on the digits (chance is 0.1), depending on the box's
        # threads; this test is about the distributed run, so the gate's floors are set where
        # a short run on a busy 2-core CI box passes them.
        conf = {
            "dataset_uri": str(demo_dataset),
            "epochs": 2,
            "accuracy_floor": 0.3,
            "latency_slo_ms": 1000,
            "chunk_files": CHUNK_FILES,
        }
        response = client.post(
            f"/api/v2/dags/{DAG_ID}/dagRuns",
            json={"logical_date": None, "conf": conf},
        )
        assert response.status_code == 200, response.text
        run_id = response.json()["dag_run_id"]
        assert response.json()["conf"]["epochs"] == 2

        run = wait_for_run(stack, client, run_id, RUN_TIMEOUT_S)
        elapsed = time.monotonic() - started

        tis = client.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances").json()
        by_task = {ti["task_id"]: ti for ti in tis["task_instances"]}
        assert by_task["deploy"]["state"] == "success"
        assert by_task["terminate"]["state"] == "success"
        # Tasks ran on the Celery worker processes, not in the scheduler; the chunks on both.
        assert by_task["validate"]["executor"] in (None, "CeleryExecutor")
        ran = {
            worker: chunks_run(stack.log_tail(worker, 5_000_000), run_id)
            for worker in ("celery-worker", "celery-worker-2")
        }
        scans = sorted(n for worker in ran.values() for task, n in worker if task == "scan")
        assert scans == list(range(SCAN_CHUNKS)), ran  # each chunk once (no retry needed)
        assert all(ran.values()), f"a worker ran no chunk: {ran}"
        assert_chunks_equal_one_pass(store, run_id, demo_dataset)

        # The registry has a production version trained with the requested epochs.
        registry = Registry(str(store / "registry"), "digits")
        production = registry.get_alias(PRODUCTION)
        assert production is not None
        entry = registry.entry(production.version)
        assert entry.status == "accepted"
        assert entry.params is not None and entry.params["epochs"] == 2

        # The plugin's task links resolve and serve the run's pages from the api-server.
        links = client.get(
            f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/validate/links"
        ).json()["extra_links"]
        assert links["Data Docs"], links
        docs = client.get(links["Data Docs"])
        assert docs.status_code == 200 and "text/html" in docs.headers["content-type"]
        deploy_links = client.get(
            f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/deploy/links"
        ).json()["extra_links"]
        assert deploy_links["Deployed model"] is None  # registry-only deploy: no service link
        models = client.get("/burstcv/api/models").json()
        assert models["aliases"][PRODUCTION] == production.version
        assert any(r["version"] == production.version for r in models["runs"])
        print(f"celery e2e: run {run['state']} in {elapsed:.0f} s")

        # The train task's own log (the triggerer wrote it) holds one progress line per epoch.
        train_log = task_log(client, run_id, "train", by_task["train"]["try_number"])
        progress = re.findall(r"epoch (\d)/2 val_accuracy .*? left \| ", train_log)
        assert progress == ["1", "2"], train_log
        screenshot_task_log(stack, run_id, store / "train-log.png")


def chunks_run(worker_log: str, run_id: str) -> list[tuple[str, int]]:
    """Return the (task, map index) of the chunk tasks a Celery worker's log says it ran."""
    found = []
    for line in worker_log.splitlines():
        if "Executing workload" in line and run_id in line:
            task = re.search(r"task_id='(scan|pack_shards)'", line)
            index = re.search(r"map_index=(-?\d+)", line)
            if task and index:
                found.append((task.group(1), int(index.group(1))))
    return found


def assert_chunks_equal_one_pass(store: Path, run_id: str, dataset: Path) -> None:
    """Assert the run's joined manifest, validation and shards equal a one-chunk run's."""
    import pandas as pd

    from burstcv.params import RunParams
    from burstcv.settings import Settings
    from burstcv.stages import data as data_stage
    from burstcv.stages import resolve as resolve_stage
    from burstcv_spec.contracts import (
        PackPlan,
        RunRef,
        ScanPlan,
        ValidationRecord,
        read_artifact,
    )

    chunked = resolve_stage.run_layout(run_id, Settings(artifact_root=str(store / "artifacts")))
    assert len(read_artifact(chunked.scan_plan, ScanPlan).chunks) == SCAN_CHUNKS
    assert len(read_artifact(chunked.pack_plan, PackPlan).chunks) == 2  # train, val shard
    settings = Settings(home=str(store / "one-pass"), artifact_root=str(store / "one-pass"))
    params = RunParams.resolve({"dataset_uri": str(dataset)}, settings)
    run = RunRef.of("manual__one_pass")
    validated = data_stage.validate(run, settings, params=params)
    packed = data_stage.pack(run, validated, settings=settings)
    one = resolve_stage.run_layout(run, settings)
    assert len(read_artifact(one.scan_plan, ScanPlan).chunks) == 1
    pd.testing.assert_frame_equal(pd.read_parquet(chunked.manifest), pd.read_parquet(one.manifest))
    where = {"manifest_uri", "data_docs_uri", "validated_at"}
    assert read_artifact(chunked.validation, ValidationRecord).model_dump(
        exclude=where
    ) == read_artifact(one.validation, ValidationRecord).model_dump(exclude=where)
    shards = sorted((Path(chunked.shards)).glob("*.npz"))
    assert [p.name for p in shards] == [
        Path(u).name for u in packed.train_shards + packed.val_shards
    ]
    for path in shards:
        assert path.read_bytes() == (Path(one.shards) / path.name).read_bytes(), path.name


def screenshot_task_log(stack: AirflowStack, run_id: str, shot: Path) -> None:
    """Screenshot the train task's log page of the Airflow UI in headless Chromium."""
    import urllib.parse

    import numpy as np
    from PIL import Image

    url = (
        f"{stack.api_url}/dags/{DAG_ID}/runs/{urllib.parse.quote(run_id, safe='')}"
        "/tasks/train?try_number=1"
    )
    said = chromium_screenshot(url, shot, 1400, 900, wait_ms=15000)
    if said is None:
        return  # the REST assertion above stands; the picture needs Chromium
    assert shot.is_file(), f"no screenshot; chromium said:\n{said[-3000:]}"
    with Image.open(shot) as img:
        pixels = np.asarray(img.convert("RGB"))
    assert len({tuple(c) for c in pixels.reshape(-1, 3)[::7].tolist()}) > 50  # drawn
    print(f"train task log page: {url} -> {shot}")
