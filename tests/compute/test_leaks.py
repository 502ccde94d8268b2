"""Leave a box running every way a user could, against the emulator: each ends `terminated`.

Provision timing out inside RunInstances; the worker killed right after RunInstances returned;
Airflow down with the box's own script never run (the AWS-side backstop fires); and the
launch-time checks that stop anything being rented at all (dry run, ClientToken).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import boto3
import pytest
from airflow.sdk.exceptions import AirflowTaskTimeout
from awsaudit import RecordingProxy, denied, evaluate
from botocore.exceptions import ClientError
from burstcv_testkit import HELD_WHEEL, launch_of

from burstcv.compute import attempts
from burstcv.compute.base import TAG_EXPIRES_AT, TAG_RUN_ID
from burstcv.compute.ec2 import (
    BACKSTOP_TARGET_ARN,
    Ec2Backend,
    Ec2Settings,
    LaunchAttempt,
    LaunchCheckError,
    backstop_name,
    client_token,
)
from burstcv.params import RunParams
from burstcv.settings import Settings
from burstcv.stages import boxes, resolve
from burstcv_spec.contracts import Launch, Provisioned, RunRef

DAG_ID = "burstcv_pipeline"
BACKSTOP_POLICY = os.path.join(
    os.path.dirname(__file__), "..", "..", "deploy", "backstop-role-policy.json"
)


def request(run_id: str, **overrides: Any) -> Launch:
    """Return a launch whose box the harness holds (its job is never read)."""
    return launch_of(run_id, dag_id=DAG_ID, **{**HELD_WHEEL, **overrides})


def instances_of(ec2_client: Any, run_id: str) -> list[dict[str, Any]]:
    """Return every instance tagged with the run, in any state (the test's own eyes)."""
    pages = ec2_client.get_paginator("describe_instances").paginate(
        Filters=[{"Name": f"tag:{TAG_RUN_ID}", "Values": [run_id]}]
    )
    return [i for p in pages for r in p["Reservations"] for i in r["Instances"]]


def states(ec2_client: Any, run_id: str) -> list[str]:
    """Return the state name of each instance of the run."""
    return [i["State"]["Name"] for i in instances_of(ec2_client, run_id)]


def held_launch_fields() -> dict[str, Any]:
    """Return the launch fields a held box never uses: the run's deadline and its wheel."""
    from datetime import UTC, datetime, timedelta

    return {
        "deadline_at": (datetime.now(UTC) + timedelta(seconds=600)).isoformat(),
        **HELD_WHEEL,
    }


def test_a_task_timeout_inside_run_instances_leaves_no_box(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "timeout-in-run-instances"
    player.modes[run_id] = kit.HOLD

    def time_out(http_response: Any, parsed: dict[str, Any], **_: Any) -> None:
        if parsed.get("Instances"):  # EC2 has started the box; the answer never arrives
            raise AirflowTaskTimeout("Timeout, PID: 4242")

    backend.client.meta.events.register("after-call.ec2.RunInstances", time_out)
    with pytest.raises(AirflowTaskTimeout):
        backend.launch(request(run_id))
    assert states(ec2_client, run_id) == ["terminated"]
    assert kit.live_managed() == []


def test_a_failed_provision_terminates_what_it_started(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = "manual__2026-01-01T00:00:00+00:00"
    key = "manual__2026-01-01T00_00_00_00_00"
    player.modes[key] = kit.HOLD
    launched: list[str] = []

    def after_run(parsed: dict[str, Any], **_: Any) -> None:
        launched.extend(i["InstanceId"] for i in parsed.get("Instances", []))

    def interrupt(**_: Any) -> None:
        if launched:
            raise KeyboardInterrupt  # any BaseException, after the box exists

    for module in (boxes, attempts):
        monkeypatch.setattr(module, "get_backend", lambda name, settings=None: backend)
    backend.client.meta.events.register("after-call.ec2.RunInstances", after_run)
    backend.scheduler.meta.events.register("before-call.scheduler.CreateSchedule", interrupt)
    launch = Launch(
        run=RunRef(airflow_run_id=run_id, run_key=key),
        dag_id=DAG_ID,
        job_uri=f"s3://never-read/runs/{key}/job/job.json",
        time_budget_s=600,
        instance_types=["g6.xlarge"],
        use_spot=True,
        **held_launch_fields(),
    )
    with pytest.raises(KeyboardInterrupt):
        attempts.launch_attempt("ec2", launch, f"{kit.artifact_root}/runs/{key}/job", 1, Settings())
    assert len(launched) == 1
    assert states(ec2_client, key) == ["terminated"]


def test_a_worker_killed_right_after_launch_is_cleaned_up_by_the_dag(
    backend: Ec2Backend,
    ec2_settings: Ec2Settings,
    ec2_client: Any,
    player: Any,
    kit: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_id = "worker-killed"
    player.modes[run_id] = kit.HOLD
    env = dict(os.environ)
    for name, value in ec2_settings.model_dump().items():
        if value is None:
            continue
        text = ",".join(value) if isinstance(value, tuple) else str(value)
        env[f"BURSTCV_EC2_{name.upper()}"] = text
    worker = textwrap.dedent(
        f"""
        import os, signal
        from datetime import UTC, datetime, timedelta
        from burstcv.compute.ec2 import Ec2Backend
        from burstcv_spec.contracts import Launch, RunRef

        backend = Ec2Backend()
        def die(parsed, **_):
            if parsed.get("Instances"):  # the real launch returned (not the dry run)
                os.kill(os.getpid(), signal.SIGKILL)  # the worker dies: no Python code runs
        backend.client.meta.events.register("after-call.ec2.RunInstances", die)
        backend.launch(Launch(
            run=RunRef(airflow_run_id="", run_key={run_id!r}), dag_id={DAG_ID!r},
            job_uri="s3://never-read/job.json", time_budget_s=600,
            instance_types=[], use_spot=None,
            deadline_at=datetime.now(UTC) + timedelta(seconds=600),
            wheel_uri="s3://never-read/t.whl", wheel_sha256="0" * 64))
        """
    )
    result = subprocess.run([sys.executable, "-c", worker], env=env, timeout=120)
    assert result.returncode == -signal.SIGKILL
    assert states(ec2_client, run_id) == ["running"]  # what a killed worker leaves behind

    # The pipeline DAG's clean-up task (provision failed: no teardown runs) ends it.
    for module in (boxes, attempts):
        monkeypatch.setattr(module, "get_backend", lambda name, settings=None: backend)
    (iid,) = boxes.clean_up_provision(RunRef.of(run_id), "ec2")
    assert states(ec2_client, run_id) == ["terminated"]
    assert kit.live_managed() == []
    assert iid == instances_of(ec2_client, run_id)[0]["InstanceId"]


def fire(schedule: dict[str, Any], endpoint: str) -> RecordingProxy:
    """Do what EventBridge Scheduler does at the schedule's time: call its universal target.

    The target ``arn:aws:scheduler:::aws-sdk:<service>:<action>`` is called with the
    schedule's JSON input; the call goes through a recording proxy, so the test can judge it
    by the backstop role's policy.
    """
    service, action = schedule["Target"]["Arn"].split(":")[-2:]
    proxy = RecordingProxy(endpoint)
    client = boto3.client(service, region_name="us-east-1", endpoint_url=proxy.url)
    method = "".join("_" + c.lower() if c.isupper() else c for c in action)
    getattr(client, method)(**json.loads(schedule["Target"]["Input"]))
    return proxy


def test_airflow_down_and_no_boot_script_the_backstop_terminates_the_box(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any, aws: str
) -> None:
    run_id = "nobody-left"
    player.modes[run_id] = kit.HOLD  # the boot script never runs: no watchdog on the box
    (iid,) = backend.launch(request(run_id))
    scheduler = boto3.client("scheduler", region_name="us-east-1", endpoint_url=aws)
    schedule = scheduler.get_schedule(Name=backstop_name(iid))

    # AWS itself ends the box at its expiry: the expiry tag, to the second, in UTC.
    tags = {t["Key"]: t["Value"] for t in instances_of(ec2_client, run_id)[0]["Tags"]}
    assert schedule["ScheduleExpression"] == f"at({tags[TAG_EXPIRES_AT].removesuffix('Z')})"
    assert schedule["ScheduleExpressionTimezone"] == "UTC"
    assert schedule["ActionAfterCompletion"] == "DELETE"
    assert schedule["Target"]["Arn"] == BACKSTOP_TARGET_ARN
    assert schedule["Target"]["RoleArn"] == "arn:aws:iam::123456789012:role/burstcv-backstop"
    assert json.loads(schedule["Target"]["Input"]) == {"InstanceIds": [iid]}

    # Airflow is down (no teardown, no reaper): the schedule fires.
    proxy = fire(schedule, aws)
    try:
        with open(BACKSTOP_POLICY) as fh:
            role_policy = json.load(fh)
        (call,) = proxy.snapshot()
        assert call.action == "ec2:TerminateInstances"
        allowed, reason = evaluate(role_policy, call, {"ACCOUNT_ID": "123456789012"})
        assert allowed, reason
    finally:
        proxy.stop()
    assert states(ec2_client, run_id) == ["terminated"]
    assert kit.live_managed() == []


def test_teardown_removes_the_backstop(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "tidy"
    player.modes[run_id] = kit.HOLD
    (iid,) = backend.launch(request(run_id))
    assert list(backend.backstops([iid])) == [iid]
    backend.terminate_run(run_id)
    assert backend.backstops([iid]) == {}
    assert states(ec2_client, run_id) == ["terminated"]
    backend.terminate_run(run_id)  # a second teardown: the schedule is gone already, fine


def test_a_backstop_that_cannot_be_armed_leaves_no_box(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "no-backstop-role"
    player.modes[run_id] = kit.HOLD

    def refuse(**_: Any) -> None:
        raise ClientError(
            {"Error": {"Code": "ValidationException", "Message": "role cannot be assumed"}},
            "CreateSchedule",
        )

    backend.scheduler.meta.events.register("before-call.scheduler.CreateSchedule", refuse)
    with pytest.raises(RuntimeError, match=r"burstcv-backstop role .*BURSTCV_EC2_BACKSTOP=false"):
        backend.launch(request(run_id))
    assert states(ec2_client, run_id) == ["terminated"]


# --- nothing rented when the launch cannot be right -----------------------------------------


def test_a_dry_run_refusal_is_one_line_and_rents_nothing(
    ec2_settings: Ec2Settings,
    ec2_client: Any,
    kit: Any,
    audited_calls: RecordingProxy,
    deployment_policy: Any,
) -> None:
    backend = Ec2Backend(ec2_settings.model_copy(update={"instance_profile": "no-such-profile"}))
    with pytest.raises(LaunchCheckError) as caught:
        backend.launch(request("wrong-profile"))
    message = str(caught.value)
    assert "\n" not in message
    assert "BURSTCV_EC2_INSTANCE_PROFILE" in message
    runs = [c for c in audited_calls.snapshot() if c.action == "ec2:RunInstances"]
    assert runs and all(c.params.get("DryRun") == "true" for c in runs)
    assert instances_of(ec2_client, "wrong-profile") == []
    # The audit agrees: the policy would refuse passing a role other than the training one.
    assert any(
        "iam:PassRole" in line for line in denied(deployment_policy[0], runs, deployment_policy[1])
    )
    audited_calls.clear()


def test_a_missing_permission_is_named_before_anything_is_rented(
    backend: Ec2Backend, ec2_client: Any, kit: Any, audited_calls: RecordingProxy
) -> None:
    def unauthorized(params: dict[str, Any], **_: Any) -> None:
        if params.get("DryRun"):
            raise ClientError(
                {
                    "Error": {
                        "Code": "UnauthorizedOperation",
                        "Message": "You are not authorized to perform this operation.",
                    }
                },
                "RunInstances",
            )

    backend.client.meta.events.register("before-parameter-build.ec2.RunInstances", unauthorized)
    with pytest.raises(LaunchCheckError) as caught:
        backend.launch(request("not-allowed"))
    message = str(caught.value)
    assert "\n" not in message
    assert "ec2:RunInstances" in message and "iam:PassRole" in message
    assert "deploy/iam-policy.json" in message
    assert not [c for c in audited_calls.snapshot() if c.action == "ec2:RunInstances"]
    assert instances_of(ec2_client, "not-allowed") == []


def test_no_spot_service_linked_role_means_on_demand(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any
) -> None:
    run_id = "first-spot-ever"
    player.modes[run_id] = kit.HOLD

    def no_slr(params: dict[str, Any], **_: Any) -> None:
        if "InstanceMarketOptions" in params:
            raise ClientError(
                {
                    "Error": {
                        "Code": "AuthFailure.ServiceLinkedRoleCreationNotPermitted",
                        "Message": "The provided credentials do not have permission to create "
                        "the service-linked role for EC2 Spot Instances.",
                    }
                },
                "RunInstances",
            )

    backend.client.meta.events.register("before-parameter-build.ec2.RunInstances", no_slr)
    (iid,) = backend.launch(request(run_id))
    (inst,) = instances_of(ec2_client, run_id)
    assert inst["InstanceId"] == iid and "InstanceLifecycle" not in inst
    backend.terminate_run(run_id)
    assert kit.live_managed() == []


def test_every_launch_carries_a_client_token_of_run_attempt_and_option(
    backend: Ec2Backend, ec2_client: Any, player: Any, kit: Any, audited_calls: RecordingProxy
) -> None:
    player.modes["tokens"] = kit.HOLD
    backend.launch(request("tokens"))
    backend.terminate_run("tokens")
    backend.launch(request("tokens"), 2)  # a relaunch: a new token, a new box
    sent = [
        c.params.get("ClientToken")
        for c in audited_calls.snapshot()
        if c.action == "ec2:RunInstances" and c.params.get("DryRun") != "true"
    ]
    spot = LaunchAttempt("g6.xlarge", "spot")
    subnet = backend.launch_subnets()[0].subnet_id
    assert sent == [
        client_token("tokens", 1, spot, subnet),
        client_token("tokens", 2, spot, subnet),
    ]
    assert len(set(sent)) == 2 and all(len(t) <= 64 for t in sent if t)
    assert client_token("tokens", 1, LaunchAttempt("g6.xlarge", "on-demand"), subnet) != sent[0]
    # Another AZ's subnet is another request: its own token.
    assert client_token("tokens", 1, spot, "subnet-other") != sent[0]
    assert len(instances_of(ec2_client, "tokens")) == 2
    backend.terminate_run("tokens")
    assert kit.live_managed() == []


def test_a_relaunch_after_a_lost_box_is_a_new_attempt_with_a_new_token(
    backend: Ec2Backend,
    ec2_client: Any,
    player: Any,
    kit: Any,
    audited_calls: RecordingProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_id = "lost-then-relaunched"
    player.modes[run_id] = kit.HOLD
    for module in (boxes, attempts):
        monkeypatch.setattr(module, "get_backend", lambda name, settings=None: backend)
    launch = Launch(
        run=RunRef.of(run_id),
        dag_id=DAG_ID,
        job_uri=f"s3://never-read/runs/{run_id}/job/job.json",
        time_budget_s=600,
        instance_types=["g6.xlarge"],
        use_spot=True,
        **held_launch_fields(),
    )
    job_dir = f"{kit.artifact_root}/runs/{run_id}/job"
    settings = Settings()
    # The run as its first task resolved it: the relaunch reads its budget from run.json.
    given = {"compute_backend": "ec2", "instance_types": ["g6.xlarge"], "use_spot": True}
    resolve.resolve_run(launch.run, RunParams.resolve(given, settings), settings)
    (first,) = attempts.launch_attempt("ec2", launch, job_dir, 1, settings)
    ec2_client.terminate_instances(InstanceIds=[first])  # the box is lost (spot reclaim)
    provisioned = Provisioned(
        run=launch.run,
        job_uri=launch.job_uri,
        output_uri=job_dir,
        instance_ids=[first],
        backend="ec2",
        launch=launch,
    )
    assert boxes.relaunch(provisioned, settings) == 2
    (second,) = [i.instance_id for i in backend.describe(run_id) if i.state != "stopped"]
    assert second != first
    tokens = [
        c.params["ClientToken"]
        for c in audited_calls.snapshot()
        if c.action == "ec2:RunInstances" and c.params.get("DryRun") != "true"
    ]
    spot = LaunchAttempt("g6.xlarge", "spot")
    subnet = backend.launch_subnets()[0].subnet_id
    assert tokens == [client_token(run_id, 1, spot, subnet), client_token(run_id, 2, spot, subnet)]
    backend.terminate_run(run_id)
    assert kit.live_managed() == []
