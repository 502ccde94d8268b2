"""The command line: run-parameter options, and verbs that run the pipeline's own stages."""

from __future__ import annotations

import json
import shutil
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
