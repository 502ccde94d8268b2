"""Shared helpers for burstcv tests (importable from any test folder)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

# What a launch of a held box names as its training wheel: held boxes never boot, so never
# read it (the boot path itself runs for real in tests/compute/test_box_boot.py).
HELD_WHEEL: dict[str, str] = {
    "wheel_uri": f"s3://never-read/runtime/{'0' * 64}/burstcv_train-0.1.0-py3-none-any.whl",
    "wheel_sha256": "0" * 64,
}


def make_job(packed: dict[str, Any], out: Path, **overrides: Any) -> Any:
    """Return a JobSpec over the packed demo shards writing into ``out``."""
    from burstcv.training.job import JobSpec

    fields: dict[str, Any] = {
        "run_id": out.name,
        "classes": packed["classes"],
        "train_shards": packed["train_shards"],
        "val_shards": packed["val_shards"],
        "preprocess": packed["spec"].to_dict(),
        "output_uri": str(out),
        "epochs": 3,
        "dataset_fingerprint": "demo",
    }
    fields.update(overrides)
    return JobSpec(**fields)


def make_model_dir(root: Path, tag: str) -> Path:
    """Write a model folder (model.onnx bytes + model.json) as the export stage does."""
    root.mkdir(parents=True, exist_ok=True)
    data = f"onnx-{tag}".encode()
    (root / "model.onnx").write_bytes(data)
    (root / "model.json").write_text(
        json.dumps(
            {
                "name": "digits",
                "onnx_file": "model.onnx",
                "sha256": hashlib.sha256(data).hexdigest(),
                "run_id": f"run-{tag}",
                "dataset_fingerprint": "fp",
                "source_commit": "abc",
            }
        )
    )
    return root


def chromium_screenshot(
    url: str, shot: Path, width: int, height: int, *, wait_ms: int = 0
) -> str | None:
    """Screenshot ``url`` with headless Chromium into ``shot``; None if Chromium is absent.

    Returns Chromium's stderr (for a failure message). ``wait_ms`` lets a page's scripts run
    (virtual time) before the picture is taken.
    """
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return None
    args = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        f"--user-data-dir={shot.parent / 'chromium-profile'}",
        f"--screenshot={shot}",
        f"--window-size={width},{height}",
    ]
    if wait_ms:
        args.append(f"--virtual-time-budget={wait_ms}")
    result = subprocess.run([*args, url], capture_output=True, text=True, timeout=120)
    return result.stderr
