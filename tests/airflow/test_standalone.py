"""The supervisor behind `make airflow`: the api-server first, a component that exits restarted.

The children here are small Python programs standing in for Airflow's components (the real
set is supervised in tests/airflow/test_make_airflow.py, killed with -9): what is proven is
the supervision itself, with real processes, a real HTTP readiness check and real exits.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from localserver import free_port

from burstcv.airflow import health, standalone

# Answers HTTP on its port after a second (as the api-server takes a while to bind).
API = """
import http.server, sys, time
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
time.sleep(1.0)
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
open(sys.argv[2], "a").write(f"{time.time()}\\n")
server.serve_forever()
"""
# Exits with 3 soon after its first two starts, then keeps running.
FLAKY = """
import sys, time
log = sys.argv[1]
open(log, "a").write(f"{time.time()}\\n")
if len(open(log).read().splitlines()) <= 2:
    time.sleep(0.2)
    sys.exit(3)
time.sleep(600)
"""


def _starts(path: Path) -> list[float]:
    return [float(x) for x in path.read_text().split()] if path.exists() else []


def test_the_api_server_starts_first_and_an_exited_component_is_restarted_with_backoff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    api_log, flaky_log, state = tmp_path / "api", tmp_path / "flaky", tmp_path / "state.json"
    components = [
        standalone.Component("api-server", [sys.executable, "-c", API, str(port), str(api_log)]),
        standalone.Component("scheduler", [sys.executable, "-c", FLAKY, str(flaky_log)]),
    ]
    stopping = threading.Event()
    supervisor = threading.Thread(
        target=standalone.supervise,
        args=(components,),
        kwargs={
            "env": {"PATH": "/usr/bin:/bin"},
            "ready": lambda: standalone.answers(url),
            "stopping": stopping,
            "state_path": str(state),
        },
    )
    supervisor.start()
    try:
        deadline = time.monotonic() + 60
        while len(_starts(flaky_log)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        starts = _starts(flaky_log)
        assert len(starts) == 3, capsys.readouterr().out
        # The others wait for the api-server to answer.
        (api_ready,) = _starts(api_log)
        assert starts[0] >= api_ready
        # Backoff doubles while it keeps exiting soon after starting: 1 s, then 2 s.
        assert 0.9 <= starts[1] - starts[0] < 5 and 1.9 <= starts[2] - starts[1] < 7
        time.sleep(1.0)  # the state is written after each change
        pids = json.loads(state.read_text())["components"]
        assert all(psutil.pid_exists(pid) for pid in pids.values()), pids
        assert health.dead_processes(str(state)) == []
    finally:
        stopping.set()
        supervisor.join(timeout=60)
    out = capsys.readouterr().out
    assert "scheduler exited with 3" in out and "restarting it in 1 s" in out
    assert "restarting it in 2 s" in out and "restarted scheduler" in out
    assert "every component stopped" in out
    assert not any(c.alive() for c in components)
    # Once stopped, the state still names the last pids: all dead now.
    assert health.dead_processes(str(state)) == [
        "api-server (process exited)",
        "scheduler (process exited)",
    ]


def test_backoff_doubles_to_a_minute() -> None:
    assert [standalone.backoff_s(n) for n in (1, 2, 3, 4, 7, 8, 30)] == [1, 2, 4, 8, 60, 60, 60]


def test_a_process_that_is_gone_or_waiting_to_restart_is_unhealthy_at_once(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    gone = psutil.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    state.write_text(
        json.dumps(
            {
                "supervisor": psutil.Process().pid,
                "components": {
                    "api-server": psutil.Process().pid,
                    "scheduler": gone.pid,
                    "triggerer": "restarting",
                    "dag-processor": "starting",
                },
            }
        )
    )
    assert health.dead_processes(str(state)) == [
        "scheduler (process exited)",
        "triggerer (restarting)",
        "dag-processor (starting)",
    ]
    assert health.dead_processes(str(tmp_path / "absent.json")) == []
