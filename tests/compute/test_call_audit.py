"""Audit every AWS call of one pipeline's life against deploy/iam-policy.json, as AWS would.

The orchestrator's clients go through the recording proxy (see ``audited_calls`` in
conftest.py): provision through the pipeline (with the Airflow run id tag it always sends),
the wait for the job's outcome, the teardown, a reaper pass and the S3 registry (versions,
the alias lease, a failed deploy's restore, a rollback). Every recorded call is judged by a
small IAM evaluator; none may be denied, and a tag key the code sends but the policy lacks
must be.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from awsaudit import AwsCall, Check, RecordingProxy, denied, evaluate
from burstcv_testkit import HELD_WHEEL, launch_of, make_model_dir, resolve_validated

from burstcv.compute import attempts, reaper
from burstcv.compute import ec2 as ec2_module
from burstcv.compute.base import MANAGED_TAG_KEYS, TAG_AIRFLOW_RUN_ID, TAG_ATTEMPT
from burstcv.compute.ec2 import Ec2Backend
from burstcv.params import RunParams
from burstcv.registry.registry import PREVIOUS, PRODUCTION, Registry
from burstcv.settings import Settings
from burstcv.stages import boxes as boxes_stage
from burstcv_spec.contracts import Launch, Packed, PreprocessBlock, RegistryDecision, RunRef
from burstcv_spec.preprocess import PreprocessSpec

AIRFLOW_RUN_ID = "manual__2026-01-01T00:00:00+00:00"


def test_one_pipeline_life_makes_no_call_the_policy_denies(
    s3_deployment: Settings,
    player: Any,
    kit: Any,
    audited_calls: RecordingProxy,
    tmp_path: Path,
    deployment_policy: Any,
) -> None:
    settings = s3_deployment
    key = "manual__2026-01-01T00_00_00_00_00"
    player.modes[key] = kit.HOLD
    params = RunParams.resolve({"compute_backend": "ec2", "time_budget_s": 600}, settings)
    packed = Packed(
        classes=["0", "1"],
        train_shards=[f"{kit.artifact_root}/runs/{key}/dataset/shards/train-000.npz"],
        val_shards=[f"{kit.artifact_root}/runs/{key}/dataset/shards/val-000.npz"],
        counts={"train": 2, "val": 2},
        preprocess=PreprocessBlock.of(PreprocessSpec(height=32, width=32)),
        fingerprint="fp",
    )
    run = RunRef.of(AIRFLOW_RUN_ID)
    assert run.run_key == key
    resolve_validated(run, params, settings, packed)  # the first task prices it (GetProducts)
    provisioned = boxes_stage.provision(run, "burstcv_pipeline", packed, settings)
    outcome = attempts.training_outcome(key, "ec2", provisioned.output_uri)  # the wait
    assert (outcome.status, outcome.attempt) == ("running", 1)
    report = boxes_stage.terminate(run, "ec2", settings)
    assert report.instance_ids == provisioned.instance_ids
    reaped = reaper.reap_everywhere(None, lambda dag, run: False, settings=settings)
    assert reaper.reap_errors(reaped) == 0

    registry = Registry(settings.registry_uri, "digits")
    v1 = registry.register(
        str(make_model_dir(tmp_path / "a", "a")), RegistryDecision(status="accepted")
    )
    v2 = registry.register(
        str(make_model_dir(tmp_path / "b", "b")), RegistryDecision(status="accepted")
    )
    registry.promote(v1)
    with registry.aliases_locked("audit") as aliases:  # a failed deploy undoes its own move
        production, previous = aliases.read(PRODUCTION), aliases.read(PREVIOUS)
        aliases.promote(v2)
        assert aliases.undo(v2, production=production, previous=previous)
    registry.promote(v2)
    registry.rollback()

    calls = audited_calls.snapshot()
    actions = {c.action for c in calls}
    # Not a vacuous audit: every kind of call the orchestrator makes was seen and judged.
    assert {
        "ec2:RunInstances",
        "ec2:DescribeInstances",
        "ec2:DescribeImages",
        "ec2:TerminateInstances",
        "ec2:DescribeSubnets",  # every AZ's default subnet, for capacity failover
        "ec2:DescribeSpotPriceHistory",  # the spot price of the box's own AZ
        "pricing:GetProducts",  # on-demand prices for the run's budget
        "ssm:GetParameter",
        "scheduler:CreateSchedule",
        "scheduler:DeleteSchedule",
        "s3:PutObject",
        "s3:GetObject",
        "s3:ListBucket",
        "s3:DeleteObject",
    } <= actions, actions
    launches = [c for c in calls if c.action == "ec2:RunInstances" and c.status == 200]
    (launch,) = launches
    tag_keys = next(c.context["aws:TagKeys"] for c in launch.checks if "instance/" in c.resource)
    assert TAG_AIRFLOW_RUN_ID in tag_keys  # the tag the old policy refused
    deletes = [c for c in calls if c.action == "s3:DeleteObject"]
    assert any(
        r.endswith("/aliases/production.json") or ".lock" in r for c in deletes for r in c.resources
    )
    assert denied(deployment_policy[0], calls, deployment_policy[1]) == []


def test_a_tag_key_added_to_the_code_but_not_the_policy_is_denied(
    backend: Ec2Backend,
    ec2_client: Any,
    player: Any,
    kit: Any,
    audited_calls: RecordingProxy,
    monkeypatch: pytest.MonkeyPatch,
    deployment_policy: Any,
) -> None:
    player.modes["new-tag"] = kit.HOLD
    original = ec2_module.instance_tags

    def with_an_owner(
        launch: Launch, expires_at: Any, attempt: int | None = None
    ) -> list[dict[str, str]]:
        owner = {"Key": "burstcv:owner", "Value": "ml-team"}
        return [*original(launch, expires_at, attempt), owner]

    monkeypatch.setattr(ec2_module, "instance_tags", with_an_owner)
    (iid,) = backend.launch(
        launch_of("new-tag", "s3://never-read/job.json", dag_id="dag", **HELD_WHEEL)
    )
    launches = [c for c in audited_calls.snapshot() if c.action == "ec2:RunInstances"]
    refused = denied(deployment_policy[0], launches, deployment_policy[1])
    assert refused and all("burstcv:owner" in line and "aws:TagKeys" in line for line in refused)
    # The same launch without the extra key is allowed: the key alone made the difference.
    monkeypatch.setattr(ec2_module, "instance_tags", original)
    audited_calls.clear()  # the denial above is this test's point, not a finding
    ec2_client.terminate_instances(InstanceIds=[iid])
    player.modes["old-tags"] = kit.HOLD
    backend.launch(
        launch_of(
            "old-tags", "s3://never-read/job.json", dag_id="dag", airflow_run_id="r", **HELD_WHEEL
        )
    )
    launches = [c for c in audited_calls.snapshot() if c.action == "ec2:RunInstances"]
    assert launches and denied(deployment_policy[0], launches, deployment_policy[1]) == []
    backend.terminate_run("old-tags")


def test_the_code_sends_exactly_the_tag_keys_of_the_one_definition() -> None:
    from datetime import UTC, datetime

    launch = launch_of("run", "s3://b/job.json", dag_id="dag", airflow_run_id="manual__x")
    tags = ec2_module.instance_tags(launch, datetime(2026, 1, 1, tzinfo=UTC), 2)
    assert [t["Key"] for t in tags] == [
        *MANAGED_TAG_KEYS[:4],
        "Name",
        TAG_AIRFLOW_RUN_ID,
        TAG_ATTEMPT,
    ]
    assert sorted(t["Key"] for t in tags) == sorted(MANAGED_TAG_KEYS)
    assert tags[-1]["Value"] == "2"
    # The groups a run's attempts share carry no attempt.
    shared = ec2_module.instance_tags(launch, datetime(2026, 1, 1, tzinfo=UTC))
    assert TAG_ATTEMPT not in {t["Key"] for t in shared}


def test_evaluate_names_the_refused_authorization(kit: Any, deployment_policy: Any) -> None:
    call = AwsCall("s3", "s3:DeleteObject", "us-east-1", "DELETE", "/x", {}, [])
    call.checks = [Check("s3:DeleteObject", f"arn:aws:s3:::{kit.bucket}/datasets/x.parquet")]
    allowed, reason = evaluate(deployment_policy[0], call, deployment_policy[1])
    assert not allowed and "datasets/x.parquet" in reason and "no statement allows" in reason


def test_the_audit_routes_the_orchestrator_through_the_proxy(
    aws: str, audited_calls: RecordingProxy
) -> None:
    conn = json.loads(os.environ["AIRFLOW_CONN_AWS_DEFAULT"])
    assert conn["extra"]["endpoint_url"] == audited_calls.url != aws
    assert os.environ["AWS_ENDPOINT_URL_S3"] == audited_calls.url
    assert os.environ["AWS_ENDPOINT_URL"] == aws  # the test's and the boxes' own clients


def test_unaudited_leaves_the_clients_on_the_emulator(aws: str, unaudited: None) -> None:
    conn = json.loads(os.environ["AIRFLOW_CONN_AWS_DEFAULT"])
    assert conn["extra"]["endpoint_url"] == aws
    assert "AWS_ENDPOINT_URL_S3" not in os.environ


def test_a_two_box_life_makes_only_allowed_calls_on_the_runs_own_groups(
    s3_deployment: Settings,
    player: Any,
    kit: Any,
    ec2_client: Any,
    audited_calls: RecordingProxy,
    deployment_policy: Any,
) -> None:
    key = "two-box-audit"
    player.modes[key] = kit.HOLD
    params = RunParams.resolve({"compute_backend": "ec2", "num_nodes": 2}, s3_deployment)
    packed = Packed(
        classes=["0", "1"],
        train_shards=[f"{kit.artifact_root}/runs/{key}/dataset/shards/train-000.npz"],
        val_shards=[f"{kit.artifact_root}/runs/{key}/dataset/shards/val-000.npz"],
        counts={"train": 2, "val": 2},
        preprocess=PreprocessBlock.of(PreprocessSpec(height=32, width=32)),
        fingerprint="fp",
    )
    run = RunRef.of(key)
    resolve_validated(run, params, s3_deployment, packed)
    provisioned = boxes_stage.provision(run, "burstcv_pipeline", packed, s3_deployment)
    assert len(provisioned.instance_ids) == 2
    boxes_stage.terminate(run, "ec2", s3_deployment)

    calls = audited_calls.snapshot()
    actions = {c.action for c in calls}
    assert {
        "ec2:CreatePlacementGroup",
        "ec2:CreateSecurityGroup",
        "ec2:AuthorizeSecurityGroupIngress",
        "ec2:DeleteSecurityGroup",
        "ec2:DeletePlacementGroup",
    } <= actions, actions
    (launch,) = [c for c in calls if c.action == "ec2:RunInstances" and c.status == 200]
    assert any(c.resource.endswith(f":placement-group/burstcv-{key}") for c in launch.checks)
    assert denied(deployment_policy[0], calls, deployment_policy[1]) == []

    # Someone else's security group: opening or deleting it is refused.
    stranger = ec2_client.create_security_group(GroupName="not-ours", Description="x")["GroupId"]
    audited_calls.clear()
    Ec2Backend(s3_deployment.ec2).client.delete_security_group(GroupId=stranger)
    refused = denied(deployment_policy[0], audited_calls.snapshot(), deployment_policy[1])
    assert refused and all("DeleteSecurityGroup" in line for line in refused), refused
    audited_calls.clear()  # the denial above is this test's point, not a finding
