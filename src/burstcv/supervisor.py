"""Supervise what the embedded default runs: Airflow's components (`make airflow`) and the
prediction service (`make serve`).

Each child runs in a process group of its own. One that exits, stops (SIGSTOP), or whose probe
goes stale is ended with its whole group (a scheduler's executor workers with it) and started
again after a backoff, with one log line naming it, why, and its restart count. Every group
started is recorded in the state file (``SupervisorState``), so ``stop`` ends them whether or
not the supervisor still lives, and a supervisor that died leaves nothing nobody can end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Literal

import httpx
import psutil

from burstcv_spec.contracts import (
    ArtifactError,
    ProcessGroup,
    SupervisorState,
    read_artifact,
    write_artifact,
)

# Probe answers: True, progress; False, none; None, cannot tell (what it depends on is down).
Probe = Callable[[], bool | None]

STOPPED_S = 5.0  # a leader stopped (SIGSTOP) this long is hung
STABLE_S = 120.0  # a child that ran this long before ending restarts after the shortest backoff
MAX_BACKOFF_S = 60.0
END_GRACE_S = 5.0  # SIGTERM to SIGKILL, for a group whose leader exited or a stop
STOP_GRACE_S = 20.0  # the children's grace on a stop
TICK_S = 0.25
PROBE_EVERY_S = 1.0
FIRST_READY_S = 180.0  # how long the others wait for the first child's probe


def _say(name: str, line: str) -> None:
    sys.stdout.write(f"{name:<13} | {line}\n")
    sys.stdout.flush()


def _relay(name: str, stream: IO[bytes]) -> None:
    for raw in iter(stream.readline, b""):
        _say(name, raw.decode(errors="replace").rstrip())


def backoff_s(quick_ends: int) -> float:
    """Return the wait before a restart: doubling with each quick end in a row, capped."""
    return float(min(MAX_BACKOFF_S, 2 ** max(0, quick_ends - 1)))


def group_members(group: ProcessGroup) -> list[psutil.Process]:
    """Return the live processes of ``group`` (none started before it: a reused id is not ours)."""
    found = []
    for proc in psutil.process_iter(["create_time"]):
        try:
            ours = os.getpgid(proc.pid) == group.pgid and proc.info["create_time"] >= group.started
            if ours and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def end_group(group: ProcessGroup, grace_s: float) -> int:
    """End every process of ``group``: SIGTERM (and SIGCONT), then SIGKILL after ``grace_s``;
    return how many there were."""
    members = group_members(group)
    for sig in (signal.SIGTERM, signal.SIGCONT) if grace_s > 0 else ():
        for proc in members:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)
    _, alive = psutil.wait_procs(members, timeout=grace_s) if grace_s > 0 else ([], members)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    return len(members)


@dataclass
class Child:
    """One supervised program, its probe, and what the supervisor knows of it."""

    name: str
    argv: list[str]
    probe: Probe | None = None
    stale_s: float = 30.0  # no progress this long (once it first made some): hung
    first_s: float = 120.0  # no progress this long after a start: hung
    proc: subprocess.Popen[bytes] | None = None
    group: ProcessGroup | None = None
    started_at: float = 0.0
    progress_at: float = 0.0  # time.monotonic() of the last good probe
    answered: bool = False  # the probe passed since the last start
    stopped_since: float | None = None
    restarts: int = 0
    quick_ends: int = 0
    restart_at: float | None = None

    def start(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a group of its own, ended whole
        )
        self.group = ProcessGroup(
            pgid=self.proc.pid, started=psutil.Process(self.proc.pid).create_time()
        )
        self.started_at = self.progress_at = time.monotonic()
        self.answered, self.stopped_since, self.restart_at = self.probe is None, None, None
        assert self.proc.stdout is not None
        threading.Thread(target=_relay, args=(self.name, self.proc.stdout), daemon=True).start()
        again = f"restarted {self.name} (pid {self.proc.pid}, restart {self.restarts})"
        _say("burstcv", again if self.restarts else f"started {self.name} (pid {self.proc.pid})")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def state(self) -> int | Literal["starting", "restarting"]:
        if self.proc is not None and self.alive() and self.answered:
            return self.proc.pid
        return "restarting" if self.restarts or self.restart_at is not None else "starting"

    def observe(self, result: bool | None, now: float) -> None:
        """Take a probe's answer: progress (or no evidence) moves the clock on."""
        if result is not False:
            self.progress_at = now
            self.answered = self.answered or result is True

    def why_ended(self, now: float) -> str | None:
        """Return why this child must be ended now, or None while it is well."""
        if self.proc is None or self.restart_at is not None:
            return None
        if not self.alive():
            return f"exited with {self.proc.returncode}"
        try:
            stopped = psutil.Process(self.proc.pid).status() == psutil.STATUS_STOPPED
        except psutil.Error:
            stopped = False
        self.stopped_since = (self.stopped_since or now) if stopped else None
        if self.stopped_since is not None and now - self.stopped_since >= STOPPED_S:
            return f"stopped (not running) for {now - self.stopped_since:.0f} s"
        limit = self.stale_s if self.answered else self.first_s
        if now - self.progress_at > limit:
            return f"made no progress (its probe) for {now - self.progress_at:.0f} s"
        return None


