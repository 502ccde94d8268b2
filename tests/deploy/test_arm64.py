"""The serving image builds for linux/arm64 (Graviton): its lock resolves to aarch64 wheels.

No Arm machine is here, so the proof is pip's own resolver asked for the platform the image's
base runs on (CPython 3.11, manylinux aarch64, binary wheels only: nothing compiled at build
time): every pin of serving/requirements.txt must resolve, as pinned, and pull in nothing the
lock does not name. The same Dockerfile then builds on an arm64 host or under
``--platform linux/arm64`` (docs/serving.md, "Arm").
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "serving" / "requirements.txt"
AARCH64 = ("manylinux_2_28_aarch64", "manylinux2014_aarch64")


def pins() -> dict[str, str]:
    found = {}
    for line in LOCK.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", line)
        if match:
            found[re.sub(r"[-_.]+", "-", match[1]).lower()] = match[2]
    return found


def resolve_for_aarch64(tmp_path: Path, *wanted: str) -> subprocess.CompletedProcess[str]:
    """Ask pip's resolver to install ``wanted`` (pip arguments) for CPython 3.11 on manylinux
    aarch64, binary wheels only; its report is ``tmp_path/report.json``."""
    platforms = [arg for tag in AARCH64 for arg in ("--platform", tag)]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--disable-pip-version-check",
            *platforms,
            "--python-version",
            "3.11",
            "--implementation",
            "cp",
            "--only-binary=:all:",
            "--target",
            str(tmp_path / "target"),
            "--report",
            str(tmp_path / "report.json"),
            *wanted,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_serving_lock_resolves_to_aarch64_wheels(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    done = resolve_for_aarch64(tmp_path, "-r", str(LOCK))
    assert done.returncode == 0, f"the serving lock does not resolve for aarch64:\n{done.stderr}"
    installs = json.loads(report.read_text())["install"]
    resolved = {re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower(): item for item in installs}
    # Exactly the lock: every pin at its version, nothing it does not name.
    assert {name: item["metadata"]["version"] for name, item in resolved.items()} == pins()
    for name, item in resolved.items():
        wheel = item["download_info"]["url"].rsplit("/", 1)[-1]
        assert wheel.endswith(".whl"), f"{name}: {wheel} is not a wheel"
        tags = wheel[: -len(".whl")].split("-")[-1]
        assert tags == "any" or "aarch64" in tags, f"{name}: {wheel} is not for aarch64"
    # The compiled ones are the reason this is checked: each has its aarch64 build.
    for compiled in ("onnxruntime", "numpy", "pillow", "pydantic-core", "uvloop", "httptools"):
        assert "aarch64" in resolved[compiled]["download_info"]["url"], compiled


def test_the_sizing_wheel_installs_on_a_graviton_box_from_aarch64_wheels(tmp_path: Path) -> None:
    """A Graviton sizing box installs the burstcv-size wheel (the serving pins, psutil, httpx,
    boto3) into Amazon Linux's Python 3.11: every requirement resolves to an aarch64 wheel."""
    from burstcv.compute.runtime import build_sizing_wheel

    wheel = build_sizing_wheel()
    path = tmp_path / wheel.filename
    path.write_bytes(wheel.data)
    report = tmp_path / "report.json"
    done = resolve_for_aarch64(tmp_path, str(path))
    assert done.returncode == 0, f"the sizing wheel does not resolve for aarch64:\n{done.stderr}"
    installs = json.loads(report.read_text())["install"]
    resolved = {re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower(): item for item in installs}
    for name, version in pins().items():  # the service exactly as the image runs it
        assert resolved[name]["metadata"]["version"] == version, name
    for name, item in resolved.items():
        url = item["download_info"]["url"]
        tags = url.rsplit("/", 1)[-1].removesuffix(".whl").split("-")[-1]
        assert tags == "any" or "aarch64" in tags, f"{name}: {url} is not for aarch64"
    assert {"psutil", "httpx", "boto3", "burstcv-size"} <= set(resolved)
