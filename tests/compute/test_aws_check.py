"""`burstcv aws check` against the emulator: what is in place, what is missing, nothing rented."""

from __future__ import annotations

from typing import Any

import pytest
from awsaudit import RecordingProxy
from typer.testing import CliRunner

from burstcv.cli import app
from burstcv.settings import get_settings


def run_check() -> Any:
    """Run `burstcv aws check` in-process and return the result."""
    return CliRunner().invoke(app, ["aws", "check"])


def test_a_ready_account_passes_every_check_and_rents_nothing(
    s3_deployment: Any, kit: Any, audited_calls: RecordingProxy
) -> None:
    result = run_check()
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "ok       dry-run launch g6.xlarge spot" in lines
    assert "ok       dry-run launch g4dn.xlarge on-demand" in lines
    assert any(line.startswith("ok       backstop schedule") for line in lines)
    assert any(
        "s3:DeleteObject under s3://burstcv-test/registry/digits/aliases" in x for x in lines
    )
    assert "nothing was rented" in lines[-1]
    assert kit.live_managed() == []
    launches = [c for c in audited_calls.snapshot() if c.action == "ec2:RunInstances"]
    assert len(launches) == 6 and all(c.params.get("DryRun") == "true" for c in launches)
    # The probes are gone again.
    listed = kit.s3.list_objects_v2(Bucket=kit.bucket).get("Contents", [])
    assert not [o["Key"] for o in listed if ".burstcv-check" in o["Key"]]


def test_what_is_missing_is_printed_one_line_each(
    s3_deployment: Any,
    kit: Any,
    audited_calls: RecordingProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BURSTCV_EC2_INSTANCE_PROFILE", "no-such-profile")
    monkeypatch.setenv("BURSTCV_REGISTRY_URI", "s3://no-such-bucket/registry")
    get_settings.cache_clear()
    result = run_check()
    assert result.exit_code == 1
    missing = [x for x in result.output.splitlines() if x.startswith("MISSING")]
    launch = [x for x in missing if "dry-run launch" in x]
    assert len(launch) == 6 and all("BURSTCV_EC2_INSTANCE_PROFILE" in x for x in launch)
    registry = [x for x in missing if "s3://no-such-bucket" in x]
    assert len(registry) == 4 and all("NoSuchBucket" in x for x in registry)
    assert not [x for x in missing if "burstcv-test" in x]  # the artifact store is fine
    assert "10 of" in result.output
    assert kit.live_managed() == []
    audited_calls.clear()  # the refused PassRole of a wrong profile is this test's point
