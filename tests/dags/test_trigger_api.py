"""burstcv_pipeline through a real api-server, as the UI and external systems use it.

A light stack (dag-processor, scheduler with the LocalExecutor, api-server; PostgreSQL) serves
the REST API. Invalid trigger-form values are refused before any run exists; an Asset event
posted through the API starts a run on the dataset it names; the plugin's pages and task links
answer, and only to a caller with a valid token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from burstcv_airflow_stack import AirflowStack, airflow_stack, burstcv_env
from burstcv_testkit import gate_decision, write_model_dir

from burstcv.registry.registry import Registry
from burstcv_spec.contracts import RegistryDecision

DAG_ID = "burstcv_pipeline"
PLUGIN_RUN_ID = "manual__plugin-check"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return a folder with a registered production version and one run's pages."""
    root = tmp_path_factory.mktemp("trigger-api")
    model_dir = write_model_dir(
        root / "model",
        b"not a real onnx file: the registry only stores it",
        run_id=PLUGIN_RUN_ID,
    )
    registry = Registry(str(root / "registry"), "digits")
    decision = RegistryDecision.model_validate(gate_decision(accuracy=0.975, p95_ms=8.25))
    version = registry.register(str(model_dir), decision)
    registry.promote(version)
    run = root / "artifacts" / "runs" / PLUGIN_RUN_ID
    (run / "dataset" / "data_docs").mkdir(parents=True)
    (run / "dataset" / "data_docs" / "index.html").write_text("<html>expectations</html>")
    (run / "report").mkdir()
    (run / "report" / "index.html").write_text("<html>the run report</html>")
    return root


@pytest.fixture(scope="module")
def stack(store: Path, demo_dataset: Path) -> Iterator[AirflowStack]:
    """Run dag-processor, scheduler (LocalExecutor) and api-server on a fresh database."""
    # The service URL is never called: only the link is built. No cron (burstcv_env): a
    # scheduled run would keep the Asset-triggered run from being made.
    env = burstcv_env(store, demo_dataset, serving_url="http://127.0.0.1:9/")
    with airflow_stack(env, executor="LocalExecutor") as running:
        yield running


@pytest.fixture(scope="module")
def api(stack: AirflowStack) -> Iterator[httpx.Client]:
    """Return an authenticated REST client, once the DAG is in the metadata database."""
    with stack.client() as client:
        deadline = time.monotonic() + 180
        while client.get(f"/api/v2/dags/{DAG_ID}").status_code != 200:
            assert time.monotonic() < deadline, "the dag-processor never registered the DAG"
            stack.assert_running()
            time.sleep(2)
        yield client


def dag_runs(api: httpx.Client, **params: Any) -> list[dict[str, Any]]:
    """Return the DAG's runs (optionally filtered, e.g. run_type=asset_triggered)."""
    response = api.get(f"/api/v2/dags/{DAG_ID}/dagRuns", params=params)
    response.raise_for_status()
    return list(response.json()["dag_runs"])


def trigger(api: httpx.Client, conf: dict[str, Any], run_id: str | None = None) -> httpx.Response:
    """Trigger the DAG as the UI's trigger form does."""
    body: dict[str, Any] = {"logical_date": None, "conf": conf}
    if run_id:
        body["dag_run_id"] = run_id
    return api.post(f"/api/v2/dags/{DAG_ID}/dagRuns", json=body)


