"""The training job: accurate on CPU, fails fast on a bad spec, resumes to the same result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from burstcv_testkit import make_job, run_ddp_job
from pydantic import ValidationError
from torchvision import models as tvm

from burstcv.training.job import write_job
from burstcv.training.models import ARCHITECTURES, UnknownArchitectureError, build_model
from burstcv.training.train import EXIT_INTERRUPTED, run_job


def test_cpu_training_on_demo_digits_reaches_90_percent(trained_demo: dict[str, Any]) -> None:
    metrics = trained_demo["metrics"]
    assert metrics["val_accuracy"] >= 0.90
    assert metrics["device"] == "cpu"
    assert len(metrics["epochs"]) == 3
    for record in metrics["epochs"]:
        assert record["images_per_s"] > 0
        assert {"train_loss", "val_loss", "val_accuracy", "lr", "elapsed_s"} <= set(record)
    assert set(metrics["wall_s"]) == {"setup", "data", "compute", "eval"}
    out: Path = trained_demo["out"]
    assert (out / "attempts" / "1" / "DONE").exists() and not (
        out / "attempts" / "1" / "FAILED"
    ).exists()
    state = torch.load(out / "model.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    ckpt = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["epoch"] == 3 and ckpt["seed"] == 0 and ckpt["source_commit"] == "test"
    assert ckpt["dataset_fingerprint"] == "demo"


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_classifies_small_inputs(arch: str) -> None:
    model = build_model(arch, 10, 32).eval()
    with torch.no_grad():
        assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    # Pretrained: torchvision's own layout whatever the input size, so its weights fit.
    tv_name = ARCHITECTURES[arch].torchvision_name
    pretrained = build_model(arch, 10, 32, pretrained=True).eval()
    if tv_name is not None:
        reference = tvm.get_model(tv_name, num_classes=10).state_dict()
        assert {k: v.shape for k, v in pretrained.state_dict().items()} == {
            k: v.shape for k, v in reference.items()
        }
        assert str(pretrained) == str(tvm.get_model(tv_name, num_classes=10))
    with torch.no_grad():
        assert pretrained(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_unknown_architecture_names_the_choices() -> None:
    with pytest.raises(UnknownArchitectureError, match=r"choose .*resnet10"):
        build_model("vgg99", 10, 32)


def test_unknown_model_in_job_json_is_refused(packed_demo: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="unknown model 'vgg99'"):
        make_job(packed_demo, tmp_path / "out", arch="vgg99")
    # A job.json written by something else: the box writes FAILED with the reason.
    job = make_job(packed_demo, tmp_path / "out").model_dump(mode="json")
    job["arch"] = "vgg99"
    (tmp_path / "job.json").write_text(json.dumps(job))
    with pytest.raises(ValidationError):
        run_job(str(tmp_path / "job.json"))
    failed = json.loads((tmp_path / "out" / "attempts" / "1" / "FAILED").read_text())
    assert "unknown model 'vgg99'" in failed["reason"] and failed["resumable"] is False


def _failed_reason(packed: dict[str, Any], tmp_path: Path, **overrides: Any) -> str:
    out = tmp_path / "out"
    job_uri = write_job(make_job(packed, out, **overrides), str(tmp_path / "job.json"))
    with pytest.raises(Exception):  # noqa: B017 - the reason is asserted from FAILED below
        run_job(job_uri)
    assert not (out / "attempts" / "1" / "DONE").exists()
    return str(json.loads((out / "attempts" / "1" / "FAILED").read_text())["reason"])


def test_missing_shard_fails_at_once_with_its_name(
    packed_demo: dict[str, Any], tmp_path: Path
) -> None:
    reason = _failed_reason(packed_demo, tmp_path, train_shards=[str(tmp_path / "nope.npz")])
    assert "missing shard" in reason and "nope.npz" in reason


def test_classes_that_do_not_match_the_shards_fail(
    packed_demo: dict[str, Any], tmp_path: Path
) -> None:
    reason = _failed_reason(packed_demo, tmp_path, classes=[f"c{i}" for i in range(10)])
    assert "packed for classes" in reason


def test_killed_job_resumes_to_the_same_result(
    packed_demo: dict[str, Any], trained_demo: dict[str, Any], tmp_path: Path
) -> None:
    """SIGTERM mid-run (as on a spot notice) checkpoints; the rerun ends as an unbroken run does."""
    out = tmp_path / "out"
    job_uri = write_job(make_job(packed_demo, out), str(tmp_path / "job.json"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "burstcv.cli", "train", "--job", job_uri],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ},
    )
    deadline = time.monotonic() + 240
    # Interrupt inside the second epoch: after the first end-of-epoch checkpoint exists.
    while not (out / "checkpoints" / "last.pt").exists() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == EXIT_INTERRUPTED, output
    failed = json.loads((out / "attempts" / "1" / "FAILED").read_text())
    assert failed["resumable"] is True and "checkpoint saved" in failed["reason"]
    ckpt = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert (ckpt["epoch"], ckpt["step"]) != (0, 0)

    # The next attempt resumes; the first attempt's FAILED stays its own.
    assert run_job(job_uri, attempt=2) == 0
    assert (out / "attempts" / "2" / "DONE").exists()
    assert (out / "attempts" / "1" / "FAILED").exists()
    resumed = json.loads((out / "metrics.json").read_text())
    unbroken = trained_demo["metrics"]
    assert resumed["val_accuracy"] == pytest.approx(unbroken["val_accuracy"], abs=1e-6)
    assert resumed["val_loss"] == pytest.approx(unbroken["val_loss"], rel=1e-4)
    assert np.array_equal(np.array(resumed["confusion"]), np.array(unbroken["confusion"]))


def test_ddp_two_gloo_processes_train_to_the_same_accuracy_band(
    packed_demo: dict[str, Any], trained_demo: dict[str, Any], tmp_path: Path
) -> None:
    """Two ranks with one rank's batch each (per_gpu): half the steps of one rank, a rate
    scaled by AdamW's square-root rule, and the same accuracy band."""
    out = tmp_path / "out"
    one = trained_demo["metrics"]["optimizer"]  # one rank, batch 128 (a global job)
    job = make_job(packed_demo, out, batch_scaling="per_gpu")
    job_uri = write_job(job, str(tmp_path / "job.json"))
    result = run_ddp_job(job_uri)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    two = metrics["optimizer"]
    assert (two["batch_per_rank"], two["batch_size"]) == (one["batch_size"], 2 * one["batch_size"])
    assert two["steps_per_epoch"] == 1437 // 256 and one["steps_per_epoch"] == 1437 // 128
    assert two["batch_scaling"] == "per_gpu" and two["lr_world_factor"] == pytest.approx(2**0.5)
    assert two["learning_rate"] == pytest.approx(job.learning_rate * 2**0.5)
    assert metrics["val_accuracy"] >= 0.90
    assert abs(metrics["val_accuracy"] - trained_demo["metrics"]["val_accuracy"]) <= 0.05
    assert (out / "attempts" / "1" / "DONE").exists()


