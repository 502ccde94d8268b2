"""`make airflow`'s health check: a component whose recorded process is gone, stopped or
waiting to restart is unhealthy at once (a heartbeat would stay fresh for half a minute)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import psutil

from burstcv.airflow import health


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


def test_a_stopped_process_is_not_alive() -> None:
    child = psutil.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert health._alive(child.pid)
        child.send_signal(signal.SIGSTOP)
        psutil.wait_procs([child], timeout=0.5)
        for _ in range(50):
            if child.status() == psutil.STATUS_STOPPED:
                break
            psutil.wait_procs([child], timeout=0.1)
        assert not health._alive(child.pid)
    finally:
        child.kill()
        child.wait()
