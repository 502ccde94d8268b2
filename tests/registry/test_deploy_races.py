"""Overlapping deploys and rollbacks, run as real ``burstcv`` commands against a real service.

Each test runs the service (``python -m burstcv_serving``) and two ``burstcv promote`` /
``burstcv rollback`` processes at once, over a local-folder registry and an S3 one (moto in
server mode). The test holds the registry's alias lock while both commands stage their version,
so both are truly in flight together; releasing it lets them race for the move. Afterwards
production, the version the service answers with and the exit codes must agree, and the
registry's history must show every move, each replacing exactly what the one before wrote.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from test_deploy import MODEL, TOKEN, Service, running_service, write_model_dir
from test_registry_s3 import s3_root  # noqa: F401  (a fixture, used by name below)

from burstcv.registry.registry import PREVIOUS, PRODUCTION, Registry
from burstcv_spec import storage
from burstcv_spec.contracts import RegistryDecision

REPO_ROOT = Path(__file__).resolve().parents[2]
STAGE_WAIT_S = 60.0  # a busy 2-core box starts two Python CLIs and loads two models


@pytest.fixture(params=["local", "s3"])
def registry(request: pytest.FixtureRequest, tmp_path: Path) -> Registry:
    """Return an empty registry in a local folder or on S3 (moto)."""
    if request.param == "s3":
        # moto keeps one store per process: a fresh prefix keeps the tests apart.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        return Registry(f"{request.getfixturevalue('s3_root')}-{uuid.uuid4().hex[:8]}", MODEL)
    return Registry(str(tmp_path / "registry"), MODEL)


@dataclass
class Command:
    """A running ``burstcv`` command."""

    args: list[str]
    process: subprocess.Popen[str]
    rc: int | None = None
    stdout: str = ""
    stderr: str = ""

    @property
    def actor_suffix(self) -> str:
        """Return how this command's history events end their actor (its pid)."""
        return f":{self.process.pid}"

    def finish(self, timeout_s: float = 120) -> Command:
        """Wait for the command to exit and keep its exit code and output."""
        self.stdout, self.stderr = self.process.communicate(timeout=timeout_s)
        self.rc = self.process.returncode
        return self