@dataclass
class Supervisor:
    """Start children (the first alone, the rest once its probe passes), keep them going."""

    children: Sequence[Child]
    env: dict[str, str]
    state_path: str = ""
    stopping: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def write_state(self) -> None:
        if not self.state_path:
            return
        state = SupervisorState(
            supervisor=os.getpid(),
            components={c.name: c.state() for c in self.children},
            groups=[c.group for c in self.children if c.group is not None],
        )
        with self.lock:
            try:
                write_artifact(self.state_path, state)
            except OSError as exc:  # supervising goes on; `stop` reads the last one written
                _say("burstcv", f"could not write {self.state_path}: {exc}")

    def _probe_loop(self) -> None:
        while not self.stopping.is_set():
            for child in self.children:
                if child.probe is not None and child.alive() and child.restart_at is None:
                    result = child.probe()
                    was = child.answered
                    child.observe(result, time.monotonic())
                    if child.answered and not was:
                        self.write_state()
            self.stopping.wait(PROBE_EVERY_S)

    def _end(self, child: Child, why: str, now: float) -> None:
        """End ``child`` with its group and schedule its restart, saying so."""
        ran_s = now - child.started_at
        child.quick_ends = child.quick_ends + 1 if ran_s < STABLE_S else 1
        child.restarts += 1
        delay = backoff_s(child.quick_ends)
        exited = child.proc is not None and not child.alive()
        line = f"{child.name} {why} after {ran_s:.0f} s"
        child.restart_at = now + delay
        self.write_state()  # "restarting" before the group's grace runs
        if child.group is not None and child.proc is not None:
            ended = end_group(child.group, END_GRACE_S if exited else 0)
            if ended and exited:
                line += f"; ended the {ended} process(es) it left in its group"
            child.proc.wait()
        _say("burstcv", f"{line}; restart {child.restarts} in {delay:.0f} s")

    def tick(self) -> None:
        """End each child that must be, restart each that is due."""
        changed = False
        for child in self.children:
            now = time.monotonic()
            why = child.why_ended(now)
            if why is not None:
                self._end(child, why, now)
                changed = True
            elif child.restart_at is not None and now >= child.restart_at:
                child.start(self.env)
                changed = True
        if changed:
            self.write_state()

    def run(self) -> None:
        first, rest = self.children[0], self.children[1:]
        first.start(self.env)
        self.write_state()
        threading.Thread(target=self._probe_loop, daemon=True).start()
        since = time.monotonic()
        while rest and not self.stopping.is_set() and not first.answered:
            if time.monotonic() - since > FIRST_READY_S:
                _say("burstcv", f"{first.name} not up after {FIRST_READY_S:.0f} s; going on")
                break
            self.tick()
            self.stopping.wait(TICK_S)
        for child in rest:
            if not self.stopping.is_set():
                child.start(self.env)
        self.write_state()
        while not self.stopping.is_set():
            self.tick()
            self.stopping.wait(TICK_S)
        self.stop()

    def stop(self) -> None:
        for child in self.children:
            if child.alive() and child.proc is not None:
                child.proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            if child.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if child.group is not None:
                end_group(child.group, 1.0)
        _say("burstcv", "every component stopped")


