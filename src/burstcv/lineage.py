"""Name the code and versions a result came from, so every artifact states its origin."""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

# src/burstcv/lineage.py -> the checkout (when running from one). This module also ships in
# the training wheel, which runs on the AMI's Python (3.10+) without settings or git.
REPO_ROOT = Path(__file__).resolve().parents[2]


@lru_cache(maxsize=1)
def source_commit() -> str:
    """Return the git commit of the running code, BURSTCV_SOURCE_COMMIT, or 'unknown'."""
    if env := os.environ.get("BURSTCV_SOURCE_COMMIT"):
        return env
    if not (Path(REPO_ROOT) / ".git").exists():
        return "unknown"
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def utc_now() -> datetime:
    """Return the current time, timezone-aware UTC."""
    return datetime.now(timezone.utc)  # noqa: UP017 (3.10 has no datetime.UTC)


def utc_now_iso() -> str:
    """Return the current UTC time as ISO 8601."""
    return utc_now().isoformat(timespec="seconds")


def host_description() -> dict[str, str | int]:
    """Describe the machine a measurement ran on."""
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count() or 0,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }
