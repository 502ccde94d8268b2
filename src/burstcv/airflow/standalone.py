"""Run Airflow's components on this machine for `make airflow`, nothing listening beyond it.

What ``airflow standalone`` does, with one difference: the scheduler and the triggerer start
with ``--skip-serve-logs``. Their log servers bind every interface (Airflow hard-codes the
host) and serve task logs to the network; on one machine sharing one ``AIRFLOW_HOME`` the
api-server reads task and trigger logs from disk, so they are not needed. The api-server binds
``[api] host`` and ``port`` (127.0.0.1 and ``AIRFLOW_PORT`` under make).

The components run as children in this process's group, each output line prefixed with its
name; SIGTERM (``make airflow-stop``) ends them all. A component that dies is not restarted
here: ``make airflow`` sees it in the health check and restarts the whole set.

    python -m burstcv.airflow.standalone
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import IO

log = logging.getLogger(__name__)

COMPONENTS: dict[str, tuple[str, ...]] = {
    "api-server": ("api-server",),
    "scheduler": ("scheduler", "--skip-serve-logs"),
    "dag-processor": ("dag-processor",),
    "triggerer": ("triggerer", "--skip-serve-logs"),
}
STOP_GRACE_S = 20.0


def _airflow() -> list[str]:
    """Return the command that runs this environment's Airflow CLI (its ``airflow`` script)."""
    script = Path(sys.executable).parent / "airflow"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "airflow"]


def _say(name: str, line: str) -> None:
    sys.stdout.write(f"{name:<13} | {line}\n")
    sys.stdout.flush()


def _relay(name: str, stream: IO[bytes]) -> None:
    """Copy a component's output to ours, a line at a time, prefixed with its name."""
    for raw in iter(stream.readline, b""):
        _say(name, raw.decode(errors="replace").rstrip())


def prepare_login() -> None:
    """Generate the admin password the UI asks for, as standalone does (once per home)."""
    from airflow.api_fastapi.app import create_auth_manager
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
    from airflow.configuration import conf

    if conf.get("core", "simple_auth_manager_all_admins").lower() == "true":
        return
    manager = create_auth_manager()
    if not isinstance(manager, SimpleAuthManager):
        return  # another auth manager: its own users
    if not os.path.exists(manager.get_generated_password_file()):
        manager.init()


def run(components: Sequence[str] = tuple(COMPONENTS)) -> int:
    """Start the components and wait; return when told to stop or when all have exited."""
    env = dict(os.environ)
    env.setdefault("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    os.environ.update(env)
    prepare_login()
    children: dict[str, subprocess.Popen[bytes]] = {}
    for name in components:
        child = subprocess.Popen(
            [*_airflow(), *COMPONENTS[name]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        children[name] = child
        assert child.stdout is not None
        threading.Thread(target=_relay, args=(name, child.stdout), daemon=True).start()
        _say("burstcv", f"started {name} (pid {child.pid})")

    stopping = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    reported: set[str] = set()
    while not stopping.is_set() and any(c.poll() is None for c in children.values()):
        for name, child in children.items():
            if child.poll() is not None and name not in reported:
                reported.add(name)
                _say(
                    "burstcv",
                    f"{name} exited with {child.returncode}; "
                    "make airflow restarts Airflow when a component is down",
                )
        stopping.wait(1.0)
    for child in children.values():
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children.values():
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    _say("burstcv", "every component stopped")
    return 0


if __name__ == "__main__":
    sys.exit(run())
