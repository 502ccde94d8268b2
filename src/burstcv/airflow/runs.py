"""Answer "is this DAG run still going?" for the reaper, from inside or outside a task.

Never a guess: a run whose ``train`` task is live is ACTIVE whatever the run's state says; a
run that ended (or does not exist) with ``train`` done is OVER; any other state is UNKNOWN,
and the reaper keeps its boxes. States are compared by *value*: Airflow hands out enums or
strings, and ``str()`` of an enum is its qualified name (``'DagRunState.RUNNING'``).
"""

from __future__ import annotations

import logging
from typing import Any

from burstcv.compute.reaper import RunActivity

log = logging.getLogger(__name__)

TRAIN_TASK_ID = "train"  # the task that waits on the boxes (dags/burstcv_pipeline.py)
ACTIVE_RUN_STATES = frozenset({"queued", "running"})
OVER_RUN_STATES = frozenset({"success", "failed"})
# Every task state in which the train task still owns (or is about to own) its boxes.
LIVE_TASK_STATES = frozenset(
    {
        "scheduled",
        "queued",
        "running",
        "deferred",
        "restarting",
        "up_for_retry",
        "up_for_reschedule",
    }
)
# Task states in which it is over with them (or never started).
DONE_TASK_STATES = frozenset(
    {"success", "failed", "skipped", "upstream_failed", "removed", "none", ""}
)


def state_value(state: Any) -> str:
    """Return a run or task state as its lower-case value (``None`` is ``"none"``)."""
    if state is None:
        return "none"
    return str(getattr(state, "value", state)).strip().lower()


def classify(run_state: Any, train_state: Any, *, run_exists: bool = True) -> RunActivity:
    """Return whether a run still owns its boxes, from its state and its train task's."""
    train = state_value(train_state)
    if train in LIVE_TASK_STATES:
        return RunActivity.ACTIVE
    if train not in DONE_TASK_STATES:
        return RunActivity.UNKNOWN
    if not run_exists:
        return RunActivity.OVER
    run = state_value(run_state)
    if run in ACTIVE_RUN_STATES:
        return RunActivity.ACTIVE
    if run in OVER_RUN_STATES:
        return RunActivity.OVER
    return RunActivity.UNKNOWN


def run_activity_db(dag_id: str, run_id: str) -> RunActivity:
    """Ask the metadata DB directly (the CLI, which runs beside the scheduler)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as session:
        run_state = (
            session.query(DagRun.state)
            .filter(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
            .one_or_none()
        )
        train_state = (
            session.query(TaskInstance.state)
            .filter(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == TRAIN_TASK_ID,
            )
            .scalar()
        )
    return _judged(
        dag_id,
        run_id,
        run_state[0] if run_state else None,
        train_state,
        run_exists=run_state is not None,
    )


def run_activity_sdk(dag_id: str, run_id: str) -> RunActivity:
    """Ask through the Task SDK's execution API (inside a task, where the ORM is off limits);
    a run the API does not know (deleted, or never existed) is OVER."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    states = RuntimeTaskInstance.get_task_states(
        dag_id=dag_id, task_ids=[TRAIN_TASK_ID], run_ids=[run_id]
    )
    train_state = (states.get(run_id) or {}).get(TRAIN_TASK_ID)
    if state_value(train_state) in LIVE_TASK_STATES:
        return _judged(dag_id, run_id, None, train_state)
    try:
        run_state = RuntimeTaskInstance.get_dagrun_state(dag_id=dag_id, run_id=run_id)
    except Exception as exc:  # the SDK raises its own error types for a missing run
        if "not found" in str(exc).lower() or "404" in str(exc):
            return _judged(dag_id, run_id, None, train_state, run_exists=False)
        raise
    return _judged(dag_id, run_id, run_state, train_state)


def _judged(
    dag_id: str, run_id: str, run_state: Any, train_state: Any, *, run_exists: bool = True
) -> RunActivity:
    activity = classify(run_state, train_state, run_exists=run_exists)
    log.info(
        "reaper: run %s/%s is %s (run state %s, %s task %s)",
        dag_id,
        run_id,
        activity.value,
        state_value(run_state) if run_exists else "not found",
        TRAIN_TASK_ID,
        state_value(train_state),
    )
    return activity


def failed_tasks(dag_id: str, run_id: str, *, besides: str) -> list[str]:
    """Return the ids of the run's failed tasks (``besides`` left out), through the Task SDK."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    states = RuntimeTaskInstance.get_task_states(dag_id=dag_id, run_ids=[run_id])
    return sorted(
        task_id
        for task_id, state in (states.get(run_id) or {}).items()
        if task_id != besides and state_value(state) == "failed"
    )
