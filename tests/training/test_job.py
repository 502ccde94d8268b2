"""The job a box trains: what job.json admits, where an attempt's files go, how a place reads,
and an attempt's FAILED marker (the trigger's stall verdict is never written over)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from burstcv.training.job import (
    STAGE_STALLED,
    AugmentSpec,
    JobSpec,
    attempt_dir,
    load_job,
    place,
    write_failed,
    write_job,
)
from burstcv_spec.contracts import FailedMarker, read_artifact


def job(**overrides: Any) -> JobSpec:
    fields: dict[str, Any] = {
        "run_id": "r1",
        "classes": ["a", "b"],
        "train_shards": ["s/train-0"],
        "val_shards": ["s/val-0"],
        "preprocess": {},
        "output_uri": "/out/job",
    }
    return JobSpec(**{**fields, **overrides})


def test_a_job_admits_what_a_box_can_train_and_names_what_it_cannot() -> None:
    assert job().arch == "resnet10"
    for bad, field in [
        ({"classes": ["a"]}, "classes"),
        ({"classes": ["a", "a"]}, "classes"),
        ({"train_shards": []}, "train_shards"),
        ({"val_shards": []}, "val_shards"),
        ({"arch": "no-such-net"}, "arch"),
        ({"pretrained": "auto"}, "pretrained"),
        ({"freeze_backbone_epochs": 1}, "freeze"),
    ]:
        with pytest.raises(ValidationError, match=field):
            job(**bad)
    assert job(classes=["a", "b", "c"]).classes == ["a", "b", "c"]
    assert job(freeze_backbone_epochs=1, pretrained="DEFAULT").freeze_backbone_epochs == 1


@pytest.mark.parametrize(
    ("scale", "ratio", "ok"),
    [
        ((0.35, 1.0), (0.75, 1.33), True),
        ((0.5, 0.5), (1.0, 1.0), True),  # a range may be one value
        ((0.0, 1.0), (0.75, 1.33), False),  # nothing of the image
        ((0.6, 0.5), (0.75, 1.33), False),  # reversed
        ((0.5, 1.2), (0.75, 1.33), False),  # more than the image
        ((0.5, 1.0), (0.75, 2.0), True),  # a ratio may pass 1
        ((0.5, 1.0), (1.5, 1.2), False),
    ],
)
def test_a_crop_range_is_low_to_high_and_a_scale_at_most_the_image(
    scale: tuple[float, float], ratio: tuple[float, float], ok: bool
) -> None:
    if ok:
        assert AugmentSpec(rrc_scale=scale, rrc_ratio=ratio).rrc_scale == scale
    else:
        with pytest.raises(ValidationError, match="must be \\(low, high\\)"):
            AugmentSpec(rrc_scale=scale, rrc_ratio=ratio)


def test_an_attempts_files_are_under_its_number_counted_from_one(tmp_path: Path) -> None:
    spec = job(output_uri=str(tmp_path / "job"))
    assert spec.uri("metrics.json") == str(tmp_path / "job" / "metrics.json")
    assert spec.attempt_uri(2, "FAILED") == str(tmp_path / "job" / "attempts" / "2" / "FAILED")
    assert attempt_dir("/j", 1) == "/j/attempts/1"
    with pytest.raises(ValueError, match="from 1, got 0"):
        attempt_dir("/j", 0)
    uri = write_job(spec, str(tmp_path / "job.json"))
    assert uri == str(tmp_path / "job.json")
    assert load_job(uri) == spec


def test_a_place_counts_epochs_from_one() -> None:
    assert place(0, 0) == "before the first epoch"
    assert place(0, 5) == "at epoch 1 step 5"
    assert place(2, 0) == "after epoch 2"
    assert place(2, 7) == "at epoch 3 step 7"


def test_the_stall_verdict_stands_and_any_other_end_is_written(tmp_path: Path) -> None:
    job_dir = str(tmp_path)
    uri = write_failed(job_dir, 1, "train", "boom", resumable=False)
    first = read_artifact(uri, FailedMarker)
    assert (first.stage, first.reason, first.resumable, first.attempt) == (
        "train",
        "boom",
        False,
        1,
    )
    write_failed(job_dir, 1, "interrupted", "SIGTERM", resumable=True)
    assert read_artifact(uri, FailedMarker).stage == "interrupted"  # not a stall: replaced
    write_failed(job_dir, 1, STAGE_STALLED, "no beat for 301 s", resumable=True)
    write_failed(job_dir, 1, "interrupted", "SIGTERM after the stall", resumable=True)
    kept = read_artifact(uri, FailedMarker)
    assert (kept.stage, kept.reason) == (STAGE_STALLED, "no beat for 301 s")
    write_failed(job_dir, 1, STAGE_STALLED, "stalled again", resumable=True)
    assert read_artifact(uri, FailedMarker).reason == "stalled again"
    (tmp_path / "attempts" / "2").mkdir(parents=True)
    (tmp_path / "attempts" / "2" / "FAILED").write_text("{torn")
    torn = write_failed(job_dir, 2, "train", "after a torn marker", resumable=False)
    assert read_artifact(torn, FailedMarker).reason == "after a torn marker"
