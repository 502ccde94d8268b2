"""
# burstcv_reaper

The last layer against a leaked GPU. Every 10 minutes, terminate any burstcv-managed
training box whose **expiry has passed** or whose **DAG run is no longer running**, on every
backend in `BURSTCV_REAPER_BACKENDS`. It touches nothing without the burstcv tags, and it runs
independently of the pipeline run that leaked: the orchestrator itself can die mid-run.

Same logic from a shell: `burstcv reap --dry-run`.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import dag, task

from burstcv.settings import get_settings

SETTINGS = get_settings()


@dag(
    dag_id="burstcv_reaper",
    schedule=timedelta(minutes=10),
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    doc_md=__doc__,
    tags=["burstcv", "cost"],
    default_args={
        "owner": "burstcv",
        "retries": 2,
        "retry_delay": timedelta(minutes=1),
        "retry_exponential_backoff": True,
    },
)
def burstcv_reaper() -> None:
    """Wire the one reaping task."""

    @task(execution_timeout=timedelta(minutes=8))
    def reap() -> list[dict[str, Any]]:
        """Terminate expired or orphaned burstcv boxes on every configured backend."""
        from burstcv.airflow.runs import dag_run_is_active_sdk
        from burstcv.pipeline import reap as reap_backends

        names = [b.strip() for b in SETTINGS.reaper_backends.split(",") if b.strip()]
        return reap_backends(names, dag_run_is_active_sdk)

    reap()


burstcv_reaper()
