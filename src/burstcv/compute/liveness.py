"""Tell a training attempt that makes progress from one that only looks alive.

A stopped (SIGSTOP) or hung trainer is a live process that would keep its GPU until the
run's deadline. The training loop writes a beat as steps complete (at most every
``BEAT_EVERY_S``); the train task's trigger ends an attempt whose beat has not changed for
longer than its stall bound, timed on the watcher's clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from burstcv.training.job import BEAT_EVERY_S, attempt_dir
from burstcv_spec.contracts import ArtifactError, TrainingBeat, read_artifact
from burstcv_spec.layout import TRAINING_BEAT

__all__ = ["BEAT_EVERY_S", "MIN_BEATS", "STALL_STEPS", "StallWatch", "read_beat", "stall_bound_s"]

# A stall is this many of the trainer's typical steps without a new beat (if above the floor).
STALL_STEPS = 50
# A bound is at least this many beat intervals: a beat may be one interval late by design.
MIN_BEATS = 3


def stall_bound_s(beat: TrainingBeat, floor_s: float) -> float:
    """Return how long ``beat`` may stay unchanged before its trainer counts as stalled."""
    return max(floor_s, STALL_STEPS * (beat.step_s or 0.0), MIN_BEATS * BEAT_EVERY_S)


def read_beat(job_dir_uri: str, attempt: int) -> TrainingBeat | None:
    """Return an attempt's beat, or None before its first (or if unreadable: no verdict)."""
    try:
        return read_artifact(attempt_dir(job_dir_uri, attempt, TRAINING_BEAT), TrainingBeat)
    except (FileNotFoundError, ArtifactError):
        return None


@dataclass
class StallWatch:
    """Follow one attempt's beats; say when they stopped for longer than the bound."""

    floor_s: float
    last: int | None = None  # the beats count last seen
    changed_at: float = 0.0  # the watcher's time.monotonic() when it last changed

    def observe(self, beat: TrainingBeat | None, now: float) -> str | None:
        """Return why the trainer counts as stalled at ``now``, or None while it progresses."""
        if beat is None:
            return None
        if beat.beats != self.last:
            self.last, self.changed_at = beat.beats, now
            return None
        silent_s = now - self.changed_at
        bound_s = stall_bound_s(beat, self.floor_s)
        if silent_s <= bound_s:
            return None
        step = f"{beat.step_s:.2f} s" if beat.step_s else "unmeasured"
        return (
            f"no progress for {silent_s:.0f} s at epoch {beat.epoch + 1} step {beat.step} "
            f"({beat.phase}); the trainer is alive but stalled (stopped or hung), ended so that "
            f"a new box resumes from the checkpoint (bound {bound_s:.0f} s: {STALL_STEPS} steps "
            f"of {step}, at least BURSTCV_TRAIN_STALL_MIN_S {self.floor_s:.0f} s)"
        )
