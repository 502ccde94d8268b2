"""The production stack, built and run for real: docker-compose.yaml under podman-compose.

``make stack-test`` runs this (BURSTCV_STACK_TEST=1); the plain suite skips it. It builds the
images (tests/stack/standins.py: stand-ins for the public bases, then the project's own
Dockerfiles unchanged), starts docker-compose.yaml with the stand-in PostgreSQL and Redis
(tests/stack/compose.standins.yaml) under an AIRFLOW_UID that is not the image's, triggers
``burstcv_pipeline`` through Airflow's REST API on the demo digits, waits for the deployed
version, predicts through the service container, reads the Models page, runs the reaper, and
tears everything down (containers, network, volumes).

One thing stands in for what this machine lacks, at the edge: podman 4.3 here does not run
health checks on its own (that is systemd's timers' job), so a thread runs each container's
health check. And podman-compose neither waits for ``service_healthy`` with this podman nor
can start a container through ``--requires`` whose running dependencies have dependencies of
their own (a podman bug fixed in 5.6), so the test starts the services with ``--no-deps`` in
the order their ``depends_on`` gives: PostgreSQL and Redis (healthy), airflow-init (exited
0), then the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("BURSTCV_STACK_TEST") != "1",
    reason="the container stack runs under `make stack-test` (podman; minutes)",
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import standins  # noqa: E402

PROJECT = "burstcv-stacktest"
# Not the image's 50000: any uid must work (the image gives it a passwd entry).
AIRFLOW_UID = "4242"
# Started once airflow-init has succeeded, as their depends_on says.
LONG_RUNNING = (
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
    "airflow-worker",
    "airflow-bench-worker",
    "serving",
)
STACK_VARIABLES = ("BURSTCV_", "AIRFLOW", "AWS_", "POSTGRES_", "SERVING_PORT")
RUN_TIMEOUT_S = float(os.environ.get("BURSTCV_STACK_RUN_TIMEOUT_S", "1800"))


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log(message: str) -> None:
    print(f">> stack: {message}", file=sys.stderr, flush=True)


@dataclass
class Stack:
    env_file: Path
    api: str
    serving: str
    admin_password: str

    def compose(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return compose(self.env_file, *args, check=check)


def compose(env_file: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "podman_compose",
        "--project-name",
        PROJECT,
        "--env-file",
        str(env_file),
        "--file",
        str(REPO / "docker-compose.yaml"),
        "--file",
        str(HERE / "compose.standins.yaml"),
        *args,
    ]
    # Compose lets the caller's environment override .env: the test session's own settings
    # (tests/conftest.py points BURSTCV_* at its temporary folders) must not reach the stack.
    env = {k: v for k, v in standins.env().items() if not k.startswith(STACK_VARIABLES)}
    done = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True)
    if check and done.returncode != 0:
        raise AssertionError(
            f"podman-compose {' '.join(args)}: exit {done.returncode}\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    return done


def containers() -> list[dict[str, Any]]:
    out = standins.podman(
        "ps",
        "--all",
        "--filter",
        f"label=io.podman.compose.project={PROJECT}",
        "--format",
        "json",
        capture=True,
    ).stdout
    return json.loads(out or "[]")


def container_of(service: str) -> str:
    for c in containers():
        if c.get("Labels", {}).get("com.docker.compose.service") == service:
            return str(c["Names"][0])
    raise LookupError(f"no container of service {service}")


def health(name: str) -> str:
    out = standins.podman(
        "inspect", name, "--format", "{{.State.Health.Status}}", check=False, capture=True
    )
    return out.stdout.strip()


class HealthTicker(threading.Thread):
    """Run every running container's health check every few seconds (systemd's job)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(5):
            for c in containers():
                if c.get("State") == "running":
                    standins.podman("healthcheck", "run", c["Names"][0], check=False, capture=True)


