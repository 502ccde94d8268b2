"""Inject one fault per pipeline run into the standalone Airflow and say what survived.

Not a benchmark of speed: a fault drill an operator can rerun (`make chaos`). It builds a
throwaway home (its own artifact store, registry, Airflow database and free ports, so it never
touches var/ or a running `make airflow`), starts the service and the standalone Airflow through
the Makefile's own targets, and for each fault triggers one run of the digits with the local
backend, injects the fault at the moment an operator saw it happen, and waits for the run to
end. Each fault gets one verdict:

- survived: the run ended as it would have without the fault (and no box outlived it);
- degraded: the run failed, but cleanly (the reason is recorded, no box left, production kept);
- broken: the run hung, ended in the wrong state, or left a training box running.

    python bench/chaos.py                       # every fault
    python bench/chaos.py --faults reaper,trainer-kill --epochs 12
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"
sys.path.insert(0, str(REPO / "spec"))
from burstcv_spec.storage import safe_run_id  # noqa: E402  (the checkout's spec, no install)

PIPELINE, REAPER = "burstcv_pipeline", "burstcv_reaper"
RUN_TIMEOUT_S = 20 * 60


def free_port() -> int:
    """Return a TCP port nothing listens on at 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Verdict:
    """One fault's outcome: survived, degraded or broken, with what was seen."""

    fault: str
    verdict: str
    seconds: float
    detail: str


