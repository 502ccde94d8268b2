"""Settings: every local default lives under one home, wherever the package is installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from burstcv.settings import Settings

REPO = Path(__file__).resolve().parents[1]
LOCAL_PATHS = ("artifact_root", "registry_uri", "dataset_uri", "compute_state_dir")


def test_the_home_is_burstcv_home_else_airflow_home_else_var_here(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in [n for n in os.environ if n.startswith("BURSTCV_")] + ["AIRFLOW_HOME"]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    assert Settings().home == str(tmp_path / "var")
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow"))
    assert Settings().home == str(tmp_path / "airflow" / "burstcv")
    monkeypatch.setenv("BURSTCV_HOME", "relative/home")  # resolved once, when read
    settings = Settings()
    assert settings.home == str(tmp_path / "relative" / "home")
    assert settings.artifact_root == str(tmp_path / "relative" / "home" / "artifacts")
    assert settings.dataset_uri == str(tmp_path / "relative" / "home" / "data" / "digits")
    monkeypatch.setenv("BURSTCV_REGISTRY_URI", "s3://bucket/registry")  # a path set alone wins
    assert Settings().registry_uri == "s3://bucket/registry"


def test_a_setting_that_became_a_run_parameter_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BURSTCV_EPOCHS", "3")
    with pytest.raises(ValueError, match=r"BURSTCV_EPOCHS \(now the run parameter epochs\)"):
        Settings()


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return a folder holding burstcv installed from a wheel (not editable, not the repo)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("src", "serving", "spec"):
        shutil.copytree(
            REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
        )
    target = tmp_path_factory.mktemp("site-packages")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    result = subprocess.run(
        [*pip, "--no-build-isolation", "--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return target


def run_installed(
    installed: Path, cwd: Path, args: list[str], **env: str
) -> subprocess.CompletedProcess[str]:
    """Run Python on the installed copy from ``cwd``, with no burstcv or Airflow variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("BURSTCV_", "AIRFLOW"))}
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(installed), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


WHERE = """
import json, burstcv
from burstcv.airflow.local_run import embedded_airflow_env
from burstcv.cost import pricing
from burstcv.settings import Settings
s = Settings()
print(json.dumps({
    "package": burstcv.__file__,
    "home": s.home,
    "paths": [s.artifact_root, s.registry_uri, s.dataset_uri, s.compute_state_dir],
    "price_table": str(pricing.PACKAGED_TABLE),
    "g6_price": pricing.hourly_price("g6.xlarge", "us-east-1", "on-demand"),
    "embedded": embedded_airflow_env(),
}))
"""


def where(installed: Path, cwd: Path, **env: str) -> dict[str, Any]:
    """Return where the installed package keeps things, run from ``cwd``."""
    result = run_installed(installed, cwd, ["-c", WHERE], **env)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout))


def test_an_installed_package_keeps_its_data_under_the_home_not_beside_its_code(
    installed: Path, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    found = where(installed, work)
    assert Path(found["package"]).is_relative_to(installed)  # the wheel's copy, not the repo
    assert found["home"] == str(work / "var")
    assert all(Path(p).is_relative_to(work / "var") for p in found["paths"]), found["paths"]
    # Package data travels with the code.
    assert Path(found["price_table"]).is_relative_to(installed) and found["g6_price"] > 0
    # No checkout: no DAG folder is guessed, and `burstcv run` says which setting to set.
    assert found["embedded"]["AIRFLOW_HOME"] == str(work / "var" / "airflow")
    assert "AIRFLOW__CORE__DAGS_FOLDER" not in found["embedded"]
    refused = run_installed(installed, work, ["-m", "burstcv.cli", "run"])
    assert refused.returncode == 1 and "AIRFLOW__CORE__DAGS_FOLDER" in refused.stderr

    airflow_home = tmp_path / "airflow"
    found = where(installed, work, AIRFLOW_HOME=str(airflow_home))
    assert found["home"] == str(airflow_home / "burstcv")
    found = where(installed, work, AIRFLOW_HOME=str(airflow_home), BURSTCV_HOME="elsewhere")
    assert found["home"] == str(work / "elsewhere")
    assert not (installed / "var").exists()


def test_the_installed_cli_prints_the_home_and_validates_the_bundled_demo_data(
    installed: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    shown = run_installed(
        installed, tmp_path, ["-m", "burstcv.cli", "home", "--paths"], BURSTCV_HOME=str(home)
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    lines = shown.stdout.splitlines()
    assert lines[0] == str(home)
    assert dict(line.split(" ", 1) for line in lines[1:]) == {
        "artifact_root": str(home / "artifacts"),
        "registry_uri": str(home / "registry"),
        "dataset_uri": str(home / "data" / "digits"),
        "compute_state_dir": str(home / "compute"),
    }
    digits = home / "data" / "digits"
    for args in (["demo-data", str(digits)], ["validate", str(digits), "--run-id", "cli__home"]):
        done = run_installed(
            installed, tmp_path, ["-m", "burstcv.cli", *args], BURSTCV_HOME=str(home)
        )
        assert done.returncode == 0, done.stderr[-3000:]
    assert len(list(digits.rglob("*.png"))) == 1797
    evidence = home / "artifacts" / "runs" / "cli__home" / "dataset" / "validation.json"
    assert json.loads(evidence.read_text())["success"] is True
