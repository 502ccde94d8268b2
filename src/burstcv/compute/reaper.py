"""Terminate burstcv instances that outlived their expiry or their DAG run, whoever started them.

The reaper is the fourth of five layers against a leaked GPU: it trusts nothing but the tags
on the instances and the answer to "is this DAG run still running?", so it cleans up after an
orchestrator that died mid-run. Each pass first terminates every box past its expiry,
unconditionally (no question to Airflow is asked, so none can fail or keep it), then asks
Airflow about the rest. A box goes only when the answer is that its run is OVER
(:class:`RunActivity`); a run that is ACTIVE keeps its boxes, and so does one whose state the
question could not classify (UNKNOWN: kept, with a warning), because a reaper must not guess
that a run is over. An error about one box (a refused terminate, Airflow failing to answer) is
logged and counted in the report and never stops the others. It never
touches an instance without the burstcv tags (``list_managed`` only returns managed ones and
``terminate`` refuses the rest).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from burstcv.compute.base import STOPPED, ComputeBackend, InstanceInfo

log = logging.getLogger(__name__)

REASON_EXPIRED = "expired"
REASON_RUN_NOT_ACTIVE = "run-not-active"
REASON_UNTRACEABLE = "missing-run-tags"


class RunActivity(Enum):
    """Say whether a DAG run still owns its boxes: the reaper's one question to Airflow."""

    ACTIVE = "active"  # the run, or its train task, is still going: keep its boxes
    OVER = "over"  # the run ended (or never existed) and its train task is done
    UNKNOWN = "unknown"  # a state the question could not classify: keep, with a warning


RunActivityCheck = Callable[[str, str], RunActivity]


@dataclass(frozen=True)
class ReapDecision:
    """Say which instance the reaper terminates (or would) and why."""

    instance_id: str
    run_id: str
    dag_id: str
    reason: str
    detail: str


@dataclass(frozen=True)
class ReapError:
    """Say what went wrong about one box: it was left as it was, and the pass went on."""

    instance_id: str
    run_id: str
    step: str  # "check-run" (asking Airflow) or "terminate"
    error: str


@dataclass
class ReapReport:
    """List what one reaper pass found, terminated (or would), and kept."""

    checked_at: datetime
    dry_run: bool
    decisions: list[ReapDecision] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    errors: list[ReapError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

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
            "errors": [asdict(e) for e in self.errors],
            "warnings": list(self.warnings),
        }

    def summary(self) -> str:
        """Return one line for logs and the CLI."""
        verb = "would terminate" if self.dry_run else "terminated"
        errors = f"; {len(self.errors)} error(s)" if self.errors else ""
        errors += f"; {len(self.warnings)} warning(s)" if self.warnings else ""
        if not self.decisions:
            return (
                f"reaper: nothing to terminate ({len(self.kept)} managed instance(s) kept)" + errors
            )
        listed = ", ".join(f"{d.instance_id} ({d.reason})" for d in self.decisions)
        return f"reaper: {verb} {listed}; kept {len(self.kept)}{errors}"


def _expiry_decision(info: InstanceInfo) -> ReapDecision:
    expires_at = info.expires_at.isoformat() if info.expires_at else "?"
    return ReapDecision(
        info.instance_id, info.run_id, info.dag_id, REASON_EXPIRED, f"expired at {expires_at}"
    )


def decide(
    info: InstanceInfo, *, run_activity: RunActivityCheck, now: datetime
) -> ReapDecision | None:
    """Return why ``info`` must go, or None to keep it (its run is active or unclassified)."""
    if info.expires_at is not None and info.expires_at <= now:
        return _expiry_decision(info)
    if not info.run_id or not info.dag_id:
        return ReapDecision(
            info.instance_id,
            info.run_id,
            info.dag_id,
            REASON_UNTRACEABLE,
            "managed but without run-id/dag-id tags: no run can own it",
        )
    activity = run_activity(info.dag_id, info.run_id)
    if not isinstance(activity, RunActivity):
        raise TypeError(f"run_activity answered {activity!r}, not a RunActivity")
    if activity is RunActivity.OVER:
        return ReapDecision(
            info.instance_id,
            info.run_id,
            info.dag_id,
            REASON_RUN_NOT_ACTIVE,
            f"DAG run {info.dag_id}/{info.run_id} is not running",
        )
    return None


