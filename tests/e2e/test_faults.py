"""Faults beside a live run, in a real Airflow: the reaper, a dead triggerer, a run marked failed.

One stack (LocalExecutor, triggerer, PostgreSQL) runs ``burstcv_pipeline`` on the digits with
the local backend and enough epochs that its ``train`` task stays deferred throughout. Beside
that live run, the real ``burstcv_reaper`` DAG (and ``burstcv reap`` from a shell) must end an
orphaned box and an expired one, and never the live run's box; the stack's health check must
name a killed triggerer; and the run, once a user marks it failed, must end failed with its box
terminated by the teardown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from burstcv_airflow_stack import (
    AirflowStack,
    _start,
    airflow_stack,
    burstcv_env,
    end_every_box,
)
from burstcv_testkit import launch_of, make_job

from burstcv.airflow.health import check
from burstcv.compute.base import RUNNING, STOPPED
from burstcv.compute.local import LocalBackend
from burstcv.training.job import write_job
from burstcv_spec.storage import safe_run_id

pytestmark = pytest.mark.e2e

PIPELINE, REAPER = "burstcv_pipeline", "burstcv_reaper"
STACK = ("dag-processor", "scheduler", "api-server", "triggerer")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return an empty folder for the stack's artifact store, registry and compute state."""
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def stack(store: Path, demo_dataset: Path) -> Iterator[AirflowStack]:
    """Run the stack; whatever happens, end every box it or the test started."""
    env = burstcv_env(store, demo_dataset)
    try:
        home = store / "airflow"
        home.mkdir()
        with airflow_stack(env, executor="LocalExecutor", components=STACK, home=home) as up:
            yield up
    finally:
        end_every_box(store)


