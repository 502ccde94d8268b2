"""Deploy a registry version in two phases, so production only ever names a version that serves.

1. Stage: every service loads, verifies and warms the version beside the model it serves,
   in parallel; the first refusal ends the deploy, in that service's words.
2. Switch: under the alias lock (held only here: no model bytes move), production moves by
   compare-and-swap from the version read before staging, and every service must reload and
   answer with the new version; if one does not, production is put back and all reload.

An unreachable service, or a 503 (restarting, loading, shedding load), is no refusal: each call
is retried with backoff until the deploy's timeout. Only the service's own answer refuses.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from pathlib import Path
from typing import Any

import httpx

from burstcv.registry.registry import (
    CURRENT,
    PREVIOUS,
    PRODUCTION,
    AliasConflictError,
    AliasWriter,
    Current,
    Registry,
    RegistryError,
    version_name,
)
from burstcv_spec import storage
from burstcv_spec.contracts import Deployed

log = logging.getLogger(__name__)


class DeployError(RuntimeError):
    """Raise when a deploy did not happen; the message is one line saying why, and what moved."""


def one_line(text: str) -> str:
    """Collapse whitespace (a service's multi-line error included) into one line."""
    return " ".join(text.split())


def _service_words(response: httpx.Response) -> str:
    """Return what a service said about a refused call: its ``detail``, else its body."""
    try:
        body = response.json()
    except ValueError:
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    text = detail if isinstance(detail, str) else response.text or response.reason_phrase
    return one_line(f"HTTP {response.status_code}: {text}")


RETRY_FIRST_S = 0.25  # the first wait before calling an unreachable service again
RETRY_MAX_S = 2.0  # the longest wait between two calls
# Not refusals: the service is not there yet (restarting) or not ready (loading, shedding).
UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
NOT_READY = 503


class Unreachable(RuntimeError):
    """Raise when a service could not be reached before the deploy's timeout."""


def post_until_answered(
    client: httpx.Client, url: str, *, timeout_s: float, **kwargs: Any
) -> httpx.Response:
    """POST to a service, retrying with backoff while it is unreachable or answers 503; return
    its first other answer (or its last 503 at ``timeout_s``), or raise Unreachable."""
    deadline = time.monotonic() + timeout_s
    delay, tries = RETRY_FIRST_S, 0
    while True:
        tries += 1
        left = max(0.5, deadline - time.monotonic())
        try:
            response = client.post(url, timeout=left, **kwargs)
        except UNREACHABLE as exc:
            why = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay >= deadline:
                raise Unreachable(one_line(f"{why} ({tries} tries over {timeout_s:g} s)")) from exc
        else:
            if response.status_code != NOT_READY or time.monotonic() + delay >= deadline:
                return response
            why = f"HTTP {NOT_READY}"
        log.info("%s: %s; calling again in %.2f s", url, one_line(why), delay)
        time.sleep(delay)
        delay = min(2 * delay, RETRY_MAX_S)


def _admin_call(
    client: httpx.Client, url: str, token: str, timeout_s: float, **kwargs: Any
) -> tuple[Any, str]:
    """POST an admin call to a service; return (its JSON answer, "") or (None, why not)."""
    try:
        response = post_until_answered(
            client, url, timeout_s=timeout_s, headers={"Authorization": f"Bearer {token}"}, **kwargs
        )
    except Unreachable as exc:
        return None, str(exc)
    except httpx.HTTPError as exc:
        return None, one_line(f"{type(exc).__name__}: {exc}")
    if response.status_code != 200:
        return None, _service_words(response)
    return response.json(), ""


def _whose(registry: Registry) -> dict[str, str]:
    """Return the registry (absolute, as the service host may see it) and model of a deploy."""
    root = registry.layout.registry_uri
    where = root.rstrip("/") if storage.is_s3(root) else str(Path(root).resolve())
    return {"registry": where, "model": registry.model_name}


def stage_everywhere(
    urls: list[str], version: int, sha256: str, token: str, timeout_s: float, whose: dict[str, str]
) -> dict[str, Any]:
    """Have every service load and warm ``version`` without switching; return their answers.
    Raise DeployError, in the first refusing service's words, as soon as it refuses."""
    # whose names the registry and model, so that another registry's service refuses.
    body = {"version": version, "sha256": sha256, **whose}

    def stage_one(url: str) -> tuple[str, Any, str]:
        with httpx.Client() as client:
            return url, *_admin_call(client, f"{url}/v1/admin/stage", token, timeout_s, json=body)

    answers: dict[str, Any] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(urls)))
    try:
        for future in concurrent.futures.as_completed([pool.submit(stage_one, u) for u in urls]):
            url, answer, why = future.result()
            if answer is None:
                raise DeployError(f"{url} cannot serve version {version}: {why}")
            answers[url] = answer
    finally:
        # On a refusal the remaining calls finish on their own (bounded by the timeout).
        pool.shutdown(wait=False, cancel_futures=True)
    return answers


