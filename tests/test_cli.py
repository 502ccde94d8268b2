"""The command line: run-parameter options, and verbs that run the pipeline's own stages."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from burstcv.cli import app
from burstcv.cli_options import run_options
from burstcv.training.job import write_job


def test_a_command_receives_only_the_run_options_given() -> None:
    received: list[dict[str, Any]] = []
    demo = typer.Typer()

    @demo.command()
    @run_options(("epochs", "drift_max", "instance_types", "force_train"))
    def show(*, given: dict[str, Any]) -> None:
        received.append(given)

    runner = CliRunner()
    assert runner.invoke(demo, []).exit_code == 0
    args = ["--epochs", "3", "--drift-max", "none", "--instance-types", "g5.xlarge, g4dn.xlarge"]
    assert runner.invoke(demo, [*args, "--force-train"]).exit_code == 0
    refused = runner.invoke(demo, ["--epochs", "0"])
    assert refused.exit_code == 2 and "--epochs" in refused.output
    assert received == [
        {},  # nothing given: RunParams supplies every default
        {
            "epochs": 3,
            "drift_max": None,  # given empty, not left to its default
            "instance_types": ["g5.xlarge", "g4dn.xlarge"],
            "force_train": True,
        },
    ]


@pytest.fixture
def store(clean_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Point the artifact store at a fresh folder."""
    monkeypatch.setenv("BURSTCV_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    return tmp_path / "artifacts"


def test_validate_uses_the_stage_and_its_thresholds(
    store: Path, demo_dataset: Path, tmp_path: Path
) -> None:
    runner = CliRunner()
    strict = runner.invoke(
        app, ["validate", str(demo_dataset), "--min-images-per-class", "1000", "--run-id", "cli__x"]
    )
    assert strict.exit_code == 1, strict.output
    assert "min_images_per_class" in strict.output
    # The evidence is the run's, in the artifact store, as the DAG's validate task leaves it.
    evidence = json.loads((store / "runs" / "cli__x" / "dataset" / "validation.json").read_text())
    assert evidence["config"]["min_images_per_class"] == 1000
    unusable = runner.invoke(app, ["validate", str(tmp_path / "no-such-dataset")])
    assert unusable.exit_code == 2


def test_export_runs_the_export_stage_with_int8_calibration(
    store: Path, demo_dataset: Path, trained_demo: dict[str, Any]
) -> None:
    runner = CliRunner()
    run_id = "manual__2026-01-01T00:00:00+00:00"
    validated = runner.invoke(app, ["validate", str(demo_dataset), "--run-id", run_id])
    assert validated.exit_code == 0, validated.output
    # The training stage's outputs, where the DAG's train task leaves them.
    job_dir = store / "runs" / "manual__2026-01-01T00_00_00_00_00" / "job"
    job_dir.mkdir(parents=True)
    for name in ("model.pt", "metrics.json"):
        shutil.copy(trained_demo["out"] / name, job_dir / name)
    write_job(
        trained_demo["job"].model_copy(update={"output_uri": str(job_dir)}),
        str(job_dir / "job.json"),
    )

    exported = runner.invoke(app, ["export", run_id, "--int8-max-accuracy-drop", "0.5"])
    assert exported.exit_code == 0, exported.output
    model_json = json.loads((job_dir.parent / "model" / "model.json").read_text())
    quantization = model_json["quantization"]
    assert quantization["int8_tried"] is True
    assert quantization["max_accuracy_drop"] == 0.5  # the option reached the stage
    assert quantization["eval_images"] == 360  # the packed validation split
    assert quantization["calibration_images"] == 256  # drawn from the training shards
    assert model_json["parity"]["images"] == 256  # real validation images from the manifest
    assert quantization["reason"] in exported.output


def _fresh_env(tmp_path: Path) -> dict[str, str]:
    """Return a shell's environment with no Airflow or burstcv setting: a new user's."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW", "BURSTCV_", "AWS_")) and k != "HOME"
    }
    env.update(HOME=str(tmp_path / "user"), BURSTCV_HOME=str(tmp_path / "burstcv"))
    (tmp_path / "user").mkdir()
    return env


def burstcv(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "burstcv.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_run_on_a_fresh_home_prepares_airflow_and_answers_in_a_few_lines(tmp_path: Path) -> None:
    """No `airflow db migrate` first; the answer is the summary and why, not Airflow's log."""
    env = _fresh_env(tmp_path)
    missing = tmp_path / "no-such-dataset"
    done = burstcv(["run", "--dataset-uri", str(missing)], env)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "no such table" not in out + done.stderr and "Traceback" not in out + done.stderr
    assert out.startswith("burstcv_pipeline run manual__"), out
    assert "  failed: burstcv_pipeline.plan_scan run manual__" in out
    assert f"dataset path {missing} does not exist" in out
    log = tmp_path / "burstcv" / "run" / "last-run.log"
    assert f"  full log: {log}" in out
    assert len(out.splitlines()) < 25 and "[info" not in out and done.stderr == ""
    assert "Filling up the DagBag" in log.read_text()  # Airflow's lines are kept, there
    assert (tmp_path / "burstcv" / "airflow" / "airflow.db").exists()
    assert not (tmp_path / "user" / "airflow").exists()


def test_aws_check_leaves_the_users_airflow_home_alone(tmp_path: Path) -> None:
    env = _fresh_env(tmp_path)
    # No AWS here: a port nothing listens on, so the check stops at the credentials line.
    env.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL="http://127.0.0.1:9",
        AWS_MAX_ATTEMPTS="1",
    )
    done = burstcv(["aws", "check"], env)
    assert done.returncode == 1
    assert "MISSING  credentials: EndpointConnectionError" in done.stdout
    assert not (tmp_path / "user" / "airflow").exists()
    assert "Reading the config" not in done.stderr  # Airflow's INFO lines: only with -v
