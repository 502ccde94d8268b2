"""The prediction service's rule for its admin token, shared with the stack check.

``burstcv check-stack`` applies it before a compose stack starts, so a weak token stops the
stack at init, named, instead of a service that restarts in a loop.
"""

from __future__ import annotations

import ipaddress

PLACEHOLDER_ADMIN_TOKEN = "dev-token"
# Off the loopback interface anyone on the network can try the admin door: a token shorter
# than this is guessable (secrets.token_urlsafe(32) gives 43 characters).
MIN_EXPOSED_ADMIN_TOKEN_CHARS = 16


def admin_token_problem(token: str, host: str, environment: str) -> str | None:
    """Return why the service refuses ``token`` on ``host`` in ``environment``, or None."""
    if not token:
        return "BURSTCV_SERVING_ADMIN_TOKEN must not be empty"
    # Off loopback whatever the environment: listening beyond this machine exposes the door.
    if not is_loopback(host) and (
        token == PLACEHOLDER_ADMIN_TOKEN or len(token) < MIN_EXPOSED_ADMIN_TOKEN_CHARS
    ):
        what = (
            "the development placeholder"
            if token == PLACEHOLDER_ADMIN_TOKEN
            else f"{len(token)} characters long"
        )
        return (
            f"refusing to listen on {host} with BURSTCV_SERVING_ADMIN_TOKEN {what}; "
            f"set a secret of at least {MIN_EXPOSED_ADMIN_TOKEN_CHARS} characters "
            "(python -c 'import secrets; print(secrets.token_urlsafe(32))') or listen on "
            "127.0.0.1"
        )
    if environment == "production" and token == PLACEHOLDER_ADMIN_TOKEN:
        return (
            "BURSTCV_SERVING_ADMIN_TOKEN is the development placeholder; set a secret "
            "token before running with BURSTCV_SERVING_ENVIRONMENT=production"
        )
    return None


def is_loopback(host: str) -> bool:
    """Return whether ``host`` is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name or an interface address: reachable from elsewhere