def wait_until(
    what: str, predicate: Callable[[], bool], stack: AirflowStack, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{stack.all_log_tails()}")
        stack.assert_running()
        time.sleep(2)


def task_states(client: httpx.Client, dag_id: str, run_id: str) -> dict[str, str | None]:
    tis = client.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances").json()
    return {ti["task_id"]: ti["state"] for ti in tis["task_instances"]}


def run_state(client: httpx.Client, dag_id: str, run_id: str) -> str:
    return str(client.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}").json()["state"])


def launch_box(store: Path, packed_demo: dict[str, Any], run_key: str, airflow_run_id: str) -> str:
    """Start a real training box of its own (200 epochs: it outlives the test) for a run."""
    out = store / "boxes" / run_key
    job_uri = write_job(make_job(packed_demo, out, epochs=200), str(out.parent / f"{run_key}.json"))
    (iid,) = LocalBackend(str(store / "compute")).launch(
        launch_of(
            run_key, job_uri, dag_id=PIPELINE, time_budget_s=3600, airflow_run_id=airflow_run_id
        )
    )
    return iid


def box_states(store: Path, run_key: str) -> list[str]:
    return [i.state for i in LocalBackend(str(store / "compute")).describe(run_key)]


def test_a_live_run_survives_the_reaper_a_dead_triggerer_and_ends_failed_when_marked(
    stack: AirflowStack, store: Path, demo_dataset: Path, packed_demo: dict[str, Any]
) -> None:
    with stack.client() as client:
        wait_until(
            "the DAGs", lambda: client.get(f"/api/v2/dags/{REAPER}").status_code == 200, stack, 180
        )
        assert client.patch(f"/api/v2/dags/{PIPELINE}", json={"is_paused": False}).is_success
        conf = {"dataset_uri": str(demo_dataset), "epochs": 300, "force_train": True}
        response = client.post(
            f"/api/v2/dags/{PIPELINE}/dagRuns", json={"logical_date": None, "conf": conf}
        )
        assert response.status_code == 200, response.text
        live = response.json()["dag_run_id"]
        live_key = safe_run_id(live)
        wait_until(
            "train to defer",
            lambda: task_states(client, PIPELINE, live).get("train") == "deferred",
            stack,
            600,
        )
        assert box_states(store, live_key) == [RUNNING]

        # Beside it: a box whose run never existed, and one of the live run past its expiry.
        orphan = launch_box(store, packed_demo, "r-orphan", "manual__never-existed")
        expired = launch_box(store, packed_demo, "r-expired", live)
        record = next((store / "compute" / "r-expired").glob("local-*.json"))
        data = json.loads(record.read_text())
        data["expires_at"] = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
        record.write_text(json.dumps(data))

        # The reaper DAG, run by the scheduler as every 10 minutes (here on demand).
        reaped = client.post(f"/api/v2/dags/{REAPER}/dagRuns", json={"logical_date": None})
        assert reaped.status_code == 200, reaped.text
        reaper_run = reaped.json()["dag_run_id"]
        wait_until(
            "the reaper run",
            lambda: run_state(client, REAPER, reaper_run) in ("success", "failed"),
            stack,
            300,
        )
        assert run_state(client, REAPER, reaper_run) == "success", task_states(
            client, REAPER, reaper_run
        )
        assert box_states(store, "r-orphan") == [STOPPED]
        assert box_states(store, "r-expired") == [STOPPED]
        assert box_states(store, live_key) == [RUNNING], "the reaper ended live training"
        assert task_states(client, PIPELINE, live)["train"] == "deferred"
        terminated = {}
        for run in client.get(f"/api/v2/dags/{REAPER}/dagRuns").json()["dag_runs"]:
            xcom = client.get(
                f"/api/v2/dags/{REAPER}/dagRuns/{run['dag_run_id']}/taskInstances/reap"
                "/xcomEntries/return_value"
            )
            for report in xcom.json().get("value") or [] if xcom.status_code == 200 else []:
                terminated.update({d["instance_id"]: d["reason"] for d in report["decisions"]})
        assert terminated == {orphan: "run-not-active", expired: "expired"}

        # The same question from a shell, against the same metadata database.
        second = launch_box(store, packed_demo, "r-orphan-2", "manual__also-gone")
        cli = subprocess.run(
            [sys.executable, "-m", "burstcv.cli", "reap", "--dry-run", "--backend", "local"],
            env={**os.environ, **stack.env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert cli.returncode == 0, cli.stderr[-3000:]
        assert f"local: would terminate 1 ['{second}']; kept 1" in cli.stdout, cli.stdout
        LocalBackend(str(store / "compute")).terminate_run("r-orphan-2")

        # A dead triggerer: the health check names it, and a new one picks the wait up.
        dead = stack.processes.pop("triggerer")  # no longer one of the stack's live processes
        os.killpg(dead.pid, signal.SIGKILL)
        dead.wait(timeout=30)
        wait_until(
            "the triggerer to be reported unhealthy",
            lambda: any(c.startswith("triggerer") for c in check(stack.api_url)),
            stack,
            180,
        )
        api_port = int(stack.api_url.rsplit(":", 1)[1])
        stack.processes["triggerer"] = _start("triggerer", api_port, stack.env, stack.log_dir)
        wait_until("a healthy stack", lambda: check(stack.api_url) == [], stack, 180)
        assert task_states(client, PIPELINE, live)["train"] == "deferred"
        assert box_states(store, live_key) == [RUNNING]

        # The user marks the run failed: its teardown ends the box, and the run stays failed.
        marked = client.patch(f"/api/v2/dags/{PIPELINE}/dagRuns/{live}", json={"state": "failed"})
        assert marked.is_success, marked.text
        wait_until(
            "the run to end",
            lambda: (
                run_state(client, PIPELINE, live) in ("success", "failed")
                and task_states(client, PIPELINE, live).get("outcome") in ("success", "failed")
            ),
            stack,
            300,
        )
        time.sleep(5)  # the scheduler has had its chance to change its mind
        states = task_states(client, PIPELINE, live)
        assert run_state(client, PIPELINE, live) == "failed", states
        assert states["terminate"] == "success" and states["outcome"] == "failed", states
        assert states["train"] == "failed", states
        assert box_states(store, live_key) == [STOPPED]
