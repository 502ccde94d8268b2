"""Deploy an accepted version: stage it on every service, then move production to it."""

from __future__ import annotations

import logging

from burstcv.settings import Settings, get_settings
from burstcv_spec.contracts import Deployed, RunRef, VerdictRecord

log = logging.getLogger(__name__)


def deploy(run: RunRef, verdict: VerdictRecord, settings: Settings | None = None) -> Deployed:
    """Stage the accepted version on the services, then point production at it and switch."""
    from burstcv.registry.deploy import deploy as deploy_version
    from burstcv.registry.registry import Registry

    s = settings or get_settings()
    registry = Registry(s.registry_uri, s.model_name)
    urls = [u.strip().rstrip("/") for u in s.serving_url.split(",") if u.strip()]
    return deploy_version(
        registry,
        verdict.version,
        service_urls=urls,
        token=s.serving_admin_token,
        timeout_s=s.deploy_verify_timeout_s,
        actor=f"run:{run.airflow_run_id}",
    )


def deploy_skip_reason(verdict: VerdictRecord, *, promote: bool) -> str | None:
    """Return why deploy does not run (the failed checks with their figures), or None; logged
    here, so the deploy task's own log says why it skipped. ``promote`` is the run's param."""
    version = verdict.version
    if not verdict.promote:
        figures = verdict.failed_figures
        reason = f"version {version} not promoted: " + (
            "; ".join(figures) if figures else verdict.summary.removeprefix("not promoted: ")
        )
    elif not promote:
        reason = f"version {version} passed the gate but is not deployed: the run has promote=false"
    else:
        return None
    log.info("%s", reason)
    if not verdict.promote:
        log.info("gate: %s", verdict.summary)
    return reason
