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
    out = tmp_path / "out"
    job_uri = write_job(make_job(packed_demo, out), str(tmp_path / "job.json"))
    result = run_ddp_job(job_uri)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["val_accuracy"] >= 0.90
    assert abs(metrics["val_accuracy"] - trained_demo["metrics"]["val_accuracy"]) <= 0.05
    assert (out / "attempts" / "1" / "DONE").exists()


def test_a_lost_peer_box_is_resumable_only_in_a_run_of_several_boxes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    from burstcv.training.train import peer_lost

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