def http_answers(url: str, timeout_s: float) -> Probe:
    """Probe: any HTTP answer from ``url`` is progress (a 500 too: the process serves)."""

    def probe() -> bool:
        try:
            httpx.get(url, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return True

    return probe


def airflow_heartbeat(api_url: str, component: str) -> Probe:
    """Probe: the component's heartbeat, as the api-server's health answer judges it; None
    when that cannot say (no answer, or the metadata database itself unhealthy)."""
    from burstcv.airflow.health import check

    key = component.replace("-", "_")

    def probe() -> bool | None:
        try:
            bad = {b.split()[0] for b in check(api_url, timeout_s=5.0)}
        except (httpx.HTTPError, ValueError):
            return None
        return None if "metadatabase" in bad else key not in bad

    return probe


def airflow_children() -> list[Child]:
    """Airflow's components as `make airflow` runs them, the api-server first."""
    from burstcv.airflow import standalone

    url = standalone.api_url()
    children = [
        Child(
            "api-server",
            [*standalone.airflow(), *standalone.COMPONENTS["api-server"]],
            http_answers(f"{url}/api/v2/monitor/health", 10.0),
            stale_s=90.0,
            first_s=FIRST_READY_S,
        )
    ]
    for name in ("scheduler", "dag-processor", "triggerer"):
        argv = [*standalone.airflow(), *standalone.COMPONENTS[name]]
        # Airflow calls a heartbeat older than 30 s unhealthy; a minute more of it is hung.
        children.append(Child(name, argv, airflow_heartbeat(url, name), 60.0, FIRST_READY_S))
    return children


def service_children() -> list[Child]:
    """The prediction service, probed on /healthz."""
    host = os.environ.get("BURSTCV_SERVING_HOST", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    port = os.environ.get("BURSTCV_SERVING_PORT", "8000")
    probe = http_answers(f"http://{host}:{port}/healthz", 2.0)
    argv = [sys.executable, "-m", "burstcv_serving"]
    return [Child("service", argv, probe, stale_s=15.0, first_s=90.0)]


def _read(state_path: str) -> SupervisorState | None:
    try:
        return read_artifact(state_path, SupervisorState)
    except (OSError, ArtifactError):
        return None


def _supervisor_alive(state: SupervisorState) -> bool:
    try:
        return bool(psutil.Process(state.supervisor).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def stop(state_path: str) -> Iterator[str]:
    """End the supervisor of ``state_path`` and every group it recorded, leader alive or not;
    yield what was ended. The state file goes once nothing recorded is left."""
    state = _read(state_path)
    if state is None:
        return
    if _supervisor_alive(state):
        os.kill(state.supervisor, signal.SIGTERM)
        try:
            psutil.Process(state.supervisor).wait(STOP_GRACE_S + END_GRACE_S + 5)
        except psutil.TimeoutExpired:
            os.kill(state.supervisor, signal.SIGKILL)
        except psutil.Error:
            pass
        yield f"supervisor (pid {state.supervisor})"
    for group in state.groups:
        if ended := end_group(group, END_GRACE_S):
            yield f"process group {group.pgid} ({ended} process(es))"
    Path(state_path).unlink(missing_ok=True)


def wait_up(state_path: str, within_s: float, extra: Callable[[], list[str]]) -> list[str]:
    """Return what is not up (empty: all is), waiting up to ``within_s`` while the supervisor
    lives (it starts, restarts or ends what is down) rather than calling that down."""
    from burstcv.airflow.health import dead_processes

    deadline = time.monotonic() + within_s
    while True:
        state = _read(state_path)
        if state is not None and not _supervisor_alive(state):
            return ["supervisor (not running)"]
        if state is None:  # not written yet
            bad = ["supervisor (no state yet)"]
        else:
            dead = dead_processes(state_path)
            named = {line.split()[0].replace("-", "_") for line in dead}
            bad = dead + [b for b in extra() if b.split()[0] not in named]
        if not bad or time.monotonic() > deadline:
            return bad
        time.sleep(1.0)


def _airflow_health(url: str) -> Callable[[], list[str]]:
    def extra() -> list[str]:
        from burstcv.airflow.health import check

        try:
            return check(url)
        except (httpx.HTTPError, ValueError) as exc:
            return [f"api-server (no health answer: {type(exc).__name__})"]

    return extra


def run(which: str, state_path: str) -> int:
    """Supervise ``which`` (airflow or serve) until SIGTERM or SIGINT."""
    env = dict(os.environ)
    if which == "airflow":
        from burstcv.airflow import standalone

        env.setdefault("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
        os.environ.update(env)
        standalone.prepare_login()
    children = airflow_children() if which == "airflow" else service_children()
    supervisor = Supervisor(children, env, state_path)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        supervisor.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    supervisor.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``run``, ``stop`` or ``up`` (exit 1 printing what is down, after waiting for restarts)."""
    parser = argparse.ArgumentParser(prog="python -m burstcv.supervisor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "stop", "up"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--state", required=True, help="the state file (JSON)")
        if name == "run":
            cmd.add_argument("which", choices=("airflow", "serve"))
        if name == "up":
            cmd.add_argument("--airflow", default="", help="the api-server's URL, for heartbeats")
            cmd.add_argument("--within", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.which, args.state)
    if args.command == "stop":
        for line in stop(args.state):
            sys.stdout.write(f">> ended {line}\n")
        return 0
    extra = _airflow_health(args.airflow) if args.airflow else list
    bad = wait_up(args.state, args.within, extra)
    if bad:
        sys.stdout.write(", ".join(bad) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