def _expired(info: InstanceInfo, now: datetime) -> bool:
    return info.expires_at is not None and info.expires_at <= now


def reap(
    backend: ComputeBackend,
    *,
    run_activity: RunActivityCheck,
    now: datetime | None = None,
    dry_run: bool = False,
    managed: list[InstanceInfo] | None = None,
) -> ReapReport:
    """Terminate managed instances whose expiry passed, then those whose DAG run is not running.

    ``run_activity(dag_id, run_id)`` answers from Airflow; when it raises for a box, that
    box is kept (and the error counted), and the pass goes on; when it answers UNKNOWN, the
    box is kept with a warning. ``managed`` is the backend's
    ``list_managed()`` when the caller already has it.
    """
    checked_at = now or datetime.now(UTC)
    report = ReapReport(checked_at=checked_at, dry_run=dry_run)
    live = [i for i in (backend.list_managed() if managed is None else managed)]
    live = [i for i in live if i.state != STOPPED]
    # Pass 1: past its expiry, a box goes whatever Airflow would say (Airflow may be down).
    for info in live:
        if _expired(info, checked_at):
            _terminate(backend, _expiry_decision(info), report)
    # Pass 2: ask Airflow about the rest, one box at a time.
    for info in live:
        if _expired(info, checked_at):
            continue
        try:
            decision = decide(
                info, run_activity=_noting_unknown(run_activity, report), now=checked_at
            )
        # Broad on purpose: counted in the report; the pass goes on.
        except Exception as exc:
            log.exception("reaper: could not check the run of %s; keeping it", info.instance_id)
            report.errors.append(
                ReapError(
                    info.instance_id, info.run_id, "check-run", f"{type(exc).__name__}: {exc}"
                )
            )
            report.kept.append(info.instance_id)
            continue
        if decision is None:
            report.kept.append(info.instance_id)
        else:
            _terminate(backend, decision, report)
    log.info("%s", report.summary())
    return report


def _noting_unknown(check: RunActivityCheck, report: ReapReport) -> RunActivityCheck:
    """Wrap ``check`` so that every UNKNOWN answer lands in the report's warnings."""

    def noted(dag_id: str, run_id: str) -> RunActivity:
        activity = check(dag_id, run_id)
        if activity is RunActivity.UNKNOWN:
            warning = (
                f"kept the boxes of {dag_id}/{run_id}: its state could not be classified "
                "(a reaper never guesses that a run is over; their expiry still ends them)"
            )
            log.warning("reaper: %s", warning)
            report.warnings.append(warning)
        return activity

    return noted


def _terminate(backend: ComputeBackend, decision: ReapDecision, report: ReapReport) -> None:
    """Terminate one box (or, on a dry run, say so); a failure is counted, never raised."""
    log.warning(
        "reaper: %s %s (run %s, dag %s): %s",
        "would terminate" if report.dry_run else "terminating",
        decision.instance_id,
        decision.run_id,
        decision.dag_id,
        decision.detail,
    )
    if not report.dry_run:
        try:
            backend.terminate([decision.instance_id])
        # Broad on purpose: counted in the report; the pass goes on.
        except Exception as exc:
            log.exception("reaper: could not terminate %s", decision.instance_id)
            report.errors.append(
                ReapError(
                    decision.instance_id,
                    decision.run_id,
                    "terminate",
                    f"{type(exc).__name__}: {exc}",
                )
            )
            return
    report.decisions.append(decision)
