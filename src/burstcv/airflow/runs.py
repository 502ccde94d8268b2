"""Answer "is this DAG run still running?" for the reaper, from inside or outside a task."""

from __future__ import annotations

ACTIVE_STATES = ("queued", "running")


def dag_run_is_active_db(dag_id: str, run_id: str) -> bool:
    """Ask the metadata DB directly (the CLI, which runs beside the scheduler)."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        state = (
            session.query(DagRun.state)
            .filter(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
            .scalar()
        )
    return str(state) in ACTIVE_STATES


def dag_run_is_active_sdk(dag_id: str, run_id: str) -> bool:
    """Ask through the Task SDK's execution API (inside a task, where the ORM is off limits).

    A run the API does not know (deleted, or never existed) is not active.
    """
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    try:
        state = RuntimeTaskInstance.get_dagrun_state(dag_id=dag_id, run_id=run_id)
    except Exception as exc:  # the SDK raises its own error types for a missing run
        if "not found" in str(exc).lower() or "404" in str(exc):
            return False
        raise
    return str(state) in ACTIVE_STATES
