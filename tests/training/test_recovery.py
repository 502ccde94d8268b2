"""Divergence is caught, not shipped; the best validation epoch is the model; early stopping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from burstcv_testkit import make_job, write_shard

from burstcv.training.job import write_job
from burstcv.training.models import build_model
from burstcv.training.train import EXIT_DIVERGED, evaluate, load_shards, run_job, to_device_split


def _run(job: Any, tmp_path: Path) -> tuple[int, Path]:
    return run_job(write_job(job, str(tmp_path / "job.json"))), Path(job.output_uri)


def test_a_huge_rate_that_keeps_diverging_ends_the_run_with_the_reason(
    packed_demo: dict[str, Any], tmp_path: Path
) -> None:
    job = make_job(
        packed_demo,
        tmp_path / "out",
        epochs=2,
        optimizer="sgd",
        learning_rate=50.0,
        max_recoveries=1,
    )
    code, out = _run(job, tmp_path)
    assert code == EXIT_DIVERGED
    failed = json.loads((out / "attempts" / "1" / "FAILED").read_text())
    assert failed["stage"] == "train" and failed["resumable"] is False
    assert failed["reason"].startswith("training diverged 2 times and 1 recoveries are allowed")
    assert "lower learning_rate" in failed["reason"]
    # Nothing to export: no weights, no metrics, no DONE.
    assert not (out / "model.pt").exists() and not (out / "metrics.json").exists()
    assert not (out / "attempts" / "1" / "DONE").exists()


def test_a_too_high_rate_is_lowered_and_the_run_trains_on(
    packed_demo: dict[str, Any], tmp_path: Path
) -> None:
    # 4.0 (SGD, batch 128) blows the training loss up within ten steps, and 0.3x of it too;
    # at 0.09x the validation loss reaches the thousands at chance accuracy (BatchNorm's
    # statistics wrecked: the run); 0.027x trains.
    job = make_job(packed_demo, tmp_path / "out", epochs=3, optimizer="sgd", learning_rate=4.0)
    code, out = _run(job, tmp_path)
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    recoveries = metrics["recoveries"]
    assert 1 <= len(recoveries) <= job.max_recoveries
    assert "training loss" in recoveries[0]["reason"]
    assert all(" is over " in r["reason"] or " is nan" in r["reason"] for r in recoveries)
    assert recoveries[-1]["lr_scale"] == pytest.approx(0.3 ** len(recoveries))
    assert metrics["optimizer"]["lr_scale"] == pytest.approx(0.3 ** len(recoveries))
    assert len(metrics["epochs"]) == 3  # the diverged attempts left no epoch behind
    assert metrics["val_accuracy"] >= 0.85, (recoveries, metrics["epochs"])


def _shuffled_val(packed: dict[str, Any], root: Path) -> list[str]:
    """Return one val shard whose labels are shuffled: its accuracy wanders, it cannot rise."""
    images, labels = load_shards(packed["val_shards"], packed["classes"])
    rng = np.random.default_rng(0)
    return [write_shard(root / "val.npz", images, rng.permutation(labels), packed["classes"])]


def test_the_best_epoch_is_exported_and_training_stops_when_it_stops_improving(
    packed_demo: dict[str, Any], tmp_path: Path
) -> None:
    images, labels = load_shards(packed_demo["train_shards"], packed_demo["classes"])
    train = [
        write_shard(tmp_path / "train.npz", images[:256], labels[:256], packed_demo["classes"])
    ]
    val = _shuffled_val(packed_demo, tmp_path)
    job = make_job(
        packed_demo,
        tmp_path / "out",
        train_shards=train,
        val_shards=val,
        epochs=12,
        batch_size=32,
        optimizer="sgd",
        learning_rate=0.05,
        early_stop_patience=2,
    )
    code, out = _run(job, tmp_path)
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    accuracies = [e["val_accuracy"] for e in metrics["epochs"]]
    best = max(range(len(accuracies)), key=lambda i: (accuracies[i], i)) + 1  # ties: the later
    reached = accuracies.index(max(accuracies)) + 1  # a tie is no improvement: patience runs
    assert metrics["best_epoch"] == best
    assert metrics["stop_reason"].startswith("early stop: validation accuracy has not improved")
    assert metrics["epochs_run"] == len(accuracies) == reached + 2 < metrics["epochs_asked"] == 12
    assert metrics["seconds_saved"] > 0
    # What is exported is the best epoch's model, not the last: it scores the best accuracy.
    assert metrics["val_accuracy"] == pytest.approx(accuracies[best - 1])
    model = build_model(job.arch, 10, int(job.preprocess["height"]))
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    best_ckpt = torch.load(out / "checkpoints" / "best.pt", weights_only=True)
    assert json.loads(best_ckpt["best"])["epoch"] == best
    val_images, val_labels = load_shards(val, packed_demo["classes"])
    spec = job.preprocess
    ev = evaluate(
        model,
        to_device_split(val_images, val_labels, torch.device("cpu")),
        torch.tensor(spec["mean"]).view(1, 3, 1, 1),
        torch.tensor(spec["std"]).view(1, 3, 1, 1),
        1 / 255,
        10,
        256,
        None,
    )
    assert ev["accuracy"] == pytest.approx(accuracies[best - 1])


def test_the_range_test_sweeps_a_bounded_number_of_steps_and_trains_at_its_rate(
    packed_demo: dict[str, Any], tmp_path: Path
) -> None:
    images, labels = load_shards(packed_demo["train_shards"], packed_demo["classes"])
    some = np.random.default_rng(0).permutation(len(labels))[:512]  # every class
    train = [
        write_shard(tmp_path / "train.npz", images[some], labels[some], packed_demo["classes"])
    ]
    # A rate 250x too high for AdamW: the sweep, not the given rate, decides.
    job = make_job(
        packed_demo,
        tmp_path / "out",
        train_shards=train,
        epochs=2,
        batch_size=32,
        optimizer="adamw",
        learning_rate=0.5,
        lr_range_test=True,
    )
    code, out = _run(job, tmp_path)
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    test = metrics["lr_range_test"]
    # 16 steps an epoch: two epochs' 32 steps at most (it stops early once the loss climbs).
    assert 10 <= test["steps"] == len(test["lrs"]) == len(test["losses"]) <= 32
    assert test["seconds"] > 0 and test["fallback_lr"] == 0.5
    assert test["chosen_lr"] == pytest.approx(min(test["min_loss_lr"] / 10, test["steepest_lr"]))
    assert test["chosen_lr"] < 0.05  # far below what was given
    assert metrics["optimizer"]["learning_rate"] == test["chosen_lr"]
    assert metrics["val_accuracy"] >= 0.5, (metrics["recoveries"], metrics["epochs"])
