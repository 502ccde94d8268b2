"""The supervisor behind `make airflow` and `make serve` (burstcv.supervisor), on real processes.

Small Python programs stand in for Airflow's components where the property does not need
Airflow: killed with -9 (the workers they forked ended with them), stopped with SIGSTOP, hung
behind a probe, and orphaned by a supervisor killed with -9. The prediction service itself is
supervised in the last test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from localserver import REPO_ROOT, free_port

from burstcv import supervisor
from burstcv.supervisor import Child, Supervisor
from burstcv_spec.contracts import ProcessGroup

# Forks a worker (as a scheduler forks its executor's), records "leader worker", then waits.
FAMILY = """
import os, sys, time
worker = os.fork()
if worker == 0:
    time.sleep(600)
    os._exit(0)
open(sys.argv[1], "a").write(f"{os.getpid()} {worker}\\n")
time.sleep(600)
"""
# Answers HTTP, except while the file named by argv[2] exists: then every answer hangs.
HANGS = """
import http.server, os, sys, time
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        while os.path.exists(sys.argv[2]):
            time.sleep(0.1)
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""
# A supervisor of its own process, as `make` starts one: argv[1] the state, argv[2] the record.
SUPERVISOR = f"""
import sys
from burstcv.supervisor import Child, Supervisor
FAMILY = {FAMILY!r}
children = [Child(name, [sys.executable, "-c", FAMILY, sys.argv[2]]) for name in ("a", "b")]
Supervisor(children, {{"PATH": "/usr/bin:/bin"}}, sys.argv[1]).run()
"""


def _families(record: Path) -> list[tuple[int, int]]:
    lines = record.read_text().splitlines() if record.exists() else []
    return [(int(a), int(b)) for a, b in (line.split() for line in lines)]


