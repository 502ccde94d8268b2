"""Say which Airflow components are unhealthy, so `make airflow` restarts what stopped.

``make airflow`` (burstcv.airflow.standalone) starts the scheduler, dag-processor and
triggerer once and never restarts them: a triggerer killed (or out of memory) leaves every
deferred task waiting without a word, while the api-server still answers.
``GET /api/v2/monitor/health`` tells, from each component's heartbeat in the metadata
database.

    python -m burstcv.airflow.health http://127.0.0.1:8080   # exit 0 healthy, 1 not, 2 no answer
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import httpx

# The components that heartbeat into the metadata database, as the health endpoint names them.
COMPONENTS = ("metadatabase", "scheduler", "triggerer", "dag_processor")


def unhealthy(health: dict[str, Any]) -> list[str]:
    """Return 'name (status)' for every component the health answer does not call healthy."""
    bad = []
    for name in COMPONENTS:
        status = (health.get(name) or {}).get("status")
        if status != "healthy":
            bad.append(f"{name} ({status or 'not reported'})")
    return bad


def check(api_url: str, timeout_s: float = 10.0) -> list[str]:
    """Return the unhealthy components of the Airflow at ``api_url`` (empty: all healthy)."""
    response = httpx.get(f"{api_url.rstrip('/')}/api/v2/monitor/health", timeout=timeout_s)
    response.raise_for_status()
    return unhealthy(response.json())


def main(argv: list[str] | None = None) -> int:
    """Print the unhealthy components on one line; exit 0 (healthy), 1 (not) or 2 (no answer)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("api_url")
    args = parser.parse_args(argv)
    try:
        bad = check(args.api_url)
    except (httpx.HTTPError, ValueError) as exc:
        sys.stdout.write(f"no health answer from {args.api_url}: {type(exc).__name__}: {exc}\n")
        return 2
    if bad:
        sys.stdout.write(", ".join(bad) + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
