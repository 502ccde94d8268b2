"""Terminate burstcv instances that outlived their expiry or their DAG run, whoever started them.

The fourth of five layers against a leaked GPU (DESIGN.md): it trusts nothing but the
instances' tags and Airflow's answer to "is this DAG run still running?". A run ACTIVE or
UNKNOWN (kept, with a warning) keeps its boxes: a reaper must not guess that a run is over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from enum import Enum
from typing import Final, Literal

from burstcv.compute.backends import get_backend
from burstcv.compute.base import STOPPED, ComputeBackend, InstanceInfo
from burstcv.settings import Settings
from burstcv_spec.contracts import ReapDecision, ReaperReport, ReapError

log = logging.getLogger(__name__)

REASON_EXPIRED: Final = "expired"
REASON_RUN_NOT_ACTIVE: Final = "run-not-active"
REASON_UNTRACEABLE: Final = "missing-run-tags"
Reason = Literal["expired", "run-not-active", "missing-run-tags"]
Step = Literal["list", "check-run", "terminate", "groups"]


class RunActivity(Enum):
    """Say whether a DAG run still owns its boxes: the reaper's one question to Airflow."""

    ACTIVE = "active"  # the run, or its train task, is still going: keep its boxes
    OVER = "over"  # the run ended (or never existed) and its train task is done
    UNKNOWN = "unknown"  # a state the question could not classify: keep, with a warning


RunActivityCheck = Callable[[str, str], RunActivity]


def _decision(info: InstanceInfo, reason: Reason, detail: str) -> ReapDecision:
    return ReapDecision(
        instance_id=info.instance_id,
        run_key=info.run_id,
        dag_id=info.dag_id,
        reason=reason,
        detail=detail,
    )


def _error(step: Step, exc: BaseException, instance_id: str = "", run_key: str = "") -> ReapError:
    """Return the report's record of an error, which never stops the pass."""
    return ReapError(
        instance_id=instance_id, run_key=run_key, step=step, error=f"{type(exc).__name__}: {exc}"
    )


def _expiry_decision(info: InstanceInfo) -> ReapDecision:
    expires_at = info.expires_at.isoformat() if info.expires_at else "?"
    return _decision(info, REASON_EXPIRED, f"expired at {expires_at}")


def decide(
    info: InstanceInfo, *, run_activity: RunActivityCheck, now: datetime
) -> ReapDecision | None:
    """Return why ``info`` must go, or None to keep it (its run is active or unclassified)."""
    if _expired(info, now):
        return _expiry_decision(info)
    if not info.run_id or not info.dag_id:
        why = "managed but without run-id/dag-id tags: no run can own it"
        return _decision(info, REASON_UNTRACEABLE, why)
    activity = run_activity(info.dag_id, info.run_id)
    if not isinstance(activity, RunActivity):
        raise TypeError(f"run_activity answered {activity!r}, not a RunActivity")
    if activity is RunActivity.OVER:
        why = f"DAG run {info.dag_id}/{info.run_id} is not running"
        return _decision(info, REASON_RUN_NOT_ACTIVE, why)
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
    backend_name: str = "",
    region: str = "",
) -> ReaperReport:
    """Terminate managed instances whose expiry passed, then those whose DAG run is not running;
    a box ``run_activity`` raises for is kept (the error counted)."""
    checked_at = now or datetime.now(UTC)
    report = ReaperReport(
        backend=backend_name, region=region, checked_at=checked_at, dry_run=dry_run
    )
    listed = backend.list_managed() if managed is None else managed
    live = [i for i in listed if i.state != STOPPED]
    # Pass 1: past its expiry, a box goes whatever Airflow would say (Airflow may be down).
    for info in live:
        if _expired(info, checked_at):
            _terminate(backend, _expiry_decision(info), report)
    # Pass 2: ask Airflow about the rest, one box at a time.
    noting = _noting_unknown(run_activity, report)
    for info in (i for i in live if not _expired(i, checked_at)):
        try:
            decision = decide(info, run_activity=noting, now=checked_at)
        # Broad on purpose: counted in the report; the pass goes on.
        except Exception as exc:
            log.exception("reaper: could not check the run of %s; keeping it", info.instance_id)
            report.errors.append(_error("check-run", exc, info.instance_id, info.run_id))
            report.kept.append(info.instance_id)
            continue
        if decision is None:
            report.kept.append(info.instance_id)
        else:
            _terminate(backend, decision, report)
    log.info("%s", report.summary())
    return report


def _noting_unknown(check: RunActivityCheck, report: ReaperReport) -> RunActivityCheck:
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


