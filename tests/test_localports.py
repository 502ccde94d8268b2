"""A busy port is named, not misread: the checks `make serve` and `make airflow` run."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from localserver import HOST, LocalServer, free_port, server_process

from burstcv import localports


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the check as the Makefile does."""
    return subprocess.run(
        [sys.executable, "-m", "burstcv.localports", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def dummy_listener() -> Iterator[int]:
    """Listen on a free 127.0.0.1 port in this process (another program, to the check)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def http_server(registry: Path) -> contextlib.AbstractContextManager[LocalServer]:
    """Run a real HTTP server on a free port, with the service's registry variable set."""
    port = free_port()
    return server_process(
        [sys.executable, "-m", "http.server", str(port), "--bind", HOST],
        port=port,
        env={**os.environ, localports.REGISTRY_ENV: str(registry)},
        ready_path=None,
    )


def test_a_taken_port_is_named_with_its_holder_and_how_to_choose_another(
    dummy_listener: int,
) -> None:
    done = run("free", str(dummy_listener), "--var", "SERVE_PORT", "--what", "the service")
    assert done.returncode == 1
    message = done.stderr.strip()
    assert message.startswith(
        f">> cannot start the service: port {dummy_listener} on 127.0.0.1 is already in use "
        f"by pid {os.getpid()} ("
    )
    assert "stop it, or choose another port: make serve SERVE_PORT=" in message
    suggested = int(message.rsplit("SERVE_PORT=", 1)[1])
    assert suggested != dummy_listener and localports.listener(suggested) is None
    assert len(done.stderr.splitlines()) == 1


def test_a_free_port_passes() -> None:
    assert run("free", str(free_port()), "--var", "SERVE_PORT").returncode == 0


def test_the_started_process_must_be_the_one_answering(tmp_path: Path) -> None:
    with http_server(tmp_path / "registry") as server:
        port, pid = server.port, server.process.pid
        ours = run("ours", str(port), "--pid", str(pid), "--var", "SERVE_PORT")
        assert ours.returncode == 0, ours.stderr
        same_registry = run(
            "ours", str(port), "--pid", str(pid), "--var", "SERVE_PORT",
            "--registry", str(tmp_path / "registry" / "." ),
        )  # fmt: skip
        assert same_registry.returncode == 0, same_registry.stderr
        # A service of another checkout: right process, wrong registry.
        other = run(
            "ours", str(port), "--pid", str(pid), "--var", "SERVE_PORT",
            "--registry", str(tmp_path / "mine"),
        )  # fmt: skip
        assert other.returncode == 1
        assert f"reads registry {tmp_path / 'registry'}, not this checkout's" in other.stderr
        # What make started failed to bind and exited: the answer on the port is not ours.
        exited = subprocess.Popen([sys.executable, "-c", "pass"])
        exited.wait()
        taken = run(
            "ours", str(port), "--pid", str(exited.pid), "--var", "AIRFLOW_PORT",
            "--target", "airflow",
        )  # fmt: skip
        assert taken.returncode == 1
        assert f"port {port} on 127.0.0.1 is answered by pid {pid} (" in taken.stderr
        assert f"not by the process just started (pid {exited.pid}, which has exited)" in (
            taken.stderr
        )
        assert "make airflow AIRFLOW_PORT=" in taken.stderr


def test_a_child_of_the_started_process_counts_as_ours() -> None:
    # `airflow standalone` listens from a child process (its api-server).
    port = free_port()
    parent = [
        sys.executable,
        "-c",
        "import subprocess, sys; subprocess.run([sys.executable, '-m', 'http.server', "
        f"'{port}', '--bind', '{HOST}'])",
    ]
    with server_process(parent, port=port, ready_path=None) as server:
        done = run("ours", str(port), "--pid", str(server.process.pid), "--var", "AIRFLOW_PORT")
        assert done.returncode == 0, done.stderr


def test_make_serve_stops_at_once_on_a_busy_port(dummy_listener: int) -> None:
    venv = Path(sys.prefix)
    stamp = venv / ".stamp"
    if shutil.which("make") is None or not stamp.exists():
        pytest.skip("needs make and a venv built by `make setup`")
    repo = Path(__file__).resolve().parents[1]
    started = time.monotonic()
    done = subprocess.run(
        # -o: the venv counts as up to date (never rebuilt by this test).
        ["make", "-s", "-o", str(stamp), f"VENV={venv}", "serve", f"SERVE_PORT={dummy_listener}"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert f"port {dummy_listener} on 127.0.0.1 is already in use by pid {os.getpid()}" in (
        done.stderr
    )
    assert "make serve SERVE_PORT=" in done.stderr and "service on" not in done.stdout
    assert time.monotonic() - started < 60  # at once, not after a health-check timeout


@pytest.mark.parametrize(("target", "var"), [("serve", "SERVE_PORT"), ("airflow", "AIRFLOW_PORT")])
def test_a_busy_port_stops_the_target_before_any_setup(
    dummy_listener: int, tmp_path: Path, target: str, var: str
) -> None:
    """A fresh clone (no venv yet) learns of the busy port at once, not after the build."""
    if shutil.which("make") is None:
        pytest.skip("needs make")
    repo = Path(__file__).resolve().parents[1]
    venv = tmp_path / "venv-not-built"
    done = subprocess.run(
        # The bare interpreter the Makefile would build the venv with (no psutil in it).
        [
            "make",
            "-s",
            f"VENV={venv}",
            f"VAR={tmp_path / 'var'}",
            target,
            f"{var}={dummy_listener}",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert f"port {dummy_listener} on 127.0.0.1 is already in use" in done.stderr, done.stderr
    assert f"make {target} {var}=" in done.stderr
    assert not venv.exists(), "the venv build started before the port was checked"