def test_plugin_page_and_task_links_answer(stack: AirflowStack, api: httpx.Client) -> None:
    # The pages check the caller's JWT like the REST API does: a forged token gets nothing but
    # the nav icon. (This stack makes every user admin, so "no token" would pass as admin.)
    forged = {"Authorization": "Bearer not-a-jwt"}
    for path in ("/burstcv/", "/burstcv/api/models", f"/burstcv/runs/{PLUGIN_RUN_ID}/report/"):
        response = httpx.get(f"{stack.api_url}{path}", headers=forged, timeout=30)
        assert response.status_code in (401, 403), path
    icon = httpx.get(f"{stack.api_url}/burstcv/icon.svg", headers=forged, timeout=30)
    assert icon.status_code == 200

    page = api.get("/burstcv/")
    assert page.status_code == 200
    assert '<table id="versions">' in page.text and "0.9750" in page.text
    models = api.get("/burstcv/api/models").json()
    assert models["aliases"]["production"] == 1
    assert models["versions"][0]["p95_ms"] == 8.25

    # A run of the paused DAG stays queued; its task instances exist, and so do their links.
    assert trigger(api, {}, run_id=PLUGIN_RUN_ID).status_code == 200
    try:
        base = f"/api/v2/dags/{DAG_ID}/dagRuns/{PLUGIN_RUN_ID}/taskInstances"
        docs = api.get(f"{base}/validate/links").json()["extra_links"]["Data Docs"]
        assert api.get(docs).text == "<html>expectations</html>"
        report = api.get(f"{base}/report/links").json()["extra_links"]["Run report"]
        assert api.get(report).text == "<html>the run report</html>"
        deployed = api.get(f"{base}/deploy/links").json()["extra_links"]["Deployed model"]
        assert deployed == "http://127.0.0.1:9/v1/model"
        assert api.get(f"{base}/pack/links").json()["extra_links"]["Data Docs"] is None
        traversal = api.get(f"/burstcv/runs/{PLUGIN_RUN_ID}/report/..%2F..%2F..%2Fregistry")
        assert traversal.status_code == 404
        # The Models page links the version to its Airflow run: a real run, a real UI page.
        run_link = f'href="../dags/{DAG_ID}/runs/{PLUGIN_RUN_ID}"'
        assert run_link in api.get("/burstcv/").text
        assert api.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{PLUGIN_RUN_ID}").status_code == 200
        ui_page = httpx.get(f"{stack.api_url}/dags/{DAG_ID}/runs/{PLUGIN_RUN_ID}", timeout=30)
        assert ui_page.status_code == 200 and "<html" in ui_page.text.lower()
    finally:
        api.patch(f"/api/v2/dags/{DAG_ID}/dagRuns/{PLUGIN_RUN_ID}", json={"state": "failed"})


@pytest.mark.parametrize(
    ("conf", "field"),
    [
        ({"epochs": 0}, "epochs"),
        ({"model": "vgg99"}, "model"),
        ({"compute_backend": "gpu"}, "compute_backend"),
        ({"accuracy_floor": 1.5}, "accuracy_floor"),
        ({"instance_types": []}, "instance_types"),
    ],
)
def test_invalid_params_are_refused_before_a_run_exists(
    api: httpx.Client, conf: dict[str, Any], field: str
) -> None:
    before = len(dag_runs(api))
    response = trigger(api, conf)
    assert 400 <= response.status_code < 500, response.text
    assert field in response.text  # the refusal names the offending field
    assert len(dag_runs(api)) == before


def test_an_asset_event_starts_a_run_on_the_dataset_it_names(
    api: httpx.Client, tmp_path: Path
) -> None:
    assets = api.get("/api/v2/assets", params={"name_pattern": "burstcv_dataset"}).json()
    (asset,) = [a for a in assets["assets"] if a["name"] == "burstcv_dataset"]
    assert any(d["dag_id"] == DAG_ID for d in asset["scheduled_dags"])
    assert api.patch(f"/api/v2/dags/{DAG_ID}", json={"is_paused": False}).is_success
    new_dataset = str(tmp_path / "digits-v2")
    try:
        event = api.post(
            "/api/v2/assets/events",
            json={"asset_id": asset["id"], "extra": {"dataset_uri": new_dataset}},
        )
        assert event.status_code == 200, event.text
        deadline = time.monotonic() + 240
        runs: list[dict[str, Any]] = []
        while not runs:
            assert time.monotonic() < deadline, "no asset-triggered run within 240 s"
            runs = dag_runs(api, run_type="asset_triggered")
            time.sleep(2)
        (run,) = runs
        assert run["state"] in ("queued", "running")
        consumed = api.get(
            f"/api/v2/dags/{DAG_ID}/dagRuns/{run['dag_run_id']}/upstreamAssetEvents"
        ).json()["asset_events"]
        assert [e["extra"]["dataset_uri"] for e in consumed] == [new_dataset]
    finally:
        api.patch(f"/api/v2/dags/{DAG_ID}", json={"is_paused": True})
        for run in dag_runs(api, run_type="asset_triggered"):
            api.patch(
                f"/api/v2/dags/{DAG_ID}/dagRuns/{run['dag_run_id']}", json={"state": "failed"}
            )
