"""Boot the real user-data of real EC2 launches in a sandbox that looks like a fresh instance.

The orchestrator side is the real code against moto (``boxes_stage.provision`` stages the
training wheel and writes job.json, ``Ec2Backend.launch`` renders the user-data, the real
trigger waits for the attempt's marker, the train task's own try relaunches a reclaimed box). The
box side is the rendered script, unmodified, run by bash in a network namespace where
169.254.169.254 is an IMDSv2 and S3 is moto, and nothing else is reachable: it downloads the
wheel, checks its sha256, pip-installs it and what the "AMI" Python lacks (pydantic: the
stand-in holds torch, torchvision, numpy and boto3) from the wheelhouse staged beside it,
runs the preflight and trains for real. The box's ``python3`` has no boto3. Only
``shutdown``/``poweroff`` are shims, and the GPU: CUDA is required only where the test says.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import platform
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
import structlog.testing
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred
from awsaudit import RecordingProxy, console_answer, denied, simulated
from boxsandbox import Boot, BoxSandbox, SandboxUnavailable, link, make_ami_python
from burstcv_testkit import (
    corrupt_image_member,
    launch_of,
    power_off_in_emulator,
    reclaim_in_emulator,
    resolve_validated,
    s3_gateway_endpoint,
)

from burstcv.airflow.operators import WaitForTrainingOperator
from burstcv.airflow.triggers import TrainingCompletionTrigger
from burstcv.compute.attempts import current_attempt
from burstcv.compute.awscheck import instance_role_requests
from burstcv.compute.ec2 import Ec2Backend, Ec2Settings
from burstcv.compute.runtime import stage_training_wheel, training_tags
from burstcv.params import RunParams
from burstcv.settings import Settings, get_settings
from burstcv.stages import boxes as boxes_stage
from burstcv.stages import report as report_stage
from burstcv.stages import resolve
from burstcv.training.job import JobSpec, attempt_dir, rank_failures, write_job
from burstcv.training.stream import node_shards, read_shard_info
from burstcv_spec import storage
from burstcv_spec.contracts import Packed, PreprocessBlock, Provisioned, RunRef

REGION = "us-east-1"
BUCKET = "burstcv-test"
ARTIFACT_ROOT = f"s3://{BUCKET}/artifacts"
AMI_PARAMETER = "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-6.1-x86_64"
PROFILE = "burstcv-training"
TRAIN_IMAGES = 384  # small enough for seconds per epoch on 2 shared cores
VAL_IMAGES = 96
# A boot that trains several epochs, on a shared machine whose 2 cores others are using.
SLOW_BOOT_S = 1500.0


@pytest.fixture(scope="module")
def ami_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return the stand-in for the Deep Learning AMI's PyTorch interpreter (no pydantic)."""
    return make_ami_python(tmp_path_factory.mktemp("ami") / "pytorch")


INSTANCE_POLICY = Path(__file__).resolve().parents[2] / "deploy" / "instance-role-policy.json"
BOX_REGION = "us-west-2"  # differs from the launch's fallback: the box must take IMDS's


@pytest.fixture
def box_calls(aws: str) -> Iterator[RecordingProxy]:
    """Yield the proxy between a box and the emulator: it records every call of the box (and
    answers as AWS would where the emulator does not)."""
    proxy = RecordingProxy(aws)
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def box(box_calls: RecordingProxy, tmp_path: Path) -> Iterator[BoxSandbox]:
    """Yield a fresh sandbox whose S3 is the emulator, every box call recorded; then audit.

    After the test: nothing of the box survives, and every AWS call the box made (the AWS
    CLI in the boot script, boto3 in training) was signed for the box's own region and is
    allowed by deploy/instance-role-policy.json.
    """
    proxy = box_calls
    try:
        sandbox = BoxSandbox(tmp_path / "sandbox", proxy.url).__enter__()
    except SandboxUnavailable as exc:
        pytest.skip(f"network namespaces are not permitted here: {exc}")
    sandbox.imds.region = BOX_REGION
    assert sandbox.routes() == "", "the box reaches more than the emulator"
    try:
        yield sandbox
        assert sandbox.reap_processes() == [], "a process of the box outlived its script"
        calls = proxy.snapshot()
        assert calls, "the box made no AWS call through the sandbox"
        assert {call.region for call in calls} == {BOX_REGION}, [str(c) for c in calls]
        policy = json.loads(INSTANCE_POLICY.read_text())
        variables = {"ARTIFACT_ROOT": f"{BUCKET}/artifacts", "BURSTCV_BUCKET": BUCKET}
        refused = denied(policy, calls, variables)
        assert not refused, "calls deploy/instance-role-policy.json denies:\n" + "\n".join(refused)
        print(f"box AWS calls: {sorted({c.action for c in calls})} ({len(calls)}), 0 denied")
    finally:
        sandbox.close()


@pytest.fixture
def account(aws: str, ami_python: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Create the bucket and instance profile; point the ec2 backend at the sandbox's AMI."""
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=aws)
    s3.create_bucket(Bucket=BUCKET)
    iam = boto3.client("iam", region_name=REGION, endpoint_url=aws)
    iam.create_role(RoleName=PROFILE, AssumeRolePolicyDocument="{}")
    iam.create_instance_profile(InstanceProfileName=PROFILE)
    iam.add_role_to_instance_profile(InstanceProfileName=PROFILE, RoleName=PROFILE)
    for key, value in {
        "REGION": REGION,
        "AMI": AMI_PARAMETER,
        "INSTANCE_PROFILE": PROFILE,
        "PYTHON": str(ami_python),
        "REQUIRE_GPU": "false",  # the one thing this machine cannot have
        "INSTANCE_TYPES": "g6.xlarge",
        "WAITER_DELAY_S": "0.1",
        "LOG_EVERY_S": "5",
    }.items():
        monkeypatch.setenv(f"BURSTCV_EC2_{key}", value)
    return {"s3": s3, "ec2": boto3.client("ec2", region_name=REGION, endpoint_url=aws)}


