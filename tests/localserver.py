"""Local servers for tests and benchmarks: a free 127.0.0.1 port, ready before use, stopped after.

- ``server_process``: any server command, run as its own process group until the block ends;
- ``prediction_service``: ``python -m burstcv_serving`` with ``BURSTCV_SERVING_*`` settings;
- ``moto_server``: the AWS emulator (moto in server mode), in this process.

Every one is a context manager: the server stops when the block ends, whether the test passed,
failed or was interrupted. A subprocess is also asked to stop (SIGTERM, Linux) if the process
that started it dies without cleaning up, so a killed test run leaves no server behind.

Importable by the tests (pytest puts tests/ on sys.path) and by the benchmarks in bench/,
which add tests/ to sys.path. ``free_port`` is the shipped code's (the latency gate uses it).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from burstcv import localports
from burstcv.gate.latency import free_port

__all__ = [
    "HOST",
    "LocalServer",
    "free_port",
    "moto_server",
    "prediction_service",
    "server_process",
    "start_process_group",
    "stop_process_groups",
]

HOST = localports.HOST  # 127.0.0.1: nothing started here listens beyond this machine
REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 60.0  # a busy shared 2-core machine starts Python servers slowly
STOP_TIMEOUT_S = 10.0  # then SIGKILL
LOG_TAIL_CHARS = 4000

log = logging.getLogger(__name__)


@dataclass
class LocalServer:
    """A server process running on ``HOST``: its base URL, port, process and log file."""

    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """Return the end of what the server wrote (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""


def _die_with_parent() -> Any:
    """Return a preexec_fn that has Linux SIGTERM the child when its parent dies, or None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    prctl = libc.prctl  # looked up here, not in the forked child
    pr_set_pdeathsig = 1

    def set_pdeathsig() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return set_pdeathsig


def start_process_group(
    command: Sequence[str],
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``command`` as the leader of a process group of its own, logging to ``log_path``.

    Its own group: ``stop_process_groups`` stops it with its children, and a Ctrl-C meant for
    the test run reaches the test run only (which then stops it). Standard input is closed.
    """
    with log_path.open("wb") as log:  # the child keeps its own handle
        return subprocess.Popen(
            list(command),
            env=dict(os.environ if env is None else env),
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent(),  # calls prctl only (see there)
        )


def stop_process_groups(
    processes: Iterable[subprocess.Popen[bytes]], grace_s: float = STOP_TIMEOUT_S
) -> None:
    """Stop each process's group: SIGTERM to all, ``grace_s`` for them to exit, then SIGKILL.

    The SIGKILL goes to every group even when its leader exited in time: a group may outlive
    its leader (task runners, worker processes).
    """
    processes = list(processes)
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s; killing it", process.args, grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)


def _ready(server: LocalServer, ready_path: str | None) -> bool:
    """Return True once GET ``ready_path`` answers 200 (None: once the port is listened on)."""
    if ready_path is None:
        return localports.listener(server.port) is not None
    try:
        return httpx.get(f"{server.url}{ready_path}", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


def _check_ours(server: LocalServer) -> None:
    """Raise unless the listener on the port is the process started (or one of its children).

    A free port is free only when it is picked: another program may take it before the
    server binds it, and would then answer the readiness check in its place.
    """
    holder = localports.listener(server.port)
    if holder is None or holder.pid is None:  # gone already, or this user cannot tell
        return
    family = {server.process.pid}
    with contextlib.suppress(psutil.NoSuchProcess):
        family |= {
            child.pid for child in psutil.Process(server.process.pid).children(recursive=True)
        }
    if holder.pid not in family:
        raise RuntimeError(
            f"port {server.port} is answered by {holder.describe()}, not by the server started "
            f"(pid {server.process.pid}); its log:\n{server.log_tail()}"
        )


@contextlib.contextmanager
def server_process(
    command: Sequence[str],
    *,
    port: int,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    ready_path: str | None = "/readyz",
    timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[LocalServer]:
    """Run ``command`` (a server that listens on ``HOST``:``port``) until the block ends.

    Waits until GET ``ready_path`` answers 200 (None: until the port accepts connections),
    failing at once if the process exits first, and yields the running server. The process
    runs in its own process group, which is stopped as a whole (children included) when the
    block ends, however it ends; its output goes to ``log_path`` (a temporary file if None),
    whose end is printed when the block raises, so a failing test shows the server's side.
    """
    with contextlib.ExitStack() as stack:
        if log_path is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="localserver-"))
            log_path = Path(folder) / "server.log"
        process = start_process_group(command, log_path=log_path, env=env)
        server = LocalServer(f"http://{HOST}:{port}", port, process, log_path)
        try:
            _wait_ready(server, ready_path, timeout_s)
            try:
                yield server
            except BaseException:
                print(f"--- log of {' '.join(command)} (port {port}) ---\n{server.log_tail()}")
                raise
        finally:
            stop_process_groups([process])


def _wait_ready(server: LocalServer, ready_path: str | None, timeout_s: float) -> None:
    """Wait until the server is ready and is the one answering; raise with its log if not."""
    deadline = time.monotonic() + timeout_s
    while not _ready(server, ready_path):
        if server.process.poll() is not None:
            raise RuntimeError(
                f"{server.process.args[0]} exited with code {server.process.returncode} before "
                f"it was ready on port {server.port}; its log:\n{server.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{server.url}{ready_path or ''} was not ready after {timeout_s:.0f} s; "
                f"the server's log:\n{server.log_tail()}"
            )
        time.sleep(0.1)
    _check_ours(server)


@contextlib.contextmanager
def prediction_service(
    settings: Mapping[str, object],
    *,
    log_path: Path | None = None,
    ready_path: str = "/readyz",
    timeout_s: float = READY_TIMEOUT_S,
    serving_dir: Path | str = REPO_ROOT / "serving",
    port: int | None = None,
) -> Iterator[LocalServer]:
    """Run ``python -m burstcv_serving`` on a free ``HOST`` port until the block ends.

    ``settings`` become ``BURSTCV_SERVING_<NAME>`` variables (``{"POLL_INTERVAL_S": 0}``);
    the rest of the environment is inherited, with the host and port set here and the log
    level at warning unless a setting says otherwise. The service package is imported from
    ``serving_dir`` (another checkout's, to compare versions) with the burstcv_spec beside it.
    ``ready_path="/healthz"`` waits for the process only, not for a model. ``port`` names the
    port (a service restarted where clients already call it); by default a free one.
    """
    port = port or free_port()
    serving_dir = Path(serving_dir)
    path = [str(serving_dir), str(serving_dir.parent / "spec"), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        "BURSTCV_SERVING_LOG_LEVEL": "warning",
        **{f"BURSTCV_SERVING_{name.upper()}": str(value) for name, value in settings.items()},
        "BURSTCV_SERVING_HOST": HOST,
        "BURSTCV_SERVING_PORT": str(port),
    }
    with server_process(
        [sys.executable, "-m", "burstcv_serving"],
        port=port,
        env=env,
        log_path=log_path,
        ready_path=ready_path,
        timeout_s=timeout_s,
    ) as server:
        yield server


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Run the AWS emulator on a ``HOST`` port the system picks; yield its URL, then stop it.

    moto keeps one store per process: reset it (POST /moto-api/reset) or use fresh names
    between tests that share a server.
    """
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    server = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def use_moto(url: str, monkeypatch: Any, region: str = "us-east-1") -> None:
    """Empty the emulator at ``url`` and point boto3 at it for one test (via ``monkeypatch``).

    moto keeps its state per process, so every test starts from nothing.
    """
    import urllib.request

    reset = urllib.request.Request(f"{url}/moto-api/reset", method="POST")
    # The emulator shares this process with the test: on a busy machine a reset can wait long.
    urllib.request.urlopen(reset, timeout=120).close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", region)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
