"""Fine-tuning: the pretrained backbone is really loaded, frozen epochs keep it, and it pays off.

The "pretrained" weights are made here: resnet10 (torchvision's layout) learns to tell 8
grating orientations apart; the fine-tuning task is 4 orientations between those, from 64
images. Everything runs on CPU with fixed seeds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from burstcv_testkit import gratings, pretrain_on_gratings, write_shard

from burstcv.training.job import JobSpec
from burstcv.training.models import head_prefix
from burstcv.training.train import main
from burstcv.training.weights import normalization
from burstcv_spec.contracts import PretrainedLoad, TrainingMetrics

ARCH = "resnet10"
SIZE_PX = 32
PRETRAIN_ANGLES = [0.0, 22.5, 45.0, 67.5, 90.0, 112.5, 135.0, 157.5]
TASK_ANGLES = [11.25, 56.25, 101.25, 146.25]  # between the pretraining ones: related, not equal
CLASSES = [f"{a:g}deg" for a in TASK_ANGLES]
PRETRAIN_STEPS = 40
ACCURACY_FLOOR = 0.9


@pytest.fixture(scope="module")
def pretrained_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pretrain on the 8-orientation task with the fine-tuning normalisation; save state_dict."""
    path = tmp_path_factory.mktemp("pretrained") / "gratings8.pt"
    return pretrain_on_gratings(path, ARCH, PRETRAIN_ANGLES, size_px=SIZE_PX, steps=PRETRAIN_STEPS)


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Write the fine-tuning task's shards: 64 training and 128 validation images."""
    root = tmp_path_factory.mktemp("task")
    train_x, train_y = gratings(64, TASK_ANGLES, size_px=SIZE_PX, seed=3)
    val_x, val_y = gratings(128, TASK_ANGLES, size_px=SIZE_PX, seed=4)
    pixels = train_x.reshape(-1, 3) / 255.0
    return {
        "train_shards": [write_shard(root / "train.npz", train_x, train_y, CLASSES)],
        "val_shards": [write_shard(root / "val.npz", val_x, val_y, CLASSES)],
        "mean": tuple(float(v) for v in pixels.mean(0)),
        "std": tuple(float(v) for v in pixels.std(0)),
    }


def _job(task: dict[str, Any], out: Path, pretrained: str, **overrides: Any) -> JobSpec:
    mean, std = normalization(ARCH, pretrained, task["mean"], task["std"])
    fields: dict[str, Any] = {
        "run_id": out.name,
        "arch": ARCH,
        "classes": CLASSES,
        "train_shards": task["train_shards"],
        "val_shards": task["val_shards"],
        "preprocess": {"height": SIZE_PX, "width": SIZE_PX, "mean": mean, "std": std},
        "output_uri": str(out),
        "batch_size": 16,
        "pretrained": pretrained,
        "augment": {"crop_padding_px": 0},
    }
    return JobSpec(**(fields | overrides))


def _backbone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not k.startswith(head_prefix(ARCH))}


def test_frozen_epochs_keep_the_loaded_backbone_and_later_epochs_train_it(
    pretrained_file: Path, task: dict[str, Any], tmp_path: Path
) -> None:
    weights = _backbone(torch.load(pretrained_file, weights_only=True))

    # Every epoch frozen: what training ends with is, tensor for tensor, the file's backbone,
    # BatchNorm statistics included. So the weights were loaded before the first step.
    out = tmp_path / "frozen"
    frozen = main(_job(task, out, str(pretrained_file), epochs=1, freeze_backbone_epochs=1))
    after = torch.load(out / "model.pt", weights_only=True)
    assert set(_backbone(after)) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(after[name], tensor), name
    assert frozen.pretrained_loaded == PretrainedLoad(
        source=str(pretrained_file), loaded=len(weights), head=2, unused=2
    )
    assert [e.backbone_frozen for e in frozen.epochs] == [True]
    # The head alone learned the new task on the pretrained features.
    assert frozen.val_accuracy >= 0.7

    # One frozen epoch, then one that trains the backbone (at 0.1x the head's rate).
    out = tmp_path / "unfrozen"
    thawed = main(_job(task, out, str(pretrained_file), epochs=2, freeze_backbone_epochs=1))
    after = torch.load(out / "model.pt", weights_only=True)
    assert [e.backbone_frozen for e in thawed.epochs] == [True, False]
    changed = [
        k for k, v in weights.items() if v.is_floating_point() and not torch.equal(after[k], v)
    ]
    assert "conv1.weight" in changed and "layer4.0.bn2.running_mean" in changed
    assert len(changed) == sum(v.is_floating_point() for v in weights.values())


def test_fine_tuning_reaches_the_floor_in_fewer_epochs_than_scratch(
    pretrained_file: Path, task: dict[str, Any], tmp_path: Path
) -> None:
    epochs = 4
    tuned = main(
        _job(
            task,
            tmp_path / "tuned",
            str(pretrained_file),
            epochs=epochs,
            target_accuracy=ACCURACY_FLOOR,
        )
    )
    scratch = main(
        _job(task, tmp_path / "scratch", "none", epochs=epochs, target_accuracy=ACCURACY_FLOOR)
    )

    def epochs_to_floor(metrics: TrainingMetrics) -> int:
        reached = [e.epoch for e in metrics.epochs if e.val_accuracy >= ACCURACY_FLOOR]
        return reached[0] if reached else epochs + 1  # not within the run: more than it had

    assert tuned.pretrained_loaded is not None and tuned.pretrained_loaded.loaded > 0
    assert scratch.pretrained_loaded is None
    assert epochs_to_floor(tuned) <= 2, tuned.epochs
    assert epochs_to_floor(tuned) < epochs_to_floor(scratch), (tuned.epochs, scratch.epochs)
    assert tuned.stop_reason == f"target accuracy {ACCURACY_FLOOR} reached"