def upload_slice(packed_demo: dict[str, Any], train_shards: int) -> Packed:
    """Upload a slice of the packed demo digits to the emulated S3; return the packed dict.

    The training slice is cut into ``train_shards`` shards of equal size.
    """
    uris: dict[str, list[str]] = {"train": [], "val": []}
    for split, count, parts in (("train", TRAIN_IMAGES, train_shards), ("val", VAL_IMAGES, 1)):
        with np.load(packed_demo[f"{split}_shards"][0]) as npz:
            images, labels, classes = npz["images"][:count], npz["labels"][:count], npz["classes"]
        for no, rows in enumerate(np.array_split(np.arange(count), parts)):
            buffer = io.BytesIO()
            np.savez(buffer, images=images[rows], labels=labels[rows], classes=classes)
            uri = f"{ARTIFACT_ROOT}/runs/shared/dataset/shards/{split}-{no:03d}.npz"
            storage.write_bytes(uri, buffer.getvalue())
            uris[split].append(uri)
    return Packed(
        classes=packed_demo["classes"],
        train_shards=uris["train"],
        val_shards=uris["val"],
        counts={"train": TRAIN_IMAGES, "val": VAL_IMAGES},
        preprocess=PreprocessBlock.of(packed_demo["spec"]),
        fingerprint="demo-slice",
    )


@pytest.fixture
def shards(account: dict[str, Any], packed_demo: dict[str, Any]) -> Packed:
    """Return the demo slice in the emulated S3: one training shard."""
    return upload_slice(packed_demo, train_shards=1)


@pytest.fixture
def split_shards(account: dict[str, Any], packed_demo: dict[str, Any]) -> Packed:
    """Return the demo slice in the emulated S3: four training shards, two for each box."""
    return upload_slice(packed_demo, train_shards=4)


def settings() -> Settings:
    """Return orchestrator settings whose artifact store is the emulated bucket."""
    return Settings(artifact_root=ARTIFACT_ROOT, registry_uri=f"{ARTIFACT_ROOT}/registry")


def params(**overrides: Any) -> RunParams:
    """Return run params for the ec2 backend on the demo slice."""
    fields: dict[str, Any] = {
        "dataset_uri": "s3://unused/dataset",
        "model": "resnet10",
        "compute_backend": "ec2",
        "instance_types": ["g6.xlarge"],
        "epochs": 2,
        "batch_size": 32,
        "learning_rate": 0.1,
    }
    fields.update(overrides)
    return RunParams(**fields)


def provision(run_key: str, packed: Packed, **overrides: Any) -> Provisioned:
    """Provision a run on the packed slice as the DAG does: its run.json first (resolved,
    with validate's choices for the slice), then the provision stage."""
    run = RunRef.of(run_key)
    resolve_validated(run, params(**overrides), settings(), packed)
    return boxes_stage.provision(run, "burstcv_pipeline", packed, settings())


def user_data(ec2: Any, instance_id: str) -> str:
    """Return the user-data EC2 would hand the instance at boot."""
    raw = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    return base64.b64decode(raw["UserData"]["Value"]).decode()


def power_off_like_ec2(ec2: Any, instance_id: str, boot: Boot) -> None:
    """Do what EC2 does when the OS halts: InstanceInitiatedShutdownBehavior=terminate."""
    attr = ec2.describe_instance_attribute(
        InstanceId=instance_id, Attribute="instanceInitiatedShutdownBehavior"
    )
    assert attr["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
    if boot.powered_off:
        # Ended by its own halt, as EC2 records it (StateReason Client.InstanceInitiatedShutdown).
        power_off_in_emulator(instance_id, REGION)


def state(ec2: Any, instance_id: str) -> str:
    """Return the emulated instance's state name."""
    reservations = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    return str(reservations[0]["Instances"][0]["State"]["Name"])


def wait_for_trigger(provisioned: Provisioned, attempt: int) -> dict[str, Any]:
    """Run the real trigger until it fires; return its event payload."""
    trigger = TrainingCompletionTrigger(
        run_id=provisioned.run.run_key,
        backend="ec2",
        output_uri=provisioned.output_uri,
        attempt=attempt,
        poll_interval_s=0.2,
        max_cost_usd=resolve.resolved_run(provisioned.run, settings()).costs.max_cost_usd,
    )

    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), timeout=60))


def boot_instance(box: BoxSandbox, ec2: Any, instance_id: str, timeout_s: float = 480.0) -> Boot:
    """Boot the instance's own user-data in the sandbox, then power it off as EC2 would."""
    box.imds.instance_id = instance_id
    boot = box.boot(user_data(ec2, instance_id), timeout_s=timeout_s)
    power_off_like_ec2(ec2, instance_id, boot)
    return boot


def stage_seconds(console: str) -> dict[str, float]:
    """Return the seconds from boot to each stage line the script and training print."""
    stamps = re.findall(r"burstcv: (\S+Z) (.*)", console)
    if not stamps:
        return {}
    t0 = datetime.fromisoformat(stamps[0][0].replace("Z", "+00:00"))
    out: dict[str, float] = {}
    for text, what in stamps:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
        out.setdefault(what.split()[0], (moment - t0).total_seconds())
    first = re.search(r"first step done ([\d.]+) s after the job started", console)
    if first:
        out["first_step_after_train_start"] = float(first.group(1))
    return out