class Drill:
    """A throwaway burstcv home with the service and standalone Airflow started by make."""

    def __init__(self, home: Path, epochs: int) -> None:
        self.home = home
        self.epochs = epochs
        self.airflow_port, self.serve_port = free_port(), free_port()
        self.api = f"http://127.0.0.1:{self.airflow_port}"
        self.dataset = home / "data" / "digits"
        # Only this drill's settings: nothing of the caller's burstcv or Airflow leaks in.
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith(("BURSTCV_", "AIRFLOW"))
        }
        self.env.update(
            {
                # No cron runs: a scheduled run would hold the DAG's one active-run slot.
                "BURSTCV_SCHEDULE": "",
                # Standalone's log servers would take the default ports of a running Airflow.
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            }
        )
        self._client: httpx.Client | None = None

    # -- make, the way an operator runs it ----------------------------------------------------
    def make(self, target: str) -> str:
        """Run one Makefile target against this drill's home; return its output."""
        done = subprocess.run(
            [
                "make",
                "--no-print-directory",
                "-C",
                str(REPO),
                target,
                f"VAR={self.home}",
                f"AIRFLOW_PORT={self.airflow_port}",
                f"SERVE_PORT={self.serve_port}",
            ],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"make {target} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done.stdout

    def start(self) -> None:
        """Make the demo data, start the service and Airflow, and unpause the pipeline."""
        subprocess.run(
            [str(BIN / "burstcv"), "demo-data", str(self.dataset)],
            env={**self.env, "BURSTCV_HOME": str(self.home)},
            check=True,
            capture_output=True,
        )
        self.make("serve")
        self.make("airflow")
        self.wait("the DAGs", lambda: self.client.get(f"/api/v2/dags/{PIPELINE}").is_success, 300)
        self.client.patch(f"/api/v2/dags/{PIPELINE}", json={"is_paused": False}).raise_for_status()

    def stop(self) -> None:
        """Stop Airflow and the service, and any box a fault left running."""
        if self._client is not None:
            self._client.close()
        subprocess.run(
            ["make", "--no-print-directory", "-C", str(REPO), "stop", f"VAR={self.home}"],
            env=self.env,
            capture_output=True,
        )
        for pgid in self.live_boxes():
            os.killpg(pgid, signal.SIGKILL)

    # -- the REST API --------------------------------------------------------------------------
    @property
    def client(self) -> httpx.Client:
        """Return an API client logged in as the standalone's admin."""
        if self._client is None:
            passwords = self.home / "airflow" / "simple_auth_manager_passwords.json.generated"
            password = json.loads(passwords.read_text())["admin"]
            token = httpx.post(
                f"{self.api}/auth/token",
                json={"username": "admin", "password": password},
                timeout=30,
            )
            token.raise_for_status()
            self._client = httpx.Client(
                base_url=self.api,
                headers={"Authorization": f"Bearer {token.json()['access_token']}"},
                timeout=60,
            )
        return self._client

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        """Start a run as the trigger form does; return its run id."""
        body = {"logical_date": None, "conf": conf or {}}
        response = self.client.post(f"/api/v2/dags/{dag_id}/dagRuns", json=body)
        response.raise_for_status()
        return str(response.json()["dag_run_id"])

    def train(self) -> str:
        """Start one pipeline run on the digits; gate limits a short CPU run passes."""
        return self.trigger(
            PIPELINE,
            {
                "dataset_uri": str(self.dataset),
                "epochs": self.epochs,
                "force_train": True,
                "accuracy_floor": 0.3,
                "latency_slo_ms": 1000,
            },
        )

    def state(self, run_id: str, dag_id: str = PIPELINE) -> str:
        """Return a run's state."""
        return str(self.client.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}").json()["state"])

    def tasks(self, run_id: str, dag_id: str = PIPELINE) -> dict[str, dict[str, Any]]:
        """Return a run's task instances by task id."""
        tis = self.client.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances").json()
        return {ti["task_id"]: ti for ti in tis["task_instances"]}

    def wait(
        self, what: str, predicate: Callable[[], bool], timeout_s: float, every_s: float = 2.0
    ) -> float:
        """Wait until ``predicate`` holds, asking every ``every_s``; return the seconds it took
        (raise on timeout)."""
        started = time.monotonic()
        while True:
            try:
                if predicate():
                    return time.monotonic() - started
            except (httpx.HTTPError, KeyError, ValueError):
                pass  # Airflow restarting: ask again
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
            time.sleep(every_s)

    def wait_end(self, run_id: str, dag_id: str = PIPELINE) -> str:
        """Wait for a run to end; return its final state."""
        self.wait(
            "the run to end",
            lambda: self.state(run_id, dag_id) in ("success", "failed"),
            RUN_TIMEOUT_S,
        )
        return self.state(run_id, dag_id)

    def wait_training(self, run_id: str, epochs_done: int = 1) -> None:
        """Wait until train is deferred and the box has finished ``epochs_done`` epochs."""
        progress = self.home / "artifacts" / "runs" / safe_run_id(run_id) / "job" / "progress.json"

        def trained() -> bool:
            if self.tasks(run_id).get("train", {}).get("state") != "deferred":
                return False
            return (
                progress.exists() and len(json.loads(progress.read_text())["epochs"]) >= epochs_done
            )

        self.wait("training to be under way", trained, 900)

    # -- the boxes -------------------------------------------------------------------------------
    def records(self, run_id: str) -> list[dict[str, Any]]:
        """Return the local backend's records of a run's boxes."""
        folder = self.home / "compute" / safe_run_id(run_id)
        return [json.loads(p.read_text()) for p in sorted(folder.glob("local-*.json"))]

    def live_boxes(self, run_id: str | None = None) -> list[int]:
        """Return the process groups of boxes (of one run, or all) that still have a process."""
        pattern = f"{safe_run_id(run_id)}/local-*.json" if run_id else "*/local-*.json"
        alive = []
        for path in (self.home / "compute").glob(pattern):
            pgid = json.loads(path.read_text())["pid"]
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                continue
            alive.append(pgid)
        return alive

    def processes(self, pgid: int, needle: str) -> list[int]:
        """Return the pids in a process group whose command line holds ``needle``."""
        found = []
        for proc in Path("/proc").iterdir():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, ValueError):
                continue
            if int(fields[2]) == pgid and needle in cmd and fields[0] not in ("Z", "X"):
                found.append(int(proc.name))
        if not found:
            raise LookupError(f"no process {needle!r} in group {pgid}")
        return found

    def trainer(self, pgid: int) -> int:
        """Return the pid of a box's trainer (not its wrapper, whose script names it too)."""
        (pid,) = [
            p
            for p in self.processes(pgid, " -m burstcv.cli train --job ")
            if not Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"bash")
        ]
        return pid

    def supervised(self, target: str) -> dict[str, Any]:
        """Return a supervisor's state (`make airflow`'s or `make serve`'s): pids and groups."""
        state: dict[str, Any] = json.loads((self.home / "run" / f"{target}.state.json").read_text())
        return state

    def airflow_component(self, component: str) -> list[int]:
        """Return the pids of one of Airflow's components: its process group (the leader and
        whatever it forked)."""
        pid = self.supervised("airflow")["components"][component]
        if not isinstance(pid, int):
            raise LookupError(f"{component} is {pid}")
        return self.group(pid)

    def group(self, pgid: int) -> list[int]:
        """Return the live pids of a process group (none: it is gone whole)."""
        try:
            return self.processes(pgid, "")
        except LookupError:
            return []

    def healthy(self) -> bool:
        """Whether Airflow is up now, as `make airflow` checks it (waiting for nothing)."""
        done = subprocess.run(
            [
                str(BIN / "python"),
                "-m",
                "burstcv.supervisor",
                "up",
                "--state",
                str(self.home / "run" / "airflow.state.json"),
                "--airflow",
                self.api,
                "--within",
                "0",
            ],
            env={**self.env, "AIRFLOW_HOME": str(self.home / "airflow")},
            capture_output=True,
            text=True,
            timeout=60,
        )
        return done.returncode == 0

    def airflow_log_lines(self) -> list[str]:
        """Return the standalone Airflow's log, a line each."""
        return (self.home / "run" / "airflow.log").read_text(errors="replace").splitlines()

    def job_dir(self, run_id: str) -> Path:
        """Return a run's training job folder (progress, checkpoints) in the artifact store."""
        return self.home / "artifacts" / "runs" / safe_run_id(run_id) / "job"

    def report(self, run_id: str) -> str:
        """Return a run's report page as plain text, or "" where none was written."""
        page = self.home / "artifacts" / "runs" / safe_run_id(run_id) / "report" / "index.html"
        text = re.sub(r"<[^>]+>", " ", page.read_text()) if page.exists() else ""
        return re.sub(r"\s+", " ", text)