def _terminate(backend: ComputeBackend, decision: ReapDecision, report: ReaperReport) -> None:
    """Terminate one box (or, on a dry run, say so); a failure is counted, never raised."""
    log.warning(
        "reaper: %s %s (run %s, dag %s): %s",
        "would terminate" if report.dry_run else "terminating",
        decision.instance_id,
        decision.run_key,
        decision.dag_id,
        decision.detail,
    )
    if not report.dry_run:
        try:
            backend.terminate([decision.instance_id])
        # Broad on purpose: counted in the report; the pass goes on.
        except Exception as exc:
            log.exception("reaper: could not terminate %s", decision.instance_id)
            report.errors.append(_error("terminate", exc, decision.instance_id, decision.run_key))
            return
    report.decisions.append(decision)


def reap_everywhere(
    backend_names: list[str] | None,
    run_activity: RunActivityCheck,
    *,
    dry_run: bool = False,
    settings: Settings,
) -> list[ReaperReport]:
    """Terminate managed boxes whose expiry passed or whose DAG run is over, everywhere: EC2 in
    every configured region, else every region enabled for the account, one report each.
    ``run_activity`` is asked with the raw Airflow run id (its own tag), not the run key."""
    reports = []
    names = backend_names or settings.reaper_backend_names()
    for name, region, backend in _reaper_targets(names, settings):
        try:
            if isinstance(backend, BaseException):
                raise backend
            managed = backend.list_managed()
        # Broad on purpose: counted in the report; the other backends and regions go on.
        except Exception as exc:
            log.exception("reaper: could not list %s boxes in %s", name, region or "-")
            reports.append(_failed_sweep(name, region, exc, dry_run))
            continue
        raw_ids = {(i.dag_id, i.run_id): i.airflow_run_id or i.run_id for i in managed}

        def activity(
            dag_id: str, run_key: str, raw_ids: dict[tuple[str, str], str] = raw_ids
        ) -> RunActivity:
            return run_activity(dag_id, raw_ids.get((dag_id, run_key), run_key))

        report = reap(
            backend,
            run_activity=activity,
            dry_run=dry_run,
            managed=managed,
            backend_name=name,
            region=region,
        )
        reports.append(report)
        _remove_expired_clusters(backend, managed, report)
    return reports


def _remove_expired_clusters(
    backend: ComputeBackend, managed: list[InstanceInfo], report: ReaperReport
) -> None:
    """Remove the groups of expired runs with no box left (EC2); an error is counted, not fatal."""
    remove = getattr(backend, "remove_expired_clusters", None)
    if remove is None:
        return
    try:
        remove(report.checked_at, {i.run_id for i in managed}, dry_run=report.dry_run)
    # Broad on purpose: counted in the report; the other backends and regions go on.
    except Exception as exc:
        log.exception("reaper: could not sweep the run groups in %s", report.region or "-")
        report.errors.append(_error("groups", exc))


def reap_errors(reports: list[ReaperReport]) -> int:
    """Return how many errors a reaper pass counted over all its reports."""
    return sum(len(r.errors) for r in reports)


def _failed_sweep(backend: str, region: str, exc: BaseException, dry_run: bool) -> ReaperReport:
    report = ReaperReport(
        backend=backend, region=region, checked_at=datetime.now(UTC), dry_run=dry_run
    )
    if _no_credentials(exc):
        # Nothing could have been launched from here without credentials either: a warning,
        # not a failed pass (a stack whose AWS settings name no credentials yet).
        report.warnings.append(f"{backend} not swept: no AWS credentials ({exc})")
        log.warning("reaper: %s", report.warnings[-1])
    else:
        report.errors.append(_error("list", exc))
    return report


def _no_credentials(exc: BaseException) -> bool:
    """Return whether ``exc`` says that no AWS credentials were found at all."""
    try:
        from botocore.exceptions import NoCredentialsError
    except ImportError:  # pragma: no cover - botocore comes with the amazon provider
        return False
    return isinstance(exc, NoCredentialsError)


def _reaper_targets(
    names: list[str], settings: Settings
) -> list[tuple[str, str, ComputeBackend | BaseException]]:
    """Return (backend name, region, backend or the error that prevented making it)."""
    targets: list[tuple[str, str, ComputeBackend | BaseException]] = []
    for name in names:
        try:
            if name != "ec2":
                targets.append((name, "", get_backend(name, settings)))
                continue
            from burstcv.compute.ec2 import Ec2Backend

            ec2 = settings.ec2
            regions = settings.reaper_region_names() or Ec2Backend(ec2).enabled_regions()
        # Broad on purpose: reported as that backend's error.
        except Exception as exc:
            targets.append((name, "", exc))
            continue
        targets += [(name, r, Ec2Backend(ec2.model_copy(update={"region": r}))) for r in regions]
    return targets