def switch_everywhere(
    urls: list[str], version: int, token: str, timeout_s: float
) -> tuple[dict[str, Any], dict[str, str]]:
    """Ask every service to reload the alias; return (answers, why each failed one failed)."""
    seen: dict[str, Any] = {}
    failed: dict[str, str] = {}
    with httpx.Client() as client:
        for url in urls:
            answer, why = _admin_call(client, f"{url}/v1/admin/reload", token, timeout_s)
            if why:
                seen[url] = failed[url] = why
            else:
                seen[url] = answer
                if answer.get("version") != version:
                    failed[url] = f"it serves version {answer.get('version')}, not {version}"
    return seen, failed


def deploy(
    registry: Registry,
    version: int,
    *,
    service_urls: list[str],
    token: str,
    timeout_s: float,
    force: bool = False,
    actor: str = "api",
    action: str = "promote",
    expect: int | Current | None = CURRENT,
) -> Deployed:
    """Stage ``version`` on every service, then move production to it and switch them.

    ``expect``: the version production must hold (by default what it holds at the start).
    Raise DeployError, one line, when the deploy did not happen or was undone.
    """
    before = registry.get_alias(PRODUCTION)
    expected = (before.version if before else None) if isinstance(expect, Current) else expect

    def refuse(why: str) -> None:
        registry.record(
            actor=actor,
            action=action,
            alias=PRODUCTION,
            from_version=expected,
            to_version=version,
            result="refused",
            detail=why,
        )

    try:
        registry.check_promotable(version, force=force)
    except RegistryError as exc:
        refuse(str(exc))
        raise
    sha256 = registry.model_card(version).sha256
    urls = [url.rstrip("/") for url in service_urls]
    staged: dict[str, Any] = {}
    if urls:
        try:
            staged = stage_everywhere(urls, version, sha256, token, timeout_s, _whose(registry))
        except DeployError as exc:
            refuse(str(exc))
            raise DeployError(f"{exc}; production left at {version_name(expected)}") from None
    else:
        log.warning(
            "no serving URLs configured: version %d goes live in the registry only", version
        )
    with registry.aliases_locked(actor) as aliases:
        previous, services = _switch(aliases, version, expected, urls, token, timeout_s, action)
    return Deployed(version=version, previous_version=previous, services=services, staged=staged)


def _switch(
    aliases: AliasWriter,
    version: int,
    expected: int | None,
    urls: list[str],
    token: str,
    timeout_s: float,
    action: str,
) -> tuple[int | None, dict[str, Any]]:
    """Move production to ``version`` and have every service serve it, else move it back;
    return (the version production held before, the services' answers)."""
    previous_before, production_before = aliases.read(PREVIOUS), aliases.read(PRODUCTION)
    try:
        old = aliases.promote(version, expect=expected, action=action)
    except AliasConflictError as exc:
        raise DeployError(
            f"{exc.alias} was moved to {version_name(exc.found)} while version {version} was "
            "being staged; that move was left alone (run the command again to replace it)"
        ) from None
    services, failed = switch_everywhere(urls, version, token, timeout_s) if urls else ({}, {})
    if not failed:
        if urls:
            log.info("version %d serving on %s", version, ", ".join(urls))
        return (old.version if old else None), services
    why = "; ".join(f"{url}: {words}" for url, words in failed.items())
    if old is not None and old.version == version:
        raise DeployError(f"version {version} is production but not served: {why}")
    if aliases.undo(version, production=production_before, previous=previous_before):
        undone = f"production restored to {version_name(expected)}"
        # Every service goes back, not only those that failed: one that already switched
        # would otherwise serve the undone version until its next poll.
        if expected is not None:
            switch_everywhere(urls, expected, token, timeout_s)
    else:
        now = aliases.read(PRODUCTION)
        undone = (
            f"production was moved on to {version_name(now.version if now else None)} "
            "meanwhile and was left alone"
        )
    raise DeployError(f"version {version} failed to switch ({why}); {undone}")


def rollback(
    registry: Registry,
    *,
    service_urls: list[str],
    token: str,
    timeout_s: float,
    actor: str = "api",
) -> Deployed:
    """Deploy the previous version in place of production (staged first, like any deploy)."""
    current, previous = registry.get_alias(PRODUCTION), registry.get_alias(PREVIOUS)
    if current is None or previous is None:
        raise RegistryError(f"{registry.model_name} has no previous version to roll back to")
    # Forced: the previous version served in production already, whatever its gate said.
    return deploy(
        registry,
        previous.version,
        service_urls=service_urls,
        token=token,
        timeout_s=timeout_s,
        force=True,
        actor=actor,
        action="rollback",
        expect=current.version,
    )
