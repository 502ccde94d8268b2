"""Check the rendered user-data: watchdog first, from the run's deadline; trap before work."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from burstcv.compute.userdata import (
    UserDataSpec,
    expiry_of,
    parse_config,
    render_user_data,
)

DEADLINE = datetime(2026, 5, 1, 11, 0, 1, tzinfo=UTC)
SPEC = UserDataSpec(
    run_id="manual__2024-05-01T10:00:00+00:00",
    job_uri="s3://bucket/artifacts/runs/r1/job/job.json",
    attempt=2,
    wheel_uri="s3://bucket/artifacts/runtime/ab/burstcv_train-0.1.0-py3-none-any.whl",
    wheel_sha256="a" * 64,
    deadline_at=DEADLINE,
    region="eu-west-1",
)


def commands(script: str) -> list[str]:
    """Return the script's lines that do something (no blanks, comments or the shebang)."""
    return [
        line.strip()
        for line in script.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def watchdog_at(script: str, now: datetime, tmp_path: Path) -> str:
    """Run the script's watchdog lines at ``now`` with a recording shutdown; return its call."""
    lines = commands(script)
    head = "\n".join(lines[1:4])  # WATCHDOG_MIN=..., its floor, shutdown ...
    shim = tmp_path / "shutdown"
    shim.write_text('#!/bin/bash\necho "$*"\n')
    shim.chmod(0o755)
    date = tmp_path / "date"
    date.write_text(f"#!/bin/bash\necho {int(now.timestamp())}\n")
    date.chmod(0o755)
    out = subprocess.run(
        ["bash", "-c", head],
        capture_output=True,
        text=True,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
        check=True,
    )
    return out.stdout.strip()


def test_watchdog_is_armed_first_from_the_runs_deadline(tmp_path: Path) -> None:
    script = render_user_data(SPEC)
    lines = commands(script)
    assert lines[0] == "set -Eeuo pipefail"
    assert lines[1].startswith("WATCHDOG_MIN=")
    assert lines[3].startswith('shutdown -h "+$WATCHDOG_MIN"') and lines[3].endswith("|| poweroff")
    # An hour and one second before the deadline: 61 min, plus the 5 min margin.
    call = watchdog_at(script, DEADLINE - timedelta(seconds=3601), tmp_path)
    assert call.startswith("-h +66 ")
    # A relaunch 10 minutes before the deadline gets what is left of the run, not a new budget.
    assert watchdog_at(script, DEADLINE - timedelta(minutes=10), tmp_path).startswith("-h +15 ")
    # Past the deadline the box still gets the margin to write its marker and log.
    assert watchdog_at(script, DEADLINE + timedelta(hours=1), tmp_path).startswith("-h +5 ")


def test_the_expiry_tag_is_the_deadline_plus_the_margin_plus_one_minute() -> None:
    assert expiry_of(DEADLINE) == DEADLINE + timedelta(minutes=6)
    assert expiry_of(DEADLINE, 0) == DEADLINE + timedelta(minutes=1)
    assert expiry_of(DEADLINE, 10) == DEADLINE + timedelta(minutes=11)


@pytest.mark.parametrize("seconds_left", [0, 1, 59, 60, 61, 599.5, 3600, 7201, -3600])
@pytest.mark.parametrize("margin", [0, 5])
def test_a_box_launched_before_the_deadline_is_off_by_its_expiry_tag(
    seconds_left: float, margin: int, tmp_path: Path
) -> None:
    # The reaper trusts the expiry tag as "the watchdog has ended it by now": never too early.
    launched = DEADLINE - timedelta(seconds=seconds_left)
    script = render_user_data(replace(SPEC, margin_min=margin))
    call = watchdog_at(script, launched, tmp_path)  # "-h +N ..."
    off_at = launched + timedelta(minutes=int(call.split()[1].removeprefix("+")))
    if seconds_left < 0:  # past the deadline: the margin (never under a minute) from boot
        assert off_at == launched + timedelta(minutes=max(1, margin))
    else:
        assert DEADLINE + timedelta(minutes=margin) <= off_at <= expiry_of(DEADLINE, margin)


def test_exit_trap_is_set_before_any_work_and_shuts_down() -> None:
    script = render_user_data(SPEC)
    trap_at = script.index("trap finish EXIT")
    for step in ('s3 cp "$WHEEL_URI"', "pip install", "preflight --job", "train --job"):
        assert trap_at < script.index(step), step
    finish = script[script.index("finish() {") : trap_at]
    # A box that found no way to S3 goes down at once: nothing it writes could get out.
    no_s3 = finish.index('if [ -n "${NO_S3:-}" ]; then')
    assert finish.index("shutdown -h now", no_s3) < finish.index('"$ATTEMPT_DIR/DONE"')
    # Otherwise a marker for this attempt, then the log, then an immediate shutdown.
    assert finish.index('"$ATTEMPT_DIR/DONE"') < finish.index("write_failed")
    assert finish.index("write_failed") < finish.index('"$LOG_URI"')
    assert finish.index('"$LOG_URI"') < finish.rindex("shutdown -h now")
    # S3 is checked after the trap is set and before anything needs it.
    probe = script.index('s3 exists "$JOB_URI"')
    assert trap_at < probe < script.index("spot_poller &") < script.index('s3 cp "$WHEEL_URI"')
    assert "trap 'exit 143' TERM INT HUP" in script
    # A marker check that needs no ListBucket-wide listing.
    assert "s3.head_object(" in script and "list_objects" not in script


def test_every_s3_call_goes_through_boto3_the_aws_cli_only_without_one() -> None:
    script = render_user_data(SPEC)
    s3 = script[script.index("s3() {") : script.index("\n}\n", script.index("s3() {"))]
    # boto3 first; the CLI only in s3()'s fallback, for a box whose Python has no boto3.
    assert s3.index('"$S3PY" "$WORK/s3io.py"') < s3.index("aws s3")
    outside = script.replace(s3, "")
    assert not re.search(r"\baws s3", outside), "the AWS CLI runs outside s3()'s fallback"
    # The helper is written before the exit trap, which needs it for the marker and the log.
    assert script.index("s3io.py") < script.index("trap finish EXIT")


# What the AWS CLI v2 does for each case (its documented exit codes), as a fake ``aws``.
_FAKE_AWS = """#!/bin/bash
case "$FAKE_AWS" in
  found) echo '{"ContentLength": 1}' ;;
  missing) printf '\\nAn error occurred (404) calling the HeadObject operation: Not Found\\n' >&2
    exit 254 ;;
  denied) printf '\\nAn error occurred (403) calling the HeadObject operation: Forbidden\\n' >&2
    exit 254 ;;
  offline) printf '\\nCould not connect to the endpoint URL: "https://b.s3.amazonaws.com/k"\\n' >&2
    exit 255 ;;
  nocreds) echo 'Unable to locate credentials.' >&2; exit 253 ;;
  skipped) echo 'warning: Skipping file /x. File does not exist.' >&2; exit 2 ;;
esac
"""


@pytest.mark.parametrize(
    ("case", "command", "code", "says"),
    [
        ("found", "exists", 0, ""),
        ("missing", "exists", 1, ""),  # S3 answered: no such key (not "unreachable")
        ("denied", "exists", 2, "aws exit code 254: An error occurred (403)"),
        ("offline", "exists", 2, "aws exit code 255: Could not connect"),
        ("nocreds", "exists", 2, "aws exit code 253: Unable to locate credentials."),
        ("found", "cp", 0, ""),
        ("skipped", "cp", 2, "aws exit code 2: warning: Skipping file"),
    ],
)
def test_s3_through_the_aws_cli_reads_its_v2_exit_codes(
    tmp_path: Path, case: str, command: str, code: int, says: str
) -> None:
    script = render_user_data(SPEC)
    start = script.index("s3() {")
    function = script[start : script.index("\n}\n", start) + 3]
    aws = tmp_path / "aws"
    aws.write_text(_FAKE_AWS)
    aws.chmod(0o755)
    args = "exists s3://b/k" if command == "exists" else "cp /x s3://b/k"
    done = subprocess.run(
        ["bash", "-c", f'S3PY=""\n{function}\ns3 {args}'],
        capture_output=True,
        text=True,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin", "FAKE_AWS": case},
    )
    assert done.returncode == code, done.stderr
    if says:
        assert done.stderr.startswith(f"s3: {args}: {says}"), done.stderr
        assert done.stderr.count("\n") == 1  # one line in the box's log
    else:
        assert done.stderr == ""


def test_a_sizing_box_checks_s3_on_its_wheel_and_installs_from_the_wheelhouse() -> None:
    from burstcv.compute.userdata import SizingBoxSpec, render_sizing_user_data

    root = "s3://bucket/artifacts/runs/r1/bench/sizing"
    script = render_sizing_user_data(
        SizingBoxSpec(
            run_id="r1.size-c7i-large",
            instance_type="c7i.large",
            model_uri="s3://bucket/artifacts/runs/r1/model",
            requests_uri=f"{root}/requests/",
            out_uri=f"{root}/boxes/c7i.large.json",
            log_uri=f"{root}/logs/c7i.large.log",
            wheel_uri="s3://bucket/artifacts/runtime/ab/burstcv_size-0.1.0-py3-none-any.whl",
            wheel_sha256="a" * 64,
            latency_slo_ms=200,
            step_s=1,
            deadline_at=DEADLINE,
            region="eu-west-1",
        )
    )
    # The reachability check is on an object that exists (the staged wheel), not a prefix.
    assert 'out=$(s3 exists "$WHEEL_URI" 2>&1)' in script and 'exists "$REQUESTS_URI' not in script
    # dnf's Python before the install; the wheelhouse of that Python, then no index.
    order = ["dnf install", 'TAG=$("$PYTHON"', "wheelhouse/$TAG.tar", "--no-index", "pip install"]
    positions = [script.index(step) for step in order]
    assert positions == sorted(positions)
    assert '"${FROM[@]}" "$WHEEL"' in script and "sha256sum -c --quiet SHA256SUMS" in script
    assert script.index('S3PY=$(command -v "$PYTHON")') > script.index("pip install")


def test_the_order_is_poller_and_log_then_install_preflight_train() -> None:
    script = render_user_data(SPEC)
    order = [
        "spot_poller &",
        "ship_log &",
        "sha256sum -c",
        "pip install",
        '"$BURSTCV" preflight',
        '"$BURSTCV" train --job "$JOB_URI" --attempt "$ATTEMPT"',
    ]
    positions = [script.index(step) for step in order]
    assert positions == sorted(positions)
    assert "X-aws-ec2-metadata-token" in script  # IMDSv2 only
    assert "meta-data/placement/region" in script and "export AWS_REGION" in script


def test_config_block_round_trips_odd_run_ids() -> None:
    config = parse_config(render_user_data(SPEC))
    assert config["RUN_ID"] == SPEC.run_id
    assert config["JOB_URI"] == SPEC.job_uri
    assert config["ATTEMPT"] == "2"
    assert config["ATTEMPT_DIR"] == "s3://bucket/artifacts/runs/r1/job/attempts/2"
    assert config["WHEEL_SHA256"] == "a" * 64
    assert config["FALLBACK_REGION"] == "eu-west-1"
    assert config["PYTHON"] == "/opt/pytorch/bin/python"


def test_refuses_what_an_instance_cannot_use() -> None:
    with pytest.raises(ValueError, match="S3"):
        render_user_data(UserDataSpec(**{**SPEC.__dict__, "job_uri": "/tmp/job.json"}))
    with pytest.raises(ValueError, match="wheel"):
        render_user_data(UserDataSpec(**{**SPEC.__dict__, "wheel_uri": "https://x/y.whl"}))
    with pytest.raises(ValueError, match="sha256"):
        render_user_data(UserDataSpec(**{**SPEC.__dict__, "wheel_sha256": "abc"}))
    with pytest.raises(ValueError, match="timezone"):
        render_user_data(UserDataSpec(**{**SPEC.__dict__, "deadline_at": datetime(2026, 1, 1)}))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("num_nodes", [1, 2])
def test_bash_accepts_the_syntax(tmp_path: Path, num_nodes: int) -> None:
    from dataclasses import replace

    script = tmp_path / "user-data.sh"
    script.write_text(render_user_data(replace(SPEC, num_nodes=num_nodes)))
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
@pytest.mark.parametrize("num_nodes", [1, 2])
def test_shellcheck_finds_no_errors(tmp_path: Path, num_nodes: int) -> None:
    from dataclasses import replace

    script = tmp_path / "user-data.sh"
    script.write_text(render_user_data(replace(SPEC, num_nodes=num_nodes)))
    result = subprocess.run(
        ["shellcheck", "--severity=error", str(script)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("num_nodes", [1, 16])
def test_the_script_fits_ec2s_user_data_limit_with_long_names(num_nodes: int) -> None:
    """RunInstances refuses user data over 16 KB (before base64): the boot script stays under."""
    from dataclasses import replace

    long_run = "manual__" + "x" * 250  # Airflow run ids go up to 250 characters
    long_prefix = "s3://" + "b" * 63 + "/" + "p" * 200
    spec = replace(
        SPEC,
        run_id=long_run,
        job_uri=f"{long_prefix}/runs/{long_run}/job/job.json",
        wheel_uri=f"{long_prefix}/runtime/{'a' * 64}/burstcv_train-0.1.0-py3-none-any.whl",
        num_nodes=num_nodes,
    )
    size = len(render_user_data(spec).encode())
    assert size < 16 * 1024 * 0.75, f"{size} bytes: keep a quarter of the limit free"


def test_several_boxes_rendezvous_through_torchrun_on_node_0s_private_address() -> None:
    from dataclasses import replace

    from burstcv.compute.userdata import RENDEZVOUS_PORT

    one, two = render_user_data(SPEC), render_user_data(replace(SPEC, num_nodes=2))
    assert parse_config(two)["NUM_NODES"] == "2"
    assert parse_config(two)["RENDEZVOUS_PORT"] == str(RENDEZVOUS_PORT)
    assert "NUM_NODES" not in parse_config(one) and "torch.distributed.run" not in one
    lines = commands(two)
    # The node rank is the launch index; node 0 publishes its private address for this
    # attempt, the others read it; every box then runs torchrun (c10d) on that address.
    assert 'LAUNCH_INDEX=$(imds meta-data/ami-launch-index) || LAUNCH_INDEX=""' in lines
    assert 'RENDEZVOUS_URI="$ATTEMPT_DIR/rendezvous/node-0-address"' in lines
    run = two[two.index("torch.distributed.run") :]
    for flag in ("--nnodes", "--rdzv-backend c10d", "--rdzv-endpoint", "--max-restarts 0"):
        assert flag in run, flag
    assert '--rdzv-endpoint "$RENDEZVOUS_HOST:$RENDEZVOUS_PORT"' in run
    assert '--rdzv-id "$RUN_ID-$ATTEMPT"' in run  # a relaunch is a new rendezvous
    # Training's markers are rank 0's: a box's trap writes none for the train stage.
    assert 'if [ -n "${LAUNCH_INDEX:-}" ] && [ "$STAGE" = train ]; then' in lines
    order = [two.index(text) for text in ("trap finish EXIT", "STAGE=rendezvous", "STAGE=train")]
    assert order == sorted(order)


def test_the_steps_a_box_stamped_are_read_back_from_its_console() -> None:
    from burstcv.compute.userdata import stamps

    console = (
        "[   12.3] cloud-init[801]: Cloud-init v. 24.1 running 'modules:final'\n"
        "[   12.9] cloud-init[801]: burstcv: 2026-12-05T05:01:02.123Z run r attempt 1, job s3://b/j\n"
        "burstcv: 2026-12-05T05:02:44.007Z cannot reach S3: s3: exists s3://b/j: ClientError: "
        "An error occurred (403) when calling the HeadObject operation: Forbidden\n"
        "[   99.1] reboot: Power down\n"
    )
    assert stamps(console) == [
        "run r attempt 1, job s3://b/j",
        "cannot reach S3: s3: exists s3://b/j: ClientError: An error occurred (403) when "
        "calling the HeadObject operation: Forbidden",
    ]
    assert stamps("Linux version 6.1\nburstcv: not a stamp\n") == []
    # The script's own stamp function writes what this reads.
    script = render_user_data(SPEC)
    assert 'stamp() { echo "burstcv: $(date -u +%Y-%m-%dT%H:%M:%S.%3NZ) $*"; }' in script
