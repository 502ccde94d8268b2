"""The training trigger's heartbeat: a trigger restarted after a silence says so in the log."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from burstcv_testkit import first_trigger_event

from burstcv import lineage
from burstcv.airflow.triggers import (
    SILENCE_AFTER_S,
    TrainingCompletionTrigger,
    heartbeat_uri,
    silence_line,
    write_heartbeat,
)
from burstcv_spec.contracts import (
    EpochRecord,
    TrainingProgress,
    TriggerHeartbeat,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import PROGRESS


@pytest.fixture
def finished_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Return a job folder whose attempt 1 already wrote DONE (local backend, no box)."""
    from burstcv.settings import get_settings

    monkeypatch.setenv("BURSTCV_COMPUTE_STATE_DIR", str(tmp_path / "state"))
    get_settings.cache_clear()
    out = tmp_path / "job"
    (out / "attempts" / "1").mkdir(parents=True)
    (out / "attempts" / "1" / "DONE").write_text(json.dumps({"epochs": 1}))
    yield out
    get_settings.cache_clear()


def fire(out: Path) -> dict[str, Any]:
    trigger = TrainingCompletionTrigger(
        run_id="r-quiet", backend="local", output_uri=str(out), attempt=1, poll_interval_s=0.1
    )
    return first_trigger_event(trigger)


def test_a_trigger_back_after_a_dead_triggerer_says_how_long_nobody_watched(
    finished_job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    went_quiet = lineage.utc_now() - timedelta(minutes=47)
    write_heartbeat(str(finished_job), 1, now=went_quiet)
    assert fire(finished_job)["status"] == "done"
    # Triggers log through Airflow's structlog: what the task log shows is the output.
    (warning,) = [line for line in capsys.readouterr().out.splitlines() if "no word from" in line]
    assert "warning" in warning
    assert "for 47.0 min" in warning and "docs/airflow.md" in warning
    beat = read_artifact(heartbeat_uri(str(finished_job), 1), TriggerHeartbeat)
    assert lineage.utc_now() - timedelta(seconds=30) < _at(beat) <= lineage.utc_now()
    # The page the warning names exists and says what to do.
    guide = (Path(__file__).resolve().parents[2] / "docs" / "airflow.md").read_text()
    assert "A deferred train task that hears nothing" in guide


def test_no_warning_for_a_first_trigger_or_a_short_gap(finished_job: Path) -> None:
    out = str(finished_job)
    assert silence_line(out, 1) is None  # no heartbeat yet: the attempt's first trigger
    now = lineage.utc_now()
    write_heartbeat(out, 1, now=now - timedelta(seconds=SILENCE_AFTER_S - 1))
    assert silence_line(out, 1, now=now) is None
    write_heartbeat(out, 1, now=now - timedelta(seconds=SILENCE_AFTER_S))
    assert "for 3.0 min" in (silence_line(out, 1, now=now) or "")


def test_an_unreadable_heartbeat_is_said_and_not_raised(finished_job: Path) -> None:
    Path(heartbeat_uri(str(finished_job), 1)).write_text("{not json")
    line = silence_line(str(finished_job), 1)
    assert line is not None and "cannot be read" in line
    assert fire(finished_job)["status"] == "done"


def _at(beat: TriggerHeartbeat) -> Any:
    from datetime import datetime

    return datetime.fromisoformat(beat.polled_at)


def test_a_progress_line_leads_with_accuracy_dollars_left_and_minutes_left(
    finished_job: Path, packed_demo: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from burstcv_testkit import make_job

    from burstcv.training.job import write_job

    deadline = lineage.utc_now() + timedelta(minutes=30)
    job = make_job(packed_demo, finished_job, epochs=3, deadline_at=deadline)
    write_job(job, str(finished_job / "job.json"))
    epoch = {"train_loss": 0.5, "val_loss": 0.25, "images_per_s": 812.4, "elapsed_s": 23.2}
    write_artifact(
        str(finished_job / PROGRESS),
        TrainingProgress(
            attempt=1,
            epochs_total=3,
            epochs=[
                EpochRecord(epoch=1, val_accuracy=0.8, lr=0.1, **epoch),
                EpochRecord(epoch=2, val_accuracy=0.9412, lr=0.05, **epoch),
            ],
        ),
    )
    trigger = TrainingCompletionTrigger(
        run_id="r-quiet",
        backend="local",
        output_uri=str(finished_job),
        attempt=1,
        poll_interval_s=0.1,
        max_cost_usd=5.0,
    )
    assert trigger.serialize()[1]["max_cost_usd"] == 5.0  # a restarted triggerer keeps it

    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    assert asyncio.run(asyncio.wait_for(first(), timeout=60))["status"] == "done"
    lines = [line for line in capsys.readouterr().out.splitlines() if "epoch " in line]
    assert len(lines) == 2, lines
    line = lines[1][lines[1].index("epoch 2/3") :]
    head = line.split(" | train_loss")[0]
    # The local backend bills nothing: every dollar of the budget is left.
    assert head.startswith("epoch 2/3 val_accuracy 0.9412 val_loss 0.2500 | $0.00 of $5.00, ")
    assert "$5.00 left | " in head and " min to the deadline" in head
    minutes = float(head.split(" | ")[2].split()[0])
    assert 28 <= minutes <= 30
    assert len(head) <= 110  # the log viewer's width, after its own timestamp and level
    assert "812 images/s, 23 s, billed 0 s, attempt 1" in line