def _until(what: str, check: Callable[[], object], within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        time.sleep(0.1)


def _gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


@contextlib.contextmanager
def supervising(children: list[Child], state: Path) -> Iterator[Supervisor]:
    """Run a supervisor in a thread; stop it (and check it stopped everything) at the end."""
    running = Supervisor(children, {"PATH": "/usr/bin:/bin"}, str(state))
    thread = threading.Thread(target=running.run)
    thread.start()
    try:
        yield running
    finally:
        running.stopping.set()
        thread.join(timeout=60)
    for group in json.loads(state.read_text())["groups"]:
        assert not supervisor.group_members(ProcessGroup(**group)), group


def test_a_child_killed_with_9_is_ended_with_its_workers_and_restarted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record, state = tmp_path / "family", tmp_path / "state.json"
    child = Child("scheduler", [sys.executable, "-c", FAMILY, str(record)])
    with supervising([child], state):
        _until("started", lambda: len(_families(record)) == 1)
        ((leader, worker),) = _families(record)
        os.kill(leader, signal.SIGKILL)
        _until("restarted", lambda: len(_families(record)) == 2)
        assert _gone(worker), "the killed scheduler's worker was leaked"
        new_leader, new_worker = _families(record)[1]
        assert not _gone(new_leader) and not _gone(new_worker)
        recorded = json.loads(state.read_text())
        assert recorded["components"] == {"scheduler": new_leader}
        assert [g["pgid"] for g in recorded["groups"]] == [new_leader]
    out = capsys.readouterr().out
    assert (
        "scheduler exited with -9 after 0 s; ended the 1 process(es) it left in its group; "
        "restart 1 in 1 s" in out
    ), out
    assert f"restarted scheduler (pid {new_leader}, restart 1)" in out
    assert _gone(new_leader) and _gone(new_worker)


def test_a_stopped_child_counts_as_hung_and_is_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record, state = tmp_path / "family", tmp_path / "state.json"
    child = Child("triggerer", [sys.executable, "-c", FAMILY, str(record)])
    with supervising([child], state):
        _until("started", lambda: len(_families(record)) == 1)
        ((leader, worker),) = _families(record)
        stopped_at = time.monotonic()
        os.kill(leader, signal.SIGSTOP)
        _until("replaced", lambda: len(_families(record)) == 2, within_s=supervisor.STOPPED_S + 15)
        assert time.monotonic() - stopped_at >= supervisor.STOPPED_S
        assert _gone(leader) and _gone(worker)
    out = capsys.readouterr().out
    assert "triggerer stopped (not running) for 5 s after" in out and "restart 1 in 1 s" in out
    assert "restarted triggerer" in out


def test_a_child_whose_probe_goes_stale_is_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port, hang, state = free_port(), tmp_path / "hang", tmp_path / "state.json"
    url = f"http://127.0.0.1:{port}/"
    child = Child(
        "service",
        [sys.executable, "-c", HANGS, str(port), str(hang)],
        supervisor.http_answers(url, 0.5),
        stale_s=3.0,
        first_s=30.0,
    )
    with supervising([child], state) as running:
        _until("answering", lambda: child.state() != "starting")
        assert child.proc is not None
        first = child.proc.pid
        hang.touch()  # alive, not stopped, but no answer
        _until("restarting", lambda: child.restarts == 1, within_s=20)
        hang.unlink()
        _until("back", lambda: child.state() not in ("starting", "restarting"), within_s=20)
        assert child.proc.pid != first and _gone(first)
        assert httpx.get(url, timeout=5).status_code == 200
        assert running.children == [child]
    out = capsys.readouterr().out
    assert "service made no progress (its probe) for 3 s after" in out, out


def test_a_dead_supervisors_groups_are_ended_by_stop(tmp_path: Path) -> None:
    """The supervisor killed with -9 leaves its children running; stop ends them, workers too."""
    record, state = tmp_path / "family", tmp_path / "state.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    boss = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(state), str(record)], env=env)
    try:
        _until("both started", lambda: len(_families(record)) == 2)
        _until("recorded", lambda: state.exists() and state.read_text().count("pgid") == 2)
        boss.kill()
        boss.wait()
        orphans = [pid for family in _families(record) for pid in family]
        time.sleep(0.5)
        assert not any(_gone(pid) for pid in orphans), "the children died with their supervisor"
        assert supervisor.wait_up(str(state), 5, list) == ["supervisor (not running)"]
        ended = list(supervisor.stop(str(state)))
    finally:
        boss.kill()
    assert sorted(ended) == sorted(
        f"process group {leader} (2 process(es))" for leader, _ in _families(record)
    )
    assert all(_gone(pid) for pid in orphans)
    assert not state.exists()
    assert list(supervisor.stop(str(state))) == []  # nothing recorded: nothing to do


def test_up_waits_for_a_component_being_restarted_instead_of_calling_it_down(
    tmp_path: Path,
) -> None:
    record, state = tmp_path / "family", tmp_path / "state.json"
    child = Child("dag-processor", [sys.executable, "-c", FAMILY, str(record)])
    with supervising([child], state):
        _until("started", lambda: len(_families(record)) == 1)
        ((leader, _),) = _families(record)
        os.kill(leader, signal.SIGKILL)
        _until("restarting", lambda: "restarting" in state.read_text())
        assert supervisor.wait_up(str(state), 0, list) == ["dag-processor (restarting)"]
        started = time.monotonic()
        assert supervisor.wait_up(str(state), 30, list) == []
        assert time.monotonic() - started < 10
    # Stopped for good: still down once the bounded wait is over.
    started = time.monotonic()
    assert supervisor.wait_up(str(state), 2, list) == ["dag-processor (process exited)"]
    assert 2 <= time.monotonic() - started < 6


def test_the_prediction_service_killed_with_9_is_back_within_seconds(tmp_path: Path) -> None:
    """The real service under the real supervisor program (`make serve` runs the same)."""
    port, state, log = free_port(), tmp_path / "serve.state.json", tmp_path / "serve.log"
    env = {
        **os.environ,
        "BURSTCV_SERVING_PORT": str(port),
        "BURSTCV_SERVING_REGISTRY_URI": str(tmp_path / "registry"),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    url = f"http://127.0.0.1:{port}/healthz"
    with log.open("wb") as out:
        boss = subprocess.Popen(
            [sys.executable, "-m", "burstcv.supervisor", "run", "serve", "--state", str(state)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
    try:
        assert supervisor.wait_up(str(state), 60, list) == [], log.read_text()
        service = json.loads(state.read_text())["components"]["service"]
        assert httpx.get(url, timeout=5).status_code == 200
        os.kill(service, signal.SIGKILL)
        killed_at = time.monotonic()

        def answers() -> bool:
            try:
                return httpx.get(url, timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        _until("the service answers again", answers, within_s=30)
        back_s = time.monotonic() - killed_at
        assert supervisor.wait_up(str(state), 10, list) == []
        again = json.loads(state.read_text())["components"]["service"]
        assert again != service and _gone(service)
        assert back_s < 15, back_s
        text = log.read_text()
        assert "service exited with -9 after" in text and "restart 1 in 1 s" in text, text
        assert f"restarted service (pid {again}, restart 1)" in text
    finally:
        ended = list(supervisor.stop(str(state)))
        if boss.poll() is None:
            os.killpg(boss.pid, signal.SIGKILL)
        boss.wait(timeout=30)
    assert ended and ended[0] == f"supervisor (pid {boss.pid})"
    assert _gone(again)


def test_make_serve_recovers_from_a_dead_supervisor_and_serve_stop_ends_its_orphans(
    tmp_path: Path,
) -> None:
    """`make serve` after its supervisor died ends the orphaned service and starts afresh;
    `make serve-stop` ends the recorded group though nothing supervises it."""
    import shutil

    stamp = Path(sys.prefix) / ".stamp"
    if shutil.which("make") is None or not stamp.exists():
        pytest.skip("needs make and a venv built by `make setup`")
    port, var = free_port(), tmp_path / "var"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "BURSTCV_"))}
    make = ["make", "-s", "-o", str(stamp), f"VENV={sys.prefix}", f"VAR={var}"]
    make.append(f"SERVE_PORT={port}")
    state = var / "run" / "serve.state.json"

    def run(target: str) -> str:
        done = subprocess.run(
            [*make, target], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    try:
        run("serve")
        first = json.loads(state.read_text())
        os.kill(first["supervisor"], signal.SIGKILL)
        said = run("serve")
        orphan = first["components"]["service"]
        assert f"serve's supervisor is gone; ended its orphaned process group {orphan}" in said
        assert _gone(orphan)
        second = json.loads(state.read_text())
        assert second["supervisor"] != first["supervisor"]
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        os.kill(second["supervisor"], signal.SIGKILL)
        said = run("serve-stop")
        assert f"ended process group {second['groups'][0]['pgid']}" in said, said
        assert _gone(second["components"]["service"]) and not state.exists()
    finally:
        run("serve-stop")


# Answers Airflow's health endpoint with the JSON in the file named by argv[2].
HEALTH = """
import http.server, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = open(sys.argv[2], "rb").read()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_an_airflow_heartbeat_is_judged_only_while_the_database_answers(tmp_path: Path) -> None:
    """A stale heartbeat is no progress; a locked database or a silent api-server blames none."""
    port, answer = free_port(), tmp_path / "health.json"
    url = f"http://127.0.0.1:{port}"
    scheduler = supervisor.airflow_heartbeat(url, "scheduler")
    dag_processor = supervisor.airflow_heartbeat(url, "dag-processor")
    assert scheduler() is None  # nothing answers yet

    def health(database: str, scheduler: str) -> None:
        statuses = {"metadatabase": database, "scheduler": scheduler}
        statuses |= {"triggerer": "healthy", "dag_processor": "healthy"}
        answer.write_text(json.dumps({k: {"status": v} for k, v in statuses.items()}))

    health("healthy", "healthy")
    server = subprocess.Popen([sys.executable, "-c", HEALTH, str(port), str(answer)])
    try:
        _until("answering", lambda: scheduler() is not None)
        assert scheduler() is True and dag_processor() is True
        health("healthy", "unhealthy")
        assert scheduler() is False and dag_processor() is True
        health("unhealthy", "unhealthy")
        assert scheduler() is None and dag_processor() is None
    finally:
        server.kill()
        server.wait()