def test_a_clean_boot_installs_the_wheel_trains_and_powers_off(
    box: BoxSandbox,
    account: dict[str, Any],
    shards: Packed,
) -> None:
    ec2 = account["ec2"]
    provisioned = provision("manual__clean", shards)
    (instance_id,) = provisioned.instance_ids
    job = JobSpec.model_validate(storage.read_json(provisioned.job_uri))
    assert job.runtime_sha256 and job.deadline_at is not None
    # A data memory budget smaller than the data: the box streams the shards from S3, as for a
    # dataset larger than its memory, and keeps them on its disk after the first download.
    write_job(job.model_copy(update={"data_memory_budget_mb": 1}), provisioned.job_uri)

    boot = boot_instance(box, ec2, instance_id)
    print("boot stages (s):", stage_seconds(boot.console), "total", round(boot.seconds, 1))

    assert boot.exit_code == 0, boot.console
    # No AWS CLI on the box's PATH: the wheel, the markers and the log went through boto3.
    assert shutil.which("aws", path=box.path) is None
    # What the AMI's environment lacks came from the wheelhouse: no route to an index here.
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}"
    assert f"installed from the wheelhouse ({tag})" in boot.console, boot.console
    assert box.routes() == ""
    assert boot.shutdown_calls[0][:2] == ["shutdown", "-h"] and boot.shutdown_calls[0][2][0] == "+"
    assert boot.shutdown_calls[-1] == ["shutdown", "-h", "now"]
    assert "preflight passed" in boot.console
    # The wheel went in without resolving torch (pip installed only burstcv-train).
    assert "Collecting torch" not in boot.console and "Downloading" not in boot.console
    with structlog.testing.capture_logs() as trigger_log:  # what the triggerer puts in the log
        event = wait_for_trigger(provisioned, attempt=1)
    assert event["status"] == "done", event
    metrics = storage.read_json(f"{provisioned.output_uri}/metrics.json")
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]
    # The train task's log: one line per epoch, with money and time, from the real trigger.
    progress = [entry["event"] for entry in trigger_log if entry["event"].startswith("epoch ")]
    assert [line.split(" val_accuracy")[0] for line in progress] == ["epoch 1/2", "epoch 2/2"]
    for line in progress:
        # What a reader scans for first: accuracy, dollars spent and left, minutes left.
        assert re.match(
            r"epoch \d/2 val_accuracy [\d.]+ val_loss [\d.]+ \| \$[\d.]+ of \$[\d.]+, "
            r"\$[\d.]+ left \| [\d.]+ min to the deadline \| train_loss [\d.]+, "
            r"\d+ images/s, \d+ s, billed \d+ s, attempt 1$",
            line,
        ), line
        assert len(line.split(" | train_loss")[0]) <= 110, line
    assert metrics["attempt"] == 1
    # Each shard was downloaded once; every later epoch and evaluation read the box's copy,
    # and the copies went when training ended.
    assert "streaming train shards" in boot.console
    cache = re.search(r"shard cache: (\d+) downloads, (\d+) local reads", boot.console)
    assert cache, boot.console[-3000:]
    val_streamed = "validation streamed" in boot.console
    assert int(cache.group(1)) == len(shards.train_shards) + val_streamed * len(shards.val_shards)
    assert int(cache.group(2)) >= 2 * len(shards.train_shards)
    assert not any((boot.box_dir / "opt" / "shard-cache").rglob("*.npz"))
    log = storage.read_bytes(attempt_dir(provisioned.output_uri, 1, "logs", f"{instance_id}.log"))
    assert b"training exited with 0" in log
    assert state(ec2, instance_id) == "terminated"
    # Every metadata read the box made carried an IMDSv2 token.
    assert all(has_token for method, _, has_token in box.imds.requests if method == "GET")
    assert any("placement/region" in path for _, path, _ in box.imds.requests)


