"""Operators the burstcv DAGs use where a plain @task is not enough (deferral, retry, on_kill)."""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from burstcv.airflow.triggers import TrainingCompletionTrigger
from burstcv_spec.contracts import Provisioned

log = logging.getLogger(__name__)


def _resumable(outcome: dict[str, Any]) -> bool:
    # A box that vanished (spot reclaim, crash) or was interrupted on purpose left a
    # checkpoint to continue from; a job that failed on its own would fail again.
    return outcome.get("status") == "lost" or bool(outcome.get("resumable"))


class WaitForTrainingOperator(BaseOperator):
    """Defer until the training job of this run finishes; fail fast if its box is lost.

    A retry of this task starts a new box when the last one was lost or interrupted, and
    the job resumes from its last checkpoint. ``on_kill`` (a user marking the task failed, a
    timeout) terminates every instance of the run: the second layer against a leaked GPU,
    after the teardown task.
    """

    template_fields = ("provisioned",)  # provision's XCom: Provisioned as JSON

    def __init__(self, *, provisioned: Any, poll_interval_s: float = 2.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.provisioned = provisioned
        self.poll_interval_s = poll_interval_s

    def execute(self, context: Any) -> Any:
        """Hand the wait to the triggerer (relaunching first if this is a retry after a loss)."""
        from burstcv.pipeline import (
            TrainingFailed,
            collect_training,
            current_attempt,
            failure_line,
            relaunch,
            training_outcome,
        )

        info = self._boxes()
        # The attempt the run waits for: provision's (its try number), or the last relaunch.
        attempt = current_attempt(info.output_uri)
        ti = context.get("ti") or context.get("task_instance")
        if ti is not None and getattr(ti, "try_number", 1) > 1:
            outcome = training_outcome(info.run.run_key, info.backend, info.output_uri, attempt)
            if outcome["status"] == "done":
                return collect_training(info.run, outcome).model_dump(mode="json")
            if outcome["status"] in ("lost", "failed"):
                if not _resumable(outcome):
                    self._log_box_tail(attempt)
                    raise AirflowFailException(failure_line(outcome))
                try:
                    attempt = relaunch(info)
                except TrainingFailed as exc:
                    raise AirflowFailException(str(exc)) from exc
        self.defer(
            trigger=TrainingCompletionTrigger(
                run_id=info.run.run_key,
                backend=info.backend,
                output_uri=info.output_uri,
                attempt=attempt,
                poll_interval_s=self.poll_interval_s,
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        """Return the training figures, or fail with the box's own reason (and its log tail)."""
        from burstcv.pipeline import TrainingFailed, collect_training

        try:
            return collect_training(self._boxes().run, event).model_dump(mode="json")
        except TrainingFailed as exc:
            self._log_box_tail(int(event.get("attempt", 1)))
            if _resumable(event):
                raise AirflowException(f"{exc} (a retry resumes from the checkpoint)") from exc
            log.error("%s", exc)
            raise AirflowFailException(str(exc)) from exc  # retrying cannot fix the job

    def _log_box_tail(self, attempt: int) -> None:
        """Show the end of the box's own log in this task's log."""
        from burstcv.pipeline import box_log_tail

        info = self._boxes()
        for line in box_log_tail(info.run.run_key, info.backend, info.output_uri, attempt):
            log.info("box | %s", line)

    def _boxes(self) -> Provisioned:
        """Return provision's result, rebuilt from its XCom JSON."""
        return Provisioned.model_validate(self.provisioned)

    def on_kill(self) -> None:
        """Terminate the run's instances when the task is killed."""
        from burstcv.pipeline import terminate

        if isinstance(self.provisioned, dict):  # else not rendered yet: nothing was read
            info = self._boxes()
            log.warning("task killed: terminating instances of run %s", info.run.run_key)
            terminate(info.run, info.backend)
