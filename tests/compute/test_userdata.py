"""Check the rendered user-data: watchdog first, strict mode, an EXIT trap that shuts down."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from burstcv.compute.userdata import (
    UserDataSpec,
    max_instance_seconds,
    parse_config,
    render_user_data,
    watchdog_minutes,
)

SPEC = UserDataSpec(
    run_id="manual__2024-05-01T10:00:00+00:00",
    job_uri="s3://bucket/artifacts/runs/r1/job/job.json",
    bundle_uri="s3://bucket/artifacts/bundle/burstcv.whl",
    time_budget_s=3601,
)


def commands(script: str) -> list[str]:
    """Return the script's lines that do something (no blanks, comments or the shebang)."""
    return [
        line.strip()
        for line in script.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_watchdog_is_armed_before_anything_else() -> None:
    lines = commands(render_user_data(SPEC))
    assert lines[0] == "set -Eeuo pipefail"
    # ceil(3601 s / 60) = 61 min, plus the 5 min margin.
    assert lines[1].startswith("shutdown -h +66 ")
    assert lines[1].endswith("|| poweroff")


def test_watchdog_minutes_round_up_and_add_the_margin() -> None:
    assert watchdog_minutes(60, 0) == 1
    assert watchdog_minutes(61, 0) == 2
    assert watchdog_minutes(600) == 15
    assert max_instance_seconds(600) == 15 * 60
    with pytest.raises(ValueError):
        watchdog_minutes(0)


def test_exit_trap_is_set_before_the_install_and_shuts_down() -> None:
    script = render_user_data(SPEC)
    trap_at = script.index("trap finish EXIT")
    assert trap_at < script.index('aws s3 cp "$BUNDLE_URI"')
    assert trap_at < script.index("train --job")
    finish = script[script.index("finish() {") : trap_at]
    # Both paths end in an immediate shutdown after the marker check and the log upload.
    assert finish.index("marker_exists DONE") < finish.index('"$JOB_DIR/FAILED"')
    assert finish.index('"$JOB_DIR/FAILED"') < finish.index('"$JOB_DIR/logs/')
    assert finish.rstrip().endswith("}")
    assert finish.index("shutdown -h now") > finish.index('"$JOB_DIR/logs/')
    # Signals go through the same trap.
    assert "trap 'exit 143' TERM INT HUP" in script


def test_the_order_is_install_then_poller_then_training() -> None:
    script = render_user_data(SPEC)
    install = script.index('pip" install')
    poller = script.index("spot_poller &")
    train = script.index('"$WORK/venv/bin/burstcv" train --job "$JOB_URI"')
    assert install < poller < train
    assert "X-aws-ec2-metadata-token" in script  # IMDSv2 only
    assert "meta-data/spot/instance-action" in script
    assert "while sleep 5" in script


def test_config_block_round_trips_odd_run_ids() -> None:
    config = parse_config(render_user_data(SPEC))
    assert config["RUN_ID"] == SPEC.run_id
    assert config["JOB_URI"] == SPEC.job_uri
    assert config["JOB_DIR"] == "s3://bucket/artifacts/runs/r1/job"
    assert config["WATCHDOG_MIN"] == "66"


def test_refuses_uris_an_instance_cannot_read() -> None:
    with pytest.raises(ValueError, match="S3"):
        render_user_data(UserDataSpec("r", "/tmp/job.json", SPEC.bundle_uri, 60))
    with pytest.raises(ValueError, match="bundle"):
        render_user_data(UserDataSpec("r", SPEC.job_uri, "https://x/y.whl", 60))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_accepts_the_syntax(tmp_path: Path) -> None:
    script = tmp_path / "user-data.sh"
    script.write_text(render_user_data(SPEC))
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_finds_no_errors(tmp_path: Path) -> None:
    script = tmp_path / "user-data.sh"
    script.write_text(render_user_data(SPEC))
    result = subprocess.run(
        ["shellcheck", "--severity=error", str(script)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout
