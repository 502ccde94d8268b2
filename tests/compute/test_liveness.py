"""Progress-based liveness: a trainer is alive while its own beat changes, not its process."""

from __future__ import annotations

from pathlib import Path

import pytest

from burstcv.compute.liveness import (
    BEAT_EVERY_S,
    MIN_BEATS,
    STALL_STEPS,
    StallWatch,
    read_beat,
    stall_bound_s,
)
from burstcv.training.job import attempt_dir
from burstcv_spec.contracts import TrainingBeat, write_artifact
from burstcv_spec.layout import TRAINING_BEAT


def beat(beats: int, step_s: float | None = 0.1, **fields: object) -> TrainingBeat:
    values: dict[str, object] = {
        "attempt": 1,
        "beats": beats,
        "epoch": 2,
        "step": 340,
        "phase": "train",
        "step_s": step_s,
        "written_at": "2026-12-04T10:00:00+00:00",
    }
    return TrainingBeat.model_validate({**values, **fields})


@pytest.mark.parametrize(
    ("step_s", "floor_s", "bound_s"),
    [
        (0.1, 300.0, 300.0),  # fast steps: the floor
        (30.0, 300.0, STALL_STEPS * 30.0),  # slow steps: their own multiple
        (None, 300.0, 300.0),  # before a step is measured: the floor
        (0.1, 1.0, MIN_BEATS * BEAT_EVERY_S),  # never under a few beat intervals
        (None, 1.0, MIN_BEATS * BEAT_EVERY_S),  # unmeasured steps count for nothing
    ],
)
def test_the_stall_bound_follows_the_measured_step_time_above_a_floor(
    step_s: float | None, floor_s: float, bound_s: float
) -> None:
    assert stall_bound_s(beat(1, step_s), floor_s) == bound_s


def test_a_beat_that_keeps_changing_is_never_a_stall() -> None:
    watch = StallWatch(floor_s=60.0)
    for n in range(1, 200):
        assert watch.observe(beat(n), now=n * 30.0) is None  # a new beat every 30 s


def test_a_beat_unchanged_past_the_bound_is_a_stall_that_says_where() -> None:
    watch = StallWatch(floor_s=60.0)
    assert watch.observe(beat(7), now=1000.0) is None
    assert watch.observe(beat(7), now=1060.0) is None  # at the bound: not yet
    reason = watch.observe(beat(7, phase="validate"), now=1061.0)
    assert reason is not None
    assert reason.startswith("no progress for 61 s at epoch 3 step 340 (validate)")
    assert "BURSTCV_TRAIN_STALL_MIN_S 60 s" in reason
    # Progress again: the clock starts over from the new beat.
    assert watch.observe(beat(8), now=1062.0) is None
    assert watch.observe(beat(8), now=1100.0) is None


def test_no_beat_yet_is_no_verdict() -> None:
    """Booting, installing, fetching data: before its first beat, only the deadline bounds it."""
    watch = StallWatch(floor_s=10.0)
    assert watch.observe(None, now=0.0) is None
    assert watch.observe(None, now=10_000.0) is None


def test_the_silence_is_timed_on_the_watchers_clock_not_the_boxs() -> None:
    watch = StallWatch(floor_s=60.0)
    skewed = beat(3, written_at="2020-01-01T00:00:00+00:00")  # a box clock years behind
    assert watch.observe(skewed, now=5.0) is None
    assert watch.observe(skewed, now=60.0) is None


def test_a_beat_is_read_from_the_attempts_folder_and_a_bad_one_is_no_verdict(
    tmp_path: Path,
) -> None:
    job = str(tmp_path / "job")
    assert read_beat(job, 1) is None
    write_artifact(attempt_dir(job, 1, TRAINING_BEAT), beat(4))
    assert read_beat(job, 1) == beat(4)
    assert read_beat(job, 2) is None  # another attempt's beat is not this one's
    Path(attempt_dir(job, 1, TRAINING_BEAT)).write_text("{ torn")
    assert read_beat(job, 1) is None
