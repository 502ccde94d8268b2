"""Operators the burstcv DAGs use where a plain @task is not enough (deferral, on_kill)."""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from burstcv.airflow.triggers import TrainingCompletionTrigger

log = logging.getLogger(__name__)


class WaitForTrainingOperator(BaseOperator):
    """Defer until the training job of this run finishes; fail fast if its box is lost.

    ``on_kill`` (a user marking the task failed, a timeout) terminates every instance of the
    run: the second layer against a leaked GPU, after the teardown task.
    """

    template_fields = ("provisioned",)

    def __init__(self, *, provisioned: Any, poll_interval_s: float = 2.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.provisioned = provisioned
        self.poll_interval_s = poll_interval_s

    def execute(self, context: Any) -> None:
        """Hand the wait to the triggerer."""
        info = self.provisioned
        self.defer(
            trigger=TrainingCompletionTrigger(
                run_id=context["run_id"],
                backend=info["backend"],
                output_uri=info["output_uri"],
                poll_interval_s=self.poll_interval_s,
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        """Return the training figures, or fail with the box's own reason."""
        from burstcv.pipeline import TrainingFailed, collect_training

        try:
            return collect_training(context["run_id"], event)
        except TrainingFailed as exc:
            raise AirflowException(str(exc)) from exc

    def on_kill(self) -> None:
        """Terminate the run's instances when the task is killed."""
        from burstcv.pipeline import terminate

        info = self.provisioned
        if isinstance(info, dict) and info.get("backend"):
            log.warning("task killed: terminating instances of run %s", info["run_key"])
            terminate(info["run_key"], info["backend"])
