"""Say which Airflow components are unhealthy, so `make airflow` restarts what stopped.

A heartbeat stays fresh for half a minute after its process died, so with ``--state`` (the
pids ``burstcv.supervisor`` writes) a component whose process is gone is unhealthy at once.
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
    statuses = {name: (health.get(name) or {}).get("status") for name in COMPONENTS}
    return [f"{n} ({s or 'not reported'})" for n, s in statuses.items() if s != "healthy"]


def _alive(pid: Any) -> bool:
    import psutil

    if not isinstance(pid, int):
        return False
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED)
    except psutil.Error:
        return False


def dead_processes(state_path: str) -> list[str]:
    """Return 'name (why)' for each supervised process not running now (none without a
    readable state file: an Airflow started another way)."""
    from burstcv_spec.contracts import ArtifactError, SupervisorState, read_artifact

    try:
        state = read_artifact(state_path, SupervisorState)
    except (OSError, ArtifactError):
        return []
    if not _alive(state.supervisor):
        return ["supervisor (process exited)"]
    return [
        f"{name} ({pid if isinstance(pid, str) else 'process exited'})"
        for name, pid in state.components.items()
        if isinstance(pid, str) or not _alive(pid)
    ]


def check(api_url: str, timeout_s: float = 10.0) -> list[str]:
    """Return the unhealthy components of the Airflow at ``api_url`` (empty: all healthy)."""
    response = httpx.get(f"{api_url.rstrip('/')}/api/v2/monitor/health", timeout=timeout_s)
    response.raise_for_status()
    return unhealthy(response.json())


def main(argv: list[str] | None = None) -> int:
    """Print the unhealthy components on one line; exit 0 (healthy), 1 (not) or 2 (no answer)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("api_url")
    parser.add_argument("--state", default="", help="the supervisor's pid file (JSON)")
    args = parser.parse_args(argv)
    dead = dead_processes(args.state) if args.state else []
    named = {line.split()[0].replace("-", "_") for line in dead}  # as the health answer names
    try:
        bad = dead + [b for b in check(args.api_url) if b.split()[0] not in named]
    except (httpx.HTTPError, ValueError) as exc:
        why = f"; {', '.join(dead)}" if dead else ""
        sys.stdout.write(
            f"no health answer from {args.api_url}: {type(exc).__name__}: {exc}{why}\n"
        )
        return 2
    if bad:
        sys.stdout.write(", ".join(bad) + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
