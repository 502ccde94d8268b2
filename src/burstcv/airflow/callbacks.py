"""Small Airflow hooks the DAGs share: failure summaries and reading triggering Asset events."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("burstcv.airflow")
FAILURE_MARKER = "burstcv FAILED "  # begins each failure line (`burstcv run` reads them back)


def log_failure_summary(context: dict[str, Any]) -> None:
    """Log one line that says which task of which run failed, and why."""
    ti = context.get("task_instance") or context.get("ti")
    exc = context.get("exception")
    reason = str(exc).splitlines()[0] if exc else "no exception recorded"
    where = (
        f"{ti.dag_id}.{ti.task_id} run {ti.run_id} try {ti.try_number}" if ti else "unknown task"
    )
    log.error("%s%s: %s", FAILURE_MARKER, where, reason)


def dataset_from_asset_events(events: Any) -> str | None:
    """Return the dataset URI carried by the newest triggering Asset event, if any: its
    ``extra``'s ``dataset_uri`` (from an ingestion job or a POST /api/v2/assets/events)."""
    if not events:
        return None
    newest: tuple[Any, str] | None = None
    for asset_events in events.values():
        for event in asset_events:
            uri = (getattr(event, "extra", None) or {}).get("dataset_uri")
            stamp = getattr(event, "timestamp", None)
            if uri and (newest is None or (stamp is not None and stamp >= newest[0])):
                newest = (stamp, str(uri))
    return newest[1] if newest else None
