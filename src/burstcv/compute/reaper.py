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
from datetime import UTC, datetime
from enum import Enum
from typing import Final

from burstcv.compute.backends import get_backend
from burstcv.compute.base import STOPPED, ComputeBackend, InstanceInfo
from burstcv.settings import Settings
from burstcv_spec.contracts import ReapDecision, ReaperReport, ReapError

log = logging.getLogger(__name__)

REASON_EXPIRED: Final = "expired"
REASON_RUN_NOT_ACTIVE: Final = "run-not-active"
REASON_UNTRACEABLE: Final = "missing-run-tags"


class RunActivity(Enum):
    """Say whether a DAG run still owns its boxes: the reaper's one question to Airflow."""

    ACTIVE = "active"  # the run, or its train task, is still going: keep its boxes
    OVER = "over"  # the run ended (or never existed) and its train task is done
    UNKNOWN = "unknown"  # a state the question could not classify: keep, with a warning


RunActivityCheck = Callable[[str, str], RunActivity]


def _expiry_decision(info: InstanceInfo) -> ReapDecision:
    expires_at = info.expires_at.isoformat() if info.expires_at else "?"
    return ReapDecision(
        instance_id=info.instance_id,
        run_key=info.run_id,
        dag_id=info.dag_id,
        reason=REASON_EXPIRED,
        detail=f"expired at {expires_at}",
    )


def decide(
    info: InstanceInfo, *, run_activity: RunActivityCheck, now: datetime
) -> ReapDecision | None:
    """Return why ``info`` must go, or None to keep it (its run is active or unclassified)."""
    if info.expires_at is not None and info.expires_at <= now:
        return _expiry_decision(info)
    if not info.run_id or not info.dag_id:
        return ReapDecision(
            instance_id=info.instance_id,
            run_key=info.run_id,
            dag_id=info.dag_id,
            reason=REASON_UNTRACEABLE,
            detail="managed but without run-id/dag-id tags: no run can own it",
        )
    activity = run_activity(info.dag_id, info.run_id)
    if not isinstance(activity, RunActivity):
        raise TypeError(f"run_activity answered {activity!r}, not a RunActivity")
    if activity is RunActivity.OVER:
        return ReapDecision(
            instance_id=info.instance_id,
            run_key=info.run_id,
            dag_id=info.dag_id,
            reason=REASON_RUN_NOT_ACTIVE,
            detail=f"DAG run {info.dag_id}/{info.run_id} is not running",
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
    backend_name: str = "",
    region: str = "",
) -> ReaperReport:
    """Terminate managed instances whose expiry passed, then those whose DAG run is not running.

    ``run_activity(dag_id, run_id)`` answers from Airflow; when it raises for a box, that
    box is kept (and the error counted), and the pass goes on; when it answers UNKNOWN, the
    box is kept with a warning. ``managed`` is the backend's
    ``list_managed()`` when the caller already has it; ``backend_name`` and ``region`` name
    the sweep in the report.
    """
    checked_at = now or datetime.now(UTC)
    report = ReaperReport(
        backend=backend_name, region=region, checked_at=checked_at, dry_run=dry_run
    )
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
                    instance_id=info.instance_id,
                    run_key=info.run_id,
                    step="check-run",
                    error=f"{type(exc).__name__}: {exc}",
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
            report.errors.append(
                ReapError(
                    instance_id=decision.instance_id,
                    run_key=decision.run_key,
                    step="terminate",
                    error=f"{type(exc).__name__}: {exc}",
                )
            )
            return
    report.decisions.append(decision)


def reap_everywhere(
    backend_names: list[str] | None,
    run_activity: RunActivityCheck,
    *,
    dry_run: bool = False,
    settings: Settings,
) -> list[ReaperReport]:
    """Terminate managed boxes whose expiry passed or whose DAG run is over, everywhere.

    ``backend_names`` empty: the settings' (local, and ec2 whenever AWS is configured). EC2
    is swept in every configured region, or every region enabled for the account. One report
    per backend and region; an error about a backend, a region or one box is logged and
    counted in its report's ``errors`` and never stops the rest.

    ``run_activity(dag_id, airflow_run_id)`` answers from Airflow (active, over, or unknown:
    kept). Boxes are tagged with a path-safe run key; the raw Airflow run id travels in its
    own tag for this question.
    """
    reports = []
    for name, region, backend in _reaper_targets(
        backend_names or settings.reaper_backend_names(), settings
    ):
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
    """Remove the placement and security groups of expired runs with no box left (EC2).

    A run of several boxes has groups of its own; its teardown removes them, so only a run
    whose orchestrator died leaves them. They cost nothing, so an error is counted, not fatal.
    """
    remove = getattr(backend, "remove_expired_clusters", None)
    if remove is None:
        return
    try:
        remove(report.checked_at, {i.run_id for i in managed}, dry_run=report.dry_run)
    # Broad on purpose: counted in the report; the other backends and regions go on.
    except Exception as exc:
        log.exception("reaper: could not sweep the run groups in %s", report.region or "-")
        report.errors.append(
            ReapError(instance_id="", step="groups", error=f"{type(exc).__name__}: {exc}")
        )


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
        report.errors.append(
            ReapError(instance_id="", step="list", error=f"{type(exc).__name__}: {exc}")
        )
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
        if name != "ec2":
            try:
                targets.append((name, "", get_backend(name, settings)))
            # Broad on purpose: reported as that backend's error.
            except Exception as exc:
                targets.append((name, "", exc))
            continue
        from burstcv.compute.ec2 import Ec2Backend

        try:
            ec2 = settings.ec2
            regions = settings.reaper_region_names() or Ec2Backend(ec2).enabled_regions()
        # Broad on purpose: reported as that backend's error.
        except Exception as exc:
            targets.append((name, "", exc))
            continue
        for region in regions:
            targets.append((name, region, Ec2Backend(ec2.model_copy(update={"region": region}))))
    return targets