# -- the faults ---------------------------------------------------------------------------------
def reaper_beside_live_training(drill: Drill) -> tuple[str, str]:
    run = drill.train()
    drill.wait_training(run)
    reaper = drill.trigger(REAPER)
    reaped = drill.wait_end(reaper, REAPER)
    kept = bool(drill.live_boxes(run))
    final = drill.wait_end(run)
    detail = f"reaper run {reaped}; live box {'kept' if kept else 'TERMINATED'}; run {final}"
    return ("survived" if reaped == "success" and kept and final == "success" else "broken"), detail


def trainer_killed(drill: Drill) -> tuple[str, str]:
    run = drill.train()
    drill.wait_training(run)
    (pgid,) = drill.live_boxes(run)
    os.kill(drill.trainer(pgid), signal.SIGKILL)  # as the out-of-memory killer does
    return _resumed(drill, run, "trainer killed (-9)")


def wrapper_killed(drill: Drill) -> tuple[str, str]:
    run = drill.train()
    drill.wait_training(run)
    (pgid,) = drill.live_boxes(run)
    os.kill(pgid, signal.SIGKILL)
    return _resumed(drill, run, "box wrapper killed (-9)")


def _resumed(drill: Drill, run: str, what: str) -> tuple[str, str]:
    final = drill.wait_end(run)
    tries = drill.tasks(run)["train"]["try_number"]
    boxes = len(drill.records(run))
    detail = f"{what}; run {final}; train try {tries}; {boxes} box(es) over the run"
    if drill.live_boxes(run):
        return "broken", detail + "; a box outlived the run"
    return ("survived" if final == "success" else "degraded"), detail


