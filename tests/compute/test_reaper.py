"""Check the reaper against the emulator: it ends leaked burstcv instances and nothing else."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import boto3
from botocore.exceptions import ClientError
from burstcv_testkit import HELD_WHEEL

from burstcv import pipeline
from burstcv.compute.base import TAG_RUN_ID, LaunchRequest
from burstcv.compute.ec2 import Ec2Backend, Ec2Settings
from burstcv.compute.reaper import (
    REASON_EXPIRED,
    REASON_RUN_NOT_ACTIVE,
    RunActivity,
    reap,
)
from burstcv.settings import Settings

DAG_ID = "burstcv_train"


def launch_held(backend: Ec2Backend, player: Any, run_id: str, time_budget_s: int = 600) -> str:
    """Launch one instance for ``run_id`` that the harness leaves running (a leak)."""
    player.modes[run_id] = player.HOLD
    (iid,) = backend.launch(
        LaunchRequest(
            run_id=run_id,
            dag_id=DAG_ID,
            job_uri=f"s3://never-read/runs/{run_id}/job/job.json",  # held: never read
            time_budget_s=time_budget_s,
            **HELD_WHEEL,
        )
    )
    return iid


def state(ec2_client: Any, iid: str) -> str:
    """Return the emulator's state name for one instance."""
    reservations = ec2_client.describe_instances(InstanceIds=[iid])["Reservations"]
    return str(reservations[0]["Instances"][0]["State"]["Name"])


def strangers(ec2_client: Any) -> list[str]:
    """Start two instances burstcv must never touch: untagged, and run-tagged but unmanaged."""
    image = ec2_client.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    untagged = ec2_client.run_instances(ImageId=image, MinCount=1, MaxCount=1)
    lookalike = ec2_client.run_instances(
        ImageId=image,
        MinCount=1,
        MaxCount=1,
        TagSpecifications=[
            {"ResourceType": "instance", "Tags": [{"Key": TAG_RUN_ID, "Value": "gone-run"}]}
        ],
    )
    return [untagged["Instances"][0]["InstanceId"], lookalike["Instances"][0]["InstanceId"]]


