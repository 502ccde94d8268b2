"""
# burstcv_reaper

A layer against a leaked GPU, **on from the start** (created unpaused). Every 10 minutes,
terminate any burstcv-managed training box whose **expiry has passed** (first, whatever
Airflow says) or whose **DAG run is over** (ended or gone, with its `train` task done), on
every backend the deployment uses (`BURSTCV_REAPER_BACKENDS`; by default local, and EC2
whenever AWS is configured) and in every EC2 region (`BURSTCV_REAPER_REGIONS`, by default
every region enabled for the account). A run whose `train` task is queued, running or deferred
keeps its boxes, and so does a run whose state cannot be classified (a warning in this task's
log): a reaper never guesses that a run is over. An error about one box is logged and counted
and never stops the others; the task fails after the whole pass when any error was counted.
It touches nothing without the burstcv tags, and it runs independently of the pipeline run
that leaked: the orchestrator itself can die.

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
    # A safety net that waits to be switched on is no safety net.
    is_paused_upon_creation=False,
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
        """Terminate expired or orphaned burstcv boxes on every backend and region."""
        from burstcv.airflow.runs import run_activity_sdk
        from burstcv.compute.reaper import reap_errors, reap_everywhere

        reports = reap_everywhere(
            SETTINGS.reaper_backend_names(), run_activity_sdk, settings=SETTINGS
        )
        if errors := reap_errors(reports):
            lines = "; ".join(r.summary() for r in reports if r.errors)
            raise RuntimeError(f"reaper pass done with {errors} error(s): {lines}")
        return [report.model_dump(mode="json") for report in reports]

    reap()


burstcv_reaper()