def triggerer_killed(drill: Drill) -> tuple[str, str]:
    run = drill.train()
    drill.wait_training(run)
    for pid in drill.airflow_component("triggerer"):
        os.kill(pid, signal.SIGKILL)
    # What an operator does on seeing it: make airflow a second later, which must wait for
    # the supervisor's restart, not restart the whole of Airflow (running tasks with it).
    supervisor = drill.supervised("airflow")["supervisor"]
    time.sleep(1)
    said = drill.make("airflow")
    waited = "every component healthy" in said and "restarting Airflow" not in said
    kept = drill.supervised("airflow")["supervisor"] == supervisor
    final = drill.wait_end(run)
    first = said.splitlines()[0] if said else "(nothing)"
    detail = f"make airflow a second later: {first}; run {final}"
    return ("survived" if waited and kept and final == "success" else "broken"), detail


def component_killed(component: str) -> Callable[[Drill], tuple[str, str]]:
    """Kill one of Airflow's components with -9 mid-training; nobody runs make afterwards."""

    def fault(drill: Drill) -> tuple[str, str]:
        run = drill.train()
        drill.wait_training(run)
        killed = drill.airflow_component(component)
        os.kill(killed[0], signal.SIGKILL)  # the leader: what it forked is left in its group
        # The health check must see it at once: the supervisor's state, not a heartbeat.
        noticed = not drill.healthy()

        def back() -> bool:
            try:
                now = set(drill.airflow_component(component))
            except LookupError:  # not restarted yet
                return False
            return not now & set(killed) and drill.healthy()

        healed_s = drill.wait(f"{component} restarted and healthy", back, 300)
        leaked = drill.group(killed[0])  # its workers, had they outlived it
        drill._client = None  # a new api-server: log in again
        final = drill.wait_end(run)
        said = drill.make("airflow")
        kept = "already running" in said and "every component healthy" in said
        detail = (
            f"{component} killed (-9): health {'noticed at once' if noticed else 'MISSED it'}; "
            f"restarted and healthy in {healed_s:.0f} s with no one acting; "
            f"{len(leaked)} of its {len(killed)} process(es) leaked; run {final}; "
            f"make airflow then: {'healthy, same supervisor' if kept else said.splitlines()[0]}"
        )
        survived = noticed and kept and not leaked and final == "success"
        return ("survived" if survived and not drill.live_boxes(run) else "broken"), detail

    return fault


def trainer_stopped(drill: Drill) -> tuple[str, str]:
    """A hung trainer (kill -STOP): noticed by its progress beat, relaunched, resumed."""
    run = drill.train()
    drill.wait_training(run)
    (pgid,) = drill.live_boxes(run)
    os.kill(drill.trainer(pgid), signal.SIGSTOP)
    stopped = time.monotonic()
    marker = drill.job_dir(run) / "attempts" / "1" / "FAILED"

    def marked() -> bool:
        return marker.exists() and "stalled" in marker.read_text()

    drill.wait("the stall to be noticed", marked, 30 * 60)
    noticed_s = time.monotonic() - stopped
    verdict, detail = _resumed(
        drill, run, f"trainer stopped (SIGSTOP), noticed in {noticed_s:.0f} s"
    )
    # The stall is the attempt's record for good (the trainer, continued after its SIGTERM,
    # must not write "interrupted" over it), and the report says it.
    kept = "stalled" in marker.read_text()
    said = re.search(r"Attempt 1 was ended as stalled[^.]*", drill.report(run))
    detail += f"; attempt 1 {'still' if kept else 'no longer'} marked stalled"
    detail += f"; report: {said.group(0) if said else 'no stall line'}"
    return (verdict if kept and said else "broken"), detail


def checkpoint_corrupt(drill: Drill) -> tuple[str, str]:
    """The newest checkpoint torn (as by a box lost mid-write), then the trainer killed."""
    run = drill.train()
    drill.wait_training(run, epochs_done=2)  # last.pt and prev.pt both exist
    last = drill.job_dir(run) / "checkpoints" / "last.pt"
    (pgid,) = drill.live_boxes(run)
    trainer = drill.trainer(pgid)
    os.kill(trainer, signal.SIGSTOP)  # no new checkpoint lands over the torn one
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 3])
    os.kill(trainer, signal.SIGKILL)
    verdict, detail = _resumed(drill, run, f"last.pt torn to {len(data) // 3} bytes, trainer -9")
    return verdict, detail