def wait_for(what: str, probe: Any, timeout: float, every: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def dump_logs() -> None:
    for c in containers():
        name = c["Names"][0]
        out = standins.podman("logs", "--tail", "60", name, check=False, capture=True)
        log(f"--- {name} ({c.get('State')}, exit {c.get('ExitCode')}) ---")
        print((out.stdout + out.stderr)[-6000:], file=sys.stderr)


def tear_down(env_file: Path) -> None:
    compose(env_file, "down", "--volumes", "--timeout", "20", check=False)
    for c in containers():  # what compose did not know of (a crashed earlier run)
        standins.podman("rm", "--force", c["Names"][0], check=False, capture=True)
    volumes = standins.podman(
        "volume", "ls", "--format", "{{.Name}}", check=False, capture=True
    ).stdout.split()
    for volume in volumes:
        if volume.startswith(f"{PROJECT}_"):
            standins.podman("volume", "rm", "--force", volume, check=False, capture=True)
    standins.podman("network", "rm", "--force", f"{PROJECT}_default", check=False, capture=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    started = time.monotonic()
    standins.build_all()
    log(f"images built in {time.monotonic() - started:.0f} s")
    env_file = tmp_path_factory.mktemp("stack") / ".env"
    api_port, serving_port = free_port(), free_port()
    subprocess.run(
        [
            sys.executable,
            str(REPO / "docker" / "stack-env.py"),
            "--out",
            str(env_file),
            "--force",
            f"AIRFLOW_UID={AIRFLOW_UID}",
            f"AIRFLOW_API_PORT={api_port}",
            f"SERVING_PORT={serving_port}",
        ],
        check=True,
        capture_output=True,
    )
    values = dict(
        line.split("=", 1)
        for line in env_file.read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    tear_down(env_file)  # leftovers of an interrupted run
    ticker = HealthTicker()
    ticker.start()
    ok = False
    try:
        up = time.monotonic()
        # docker compose's depends_on order, step by step (see the module's docstring).
        compose(env_file, "up", "--detach", "--no-build", "--no-deps", "postgres", "redis")
        for service in ("postgres", "redis"):
            wait_for(
                f"{service} healthy", lambda s=service: health(container_of(s)) == "healthy", 120
            )
        compose(env_file, "up", "--detach", "--no-build", "--no-deps", "airflow-init")
        init = container_of("airflow-init")
        wait_for(
            "airflow-init to finish",
            lambda: (
                standins.podman(
                    "inspect", init, "--format", "{{.State.Status}}", capture=True
                ).stdout.strip()
                == "exited"
            ),
            600,
        )
        code = standins.podman("inspect", init, "--format", "{{.State.ExitCode}}", capture=True)
        assert code.stdout.strip() == "0", "airflow-init failed"
        api = f"http://127.0.0.1:{api_port}"

        def version() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{api}/api/v2/version", timeout=5).status_code == 200
            return False

        compose(env_file, "up", "--detach", "--no-build", "--no-deps", *LONG_RUNNING)
        wait_for("the api-server", version, 300)
        log(f"stack up in {time.monotonic() - up:.0f} s")
        yield Stack(
            env_file=env_file,
            api=api,
            serving=f"http://127.0.0.1:{serving_port}",
            admin_password=values["AIRFLOW_ADMIN_PASSWORD"],
        )
        ok = True
    finally:
        if not ok:
            dump_logs()
        ticker.stopped.set()
        if os.environ.get("BURSTCV_STACK_KEEP") == "1":  # to look around after a failure
            log(f"kept running: {PROJECT} (env file {env_file})")
        else:
            tear_down(env_file)
            assert not containers(), "the stack's containers outlived the test"


def token(stack: Stack) -> dict[str, str]:
    response = httpx.post(
        f"{stack.api}/auth/token",
        json={"username": "admin", "password": stack.admin_password},
        timeout=30,
    )
    response.raise_for_status()
    return {"Authorization": f"Bearer {response.json()['access_token']}"}


def run_dag(
    stack: Stack, headers: dict[str, str], dag_id: str, conf: dict[str, Any]
) -> tuple[str, str]:
    """Unpause and trigger ``dag_id``; return the run's final state and its run id."""
    api = f"{stack.api}/api/v2/dags/{dag_id}"

    def parsed() -> bool:
        return httpx.get(api, headers=headers, timeout=30).status_code == 200

    wait_for(f"{dag_id} to be parsed", parsed, 300, every=5)
    httpx.patch(api, headers=headers, json={"is_paused": False}, timeout=30).raise_for_status()
    response = httpx.post(
        f"{api}/dagRuns", headers=headers, json={"logical_date": None, "conf": conf}, timeout=30
    )
    response.raise_for_status()
    run_id = response.json()["dag_run_id"]
    log(f"triggered {dag_id} run {run_id}")
    started = time.monotonic()

    def finished() -> str | None:
        state = httpx.get(f"{api}/dagRuns/{run_id}", headers=headers, timeout=30).json()["state"]
        return state if state in ("success", "failed") else None

    state = wait_for(f"{dag_id} run {run_id}", finished, RUN_TIMEOUT_S, every=10)
    log(f"{dag_id} run {run_id}: {state} in {time.monotonic() - started:.0f} s")
    if state != "success":
        tis = httpx.get(f"{api}/dagRuns/{run_id}/taskInstances", headers=headers, timeout=30)
        for ti in tis.json()["task_instances"]:
            log(f"  {ti['task_id']}: {ti['state']}")
            if ti["state"] == "failed":
                print_task_log(stack, headers, dag_id, run_id, ti)
    return str(state), run_id


def print_task_log(
    stack: Stack, headers: dict[str, str], dag_id: str, run_id: str, ti: dict[str, Any]
) -> None:
    """Print the tail of a failed task's log, read through the REST API as a user would."""
    url = (
        f"{stack.api}/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{ti['task_id']}"
        f"/logs/{ti['try_number']}"
    )
    response = httpx.get(url, headers=headers, params={"full_content": True}, timeout=60)
    content = response.json().get("content", []) if response.status_code == 200 else []
    lines = [
        " ".join(str(v) for k, v in entry.items() if k in ("event", "error_detail"))
        if isinstance(entry, dict)
        else str(entry)
        for entry in content
    ]
    print("\n".join(lines[-40:]) or response.text[-3000:], file=sys.stderr)


def test_the_stack_trains_deploys_and_serves_the_demo_digits(stack: Stack, tmp_path: Path) -> None:
    headers = token(stack)
    state, run_id = run_dag(stack, headers, "burstcv_pipeline", {})
    if state != "success":
        dump_logs()
    assert state == "success"
    # The benchmark ran on its own queue, which only airflow-bench-worker consumes (the main
    # worker takes the default queue): it ran there, and training did not.
    tis = httpx.get(
        f"{stack.api}/api/v2/dags/burstcv_pipeline/dagRuns/{run_id}/taskInstances",
        headers=headers,
        timeout=30,
    ).json()["task_instances"]
    by_task = {ti["task_id"]: ti for ti in tis if ti.get("map_index", -1) == -1}
    assert by_task["benchmark"]["queue"] == "burstcv_bench", by_task["benchmark"]
    assert by_task["train"]["queue"] != "burstcv_bench"

    # The Models page of the plugin, in the api-server, shows the deployed version.
    models = httpx.get(f"{stack.api}/burstcv/api/models", headers=headers, timeout=30)
    models.raise_for_status()
    page = httpx.get(f"{stack.api}/burstcv/", headers=headers, timeout=30)
    assert page.status_code == 200 and "digits" in page.text

    # The service container serves that version: a demo digit gets a prediction.
    from burstcv.data.demo import write_demo_dataset

    write_demo_dataset(tmp_path / "digits")
    image = sorted((tmp_path / "digits" / "val" / "7").glob("*.png"))[0]
    response = httpx.post(
        f"{stack.serving}/v1/predict",
        files={"file": (image.name, image.read_bytes())},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["predictions"][0]["label"] in {str(d) for d in range(10)}
    assert body["version"], body
    assert str(body["version"]) in json.dumps(models.json())

    # The reaper sweeps the local backend only (no AWS settings here) and passes.
    assert run_dag(stack, headers, "burstcv_reaper", {})[0] == "success"
