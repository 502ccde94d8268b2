"""The reaper's question to Airflow: is this run still going? Asked with Airflow's own enums."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from airflow.sdk.api.datamodels._generated import DagRunState as SdkDagRunState
from airflow.utils.state import DagRunState, TaskInstanceState

from burstcv.airflow.runs import classify, state_value
from burstcv.compute.base import RUNNING, InstanceInfo
from burstcv.compute.reaper import RunActivity, reap


@pytest.mark.parametrize("enum", [DagRunState, SdkDagRunState])
def test_a_running_run_is_active_whichever_enum_airflow_hands_out(enum: Any) -> None:
    # str() of these enums is 'DagRunState.RUNNING' on some Pythons: compare values.
    assert state_value(enum.RUNNING) == "running"
    assert classify(enum.RUNNING, None) is RunActivity.ACTIVE
    assert classify(enum.QUEUED, None) is RunActivity.ACTIVE
    assert classify(enum.SUCCESS, TaskInstanceState.SUCCESS) is RunActivity.OVER
    assert classify(enum.FAILED, None) is RunActivity.OVER


@pytest.mark.parametrize(
    "train",
    [
        TaskInstanceState.DEFERRED,
        TaskInstanceState.RUNNING,
        TaskInstanceState.QUEUED,
        TaskInstanceState.SCHEDULED,
        TaskInstanceState.UP_FOR_RETRY,
        "deferred",
    ],
)
def test_a_live_train_task_keeps_the_run_active_whatever_the_run_says(train: Any) -> None:
    for run_state in (DagRunState.FAILED, DagRunState.SUCCESS, "a-state-from-the-future", None):
        assert classify(run_state, train) is RunActivity.ACTIVE
    assert classify(None, train, run_exists=False) is RunActivity.ACTIVE


def test_an_ended_or_missing_run_is_over_and_anything_else_unknown() -> None:
    for train in (TaskInstanceState.SUCCESS, TaskInstanceState.FAILED, "skipped", None):
        assert classify(DagRunState.FAILED, train) is RunActivity.OVER
    assert classify(None, None, run_exists=False) is RunActivity.OVER
    assert classify("paused-for-review", None) is RunActivity.UNKNOWN
    assert classify(None, None) is RunActivity.UNKNOWN  # exists but has no state: unknown
    assert classify(DagRunState.SUCCESS, "a-task-state-from-the-future") is RunActivity.UNKNOWN


class _Boxes:
    """A backend of listed boxes; terminate records what it was asked to end."""

    name = "listed"

    def __init__(self, infos: list[InstanceInfo]) -> None:
        self.infos, self.terminated = infos, []  # type: list[InstanceInfo], list[str]

    def list_managed(self) -> list[InstanceInfo]:
        return self.infos

    def terminate(self, ids: list[str]) -> None:
        self.terminated.extend(ids)


def _box(run_id: str) -> InstanceInfo:
    now = datetime.now(UTC)
    return InstanceInfo(
        instance_id=f"i-{run_id}",
        run_id=run_id,
        dag_id="burstcv_pipeline",
        state=RUNNING,
        expires_at=now + timedelta(hours=1),
        instance_type="g5.xlarge",
        lifecycle="spot",
        launched_at=now,
    )


def test_a_run_the_reaper_cannot_classify_keeps_its_box_with_a_warning() -> None:
    answers = {"odd": RunActivity.UNKNOWN, "over": RunActivity.OVER, "live": RunActivity.ACTIVE}
    backend = _Boxes([_box(r) for r in answers])
    report = reap(backend, run_activity=lambda dag, run: answers[run])  # type: ignore[arg-type]
    assert backend.terminated == ["i-over"]
    assert report.kept == ["i-odd", "i-live"]
    (warning,) = report.warnings
    assert "burstcv_pipeline/odd" in warning and "could not be classified" in warning
    assert report.warnings == [warning] and "1 warning(s)" in report.summary()


def test_a_yes_no_answer_is_refused_not_read_as_over() -> None:
    backend = _Boxes([_box("legacy")])
    report = reap(backend, run_activity=lambda dag, run: False)  # type: ignore[arg-type,return-value]
    assert backend.terminated == [] and report.kept == ["i-legacy"]
    assert "not a RunActivity" in report.errors[0].error
