"""Wait for a training job without holding a worker slot: an Airflow trigger on its markers.

Its heartbeat in the attempt's folder lets a trigger started again after a silence (the
triggerer died, or was too busy) say how long nobody watched the training.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import time
from collections.abc import AsyncIterator
from datetime import datetime
from functools import partial
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from burstcv import lineage
from burstcv_spec import storage
from burstcv_spec.contracts import ArtifactError, TriggerHeartbeat, read_artifact, write_artifact
from burstcv_spec.layout import TRIGGER_HEARTBEAT

HEARTBEAT_EVERY_S = 60.0  # a write per minute at most: an S3 PUT per minute per waiting run
SILENCE_AFTER_S = 3 * HEARTBEAT_EVERY_S  # three missed heartbeats: nobody was watching


def heartbeat_uri(output_uri: str, attempt: int) -> str:
    """Return where one attempt's trigger heartbeat lives (beside its DONE/FAILED markers)."""
    from burstcv.training.job import attempt_dir

    return attempt_dir(output_uri, attempt, TRIGGER_HEARTBEAT)


def write_heartbeat(output_uri: str, attempt: int, now: datetime | None = None) -> None:
    """Record that the attempt's trigger polled now."""
    beat = TriggerHeartbeat(
        attempt=attempt,
        polled_at=(now or lineage.utc_now()).isoformat(),
        every_s=HEARTBEAT_EVERY_S,
    )
    write_artifact(heartbeat_uri(output_uri, attempt), beat)


def silence_line(output_uri: str, attempt: int, now: datetime | None = None) -> str | None:
    """Return the warning a restarted trigger logs after a silence, or None if there was none."""
    uri = heartbeat_uri(output_uri, attempt)
    if not storage.exists(uri):
        return None  # the first trigger of this attempt: nothing to compare with
    try:
        last = datetime.fromisoformat(read_artifact(uri, TriggerHeartbeat).polled_at)
    except (ArtifactError, ValueError) as exc:
        return f"the trigger's last heartbeat cannot be read ({exc}); watching again now"
    silent_s = ((now or lineage.utc_now()) - last).total_seconds()
    if silent_s < SILENCE_AFTER_S:
        return None
    return (
        f"no word from this task's trigger for {silent_s / 60:.1f} min (last heartbeat "
        f"{last.isoformat(timespec='seconds')}): the triggerer was down or too busy to run it, "
        "so nobody watched the training meanwhile (the box kept training, and its markers "
        "are read now); see docs/airflow.md, 'A deferred train task that hears nothing'"
    )


class TrainingCompletionTrigger(BaseTrigger):
    """Fire when the run's DONE or FAILED marker appears, or its boxes vanish without one;
    a trainer whose own beat stops for longer than its stall bound is marked FAILED
    (resumable) here, so a stopped or hung trainer does not hold its GPU until the deadline."""

    def __init__(
        self,
        run_id: str,
        backend: str,
        output_uri: str,
        attempt: int = 1,
        poll_interval_s: float = 5.0,
        max_cost_usd: float | None = None,
        stall_min_s: float | None = None,
        boxes: int = 1,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseTrigger.__init__ has no annotations
        self.run_id = run_id
        self.backend = backend
        self.output_uri = output_uri
        self.attempt = attempt  # only this attempt's markers end the wait
        self.poll_interval_s = poll_interval_s
        # The run's budget, for the progress lines (None: none; an older serialized trigger: 0).
        self.max_cost_usd = max_cost_usd or None
        # The floor of the stall bound (burstcv.compute.liveness); None: the setting's.
        self.stall_min_s = stall_min_s
        self.boxes = boxes  # boxes per attempt: how often the ranks' markers are read

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Return the classpath and kwargs (``__init__``'s) the triggerer rebuilds this from."""
        kwargs = {name: getattr(self, name) for name in inspect.signature(type(self)).parameters}
        return "burstcv.airflow.triggers.TrainingCompletionTrigger", kwargs

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Poll the artifact store and the backend until the job has an outcome."""
        # The attempts module's first import (pandas, numpy) would block the triggerer's loop.
        await asyncio.to_thread(importlib.import_module, "burstcv.compute.attempts")
        from burstcv.compute.attempts import progress_lines, training_outcome
        from burstcv.compute.liveness import StallWatch, read_beat
        from burstcv.settings import get_settings
        from burstcv.training.job import STAGE_STALLED, write_failed

        silence = await asyncio.to_thread(silence_line, self.output_uri, self.attempt)
        if silence:
            self.log.warning("%s", silence)
        logged, beat_at = 0, float("-inf")
        floor_s = self.stall_min_s or get_settings().train_stall_min_s
        watch = StallWatch(floor_s=floor_s)
        job = (self.run_id, self.backend, self.output_uri, self.attempt)
        while True:
            if time.monotonic() - beat_at >= HEARTBEAT_EVERY_S:
                await asyncio.to_thread(write_heartbeat, self.output_uri, self.attempt)
                beat_at = time.monotonic()
            # Storage and cloud calls are blocking: keep them off the triggerer's event loop.
            outcome = await asyncio.to_thread(training_outcome, *job, None, self.boxes)
            # One line per finished epoch in the task log, as the box writes them.
            lines = await asyncio.to_thread(progress_lines, *job, logged, self.max_cost_usd)
            for line in lines:
                self.log.info(line)
            logged += len(lines)
            if outcome.status != "running":
                yield TriggerEvent(outcome.model_dump(mode="json"))
                return
            # Alive is not enough: the trainer must make progress (its own beat).
            beat = await asyncio.to_thread(read_beat, self.output_uri, self.attempt)
            if stalled := watch.observe(beat, time.monotonic()):
                self.log.warning("attempt %d: %s", self.attempt, stalled)
                # A resumable FAILED marker: the train task relaunches (terminating this
                # attempt's boxes first) and the next box resumes from the checkpoint.
                stall = partial(write_failed, self.output_uri, self.attempt, STAGE_STALLED)
                await asyncio.to_thread(stall, stalled, resumable=True)
                continue
            await asyncio.sleep(self.poll_interval_s)
