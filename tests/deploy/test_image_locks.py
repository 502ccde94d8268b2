"""The images' locks (docker/locks.py): current, exact, torch only where it trains.

docker/requirements-runtime.txt is what every Airflow image installs, docker/requirements-train.txt
what the worker adds; both are generated from requirements.txt, the lock the tests run with.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
LOCKS = REPO / "docker" / "locks.py"
DEV_LOCK = REPO / "requirements.txt"
RUNTIME_LOCK = REPO / "docker" / "requirements-runtime.txt"
TRAIN_LOCK = REPO / "docker" / "requirements-train.txt"
DOCKERFILE = REPO / "docker" / "airflow.Dockerfile"
# Never in the runtime image: training (the worker's), CUDA, and the development tools.
NOT_AT_RUNTIME = ("torch", "torchvision", "pytest", "moto", "mypy", "ruff", "podman-compose")
CUDA_PREFIXES = ("nvidia-", "triton", "cuda-")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.!+_-]+)$")


def lock_lines(path: Path) -> list[str]:
    """Return the requirement lines of a lock (comments and blank lines skipped)."""
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def pins(path: Path) -> dict[str, str]:
    """Return {canonical name: version} of a lock whose every line is ``name==version``."""
    out: dict[str, str] = {}
    for line in lock_lines(path):
        match = _PIN.match(line)
        assert match, f"{path.name}: not name==version: {line!r}"
        name = canonicalize_name(match.group(1))
        assert name not in out, f"{path.name}: {name} pinned twice"
        out[name] = match.group(2)
    return out


def run_locks(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )


def test_the_locks_are_current() -> None:
    result = run_locks(LOCKS, "--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_reports_a_stale_lock_and_a_rewrite_restores_it(tmp_path: Path) -> None:
    # A copy of the generator in a tree of its own (it finds the repo from its own path).
    (tmp_path / "docker").mkdir()
    for path in (LOCKS, DEV_LOCK, REPO / "pyproject.toml", RUNTIME_LOCK, TRAIN_LOCK):
        shutil.copy(path, tmp_path / path.relative_to(REPO))
    script = tmp_path / "docker" / "locks.py"
    runtime = tmp_path / "docker" / "requirements-runtime.txt"
    stale = runtime.read_text().replace("\ntyper==", "\n# typer==")
    assert stale != runtime.read_text()
    runtime.write_text(stale)
    checked = run_locks(script, "--check")
    assert checked.returncode == 1
    assert "requirements-runtime.txt" in checked.stdout
    assert "requirements-train.txt" not in checked.stdout
    assert runtime.read_text() == stale  # --check writes nothing
    rewritten = run_locks(script)
    assert rewritten.returncode == 0, rewritten.stderr
    assert runtime.read_text() == RUNTIME_LOCK.read_text()
    assert run_locks(script, "--check").returncode == 0


def test_the_runtime_lock_has_no_torch_cuda_or_test_tools() -> None:
    runtime = pins(RUNTIME_LOCK)
    assert not set(runtime) & {canonicalize_name(n) for n in NOT_AT_RUNTIME}
    assert not [name for name in runtime if name.startswith(CUDA_PREFIXES)]
    # What the stack needs beyond the code's imports: Airflow, the CeleryExecutor, PostgreSQL.
    for name in ("apache-airflow", "apache-airflow-providers-celery", "redis", "psycopg2-binary"):
        assert name in runtime, name


def test_the_train_lock_has_cpu_torch_at_the_dev_lock_versions() -> None:
    train, dev = pins(TRAIN_LOCK), pins(DEV_LOCK)
    assert train["torch"] == dev["torch"]
    assert train["torchvision"] == dev["torchvision"]
    assert not [name for name in train if name.startswith(CUDA_PREFIXES)]
    # It adds to the runtime lock (installed with it as constraints), never repeats it.
    assert not set(train) & set(pins(RUNTIME_LOCK))


@pytest.mark.parametrize("lock", [RUNTIME_LOCK, TRAIN_LOCK], ids=lambda p: p.name)
def test_every_line_pins_the_dev_lock_version(lock: Path) -> None:
    dev = pins(DEV_LOCK)
    locked = pins(lock)
    assert locked
    for name, version in locked.items():
        assert name in dev, f"{lock.name}: {name} is not in requirements.txt"
        assert version == dev[name], f"{lock.name}: {name}=={version}, requirements.txt {dev[name]}"


def test_torch_is_the_train_extra_only() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    dependencies = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    assert not dependencies & {"torch", "torchvision"}
    train = {
        canonicalize_name(Requirement(r).name) for r in project["optional-dependencies"]["train"]
    }
    assert {"torch", "torchvision"} <= train


def test_the_images_airflow_and_python_are_the_locks() -> None:
    text = DOCKERFILE.read_text()
    image = re.search(r"^ARG AIRFLOW_IMAGE=apache/airflow:(\S+)-python(\d+\.\d+)$", text, re.M)
    version = re.search(r"^ARG AIRFLOW_VERSION=(\S+)$", text, re.M)
    assert image and version
    airflow = pins(DEV_LOCK)["apache-airflow"]
    assert image.group(1) == version.group(1) == airflow
    # The locks' environment markers are evaluated on this interpreter: the image's must match.
    assert image.group(2) == f"{sys.version_info.major}.{sys.version_info.minor}"
