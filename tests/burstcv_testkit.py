"""Shared helpers for burstcv tests (importable from any test folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