def db_locked(drill: Drill) -> tuple[str, str]:
    """Airflow's SQLite database held under an exclusive lock for 60 s mid-training."""
    import sqlite3

    run = drill.train()
    drill.wait_training(run)
    before = len(drill.airflow_log_lines())
    db = sqlite3.connect(drill.home / "airflow" / "airflow.db", timeout=60, isolation_level=None)
    try:
        db.execute("BEGIN EXCLUSIVE")
        time.sleep(60)
    finally:
        db.execute("ROLLBACK")
        db.close()
    exits = [line for line in drill.airflow_log_lines()[before:] if "; restart " in line]
    healed_s = drill.wait("Airflow healthy again", drill.healthy, 600)
    drill._client = None
    final = drill.wait_end(run)
    names = sorted({line.split("|")[-1].split()[0] for line in exits})
    detail = (
        f"database locked 60 s: {len(exits)} component exit(s) {names or ''} restarted by the "
        f"supervisor; healthy {healed_s:.0f} s after; run {final}"
    )
    return ("survived" if final == "success" and not drill.live_boxes(run) else "broken"), detail


def service_killed_mid_deploy(drill: Drill) -> tuple[str, str]:
    """The prediction service killed (-9) while deploy runs (staging the new version).

    Its supervisor restarts it within seconds, saying so; deploy then succeeds (on a retry) or
    fails cleanly with production kept; nobody runs `make serve`.
    """
    serving = f"http://127.0.0.1:{drill.serve_port}/v1/model"

    def served() -> Any:
        response = httpx.get(serving, timeout=30)
        return response.json().get("version") if response.is_success else None

    before = served()
    run = drill.train()
    # As the deploy task starts: polled often, since staging takes a second or two.
    drill.wait(
        "the deploy",
        lambda: (
            drill.tasks(run).get("deploy", {}).get("state")
            in ("running", "success", "failed", "up_for_retry")
        ),
        RUN_TIMEOUT_S,
        every_s=0.2,
    )
    state_then = drill.tasks(run)["deploy"]["state"]
    back_s, said = service_back_after_kill(drill)
    final = drill.wait_end(run)
    deploy = drill.tasks(run)["deploy"]["state"]
    after = served()
    detail = (
        f"service killed (-9) with deploy {state_then}: {said}, answering in {back_s:.1f} s; "
        f"deploy {deploy}; run {final}; it serves version {after} (before the run: {before})"
    )
    if drill.live_boxes(run):
        return "broken", detail + "; a box outlived the run"
    if "restart 1" not in said:
        return "broken", detail
    if final == "failed" and deploy == "failed" and after == before:
        return "degraded", detail  # failed cleanly: production kept
    if final == "success" and deploy == "success" and after not in (None, before):
        return "survived", detail
    return "broken", detail


def service_back_after_kill(drill: Drill) -> tuple[float, str]:
    """Kill the service (-9, not its supervisor); return how soon it answers again, by itself,
    and the supervisor's log line about it."""
    service = drill.supervised("serve")["components"]["service"]
    log = drill.home / "run" / "serve.log"
    before = len(log.read_text(errors="replace").splitlines())
    os.kill(service, signal.SIGKILL)
    killed = time.monotonic()

    def answers() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{drill.serve_port}/healthz", timeout=1).is_success
        except httpx.HTTPError:
            return False

    drill.wait("the service back", answers, 60, every_s=0.1)
    back_s = time.monotonic() - killed
    lines = log.read_text(errors="replace").splitlines()[before:]
    said = next((line.split("| ", 1)[-1] for line in lines if "service exited" in line), "")
    return back_s, said or "no log line about it"


