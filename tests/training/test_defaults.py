"""Every training param left at its default trains well on photos and on the digits alike.

The run's own stages choose the recipe (validate), fix the preprocessing (pack) and write
job.json (as provision does); the job then trains in-process on CPU.
"""

from __future__ import annotations

import json
import logging
from logging.handlers import BufferingHandler
from pathlib import Path
from typing import Any

from burstcv.data.photos import PHOTO_CLASSES, write_photo_dataset
from burstcv.params import ResolvedRun, RunParams
from burstcv.stages import boxes, data, resolve
from burstcv.training.job import write_job
from burstcv.training.train import run_job
from burstcv_spec import storage
from burstcv_spec.contracts import RunRef

AUTO = {"model", "batch_size", "learning_rate", "epochs", "optimizer", "warmup_steps"}


def train_with_defaults(
    dataset: Path, run_key: str, **given: Any
) -> tuple[ResolvedRun, dict[str, Any]]:
    """Validate, pack and train ``dataset`` with every training param at its default; return
    the run as resolved (run.json, with validate's choices) and its metrics."""
    params = RunParams.resolve({"dataset_uri": str(dataset), **given})
    run = RunRef.of(run_key)
    validated = data.validate(run, params=params)
    packed = data.pack(run, validated)
    job = boxes.training_job(run, packed)
    layout = resolve.run_layout(run)
    assert run_job(write_job(job, layout.job_spec)) == 0
    return resolve.resolved_run(run), json.loads(storage.read_bytes(layout.metrics))


def test_a_small_photo_set_trains_well_with_every_default(tmp_path: Path) -> None:
    # 3 classes of real photos (crops of scikit-learn's two), 40 + 12 per class, 200-800 px;
    # the size is lowered to 32 px for the CPU (a training default is not a size choice).
    write_photo_dataset(tmp_path / "photos", per_class=(40, 12))
    # A handler on the stages' own logger: Airflow, first imported mid-run when this test runs
    # alone, replaces the root logger's handlers (pytest's capture handler among them).
    stages_log, seen = logging.getLogger("burstcv.stages"), BufferingHandler(100_000)
    level = stages_log.level
    stages_log.setLevel(logging.INFO)
    stages_log.addHandler(seen)
    try:
        resolved, metrics = train_with_defaults(
            tmp_path / "photos", "photos-defaults", image_size=32
        )
    finally:
        stages_log.removeHandler(seen)
        stages_log.setLevel(level)
    training = resolved.training
    assert training is not None and set(training.derived) >= AUTO
    assert training.model == "resnet18"  # it has ImageNet weights
    assert (training.batch_size, training.optimizer) == (8, "adamw")  # 15 steps an epoch
    if training.warning:  # no internet here: from scratch, said in one line
        assert training.pretrained == "none"
        assert training.warning.startswith("pretrained auto: the ImageNet weights of resnet18")
        warned = [r.getMessage() for r in seen.buffer if r.levelno == logging.WARNING]
        assert warned == [training.warning]
    else:
        assert training.pretrained.startswith("ResNet18_Weights.")
    chose = [r.getMessage() for r in seen.buffer if r.getMessage().startswith("training: ")]
    assert chose == [f"training: {training.reason}"] and "\n" not in training.reason
    doc = json.loads(storage.read_bytes(resolve.run_layout(resolved.run_id).record))
    assert doc["training"]["reason"] == training.reason  # run.json, as every later task reads
    assert metrics["classes"] == sorted(PHOTO_CLASSES) and metrics["arch"] == "resnet18"
    assert metrics["optimizer"]["name"] == "adamw" and metrics["epochs_asked"] == training.epochs
    assert metrics["recoveries"] == []
    assert metrics["val_accuracy"] >= 0.85, metrics["epochs"]


def test_the_demo_digits_keep_their_accuracy_with_every_default(demo_dataset: Path) -> None:
    resolved, metrics = train_with_defaults(demo_dataset, "digits-defaults")
    training = resolved.training
    assert training is not None and training.pretrained == "none" and training.warning is None
    assert (training.model, training.batch_size, training.epochs) == ("resnet10", 128, 6)
    # No more work than the digits' old defaults (batch 128, 6 epochs): under a minute of
    # training on 2 idle CPU cores.
    assert metrics["epochs_run"] * metrics["train_images"] <= 6 * 1437
    assert metrics["val_accuracy"] >= 0.99, metrics["epochs"]
