"""Run and supervise Airflow's components on this machine for `make airflow`, nothing
listening beyond it.

What ``airflow standalone`` does, except that: the scheduler and triggerer skip their log
servers (which bind every interface; the api-server reads the logs from disk); the others
start once the api-server answers (a task queued at start-up reports to it); and a component
that exits restarts after a backoff. Their pids go to ``BURSTCV_AIRFLOW_STATE`` (JSON, when
set) for ``burstcv.airflow.health``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Literal

import httpx

log = logging.getLogger(__name__)

COMPONENTS: dict[str, tuple[str, ...]] = {
    "api-server": ("api-server",),
    "scheduler": ("scheduler", "--skip-serve-logs"),
    "dag-processor": ("dag-processor",),
    "triggerer": ("triggerer", "--skip-serve-logs"),
}
STOP_GRACE_S = 20.0
# How long the others wait for the api-server to answer before starting anyway.
FIRST_READY_S = 180.0
# A component that ran this long before exiting restarts after the shortest backoff again.
STABLE_S = 120.0
MAX_BACKOFF_S = 60.0
SUPERVISE_EVERY_S = 0.5


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


def api_url() -> str:
    """Return the api-server's address from Airflow's configuration ([api] host and port)."""
    from airflow.configuration import conf

    host = conf.get("api", "host", fallback="127.0.0.1") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{conf.getint('api', 'port', fallback=8080)}"


def answers(url: str) -> bool:
    """Return whether the api-server answers its health endpoint (whatever it says)."""
    try:
        return httpx.get(f"{url}/api/v2/monitor/health", timeout=5.0).status_code < 500
    except httpx.HTTPError:
        return False


@dataclass
class Component:
    """One supervised child: its command, its process, and when it may start again."""

    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    quick_exits: int = 0  # exits in a row, each sooner than STABLE_S after its start
    restart_at: float | None = None  # time.monotonic() of the next start, once it exited

    def start(self, env: dict[str, str], verb: str = "started") -> None:
        self.proc = subprocess.Popen(
            self.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.started_at, self.restart_at = time.monotonic(), None
        assert self.proc.stdout is not None
        threading.Thread(target=_relay, args=(self.name, self.proc.stdout), daemon=True).start()
        _say("burstcv", f"{verb} {self.name} (pid {self.proc.pid})")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def backoff_s(quick_exits: int) -> float:
    """Return the wait before a restart: doubling with each quick exit in a row, capped."""
    return float(min(MAX_BACKOFF_S, 2 ** max(0, quick_exits - 1)))


def _state(component: Component) -> int | Literal["starting", "restarting"]:
    """Return a component's pid, or "starting" (never started) or "restarting" (it exited)."""
    if component.proc is None:
        return "starting"
    return component.proc.pid if component.alive() else "restarting"


def _write_state(path: str, components: Sequence[Component]) -> None:
    """Write each component's pid, or why it has none, atomically."""
    if not path:
        return
    from burstcv_spec.contracts import SupervisorState, write_artifact

    state = SupervisorState(
        supervisor=os.getpid(), components={c.name: _state(c) for c in components}
    )
    write_artifact(path, state)  # atomically: a reader never finds it half-written


def supervise(
    components: Sequence[Component],
    *,
    env: dict[str, str],
    ready: Callable[[], bool],
    stopping: threading.Event,
    state_path: str = "",
) -> None:
    """Start ``components`` (the first alone, the rest once ``ready()``), restart any that
    exits, until ``stopping`` is set; then stop them all."""
    first = components[0]
    first.start(env)
    _write_state(state_path, components)
    waited_since = time.monotonic()
    while not stopping.is_set() and first.alive() and not ready():
        if time.monotonic() - waited_since > FIRST_READY_S:
            _say(
                "burstcv",
                f"{first.name} does not answer after {FIRST_READY_S:.0f} s; "
                "starting the others anyway",
            )
            break
        stopping.wait(0.5)
    for component in components[1:]:
        if stopping.is_set():
            break
        component.start(env)
    _write_state(state_path, components)
    while not stopping.is_set():
        if _restart_exited(components, env):
            _write_state(state_path, components)
        stopping.wait(SUPERVISE_EVERY_S)
    _stop(components)


def _restart_exited(components: Sequence[Component], env: dict[str, str]) -> bool:
    """Schedule the restart of each component that exited, or restart it when due; return
    whether any changed."""
    changed = False
    now = time.monotonic()
    for component in components:
        if component.proc is None or component.alive():
            continue
        if component.restart_at is None:
            ran_s = now - component.started_at
            component.quick_exits = component.quick_exits + 1 if ran_s < STABLE_S else 1
            delay = backoff_s(component.quick_exits)
            component.restart_at = now + delay
            _say(
                "burstcv",
                f"{component.name} exited with {component.proc.returncode} after "
                f"{ran_s:.0f} s; restarting it in {delay:.0f} s",
            )
            changed = True
        elif now >= component.restart_at:
            component.start(env, "restarted")
            changed = True
    return changed


def _stop(components: Sequence[Component]) -> None:
    """Terminate every component, and kill any still running after STOP_GRACE_S."""
    for component in components:
        if component.alive() and component.proc is not None:
            component.proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for component in components:
        if component.proc is None:
            continue
        try:
            component.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            component.proc.kill()
            component.proc.wait()
    _say("burstcv", "every component stopped")


def run(components: Sequence[str] = tuple(COMPONENTS)) -> int:
    """Start the components (the api-server first) and supervise them until told to stop."""
    env = dict(os.environ)
    env.setdefault("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    os.environ.update(env)
    prepare_login()
    url = api_url()
    stopping = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # The api-server first: the others' tasks report to the execution API it serves.
    ordered = sorted(components, key=lambda name: name != "api-server")
    supervise(
        [Component(name, [*_airflow(), *COMPONENTS[name]]) for name in ordered],
        env=env,
        ready=lambda: answers(url),
        stopping=stopping,
        state_path=os.environ.get("BURSTCV_AIRFLOW_STATE", ""),
    )
    return 0


if __name__ == "__main__":
    sys.exit(run())