def service_killed_under_load(drill: Drill) -> tuple[str, str]:
    """The service killed (-9) outside a deploy while predictions arrive: back within seconds
    by itself, only the seconds it was down failing requests."""
    import threading

    image = next((drill.dataset / "val").rglob("*.png"))
    url = f"http://127.0.0.1:{drill.serve_port}/v1/predict"
    if not httpx.get(f"http://127.0.0.1:{drill.serve_port}/v1/model", timeout=30).is_success:
        drill.wait_end(drill.train())  # a model to predict with
    counts = {"ok": 0, "failed": 0}
    stopping = threading.Event()

    def load() -> None:  # ~20 predictions/s
        with httpx.Client(timeout=5) as client:
            while not stopping.is_set():
                try:
                    ok = client.post(url, files={"file": image.read_bytes()}).is_success
                except httpx.HTTPError:
                    ok = False
                counts["ok" if ok else "failed"] += 1
                stopping.wait(0.05)

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(5)
    try:
        back_s, said = service_back_after_kill(drill)
        time.sleep(5)
    finally:
        stopping.set()
        thread.join()
    detail = (
        f"service killed (-9): {said}; answering again in {back_s:.1f} s; "
        f"{counts['failed']} of {counts['ok'] + counts['failed']} predictions failed"
    )
    # Only the seconds it was truly down may fail requests (20/s).
    survived = "restart 1" in said and back_s < 15 and counts["failed"] <= 20 * (back_s + 1)
    return ("survived" if survived else "broken"), detail


def airflow_killed(drill: Drill) -> tuple[str, str]:
    """Every Airflow process killed at once (-9: the supervisor and every group it started, as
    a host's out-of-memory killer or a lost container leaves them), then `make airflow`."""
    run = drill.train()
    drill.wait_training(run)
    state = drill.supervised("airflow")
    os.kill(state["supervisor"], signal.SIGKILL)
    for group in state["groups"]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group["pgid"], signal.SIGKILL)
    drill._client = None  # a new api-server: log in again
    drill.make("airflow")
    return _resumed(drill, run, "whole Airflow killed (-9) and started again")


def supervisor_killed(drill: Drill) -> tuple[str, str]:
    """The supervisor alone killed (-9): its components run on, orphaned. `make airflow`
    must end them (what they forked too) and start a fresh Airflow, not stop at the port."""
    run = drill.train()
    drill.wait_training(run)
    state = drill.supervised("airflow")
    os.kill(state["supervisor"], signal.SIGKILL)
    time.sleep(20)  # as long as it took a dag-processor to die with nobody to restart it
    orphans = [pid for group in state["groups"] for pid in drill.group(group["pgid"])]
    drill._client = None
    said = drill.make("airflow")
    left = [pid for group in state["groups"] for pid in drill.group(group["pgid"])]
    verdict, detail = _resumed(
        drill,
        run,
        f"supervisor killed (-9), {len(orphans)} orphaned process(es); make airflow: "
        f"{said.splitlines()[0] if said else '(nothing)'}; {len(left)} left running",
    )
    return ("broken" if left or "orphaned" not in said else verdict), detail


def scheduler_stopped(drill: Drill) -> tuple[str, str]:
    """The scheduler stopped (SIGSTOP) for 90 s mid-training: the supervisor counts it as hung,
    ends its group and starts another; nobody acts."""
    run = drill.train()
    drill.wait_training(run)
    before = len(drill.airflow_log_lines())
    (leader, *_) = drill.airflow_component("scheduler")
    os.kill(leader, signal.SIGSTOP)
    time.sleep(90)
    replaced = [line for line in drill.airflow_log_lines()[before:] if "scheduler stopped" in line]
    left = drill.group(leader)
    for pid in left:  # not replaced: let the drill go on
        os.kill(pid, signal.SIGCONT)
    drill._client = None
    acted = replaced[0].split("| ", 1)[-1] if replaced else "never acted on"
    verdict, detail = _resumed(
        drill, run, f"scheduler stopped 90 s: {acted}; {len(left)} process(es) of its group left"
    )
    return ("broken" if left or not replaced else verdict), detail


