"""Move the production alias, tell the services, and verify they serve it; else move it back."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from burstcv.registry.registry import PREVIOUS, PRODUCTION, Registry

log = logging.getLogger(__name__)


class DeployError(RuntimeError):
    """Raise when a deploy could not be verified; the aliases were restored first."""


@dataclass
class DeployResult:
    """Say what was deployed where, and what each service reported."""

    version: int
    previous_version: int | None
    services: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "version": self.version,
            "previous_version": self.previous_version,
            "services": self.services,
        }


def notify_and_verify(
    urls: list[str], version: int, token: str, timeout_s: float
) -> dict[str, Any]:
    """Ask each service to reload, then wait until its /v1/model reports ``version``."""
    seen: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10.0) as client:
        for url in urls:
            try:
                client.post(f"{url}/v1/admin/reload", headers={"Authorization": f"Bearer {token}"})
            except httpx.HTTPError as exc:
                log.warning("reload request to %s failed (%s); waiting for its poll", url, exc)
        for url in urls:
            last: Any = None
            while time.monotonic() < deadline:
                try:
                    response = client.get(f"{url}/v1/model")
                    last = response.json() if response.status_code == 200 else response.status_code
                except (httpx.HTTPError, ValueError) as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if isinstance(last, dict) and last.get("version") == version:
                    break
                time.sleep(0.25)
            seen[url] = last
    return seen


def deploy(
    registry: Registry,
    version: int,
    *,
    service_urls: list[str],
    token: str,
    timeout_s: float,
    force: bool = False,
) -> DeployResult:
    """Promote ``version`` and verify every service serves it; restore the aliases if not."""
    before_prod, before_prev = registry.get_alias(PRODUCTION), registry.get_alias(PREVIOUS)
    old = registry.promote(version, force=force)
    result = DeployResult(version=version, previous_version=old.version if old else None)
    if not service_urls:
        log.warning("no serving URLs configured: version %d is live in the registry only", version)
        return result
    result.services = notify_and_verify(service_urls, version, token, timeout_s)
    failed = {
        url: got
        for url, got in result.services.items()
        if not (isinstance(got, dict) and got.get("version") == version)
    }
    if failed:
        registry.restore_aliases(before_prod, before_prev)
        if before_prod is not None:
            # Every service goes back, not only those that failed: one that already switched
            # would otherwise serve the undone version until its next poll (or forever).
            notify_and_verify(service_urls, before_prod.version, token, min(timeout_s, 10.0))
        detail = "; ".join(f"{url} reported {got!r}" for url, got in failed.items())
        raise DeployError(
            f"version {version} was not confirmed within {timeout_s:g}s ({detail}); production "
            f"alias restored to {before_prod.version if before_prod else 'none'}. Is the service "
            "running (make serve)? Set BURSTCV_SERVING_URL='' to deploy to the registry only."
        )
    log.info("version %d serving on %s", version, ", ".join(service_urls))
    return result
