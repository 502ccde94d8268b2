"""Terminate burstcv instances that outlived their expiry or their DAG run, whoever started them.

The reaper is the last of the four layers against a leaked GPU: it trusts nothing but the tags
on the instances and the answer to "is this DAG run still running?", so it cleans up after an
orchestrator that died mid-run. It never touches an instance without the burstcv tags
(``list_managed`` only returns managed ones and ``terminate`` refuses the rest).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from burstcv.compute.base import STOPPED, ComputeBackend, InstanceInfo

log = logging.getLogger(__name__)

REASON_EXPIRED = "expired"
REASON_RUN_NOT_ACTIVE = "run-not-active"
REASON_UNTRACEABLE = "missing-run-tags"


@dataclass(frozen=True)
class ReapDecision:
    """Say which instance the reaper terminates (or would) and why."""

    instance_id: str
    run_id: str
    dag_id: str
    reason: str
    detail: str


@dataclass
class ReapReport:
    """List what one reaper pass found, terminated (or would), and kept."""

    checked_at: datetime
    dry_run: bool
    decisions: list[ReapDecision] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    @property
    def instance_ids(self) -> list[str]:
        """Return the ids terminated (or, on a dry run, that would be)."""
        return [d.instance_id for d in self.decisions]

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "checked_at": self.checked_at.isoformat(),
            "dry_run": self.dry_run,
            "terminated" if not self.dry_run else "would_terminate": [
                asdict(d) for d in self.decisions
            ],
            "kept": list(self.kept),
        }

    def summary(self) -> str:
        """Return one line for logs and the CLI."""
        verb = "would terminate" if self.dry_run else "terminated"
        if not self.decisions:
            return f"reaper: nothing to terminate ({len(self.kept)} managed instance(s) kept)"
        listed = ", ".join(f"{d.instance_id} ({d.reason})" for d in self.decisions)
        return f"reaper: {verb} {listed}; kept {len(self.kept)}"


def decide(
    info: InstanceInfo, *, is_run_active: Callable[[str, str], bool], now: datetime
) -> ReapDecision | None:
    """Return why ``info`` must go, or None to keep it."""
    if info.expires_at is not None and info.expires_at <= now:
        return ReapDecision(
            info.instance_id,
            info.run_id,
            info.dag_id,
            REASON_EXPIRED,
            f"expired at {info.expires_at.isoformat()}",
        )
    if not info.run_id or not info.dag_id:
        return ReapDecision(
            info.instance_id,
            info.run_id,
            info.dag_id,
            REASON_UNTRACEABLE,
            "managed but without run-id/dag-id tags: no run can own it",
        )
    if not is_run_active(info.dag_id, info.run_id):
        return ReapDecision(
            info.instance_id,
            info.run_id,
            info.dag_id,
            REASON_RUN_NOT_ACTIVE,
            f"DAG run {info.dag_id}/{info.run_id} is not running",
        )
    return None


def reap(
    backend: ComputeBackend,
    *,
    is_run_active: Callable[[str, str], bool],
    now: datetime | None = None,
    dry_run: bool = False,
) -> ReapReport:
    """Terminate managed instances whose expiry passed or whose DAG run is not running.

    ``is_run_active(dag_id, run_id)`` answers from Airflow; if it raises, nothing is
    terminated and the error propagates (a reaper must not guess that a run is over).
    """
    checked_at = now or datetime.now(UTC)
    report = ReapReport(checked_at=checked_at, dry_run=dry_run)
    for info in backend.list_managed():
        if info.state == STOPPED:
            continue
        decision = decide(info, is_run_active=is_run_active, now=checked_at)
        if decision is None:
            report.kept.append(info.instance_id)
        else:
            report.decisions.append(decision)
    for decision in report.decisions:
        log.warning(
            "reaper: %s %s (run %s, dag %s): %s",
            "would terminate" if dry_run else "terminating",
            decision.instance_id,
            decision.run_id,
            decision.dag_id,
            decision.detail,
        )
    if report.decisions and not dry_run:
        backend.terminate(report.instance_ids)
    log.info("%s", report.summary())
    return report