def test_a_failed_preflight_is_final_and_says_what_to_set(
    box: BoxSandbox,
    account: dict[str, Any],
    shards: Packed,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ec2 = account["ec2"]
    monkeypatch.setenv("BURSTCV_EC2_REQUIRE_GPU", "true")  # this sandbox has no NVIDIA driver
    provisioned = provision("manual__nogpu", shards)
    (instance_id,) = provisioned.instance_ids
    # The role's credentials come slower than botocore's default 1 s wait: the box still gets
    # them (the failure below is the GPU check's, not a credential fetch's).
    box.imds.credentials_delay_s = 2.0

    boot = boot_instance(box, ec2, instance_id)

    assert boot.exit_code == 3, boot.console
    assert "NoCredentialsError" not in boot.console, boot.console
    assert boot.shutdown_calls[-1] == ["shutdown", "-h", "now"]
    event = wait_for_trigger(provisioned, attempt=1)
    assert event["status"] == "failed" and event["stage"] == "preflight"
    assert event["resumable"] is False
    assert "BURSTCV_EC2_AMI" in event["reason"]
    assert "\n" not in event["reason"]
    assert not storage.exists(f"{provisioned.output_uri}/checkpoints/last.pt")
    # Final: the train task fails without a retry, with that line and the box's log tail.
    from airflow.sdk.exceptions import AirflowFailException

    from burstcv.airflow.operators import WaitForTrainingOperator

    operator = WaitForTrainingOperator(task_id="train", provisioned=provisioned)
    with (
        caplog.at_level("INFO", logger="burstcv.airflow.operators"),
        pytest.raises(AirflowFailException) as failed,
    ):
        operator.execute_complete({"run_id": "manual__nogpu"}, event)
    assert "at preflight" in str(failed.value) and event["reason"] in str(failed.value)
    tail = [r.getMessage() for r in caplog.records if r.getMessage().startswith("box | ")]
    assert any("preflight failed" in line for line in tail), tail
    assert state(ec2, instance_id) == "terminated"


@pytest.fixture
def box_without_s3(aws: str, tmp_path: Path) -> Iterator[BoxSandbox]:
    """Yield a sandbox whose network lets nothing out to S3 (no egress rule)."""
    try:
        sandbox = BoxSandbox(tmp_path / "sandbox", aws).__enter__()
    except SandboxUnavailable as exc:
        pytest.skip(f"network namespaces are not permitted here: {exc}")
    sandbox.imds.region = BOX_REGION
    sandbox.cut_s3()
    try:
        yield sandbox
        assert sandbox.reap_processes() == [], "a process of the box outlived its script"
    finally:
        sandbox.close()


def test_a_box_that_cannot_reach_s3_powers_off_and_fails_at_boot_after_one_launch(
    box_without_s3: BoxSandbox,
    account: dict[str, Any],
    shards: Packed,
    audited_calls: RecordingProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from burstcv.airflow.operators import WaitForTrainingOperator

    ec2 = account["ec2"]
    # An account that follows CIS 4.3: the default security group the box gets has no rule.
    (vpc,) = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"]
    (group,) = ec2.describe_security_groups(
        Filters=[
            {"Name": "group-name", "Values": ["default"]},
            {"Name": "vpc-id", "Values": [vpc["VpcId"]]},
        ]
    )["SecurityGroups"]
    ec2.revoke_security_group_egress(
        GroupId=group["GroupId"], IpPermissions=group["IpPermissionsEgress"]
    )
    try:
        provisioned = provision("manual__noegress", shards)
        (instance_id,) = provisioned.instance_ids

        boot = boot_instance(box_without_s3, ec2, instance_id)

        # The box says why in its own log (its console), writes nothing, and halts at once.
        assert boot.exit_code == 4, boot.console
        assert "cannot reach S3" in boot.console, boot.console
        assert "installing" not in boot.console
        assert boot.shutdown_calls[-1] == ["shutdown", "-h", "now"]
        attempt_uri = f"{provisioned.output_uri}/attempts/1"
        assert not storage.exists(f"{attempt_uri}/logs/{instance_id}.log")
        # What EC2 captured of its console (the emulator has no boxes of its own to capture).
        monkeypatch.setitem(
            audited_calls.answers, "ec2:GetConsoleOutput", console_answer(instance_id, boot.console)
        )
        # The orchestrator: FAILED at boot, the cause read from the account, never relaunched.
        event = wait_for_trigger(provisioned, attempt=1)
        assert (event["status"], event["stage"], event["resumable"]) == ("failed", "boot", False)
        assert f"box {instance_id} powered off without reaching S3" in event["reason"]
        assert group["GroupId"] in event["reason"] and "egress" in event["reason"]
        # And in the box's own words: the step it stopped at, the error it met.
        said = re.search(
            r"its console's last step: \"cannot reach S3: s3: exists (.+?)\"", event["reason"]
        )
        assert said and provisioned.output_uri in said.group(1), event["reason"]
        assert "GetConsoleOutput" in [c.action.split(":")[1] for c in audited_calls.snapshot()]
        operator = WaitForTrainingOperator(task_id="train", provisioned=provisioned)
        with pytest.raises(AirflowFailException, match="at boot"):
            operator.execute_complete({"run_id": "manual__noegress"}, event)
        launched = ec2.describe_instances(
            Filters=[{"Name": "tag:burstcv:run-id", "Values": [provisioned.run.run_key]}]
        )["Reservations"]
        assert [i["InstanceId"] for r in launched for i in r["Instances"]] == [instance_id]
    finally:
        ec2.authorize_security_group_egress(
            GroupId=group["GroupId"],
            IpPermissions=[{"IpProtocol": "-1", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}],
        )


def test_a_bucket_whose_kms_key_the_role_cannot_use_fails_at_boot_after_one_launch(
    box: BoxSandbox,
    box_calls: RecordingProxy,
    aws: str,
    account: dict[str, Any],
    shards: Packed,
    audited_calls: RecordingProxy,
    iam_resources_audited: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ec2, s3 = account["ec2"], account["s3"]
    monkeypatch.setenv("BURSTCV_ARTIFACT_ROOT", ARTIFACT_ROOT)  # what the trigger reads
    get_settings.cache_clear()
    # The account as docs/aws.md sets it up: a route to S3 (the free gateway endpoint).
    s3_gateway_endpoint(ec2, REGION)
    kms = boto3.client("kms", region_name=REGION, endpoint_url=aws)
    key = kms.create_key(Description="the artifact bucket's key")["KeyMetadata"]["Arn"]
    s3.put_bucket_encryption(
        Bucket=BUCKET,
        ServerSideEncryptionConfiguration={
            "Rules": [
                {
                    "ApplyServerSideEncryptionByDefault": {
                        "SSEAlgorithm": "aws:kms",
                        "KMSMasterKeyID": key,
                    }
                }
            ]
        },
    )
    provisioned = provision("manual__kms", shards)
    (instance_id,) = provisioned.instance_ids

    # S3's answer to a caller that may not use an object's key (the emulator stores objects
    # unencrypted and checks no key): 403 for each of the box's object calls.
    def refused(call: Any) -> tuple[int, bytes]:
        if call.method == "HEAD":
            return 403, b""
        return 403, (
            "<Error><Code>AccessDenied</Code><Message>User: arn:aws:sts::123456789012:"
            f"assumed-role/{PROFILE}/{instance_id} is not authorized to perform: "
            f"kms:Decrypt on resource: {key}</Message></Error>"
        ).encode()

    monkeypatch.setitem(box_calls.answers, "s3:GetObject", refused)
    monkeypatch.setitem(box_calls.answers, "s3:PutObject", refused)
    boot = boot_instance(box, ec2, instance_id)

    # The box could not read its job: it says so on its console and halts, writing nothing.
    assert boot.exit_code == 4, boot.console
    assert "cannot reach S3" in boot.console and "403" in boot.console, boot.console
    assert boot.shutdown_calls[-1] == ["shutdown", "-h", "now"]
    # What IAM's simulator answers for the training role (deploy/instance-role-policy.json:
    # the run's files, no statement for a customer managed key), and what EC2 captured of
    # the box's console.
    policy = json.loads(INSTANCE_POLICY.read_text())
    variables = {"ARTIFACT_ROOT": f"{BUCKET}/artifacts", "BURSTCV_BUCKET": BUCKET}
    simulation = simulated(policy, variables, instance_role_requests(ARTIFACT_ROOT, key))
    monkeypatch.setitem(audited_calls.answers, "iam:SimulatePrincipalPolicy", (200, simulation))
    monkeypatch.setitem(
        audited_calls.answers, "ec2:GetConsoleOutput", console_answer(instance_id, boot.console)
    )
    event = wait_for_trigger(provisioned, attempt=1)

    # FAILED at boot, not resumable: the cause (the role may not use the bucket's key) read
    # from the account, and the box's own words.
    assert (event["status"], event["stage"], event["resumable"]) == ("failed", "boot", False)
    reason = event["reason"]
    assert f"box {instance_id} powered off without reaching S3" in reason
    assert f"the bucket's default key {key}" in reason and "kms:" in reason, reason
    assert "its console's last step: \"cannot reach S3: " in reason and "403" in reason
    operator = WaitForTrainingOperator(task_id="train", provisioned=provisioned.model_dump())
    with pytest.raises(AirflowFailException, match="powered off without reaching S3"):
        operator.execute_complete({"run_id": "manual__kms"}, event)
    launched = ec2.describe_instances(
        Filters=[{"Name": "tag:burstcv:run-id", "Values": [provisioned.run.run_key]}]
    )["Reservations"]
    assert [i["InstanceId"] for r in launched for i in r["Instances"]] == [instance_id]
    # The run's report says the same.
    page = storage.read_bytes(report_stage.report(provisioned.run, settings())).decode()
    assert "Training failed in attempt 1, at the boot stage: " in page and key in page


def test_a_python_outside_the_range_fails_preflight_before_the_install(
    box: BoxSandbox,
    account: dict[str, Any],
    shards: Packed,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ec2 = account["ec2"]
    monkeypatch.setenv("BURSTCV_EC2_PYTHON", "/usr/bin/python-that-is-not-there")
    provisioned = provision("manual__nopy", shards)
    (instance_id,) = provisioned.instance_ids
    # No Python with boto3 on this box: the AMI's AWS CLI (DLAMIs have one) still writes the
    # FAILED marker that says what to set, instead of a box "lost" without a word.
    box.add_aws_cli()

    boot = boot_instance(box, ec2, instance_id)
    assert "S3 through the AWS CLI" in boot.console, boot.console

    event = wait_for_trigger(provisioned, attempt=1)
    assert event["status"] == "failed" and event["stage"] == "preflight", event
    assert "BURSTCV_EC2_PYTHON" in event["reason"] and event["resumable"] is False
    assert "installing" not in boot.console
    assert boot.shutdown_calls[-1] == ["shutdown", "-h", "now"]


def test_a_spot_reclaim_still_shutting_down_resumes_in_the_same_try(
    box: BoxSandbox,
    account: dict[str, Any],
    shards: Packed,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ec2 = account["ec2"]
    monkeypatch.setenv("BURSTCV_ARTIFACT_ROOT", ARTIFACT_ROOT)  # where the task reads metrics
    get_settings.cache_clear()
    provisioned = provision("manual__spot", shards, epochs=4, batch_size=8)
    (first_box,) = provisioned.instance_ids
    progress_uri = f"{provisioned.output_uri}/progress.json"
    live_log = attempt_dir(provisioned.output_uri, 1, "logs", f"{first_box}.log")
    seen_while_running: list[bool] = []

    def notice_after_the_first_epoch() -> None:
        deadline = time.monotonic() + 600  # a shared, busy machine trains slowly
        while time.monotonic() < deadline and not storage.exists(progress_uri):
            time.sleep(0.2)
        # The log ships every few seconds: it is in the store while the box still trains.
        seen_while_running.append(storage.exists(live_log))
        box.imds.spot_action = {"action": "terminate", "time": datetime.now(UTC).isoformat()}

    threading.Thread(target=notice_after_the_first_epoch, daemon=True).start()
    box.imds.instance_id = first_box
    first = box.boot(user_data(ec2, first_box), timeout_s=SLOW_BOOT_S)
    box.imds.spot_action = None
    reclaim_in_emulator(first_box)  # EC2 takes it back: shutting-down, for minutes

    assert first.exit_code == 143, first.console
    assert seen_while_running == [True]
    assert first.shutdown_calls[-1] == ["shutdown", "-h", "now"]
    event = wait_for_trigger(provisioned, attempt=1)
    assert event["status"] == "failed" and event["resumable"] is True, event
    interrupted_at = storage.read_json(f"{provisioned.output_uri}/progress.json")["epochs"]
    assert 1 <= len(interrupted_at) < 4

    # The train task's own try relaunches: no Airflow retry is spent on a reclaim.
    operator = WaitForTrainingOperator(task_id="train", provisioned=provisioned.model_dump())
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute_complete({"run_id": "manual__spot"}, event)
    assert deferred.value.trigger.attempt == 2
    assert state(ec2, first_box) == "shutting-down"  # never mistaken for a box that trains
    (second_box,) = [
        i.instance_id
        for i in Ec2Backend().describe(provisioned.run.run_key)
        if i.state == "running"
    ]
    second = boot_instance(box, ec2, second_box, timeout_s=SLOW_BOOT_S)

    assert second.exit_code == 0, second.console
    assert "attempt 2 resumed from" in second.console
    # The old attempt's FAILED is still there; only attempt 2's marker counts now.
    assert storage.exists(attempt_dir(provisioned.output_uri, 1, "FAILED"))
    event = wait_for_trigger(provisioned, attempt=2)
    assert event["status"] == "done", event
    trained = operator.execute_complete({"run_id": "manual__spot"}, event)
    assert trained["epochs"] == 4
    metrics = storage.read_json(f"{provisioned.output_uri}/metrics.json")
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2, 3, 4]
    assert metrics["attempt"] == 2
    assert state(ec2, second_box) == "terminated"
    get_settings.cache_clear()


def test_the_run_deadline_stops_training_mid_epoch_with_a_checkpoint(
    box: BoxSandbox, account: dict[str, Any], shards: Packed, ami_python: Path
) -> None:
    ec2 = account["ec2"]
    staged = stage_training_wheel(ARTIFACT_ROOT, training_tags(str(ami_python), ["g6.xlarge"]))
    job_dir = f"{ARTIFACT_ROOT}/runs/budget/job"
    # Past the boot (pip, preflight, torch import: ~15 s on an idle box, several times that on
    # a busy shared one) and inside the one long epoch, whatever the machine's load.
    deadline = datetime.now(UTC) + timedelta(seconds=75)
    job = JobSpec(
        run_id="budget",
        classes=shards.classes,
        train_shards=shards.train_shards * 40,  # one long epoch: the deadline falls in it
        val_shards=shards.val_shards,
        preprocess=shards.preprocess.model_dump(mode="json"),
        output_uri=job_dir,
        epochs=1,
        batch_size=8,
        time_budget_s=90,
        deadline_at=deadline,
        runtime_sha256=staged.sha256,
    )
    job_uri = write_job(job, f"{job_dir}/job.json")
    backend = Ec2Backend(Ec2Settings())
    (instance_id,) = backend.launch(
        launch_of(
            "budget",
            job_uri,
            dag_id="burstcv_pipeline",
            time_budget_s=90,
            deadline_at=deadline,
            wheel_uri=staged.uri,
            wheel_sha256=staged.sha256,
        )
    )

    boot = boot_instance(box, ec2, instance_id)

    assert boot.exit_code == 4, boot.console
    failed = storage.read_json(attempt_dir(job_dir, 1, "FAILED"))
    assert failed["stage"] == "budget" and failed["resumable"] is False
    assert "deadline" in failed["reason"]
    checkpoint = storage.read_bytes(f"{job_dir}/checkpoints/last.pt")
    import torch

    state_at_stop = torch.load(io.BytesIO(checkpoint), map_location="cpu", weights_only=True)
    assert state_at_stop["epoch"] == 0 and state_at_stop["step"] > 0  # mid-epoch
    assert boot.shutdown_calls[-1] == ["shutdown", "-h", "now"]
    assert state(ec2, instance_id) == "terminated"
    assert json.loads(json.dumps(failed))  # a plain JSON document


def test_a_wheel_that_does_not_match_its_sha256_is_never_installed(
    box: BoxSandbox, account: dict[str, Any], shards: Packed
) -> None:
    ec2 = account["ec2"]
    provisioned = provision("manual__tampered", shards)
    (instance_id,) = provisioned.instance_ids
    wheel_uri = provisioned.launch.wheel_uri
    storage.write_bytes(wheel_uri, storage.read_bytes(wheel_uri) + b"\0")

    boot = boot_instance(box, ec2, instance_id)

    event = wait_for_trigger(provisioned, attempt=1)
    assert event["status"] == "failed" and event["stage"] == "install", event
    assert "does not match its sha256" in event["reason"] and event["resumable"] is False
    assert "installed" not in boot.console.replace("installing", "")
    assert boot.shutdown_calls[-1] == ["shutdown", "-h", "now"]
    assert state(ec2, instance_id) == "terminated"


def test_a_spot_notice_during_bootstrap_is_resumable(
    box: BoxSandbox, account: dict[str, Any], shards: Packed
) -> None:
    ec2 = account["ec2"]
    provisioned = provision("manual__early", shards)
    (instance_id,) = provisioned.instance_ids
    box.imds.spot_action = {"action": "terminate", "time": datetime.now(UTC).isoformat()}

    boot = boot_instance(box, ec2, instance_id)

    assert boot.exit_code == 143, boot.console
    event = wait_for_trigger(provisioned, attempt=1)
    assert event["status"] == "failed" and event["resumable"] is True, event
    assert event["stage"] in ("install", "preflight") and "spot interruption" in event["reason"]
    assert "training exited" not in boot.console
    assert boot.shutdown_calls[-1] == ["shutdown", "-h", "now"]


# --- several boxes: two sandboxes joined by a virtual link ---------------------------------


@dataclass
class Node:
    """One box of a run of several: its sandbox and its own copy of the AMI's Python."""

    box: BoxSandbox
    ami: Path


@pytest.fixture
def cluster(aws: str, tmp_path: Path, ami_python: Path) -> Iterator[list[Node]]:
    """Yield two linked sandboxes (the boxes of one run), every box call recorded; then audit.

    Each box has its own metadata service and its own copy of "the AMI's" Python (two
    instances, two disks); afterwards nothing of either box survives and every AWS call they
    made is allowed by deploy/instance-role-policy.json.
    """
    proxy = RecordingProxy(aws)
    boxes: list[BoxSandbox] = []
    try:
        try:
            for name in ("node-a", "node-b"):
                boxes.append(BoxSandbox(tmp_path / name, proxy.url).__enter__())
            link(boxes)
        except SandboxUnavailable as exc:
            pytest.skip(f"network namespaces are not permitted here: {exc}")
        for box in boxes:
            box.imds.region = BOX_REGION
        yield [Node(box, make_ami_python(box.work / "ami" / "pytorch")) for box in boxes]
        for box in boxes:
            assert box.reap_processes() == [], "a process of a box outlived its script"
        calls = proxy.snapshot()
        assert {call.region for call in calls} == {BOX_REGION}, [str(c) for c in calls]
        policy = json.loads(INSTANCE_POLICY.read_text())
        variables = {"ARTIFACT_ROOT": f"{BUCKET}/artifacts", "BURSTCV_BUCKET": BUCKET}
        refused = denied(policy, calls, variables)
        assert not refused, "calls deploy/instance-role-policy.json denies:\n" + "\n".join(refused)
    finally:
        for box in boxes:
            box.close()
        proxy.stop()


def boot_cluster(
    nodes: list[Node],
    ec2: Any,
    instance_ids: list[str],
    ami_python: Path,
    on_start: Any = None,
) -> dict[int, Boot]:
    """Boot every box of one launch at once, each as its launch index says; power each off.

    Node i plays the instance whose launch index is i (its node rank). Returns
    each node rank's boot. ``on_start`` runs once the boots are under way.
    """
    index = {
        inst["InstanceId"]: int(inst["AmiLaunchIndex"])
        for r in ec2.describe_instances(InstanceIds=instance_ids)["Reservations"]
        for inst in r["Instances"]
    }
    boots: dict[int, Boot] = {}

    def boot_one(instance_id: str) -> None:
        rank = index[instance_id]
        box = nodes[rank].box
        box.imds.instance_id, box.imds.ami_launch_index = instance_id, rank
        # The user-data names the one AMI Python path; each box sees its own copy there.
        mounts = {ami_python.parent.parent: nodes[rank].ami.parent.parent}
        boot = box.boot(
            user_data(ec2, instance_id), timeout_s=SLOW_BOOT_S, mounts=mounts, threads=1
        )
        power_off_like_ec2(ec2, instance_id, boot)
        boots[rank] = boot

    threads = [threading.Thread(target=boot_one, args=(iid,)) for iid in instance_ids]
    for thread in threads:
        thread.start()
    if on_start is not None:
        on_start()
    for thread in threads:
        thread.join()
    return boots


def test_two_boxes_rendezvous_over_their_link_and_train_to_done(
    cluster: list[Node], account: dict[str, Any], split_shards: Packed, ami_python: Path
) -> None:
    shards = split_shards
    ec2 = account["ec2"]
    provisioned = provision("manual__two_boxes", shards, num_nodes=2)
    assert len(provisioned.instance_ids) == 2
    started = time.monotonic()

    boots = boot_cluster(cluster, ec2, provisioned.instance_ids, ami_python)
    print("two boxes booted and trained in", round(time.monotonic() - started, 1), "s")

    nodes = []
    for index, boot in boots.items():
        assert boot.exit_code == 0, boot.console
        assert f"launch index {index} of 2 at 10.77.0.{index + 1}" in boot.console
        assert "rendezvous at 10.77.0.1:29400" in boot.console, boot.console
        # Each box reads its own half of the training shards, and both agree the step count.
        # Its node rank is torchrun's, given by the rendezvous: not always its launch index.
        read = re.search(
            r"box (\d) of 2 reads 2 of 4 training shards \(192 of 384 images\)", boot.console
        )
        assert read, boot.console
        nodes.append(int(read.group(1)))
        assert boot.shutdown_calls[-1] == ["shutdown", "-h", "now"]
    assert sorted(nodes) == [0, 1]
    event = wait_for_trigger(provisioned, attempt=1)
    assert event["status"] == "done", event
    metrics = storage.read_json(f"{provisioned.output_uri}/metrics.json")
    assert metrics["world_size"] == 2 and metrics["train_images"] == TRAIN_IMAGES
    # A batch of 32 a GPU (per_gpu, the default) is 64 a step over the two boxes: 192 images
    # a box are 6 steps an epoch, at the rate given for one GPU times sqrt(2) (AdamW's rule).
    optimizer = metrics["optimizer"]
    assert (optimizer["batch_per_rank"], optimizer["batch_size"]) == (32, 64), optimizer
    assert optimizer["steps_per_epoch"] == 6 and optimizer["name"] == "adamw"
    assert optimizer["lr_world_factor"] == pytest.approx(math.sqrt(2))
    assert optimizer["learning_rate"] == pytest.approx(0.1 * math.sqrt(2))
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]
    assert all(state(ec2, iid) == "terminated" for iid in provisioned.instance_ids)
    # The teardown bills both boxes and removes the run's groups.
    billing = boxes_stage.terminate(provisioned.run, "ec2", settings())
    assert sorted(billing.billed_seconds) == sorted(provisioned.instance_ids)
    assert (
        ec2.describe_security_groups(
            Filters=[{"Name": "tag:burstcv:run-id", "Values": [provisioned.run.run_key]}]
        )["SecurityGroups"]
        == []
    )


def test_a_deterministic_error_on_the_second_box_fails_once_with_that_ranks_reason(
    cluster: list[Node],
    account: dict[str, Any],
    split_shards: Packed,
    ami_python: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ec2, shards = account["ec2"], split_shards
    monkeypatch.setenv("BURSTCV_ARTIFACT_ROOT", ARTIFACT_ROOT)
    get_settings.cache_clear()
    # A shard only the second box reads (the deal follows from the shard sizes alone) is
    # corrupt inside its image member: its header and labels still read, its pixels do not.
    counts = [read_shard_info(uri, shards.classes).count for uri in shards.train_shards]
    bad_uri = shards.train_shards[node_shards(counts, 2)[1][-1]]
    storage.write_bytes(bad_uri, corrupt_image_member(storage.read_bytes(bad_uri)))
    bad = bad_uri.rsplit("/", 1)[1]
    provisioned = provision("manual__rank_error", shards, num_nodes=2, epochs=2, batch_size=16)

    boots = boot_cluster(cluster, ec2, provisioned.instance_ids, ami_python)

    for boot in boots.values():  # both boxes ended their training and powered off
        assert boot.exit_code != 0 and boot.shutdown_calls[-1] == ["shutdown", "-h", "now"]
    owner = next(boot for boot in boots.values() if bad in boot.console)
    assert "JobSpecError" in owner.console, owner.console
    event = wait_for_trigger(provisioned, attempt=1)
    assert (event["status"], event["resumable"]) == ("failed", False), event
    assert event["reason"].startswith("rank 1 (node 1): ") and bad in event["reason"], event

    # The train task fails for good in its first attempt: no relaunch for an error that
    # would come back.
    operator = WaitForTrainingOperator(task_id="train", provisioned=provisioned.model_dump())
    with pytest.raises(AirflowFailException, match=re.escape(bad)):
        operator.execute_complete({"run_id": "manual__rank_error"}, event)
    launched = {i.instance_id for i in Ec2Backend().describe(provisioned.run.run_key)}
    assert launched == set(provisioned.instance_ids)
    assert current_attempt(provisioned.output_uri) == 1
    billing = boxes_stage.terminate(provisioned.run, "ec2", settings())
    assert sorted(billing.billed_seconds) == sorted(provisioned.instance_ids)
    # The run's report says whose error it was, with that rank's traceback.
    page = storage.read_bytes(report_stage.report(provisioned.run, settings())).decode()
    assert "Training failed in attempt 1, rank 1 (node 1), at the train stage: " in page
    assert bad in page and '<pre class="traceback">' in page


def test_the_rendezvous_host_lost_mid_run_relaunches_both_from_the_checkpoint(
    cluster: list[Node],
    account: dict[str, Any],
    split_shards: Packed,
    ami_python: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ec2, shards = account["ec2"], split_shards
    monkeypatch.setenv("BURSTCV_ARTIFACT_ROOT", ARTIFACT_ROOT)  # where the task reads metrics
    get_settings.cache_clear()
    provisioned = provision("manual__lost_box", shards, num_nodes=2, epochs=3, batch_size=16)
    progress_uri = f"{provisioned.output_uri}/progress.json"
    # Launch index 0 hosts torchrun's c10d store: losing it takes the store from the other box
    # too, the hardest box to lose.
    host = next(
        inst["InstanceId"]
        for r in ec2.describe_instances(InstanceIds=provisioned.instance_ids)["Reservations"]
        for inst in r["Instances"]
        if inst["AmiLaunchIndex"] == 0
    )
    lost: list[int] = []

    # The first rank checkpoints an epoch, then writes its progress: lost once the progress is
    # there, the host has the epoch in its checkpoint too.
    def lose_the_host_after_the_first_epoch() -> None:
        deadline = time.monotonic() + 900  # a shared, busy machine trains slowly
        while time.monotonic() < deadline and not storage.exists(progress_uri):
            time.sleep(0.2)
        lost.extend(cluster[0].box.power_loss())  # hardware gone: no trap, no marker, no log
        reclaim_in_emulator(host, ends_after_s=5.0)  # EC2 ends it in minutes

    first = boot_cluster(
        cluster,
        ec2,
        provisioned.instance_ids,
        ami_python,
        on_start=lambda: threading.Thread(
            target=lose_the_host_after_the_first_epoch, daemon=True
        ).start(),
    )
    assert lost, "the rendezvous host was never lost"
    assert first[0].shutdown_calls == [first[0].shutdown_calls[0]]  # only its watchdog
    # The other box's training saw its peer and its store go, wrote its own resumable FAILED
    # (the attempt's too, were it rank 0) and powered off.
    assert first[1].shutdown_calls[-1] == ["shutdown", "-h", "now"], first[1].console
    (survivor,) = rank_failures(provisioned.output_uri, 1)
    assert survivor.resumable and "peer box was lost" in survivor.reason, survivor
    event = wait_for_trigger(provisioned, attempt=1)
    # Lost (rank 0 was on the lost box), or failed with the survivor's resumable reason.
    assert event["resumable"] is True, event
    assert event["status"] == "lost" or "peer box was lost" in event["reason"], event
    interrupted_at = storage.read_json(progress_uri)["epochs"]
    assert 1 <= len(interrupted_at) < 3

    operator = WaitForTrainingOperator(task_id="train", provisioned=provisioned.model_dump())
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute_complete({"run_id": "manual__lost_box"}, event)
    assert deferred.value.trigger.attempt == 2
    second_ids = [
        i.instance_id
        for i in Ec2Backend().describe(provisioned.run.run_key)
        if i.state == "running"
    ]
    assert len(second_ids) == 2 and not set(second_ids) & set(provisioned.instance_ids)
    second = boot_cluster(cluster, ec2, second_ids, ami_python)

    for boot in second.values():
        assert boot.exit_code == 0, boot.console
        assert "attempt 2 resumed from" in boot.console, boot.console
        # Each relaunched box reads the shards of its node rank (the deal is the same).
        assert re.search(r"box \d of 2 reads 2 of 4 training shards", boot.console), boot.console
    event = wait_for_trigger(provisioned, attempt=2)
    assert event["status"] == "done", event
    trained = operator.execute_complete({"run_id": "manual__lost_box"}, event)
    assert trained["epochs"] == 3
    metrics = storage.read_json(f"{provisioned.output_uri}/metrics.json")
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2, 3]
    assert metrics["attempt"] == 2 and metrics["world_size"] == 2
    billing = boxes_stage.terminate(provisioned.run, "ec2", settings())
    assert sorted(billing.billed_seconds) == sorted(provisioned.instance_ids + second_ids)
    get_settings.cache_clear()