def start(registry: Registry, services: list[Service], *args: str) -> Command:
    """Start ``burstcv <args>`` with the registry and the services in its environment."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT / "src"), str(REPO_ROOT / "serving"), os.environ.get("PYTHONPATH", "")]
        ),
        "BURSTCV_REGISTRY_URI": registry.root[: -len(MODEL) - 1],
        "BURSTCV_MODEL_NAME": MODEL,
        "BURSTCV_SERVING_URL": ",".join(s.url for s in services),
        "BURSTCV_SERVING_ADMIN_TOKEN": TOKEN,
        "BURSTCV_DEPLOY_VERIFY_TIMEOUT_S": "30",
    }
    process = subprocess.Popen(
        [sys.executable, "-c", "from burstcv.cli import app; app()", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    return Command(list(args), process)


def staged(service: Service) -> set[int]:
    """Return the versions the service holds staged now."""
    response = httpx.get(
        f"{service.url}/v1/admin/staged", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5
    )
    assert response.status_code == 200, response.text
    return set(response.json()["staged"])


def wait_staged(service: Service, versions: set[int], commands: list[Command]) -> None:
    """Wait until the service has staged ``versions`` (both commands are past their stage)."""
    deadline = time.monotonic() + STAGE_WAIT_S
    while not versions <= staged(service):
        for command in commands:
            assert command.process.poll() is None, command.finish().stderr
        assert time.monotonic() < deadline, f"{versions} not staged in {STAGE_WAIT_S}s"
        time.sleep(0.05)


@contextlib.contextmanager
def watching_production(registry: Registry) -> Iterator[set[int | None]]:
    """Read the production alias continuously; yield the set of versions it ever named."""
    seen: set[int | None] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            alias = registry.get_alias(PRODUCTION)
            seen.add(alias.version if alias else None)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield seen
    finally:
        stop.set()
        watcher.join()


def assert_all_agree(
    registry: Registry, service: Service, commands: list[Command], targets: dict[int, int]
) -> int:
    """Check production, the served version, exit codes and history agree; return production.

    ``targets`` maps each command's pid to the version it asked production to move to.
    """
    production = registry.get_alias(PRODUCTION)
    assert production is not None
    # The winner's reload answered before it exited 0: no polling lag to wait for.
    assert service.version() == production.version
    assert service.predicted_label() == str(production.version % 10)
    history = registry.history()
    moves = [e for e in history if e.alias == PRODUCTION and e.result == "moved"]
    # No lost update: every move replaced exactly what the move before it wrote.
    for before, after in itertools.pairwise(moves):
        assert after.from_version == before.to_version, (before, after)
    assert moves[-1].to_version == production.version
    for command in commands:
        pid = command.process.pid
        mine = [e for e in history if e.actor.endswith(command.actor_suffix)]
        moved = [e for e in mine if e.alias == PRODUCTION and e.result == "moved"]
        if command.rc == 0:
            assert [(e.to_version, e.action) for e in moved] == [
                (targets[pid], "rollback" if command.args[0] == "rollback" else "promote")
            ], mine
            assert command.stdout.startswith(f"production -> version {targets[pid]} ")
        else:
            assert command.rc == 1, command.stderr
            assert moved == [], mine  # a command that failed moved nothing
            assert {e.result for e in mine} <= {"refused", "conflict"} and mine
            last_line = command.stderr.strip().splitlines()[-1]
            assert last_line.startswith("error: ")
            if mine[-1].result == "refused":  # the service's words, as recorded
                assert mine[-1].detail in last_line
            else:  # "production holds version N, not ...": the CLI names N too
                holder = mine[-1].detail.split(",")[0].removeprefix("production holds ")
                assert f"moved to {holder} " in last_line
    return production.version


def register(registry: Registry, tmp_path: Path, seed: int) -> int:
    """Register a good model that answers class ``seed``."""
    return registry.register(
        str(write_model_dir(tmp_path / f"m{seed}", seed)), RegistryDecision(status="accepted")
    )


def damage(registry: Registry, version: int) -> None:
    """Overwrite a registered model file with other bytes of the same size."""
    uri = registry.version_uri(version, "model.onnx")
    data = storage.read_bytes(uri)
    storage.write_bytes(uri, bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize("first", ["failing", "succeeding"])
def test_a_failing_deploy_overlapping_a_succeeding_one(
    registry: Registry, tmp_path: Path, first: str
) -> None:
    registry.promote(register(registry, tmp_path, 1))
    damaged = register(registry, tmp_path, 2)
    damage(registry, damaged)  # after registration, as a bad disk or a bad copy would
    good = register(registry, tmp_path, 3)
    with running_service(registry, tmp_path) as service, watching_production(registry) as seen:
        with registry.aliases_locked("test"):
            if first == "failing":
                failing = start(registry, [service], "promote", str(damaged))
                time.sleep(0.3)
                succeeding = start(registry, [service], "promote", str(good))
            else:
                succeeding = start(registry, [service], "promote", str(good))
                wait_staged(service, {good}, [succeeding])
                failing = start(registry, [service], "promote", str(damaged))
            failing.finish()
            # The failing command told its reason while the succeeding one was in flight.
            assert succeeding.process.poll() is None
        succeeding.finish()
        commands = [failing, succeeding]
        targets = {failing.process.pid: damaged, succeeding.process.pid: good}
        assert (failing.rc, succeeding.rc) == (1, 0), failing.stderr + succeeding.stderr
        assert assert_all_agree(registry, service, commands, targets) == good
    assert damaged not in seen and seen == {1, good}
    reason = failing.stderr.strip().splitlines()[-1]
    assert reason.startswith(f"error: {service.url} cannot serve version {damaged}: HTTP 409:")
    assert "sha256 mismatch" in reason and reason.endswith("production left at version 1")
    assert registry.get_alias(PREVIOUS).version == 1  # type: ignore[union-attr]


def test_two_succeeding_deploys_racing(registry: Registry, tmp_path: Path) -> None:
    registry.promote(register(registry, tmp_path, 1))
    v2, v3 = register(registry, tmp_path, 2), register(registry, tmp_path, 3)
    with running_service(registry, tmp_path) as service:
        with registry.aliases_locked("test"):
            a = start(registry, [service], "promote", str(v2))
            b = start(registry, [service], "promote", str(v3))
            wait_staged(service, {v2, v3}, [a, b])
        a.finish(), b.finish()
        targets = {a.process.pid: v2, b.process.pid: v3}
        production = assert_all_agree(registry, service, [a, b], targets)
    winner, loser = (a, b) if production == v2 else (b, a)
    assert (winner.rc, loser.rc) == (0, 1), a.stderr + b.stderr
    assert loser.stderr.strip().splitlines()[-1] == (
        f"error: production was moved to version {production} while version "
        f"{targets[loser.process.pid]} was being staged; that move was left alone "
        "(run the command again to replace it)"
    )
    assert registry.get_alias(PREVIOUS).version == 1  # type: ignore[union-attr]


def test_a_rollback_during_a_deploy(registry: Registry, tmp_path: Path) -> None:
    registry.promote(register(registry, tmp_path, 1))
    registry.promote(register(registry, tmp_path, 2))
    v3 = register(registry, tmp_path, 3)
    with running_service(registry, tmp_path) as service:
        assert service.version() == 2
        with registry.aliases_locked("test"):
            deploying = start(registry, [service], "promote", str(v3))
            wait_staged(service, {v3}, [deploying])
            rolling_back = start(registry, [service], "rollback")
            wait_staged(service, {v3, 1}, [deploying, rolling_back])
        deploying.finish(), rolling_back.finish()
        targets = {deploying.process.pid: v3, rolling_back.process.pid: 1}
        production = assert_all_agree(registry, service, [deploying, rolling_back], targets)
    # Whichever took the lock first won; the other found production moved and left it.
    if production == v3:
        assert (deploying.rc, rolling_back.rc) == (0, 1)
        assert registry.get_alias(PREVIOUS).version == 2  # type: ignore[union-attr]
    else:
        assert (production, deploying.rc, rolling_back.rc) == (1, 1, 0)
        assert registry.get_alias(PREVIOUS).version == 2  # type: ignore[union-attr]