def test_a_lost_peer_box_is_resumable_only_in_a_run_of_several_boxes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    from burstcv.training.world import peer_lost

    # What gloo raises when the process at the other end of a collective is gone.
    gone = RuntimeError(
        "[../gloo/transport/tcp/pair.cc:545] Read error [10.77.0.2]:40123: Connection reset by peer"
    )
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    assert not peer_lost(gone)  # one box: its own error is the job's failure
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert peer_lost(gone)
    assert peer_lost(dist.DistNetworkError("store gone"))
    # A peer whose box lost power sends no reset: the collective times out.
    assert peer_lost(
        RuntimeError(
            "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv "
            "operation to complete"
        )
    )
    assert not peer_lost(RuntimeError("CUDA out of memory"))
    assert not peer_lost(ValueError("Connection reset by peer"))  # not a collective's error


def test_a_per_gpu_job_follows_its_ranks_and_a_resume_keeps_its_first_world(
    packed_demo: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from burstcv.training.world import Dist, scale_to_world

    job = make_job(
        packed_demo,
        tmp_path / "out",
        batch_scaling="per_gpu",
        batch_size=32,
        optimizer="sgd",
        learning_rate=0.0125,
        warmup_steps=40,
    )
    # 2 boxes of 4 GPUs: 8 ranks, 256 images a step, the SGD rate x8; the recipe's warm-up
    # (counted one GPU a box) covers the same images in a quarter of the steps.
    eight = Dist(rank=5, world_size=8, local_rank=1, node=1, nodes=2)
    scaled, world = scale_to_world(job, eight)
    assert (scaled.batch_size, scaled.warmup_steps) == (256, 10)
    assert scaled.learning_rate == pytest.approx(0.1) and world.lr_factor == 8.0
    assert (world.per_rank, world.world) == (32, 8)
    swept = world.sweep_job(scaled)  # the range test: one rank's batch at one rank's rate
    assert (swept.batch_size, swept.learning_rate) == (32, pytest.approx(0.0125))
    # Relaunched on boxes with one GPU: the first attempt's global batch and rate hold.
    with caplog.at_level("WARNING", logger="burstcv.training.train"):
        resumed, kept = scale_to_world(job, Dist(rank=0, world_size=2, nodes=2), {"batch_world": 8})
    assert (resumed.batch_size, resumed.learning_rate) == (256, pytest.approx(0.1))
    assert kept.world == 8 and "its global batch of 256 images holds (128 a rank)" in caplog.text
    # A global job is split between its ranks, its rate as it is.
    whole = job.model_copy(update={"batch_scaling": "global"})
    same, split = scale_to_world(whole, eight)
    assert same is whole and (split.per_rank, split.lr_factor) == (4, 1.0)
    assert split.sweep_job(whole) is whole
