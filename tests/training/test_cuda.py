"""CUDA-only checks of the training job; skipped cleanly on machines without an NVIDIA GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from burstcv_testkit import make_job

from burstcv.training.job import write_job
from burstcv.training.train import run_job

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def test_cuda_training_uses_mixed_precision_and_reaches_accuracy(
    packed_demo: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert run_job(write_job(make_job(packed_demo, out, epochs=4), str(tmp_path / "job.json"))) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["device"].startswith("cuda")
    assert metrics["amp_dtype"] in ("torch.bfloat16", "torch.float16")
    assert metrics["val_accuracy"] >= 0.9
    assert all(e["gpu_max_memory_mb"] > 0 for e in metrics["epochs"])


def test_cuda_resume_matches_within_tolerance(packed_demo: dict[str, Any], tmp_path: Path) -> None:
    """SIGTERM after the first checkpoint, resume: final accuracy within 2 points of unbroken."""
    import os
    import signal
    import subprocess
    import sys
    import time

    unbroken, resumed = tmp_path / "a", tmp_path / "b"
    assert run_job(write_job(make_job(packed_demo, unbroken), str(tmp_path / "a.json"))) == 0
    job_uri = write_job(make_job(packed_demo, resumed), str(tmp_path / "b.json"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "burstcv.cli", "train", "--job", job_uri], env={**os.environ}
    )
    deadline = time.monotonic() + 120
    while not (resumed / "checkpoints" / "last.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert run_job(job_uri) == 0
    a = json.loads((unbroken / "metrics.json").read_text())["val_accuracy"]
    b = json.loads((resumed / "metrics.json").read_text())["val_accuracy"]
    assert abs(a - b) <= 0.02


def test_cuda_frozen_backbone_stays_the_loaded_one(
    packed_demo: dict[str, Any], tmp_path: Path
) -> None:
    """On the GPU path (channels_last, autocast) a frozen epoch leaves the backbone as loaded."""
    from burstcv.training.models import build_model, head_prefix

    torch.manual_seed(3)
    weights = build_model("resnet18", 10, 32, pretrained=True).state_dict()
    torch.save(weights, tmp_path / "w.pt")
    out = tmp_path / "out"
    job = make_job(
        packed_demo,
        out,
        arch="resnet18",
        epochs=1,
        pretrained=str(tmp_path / "w.pt"),
        freeze_backbone_epochs=1,
    )
    assert run_job(write_job(job, str(tmp_path / "job.json"))) == 0
    after = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    backbone = {k: v for k, v in weights.items() if not k.startswith(head_prefix("resnet18"))}
    for name, tensor in backbone.items():
        assert torch.equal(after[name].contiguous(), tensor.contiguous()), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["device"].startswith("cuda") and metrics["epochs"][0]["backbone_frozen"]
