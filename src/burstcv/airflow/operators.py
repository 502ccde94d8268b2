"""Operators the burstcv DAGs use where a plain @task is not enough (deferral, retry, on_kill)."""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from burstcv.airflow.triggers import TrainingCompletionTrigger
from burstcv_spec.contracts import Provisioned, TrainingOutcome

log = logging.getLogger(__name__)


class WaitForTrainingOperator(BaseOperator):
    """Defer until the training job of this run finishes; resume a lost box in the same try.

    A lost attempt is relaunched (within ``boxes.relaunch``'s bounds) and resumes from its
    checkpoint without spending an Airflow retry. ``on_kill`` terminates the run's instances:
    the second layer against a leaked GPU, after the teardown task.
    """

    template_fields = ("provisioned",)  # provision's XCom: Provisioned as JSON

    def __init__(self, *, provisioned: Any, poll_interval_s: float = 2.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.provisioned = provisioned
        self.poll_interval_s = poll_interval_s

    def execute(self, context: Any) -> Any:
        """Hand the wait to the triggerer (relaunching first if this is a retry after a loss)."""
        from burstcv.compute.attempts import current_attempt, training_outcome
        from burstcv.stages.boxes import collect_training

        info = self._boxes()
        # The attempt the run waits for: provision's (its try number), or the last relaunch.
        attempt = current_attempt(info.output_uri)
        ti = context.get("ti") or context.get("task_instance")
        if ti is not None and getattr(ti, "try_number", 1) > 1:
            outcome = training_outcome(
                info.run.run_key,
                info.backend,
                info.output_uri,
                attempt,
                boxes=info.launch.count,
            )
            if outcome.status == "done":
                return collect_training(info.run, outcome).model_dump(mode="json")
            if outcome.status in ("lost", "failed"):
                attempt = self._relaunch_or_fail(outcome)
        self._wait_for(attempt)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        """Return the training figures; relaunch a lost attempt; else fail with the box's reason."""
        from burstcv.stages.boxes import collect_training
        from burstcv.stages.resolve import TrainingFailed

        outcome = TrainingOutcome.model_validate(event)
        try:
            return collect_training(self._boxes().run, outcome).model_dump(mode="json")
        except TrainingFailed:
            attempt = self._relaunch_or_fail(outcome)
        self._wait_for(attempt)  # the same try waits for the next attempt
        return None

    def _relaunch_or_fail(self, outcome: TrainingOutcome) -> int:
        """Start the next attempt of a resumable outcome, or fail the task for good."""
        from burstcv.compute.attempts import resumable
        from burstcv.stages.boxes import relaunch
        from burstcv.stages.resolve import TrainingFailed

        attempt = outcome.attempt
        if not resumable(outcome):
            self._log_box_tail(attempt)
            log.error("%s", outcome.line())
            raise AirflowFailException(outcome.line())  # retrying cannot fix the job
        log.warning("%s; relaunching in this try", outcome.line())
        try:
            return relaunch(self._boxes())
        except TrainingFailed as exc:
            self._log_box_tail(attempt)
            raise AirflowFailException(str(exc)) from exc

    def _wait_for(self, attempt: int) -> None:
        """Defer to the trigger that watches one attempt's markers and boxes."""
        from burstcv.stages.resolve import resolved_run

        info = self._boxes()
        self.defer(
            trigger=TrainingCompletionTrigger(
                run_id=info.run.run_key,
                backend=info.backend,
                output_uri=info.output_uri,
                attempt=attempt,
                poll_interval_s=self.poll_interval_s,
                max_cost_usd=resolved_run(info.run).costs.training_usd,
                boxes=info.launch.count,
            ),
            method_name="execute_complete",
        )

    def _log_box_tail(self, attempt: int) -> None:
        """Show the end of the box's own log in this task's log."""
        from burstcv.compute.attempts import box_log_tail

        info = self._boxes()
        for line in box_log_tail(info.run.run_key, info.backend, info.output_uri, attempt):
            log.info("box | %s", line)

    def _boxes(self) -> Provisioned:
        """Return provision's result, rebuilt from its XCom JSON."""
        return Provisioned.model_validate(self.provisioned)

    def on_kill(self) -> None:
        """Terminate the run's instances when the task is killed."""
        from burstcv.stages.boxes import terminate

        if isinstance(self.provisioned, dict):  # else not rendered yet: nothing was read
            info = self._boxes()
            log.warning("task killed: terminating instances of run %s", info.run.run_key)
            terminate(info.run, info.backend)
