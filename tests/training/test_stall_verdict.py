"""A stalled trainer's verdict survives its end: the trigger's "stalled", not the trainer's own."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from burstcv_testkit import first_trigger_event, launch_of, make_job

from burstcv.compute.base import RUNNING, STOPPED
from burstcv.compute.local import LocalBackend
from burstcv.settings import get_settings
from burstcv.training.job import place, write_failed, write_job
from burstcv_spec.contracts import FailedMarker, read_artifact


def _wait_for(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.fixture
def backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalBackend]:
    monkeypatch.setenv("BURSTCV_COMPUTE_STATE_DIR", str(tmp_path / "state"))
    get_settings.cache_clear()
    local = LocalBackend()
    yield local
    local.terminate_run("r-stall")  # whatever a test asserted, no box outlives it
    get_settings.cache_clear()


def _trainer_pid(state_dir: Path) -> int:
    """Return the pid of the box's trainer (the wrapper's child running ``burstcv.cli train``)."""
    pgid = int(json.loads(next((state_dir / "r-stall").glob("local-*.json")).read_text())["pid"])
    found: list[int] = []

    def started() -> bool:
        for proc in Path("/proc").iterdir():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and cmd.startswith(sys.executable) and " train --job " in cmd:
                found.append(int(proc.name))
        return bool(found)

    _wait_for(started, 60)
    return found[0]


def test_the_trainer_ended_for_a_stall_leaves_the_stalled_verdict(
    packed_demo: dict[str, Any], tmp_path: Path, backend: LocalBackend
) -> None:
    """kill -STOP, the trigger's verdict, then the teardown's SIGTERM and SIGCONT: the trainer
    checkpoints and ends, and the attempt's FAILED still says why it was ended."""
    from burstcv.airflow.triggers import TrainingCompletionTrigger
    from burstcv.compute.liveness import read_beat

    out = tmp_path / "job"
    job_uri = write_job(make_job(packed_demo, out, epochs=200, batch_size=8), str(out / "job.json"))
    backend.launch(launch_of("r-stall", job_uri, time_budget_s=3600))
    trainer = _trainer_pid(tmp_path / "state")
    _wait_for(lambda: read_beat(str(out), 1) is not None, 240)
    os.kill(trainer, signal.SIGSTOP)
    trigger = TrainingCompletionTrigger(
        run_id="r-stall",
        backend="local",
        output_uri=str(out),
        attempt=1,
        poll_interval_s=0.5,
        stall_min_s=1.0,  # the bound is then a few beat intervals
    )
    event = first_trigger_event(trigger, 420)  # the bound: 50 steps, 30 s at least
    assert event["stage"] == "stalled", event
    assert backend.describe("r-stall")[0].state == RUNNING
    backend.terminate_run("r-stall")  # what the relaunch does first: SIGTERM, then SIGCONT
    _wait_for(lambda: backend.describe("r-stall")[0].state == STOPPED, 60)
    failed = read_artifact(str(out / "attempts" / "1" / "FAILED"), FailedMarker)
    assert failed.stage == "stalled" and failed.resumable, failed
    assert failed.reason == event["reason"] and " at epoch 1 step " in failed.reason
    # The trainer did end on its SIGTERM, as it should: checkpointed, and said so in its log.
    box_log = "".join(p.read_text() for p in (tmp_path / "state" / "r-stall").glob("*.log"))
    assert "SIGTERM: checkpoint saved at epoch 1 step " in box_log, box_log[-3000:]
    assert "attempt 1 stays stalled" in box_log, box_log[-3000:]
    assert (out / "checkpoints" / "last.pt").exists()


def test_only_the_stall_verdict_stands_over_a_later_marker(tmp_path: Path) -> None:
    job = str(tmp_path)
    marker = tmp_path / "attempts" / "1" / "FAILED"
    write_failed(job, 1, "interrupted", "SIGTERM: checkpoint saved", resumable=True)
    write_failed(job, 1, "train", "ValueError: boom", resumable=False)
    assert read_artifact(str(marker), FailedMarker).stage == "train"  # the later one
    write_failed(job, 2, "stalled", "no progress for 309 s", resumable=True)
    write_failed(job, 2, "interrupted", "SIGTERM: checkpoint saved", resumable=True)
    kept = read_artifact(str(tmp_path / "attempts" / "2" / "FAILED"), FailedMarker)
    assert (kept.stage, kept.reason) == ("stalled", "no progress for 309 s")


def test_epochs_are_counted_from_1_in_every_line() -> None:
    assert place(0, 0) == "before the first epoch"
    assert place(0, 7) == "at epoch 1 step 7"  # the beat's epoch 0 is the stall line's epoch 1
    assert place(2, 0) == "after epoch 2"
    assert place(2, 3) == "at epoch 3 step 3"
