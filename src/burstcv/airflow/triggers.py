"""Wait for a training job without holding a worker slot: an Airflow trigger on its markers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent


class TrainingCompletionTrigger(BaseTrigger):
    """Fire when the run's DONE or FAILED marker appears, or its boxes vanish without one."""

    def __init__(
        self,
        run_id: str,
        backend: str,
        output_uri: str,
        attempt: int = 1,
        poll_interval_s: float = 5.0,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseTrigger.__init__ has no annotations
        self.run_id = run_id
        self.backend = backend
        self.output_uri = output_uri
        self.attempt = attempt  # only this attempt's markers end the wait
        self.poll_interval_s = poll_interval_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Return the classpath and kwargs the triggerer rebuilds this trigger from."""
        return (
            "burstcv.airflow.triggers.TrainingCompletionTrigger",
            {
                "run_id": self.run_id,
                "backend": self.backend,
                "output_uri": self.output_uri,
                "attempt": self.attempt,
                "poll_interval_s": self.poll_interval_s,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Poll the artifact store and the backend until the job has an outcome."""
        from burstcv.pipeline import progress_lines, training_outcome

        logged = 0
        while True:
            # Storage and cloud calls are blocking: keep them off the triggerer's event loop.
            outcome = await asyncio.to_thread(
                training_outcome, self.run_id, self.backend, self.output_uri, self.attempt
            )
            # One line per finished epoch in the task log, as the box writes them.
            lines = await asyncio.to_thread(
                progress_lines, self.run_id, self.backend, self.output_uri, self.attempt, logged
            )
            for line in lines:
                self.log.info(line)
            logged += len(lines)
            if outcome["status"] != "running":
                yield TriggerEvent(outcome)
                return
            await asyncio.sleep(self.poll_interval_s)