def service_restart_during_deploy(drill: Drill) -> tuple[str, str]:
    run = drill.train()
    drill.wait(
        "the gate",
        lambda: drill.tasks(run).get("gate", {}).get("state") in ("success", "failed"),
        RUN_TIMEOUT_S,
    )
    drill.make("serve-stop")
    time.sleep(2)
    drill.make("serve")
    final = drill.wait_end(run)
    deploy = drill.tasks(run)["deploy"]["state"]
    detail = f"service restarted as deploy began; deploy {deploy}; run {final}"
    if final == "success" and deploy == "success":
        return "survived", detail
    return ("degraded" if deploy == "failed" else "broken"), detail


def marked_failed(drill: Drill) -> tuple[str, str]:
    run = drill.train()
    drill.wait_training(run)
    drill.client.patch(f"/api/v2/dags/{PIPELINE}/dagRuns/{run}", json={"state": "failed"})
    drill.wait(
        "the teardowns",
        lambda: (
            drill.tasks(run)["outcome"]["state"] in ("success", "failed", "skipped")
            and drill.state(run) in ("success", "failed")
        ),
        600,
    )
    time.sleep(10)
    final, left = drill.state(run), drill.live_boxes(run)
    # The report runs after the teardown that bills the run: it has the cost and the reason.
    page = drill.report(run)
    cost = re.search(r"Run cost \$[0-9.,]+", page)
    reason = re.search(r"Training failed in attempt [^.]*", page)
    detail = (
        f"run {final}; {'a box outlived it' if left else 'box terminated'}; report: "
        f"{cost.group(0) if cost else 'no cost'}; {reason.group(0) if reason else 'no reason'}"
    )
    whole = final == "failed" and not left and cost and reason
    return ("survived" if whole else "broken"), detail


FAULTS: dict[str, Callable[[Drill], tuple[str, str]]] = {
    "reaper": reaper_beside_live_training,
    "trainer-kill": trainer_killed,
    "wrapper-kill": wrapper_killed,
    "triggerer-kill": triggerer_killed,
    "airflow-kill": airflow_killed,
    "service-restart": service_restart_during_deploy,
    "mark-failed": marked_failed,
    "trainer-stop": trainer_stopped,
    "checkpoint-corrupt": checkpoint_corrupt,
    "api-server-kill": component_killed("api-server"),
    "scheduler-kill": component_killed("scheduler"),
    "db-lock": db_locked,
    "service-kill": service_killed_mid_deploy,
    "service-kill-load": service_killed_under_load,
    "supervisor-kill": supervisor_killed,
    "scheduler-stop": scheduler_stopped,
}


def main() -> int:
    """Run the chosen faults, one pipeline run each; print a verdict per fault."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"from {', '.join(FAULTS)}")
    parser.add_argument("--epochs", type=int, default=12, help="per run (enough to inject into)")
    parser.add_argument("--keep", action="store_true", help="keep the drill's home folder")
    parser.add_argument(
        "--unsupervised",
        action="store_true",
        help="kill the service's supervisor first: shows a check failing when its fault is "
        "not survived (service-kill-load then reads broken)",
    )
    args = parser.parse_args()
    chosen = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {unknown}; choose from {', '.join(FAULTS)}")
    home = Path(tempfile.mkdtemp(prefix="burstcv-chaos-"))
    drill = Drill(home, args.epochs)
    verdicts: list[Verdict] = []
    try:
        drill.start()
        if args.unsupervised:
            os.kill(drill.supervised("serve")["supervisor"], signal.SIGKILL)
        for name in chosen:
            started = time.monotonic()
            try:
                verdict, detail = FAULTS[name](drill)
            except (TimeoutError, RuntimeError, LookupError, httpx.HTTPError) as exc:
                verdict, detail = "broken", f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            verdicts.append(Verdict(name, verdict, time.monotonic() - started, detail))
            print(f"{name:16} {verdict:9} {verdicts[-1].seconds:6.0f} s  {detail}", flush=True)
    finally:
        drill.stop()
        if not args.keep:
            subprocess.run(["rm", "-rf", str(home)], check=False)
        else:
            print(f"home kept: {home}")
    counts = {
        v: sum(1 for x in verdicts if x.verdict == v) for v in ("survived", "degraded", "broken")
    }
    print("chaos: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    return 1 if counts["broken"] else 0


if __name__ == "__main__":
    sys.exit(main())
