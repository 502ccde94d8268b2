"""`make airflow` on another port: tasks run through that port, nothing listens beyond here,
and a component killed with -9 (the api-server included) is restarted by its supervisor.

The documented way around a taken 8080 is ``make airflow AIRFLOW_PORT=...``: the api-server,
the execution API the tasks report to and everything else must move with it, and no component
may listen on another interface (Airflow's own log servers would, on 8793 and 8794).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from localserver import free_port

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def test_make_airflow_on_another_port_runs_a_task_and_listens_only_on_loopback(
    tmp_path: Path,
) -> None:
    venv = Path(sys.prefix)
    stamp = venv / ".stamp"
    if shutil.which("make") is None or not stamp.exists():
        pytest.skip("needs make and a venv built by `make setup`")
    port = free_port()
    var = tmp_path / "var"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW", "BURSTCV_", "AWS_"))  # a shell's, not the suite's
    }
    # -o: the venv counts as up to date (never rebuilt by this test).
    make = ["make", "-s", "-o", str(stamp), f"VENV={venv}", f"VAR={var}", f"AIRFLOW_PORT={port}"]
    url = f"http://127.0.0.1:{port}"
    try:
        started = subprocess.run(
            [*make, "airflow"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"Airflow UI: {url}" in started.stdout
        login = re.search(r"login: admin / (\S+)", started.stdout)
        assert login, started.stdout
        token = httpx.post(
            f"{url}/auth/token",
            json={"username": "admin", "password": login.group(1)},
            timeout=30,
        )
        assert token.status_code in (200, 201), token.text
        headers = {"Authorization": f"Bearer {token.json()['access_token']}"}

        # The reaper DAG is unpaused and scheduled: its first run's task reports through the
        # execution API on this port (on 8080 it would fail before starting).
        deadline, runs = time.monotonic() + 300, []
        while time.monotonic() < deadline:
            answer = httpx.get(
                f"{url}/api/v2/dags/burstcv_reaper/dagRuns", headers=headers, timeout=30
            )
            if answer.status_code == 404:  # the dag-processor has not parsed it yet
                time.sleep(2)
                continue
            assert answer.status_code == 200, answer.text
            runs = [r["state"] for r in answer.json()["dag_runs"]]
            if "success" in runs or "failed" in runs:
                break
            time.sleep(2)
        log = (var / "run" / "airflow.log").read_text(errors="replace")
        assert "success" in runs, f"reaper runs: {runs}\n{log[-4000:]}"

        # Every listening socket of the whole process group is on loopback: the UI on the
        # chosen port, and no log server on every interface.
        pid = pid_before = int((var / "run" / "airflow.pid").read_text())
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        listening = {
            (c.laddr.ip, c.laddr.port)
            for proc in family
            for c in proc.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        }
        assert ("127.0.0.1", port) in listening, listening
        assert {ip for ip, _ in listening} <= LOOPBACK, listening
        assert not {8793, 8794} & {p for _, p in listening}, listening

        # kill -9 of the api-server and the scheduler: the health check says so at once (not
        # a heartbeat that stays fresh for half a minute), the supervisor restarts both, and
        # `make airflow` then finds every component healthy again, without a restart.
        state = var / "run" / "airflow.state.json"
        victims = {
            name: json.loads(state.read_text())["components"][name]
            for name in ("api-server", "scheduler")
        }
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        check = [sys.executable, "-m", "burstcv.airflow.health", url, "--state", str(state)]
        at_once = subprocess.run(check, env=env, capture_output=True, text=True, timeout=60)
        assert at_once.returncode != 0, at_once.stdout
        assert "api-server" in at_once.stdout and "scheduler" in at_once.stdout, at_once.stdout
        deadline, healthy = time.monotonic() + 240, None
        while time.monotonic() < deadline:
            healthy = subprocess.run(check, env=env, capture_output=True, text=True, timeout=60)
            if healthy.returncode == 0:
                break
            time.sleep(2)
        assert healthy is not None and healthy.returncode == 0, healthy and healthy.stdout
        log = (var / "run" / "airflow.log").read_text(errors="replace")
        assert "restarted api-server" in log and "restarted scheduler" in log, log[-4000:]
        again = subprocess.run(
            [*make, "airflow"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )
        assert again.returncode == 0, again.stdout + again.stderr
        assert "every component healthy" in again.stdout, again.stdout
        assert int((var / "run" / "airflow.pid").read_text()) == pid_before
    finally:
        stopped = subprocess.run(
            [*make, "airflow-stop"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