def test_expired_instance_of_a_dead_orchestrator_is_terminated(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    iid = launch_held(backend, player, "orphan")
    (info,) = backend.describe("orphan")
    assert info.expires_at is not None
    # The orchestrator died and its metadata still says "running": expiry alone decides.
    report = reap(backend, run_activity=lambda dag, run: RunActivity.ACTIVE, now=info.expires_at)
    assert report.instance_ids == [iid]
    assert report.decisions[0].reason == REASON_EXPIRED
    assert report.to_dict()["terminated"][0]["instance_id"] == iid
    assert state(ec2_client, iid) in ("shutting-down", "terminated")
    assert kit.live_managed() == []


def test_instance_of_a_finished_run_is_terminated_before_expiry(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    asked: list[tuple[str, str]] = []
    keep = launch_held(backend, player, "still-running")
    leak = launch_held(backend, player, "finished")

    def run_activity(dag_id: str, run_id: str) -> RunActivity:
        asked.append((dag_id, run_id))
        return RunActivity.ACTIVE if run_id == "still-running" else RunActivity.OVER

    report = reap(backend, run_activity=run_activity)
    assert report.instance_ids == [leak]
    assert report.decisions[0].reason == REASON_RUN_NOT_ACTIVE
    assert report.kept == [keep]
    assert sorted(asked) == [(DAG_ID, "finished"), (DAG_ID, "still-running")]
    assert kit.live_managed() == [keep]
    backend.terminate_run("still-running")
    assert kit.live_managed() == []


def test_reaper_leaves_instances_without_the_burstcv_tags_alone(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    others = strangers(ec2_client)
    leak = launch_held(backend, player, "leaked")
    (info,) = backend.describe("leaked")
    assert info.expires_at is not None
    report = reap(
        backend,
        run_activity=lambda dag, run: RunActivity.OVER,
        now=info.expires_at + timedelta(days=1),
    )
    assert report.instance_ids == [leak]
    assert [state(ec2_client, iid) for iid in others] == ["running", "running"]
    assert kit.live_managed() == []
    ec2_client.terminate_instances(InstanceIds=others)


def test_dry_run_terminates_nothing_and_says_what_it_would(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    leak = launch_held(backend, player, "dry")
    report = reap(backend, run_activity=lambda dag, run: RunActivity.OVER, dry_run=True)
    assert report.dry_run and report.instance_ids == [leak]
    assert report.to_dict()["would_terminate"][0]["reason"] == REASON_RUN_NOT_ACTIVE
    assert "would terminate" in report.summary()
    assert state(ec2_client, leak) == "running"
    reap(backend, run_activity=lambda dag, run: RunActivity.OVER)
    assert kit.live_managed() == []


def test_an_airflow_error_about_one_box_stops_none_of_the_others(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    unknown = launch_held(backend, player, "unknown")
    finished = launch_held(backend, player, "finished")
    expired = launch_held(backend, player, "expired", time_budget_s=60)  # 6 min, not 15
    (info,) = backend.describe("expired")
    assert info.expires_at is not None
    asked: list[str] = []

    def run_activity(dag_id: str, run_id: str) -> RunActivity:
        asked.append(run_id)
        if run_id == "unknown":
            raise ConnectionError("metadata database unreachable")
        return RunActivity.OVER

    # "now" is past the expiry of "expired" only.
    later = info.expires_at + timedelta(seconds=1)
    for run_id in ("unknown", "finished"):
        (other,) = backend.describe(run_id)
        assert other.expires_at is not None and other.expires_at > later
    report = reap(backend, run_activity=run_activity, now=later)

    # Expired first, without asking; the finished run's box despite the error before it.
    assert report.decisions[0].instance_id == expired
    assert report.decisions[0].reason == REASON_EXPIRED
    assert "expired" not in asked
    assert set(report.instance_ids) == {expired, finished}
    assert state(ec2_client, expired) == "terminated"
    assert state(ec2_client, finished) == "terminated"
    # The box whose run could not be checked is kept (no guessing) and the error counted.
    assert report.kept == [unknown]
    (error,) = report.errors
    assert (error.instance_id, error.step) == (unknown, "check-run")
    assert "metadata database unreachable" in error.error
    assert report.to_dict()["errors"][0]["instance_id"] == unknown
    assert "1 error(s)" in report.summary()
    assert state(ec2_client, unknown) == "running"
    backend.terminate_run("unknown")
    assert kit.live_managed() == []


def test_a_refused_terminate_stops_none_of_the_others(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    first = launch_held(backend, player, "refused")
    second = launch_held(backend, player, "fine")
    refused_ids: list[str] = []

    def refuse_first(params: dict[str, Any], **_: Any) -> None:
        if params.get("InstanceIds") == [first]:
            refused_ids.append(first)
            raise ClientError(
                {"Error": {"Code": "RequestLimitExceeded", "Message": "injected"}},
                "TerminateInstances",
            )

    backend.client.meta.events.register(
        "before-parameter-build.ec2.TerminateInstances", refuse_first
    )
    report = reap(backend, run_activity=lambda dag, run: RunActivity.OVER)
    assert refused_ids == [first]
    assert report.instance_ids == [second]
    assert [(e.instance_id, e.step) for e in report.errors] == [(first, "terminate")]
    assert state(ec2_client, second) == "terminated"
    assert state(ec2_client, first) == "running"
    ec2_client.terminate_instances(InstanceIds=[first])
    assert kit.live_managed() == []


def test_the_pipeline_reaper_sweeps_every_enabled_region(
    ec2_settings: Ec2Settings, ec2_client: Any, player: Any, kit: Any, monkeypatch: Any
) -> None:
    far = Ec2Backend(ec2_settings.model_copy(update={"region": "eu-west-1"}))
    player.modes["far-away"] = player.HOLD
    (iid,) = far.launch(
        LaunchRequest(
            run_id="far-away",
            dag_id=DAG_ID,
            job_uri="s3://never-read/runs/far-away/job/job.json",
            time_budget_s=600,
            **HELD_WHEEL,
        )
    )
    for key, value in {
        "BURSTCV_EC2_REGION": "us-east-1",  # the settings name another region entirely
        "BURSTCV_EC2_AMI": kit.ami_parameter,
        "BURSTCV_EC2_INSTANCE_PROFILE": "burstcv-training",
    }.items():
        monkeypatch.setenv(key, value)
    settings = Settings(reaper_backends="", reaper_regions="", compute_backend="ec2")
    assert settings.reaper_backend_names() == ["local", "ec2"]
    reports = pipeline.reap(["ec2"], lambda dag, run: RunActivity.OVER, settings=settings)
    by_region = {r["region"]: r for r in reports}
    assert {"us-east-1", "eu-west-1"} <= set(by_region)
    assert [d["instance_id"] for d in by_region["eu-west-1"]["terminated"]] == [iid]
    assert pipeline.reap_errors(reports) == 0
    far_ec2 = boto3.client(
        "ec2", region_name="eu-west-1", endpoint_url=ec2_client.meta.endpoint_url
    )
    assert state(far_ec2, iid) == "terminated"


def test_ec2_is_swept_whenever_aws_is_configured(monkeypatch: Any) -> None:
    for key in list(os.environ):
        if key.startswith(("AWS_", "BURSTCV_EC2_")) or key == "AIRFLOW_CONN_AWS_DEFAULT":
            monkeypatch.delenv(key)
    assert Settings(reaper_backends="").reaper_backend_names() == ["local"]
    monkeypatch.setenv("AWS_PROFILE", "burstcv")
    assert Settings(reaper_backends="").reaper_backend_names() == ["local", "ec2"]
    assert Settings(reaper_backends="local").reaper_backend_names() == ["local"]


def test_nothing_to_reap_reports_so(backend: Ec2Backend, ec2_client: Any) -> None:
    report = reap(backend, run_activity=lambda dag, run: RunActivity.ACTIVE)
    assert report.instance_ids == [] and "nothing to terminate" in report.summary()


def test_burstcv_reap_exits_non_zero_when_the_pass_counted_errors(
    monkeypatch: Any, tmp_path: Any
) -> None:
    from typer.testing import CliRunner

    from burstcv import cli

    pass_with_an_error = [
        {
            "backend": "ec2",
            "region": "us-east-1",
            "terminated": [{"instance_id": "i-expired"}],
            "kept": [],
            "errors": [{"instance_id": "i-other", "error": "ClientError: throttled"}],
        }
    ]
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.setattr(pipeline, "reap", lambda *args, **kwargs: pass_with_an_error)
    result = CliRunner().invoke(cli.app, ["reap"])
    assert result.exit_code == 1
    assert "ec2 us-east-1: terminated 1 ['i-expired']" in result.output
    assert "throttled" in result.output and "1 error(s) in this pass" in result.output
    pass_with_an_error[0]["errors"] = []
    assert CliRunner().invoke(cli.app, ["reap"]).exit_code == 0
