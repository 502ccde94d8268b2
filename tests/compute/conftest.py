"""Provide an AWS emulator (moto in server mode) and a player that models each launched instance.

The player watches the emulator for burstcv instances and does, from outside, what happens to
a box that never reports: it holds it up (the orchestrator is gone; only a reaper ends it),
or runs the job command and lets the box die without its script's trap (hardware, reclaim).
The boot path itself (the real user-data, the AWS CLI, pip, preflight, training) runs in a
network-namespace sandbox instead: see tests/boxsandbox.py and test_box_boot.py.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import boto3
import motoplacement
import pytest
from awsaudit import MOTO_ACCOUNT_ID, Check
from localserver import use_moto

from burstcv.compute.base import TAG_MANAGED, TAG_RUN_ID
from burstcv.compute.ec2 import Ec2Backend, Ec2Settings
from burstcv.compute.userdata import parse_config

REGION = "us-east-1"
# A region with no row in the bundled price table: AWS alone prices it.
FAR_REGION = "eu-west-1"
BUCKET = "burstcv-test"
ARTIFACT_ROOT = f"s3://{BUCKET}/artifacts"
# A public SSM AMI parameter that moto ships with an image behind it.
AMI_PARAMETER = "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-6.1-x86_64"
INSTANCE_PROFILE = "burstcv-training"

# How the player models a run: die without the trap, or leave it up (the default).
MODE_DIE = "die"  # the box dies (hardware, reclaim): job command only, no trap, no marker
MODE_HOLD = "hold"  # the box hangs on (the orchestrator is gone); only a reaper ends it

JobCommand = Callable[[str], list[str]]

_HERE = Path(__file__).resolve().parent


def fake_train_command(script: Path) -> JobCommand:
    """Return a job command that runs the stand-in training script (see ``fake_train``)."""
    return lambda job_uri: [sys.executable, str(script), "train", "--job", job_uri]


def real_train_command(job_uri: str) -> list[str]:
    """Return the command every training box runs: ``burstcv train --job <uri>``."""
    return [sys.executable, "-m", "burstcv.cli", "train", "--job", job_uri]


# --- the emulator ---------------------------------------------------------------------------


@pytest.fixture
def aws(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Point boto3 and the ``aws_default`` connection at a freshly reset emulator."""
    motoplacement.install()  # moto lacks EC2's placement groups (several-box runs use one)
    use_moto(moto_url, monkeypatch, REGION)
    # The provider's hooks read this connection from the environment: no metadata DB needed.
    conn = {"conn_type": "aws", "extra": {"endpoint_url": moto_url, "region_name": REGION}}
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps(conn))
    for key in list(os.environ):
        if key.startswith("BURSTCV_EC2_"):
            monkeypatch.delenv(key)
    yield moto_url


@pytest.fixture
def ec2_client(aws: str) -> Any:
    """Return a plain boto3 EC2 client on the emulator (the test's own eyes, not the backend's)."""
    return boto3.client("ec2", region_name=REGION, endpoint_url=aws)


@pytest.fixture
def s3_client(aws: str) -> Any:
    """Return a plain boto3 S3 client on the emulator."""
    return boto3.client("s3", region_name=REGION, endpoint_url=aws)


@pytest.fixture
def ec2_account(aws: str, s3_client: Any) -> None:
    """Create what an AWS account would hold: the bucket and the instance profile."""
    s3_client.create_bucket(Bucket=BUCKET)
    iam = boto3.client("iam", region_name=REGION, endpoint_url=aws)
    iam.create_role(RoleName=INSTANCE_PROFILE, AssumeRolePolicyDocument="{}")
    iam.create_instance_profile(InstanceProfileName=INSTANCE_PROFILE)
    iam.add_role_to_instance_profile(
        InstanceProfileName=INSTANCE_PROFILE, RoleName=INSTANCE_PROFILE
    )


@pytest.fixture
def ec2_settings(ec2_account: None) -> Ec2Settings:
    """Return EC2 settings for the emulator, with short waiter delays."""
    return Ec2Settings(
        region=REGION,
        ami=AMI_PARAMETER,
        instance_profile=INSTANCE_PROFILE,
        # The AMI's interpreter by its versioned name: a run stages that Python's wheelhouse only.
        python="/opt/pytorch/bin/python3.12",
        volume_gb=50,
        waiter_delay_s=0.1,
        waiter_max_attempts=100,
    )


@pytest.fixture
def backend(ec2_settings: Ec2Settings) -> Ec2Backend:
    """Return an EC2 backend whose hook talks to the emulator."""
    return Ec2Backend(ec2_settings)


def live_managed(ec2_client: Any) -> list[str]:
    """Return ids of burstcv instances that still exist (not terminated) on the emulator."""
    pages = ec2_client.get_paginator("describe_instances").paginate(
        Filters=[
            {"Name": f"tag:{TAG_MANAGED}", "Values": ["true"]},
            {
                "Name": "instance-state-name",
                "Values": ["pending", "running", "stopping", "stopped"],
            },
        ]
    )
    return [i["InstanceId"] for p in pages for r in p["Reservations"] for i in r["Instances"]]


# --- the stand-in training job --------------------------------------------------------------

FAKE_TRAIN = textwrap.dedent(
    '''
    """Stand in for `burstcv train --job URI`: read job.json, write outputs and a marker."""
    import json, os, signal, sys, time
    import boto3

    job_uri = sys.argv[sys.argv.index("--job") + 1]
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])

    def split(uri):
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        return bucket, key

    def put(uri, body):
        bucket, key = split(uri)
        s3.put_object(Bucket=bucket, Key=key, Body=body)

    bucket, key = split(job_uri)
    job = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    out = job["output_uri"]
    fake = job.get("fake", {})

    def on_sigterm(signum, frame):
        # Training's rule: SIGTERM means "checkpoint now and exit".
        put(out + "/checkpoints/last.pt", b"checkpoint at SIGTERM")
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    deadline = time.monotonic() + float(fake.get("seconds", 0.3))
    while time.monotonic() < deadline:
        time.sleep(0.05)
    outcome = fake.get("outcome", "done")
    if outcome == "crash":
        os._exit(int(fake.get("exit_code", 3)))  # dies without a marker
    put(out + "/checkpoints/last.pt", b"weights")
    put(out + "/metrics.json", json.dumps({"val_accuracy": 0.9}).encode())
    if outcome == "fail":
        failed = {"reason": "loss is NaN", "stage": "train", "resumable": False}
        put(out + "/attempts/1/FAILED", json.dumps(failed).encode())
        sys.exit(1)
    put(out + "/model.pt", b"state dict")
    put(out + "/attempts/1/DONE", json.dumps({"run_id": job["run_id"]}).encode())
    '''
)


@pytest.fixture
def fake_train(tmp_path_factory: pytest.TempPathFactory) -> JobCommand:
    """Return a job command running the stand-in training script."""
    script = tmp_path_factory.mktemp("fake_train") / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    return fake_train_command(script)


def write_job(run_id: str, **fake: Any) -> str:
    """Write a job.json for ``run_id`` to the emulated artifact store and return its URI."""
    job_dir = f"{ARTIFACT_ROOT}/runs/{run_id}/job"
    job = {
        "run_id": run_id,
        "arch": "resnet10",
        "classes": ["0", "1"],
        "train_shards": [],
        "val_shards": [],
        "epochs": 1,
        "batch_size": 8,
        "learning_rate": 0.1,
        "seed": 0,
        "output_uri": job_dir,
        "time_budget_s": 600,
        "fake": fake,
    }
    uri = f"{job_dir}/job.json"
    boto3.client("s3").put_object(
        Bucket=BUCKET, Key=uri.removeprefix(f"s3://{BUCKET}/"), Body=json.dumps(job).encode()
    )
    return uri


# --- the instance player --------------------------------------------------------------------


@dataclass
class Play:
    """Record what happened on one emulated instance."""

    instance_id: str
    run_id: str
    mode: str
    region: str = REGION
    config: dict[str, str] = field(default_factory=dict)
    user_data: str = ""
    started: float = 0.0
    exit_code: int | None = None
    finished: float = 0.0
    powered_off_at: float | None = None
    shutdown_calls: list[list[str]] = field(default_factory=list)
    dir: Path | None = None
    error: str = ""


class InstancePlayer:
    """Watch the emulator for burstcv instances and play each one (see module docstring)."""

    HOLD = MODE_HOLD
    DIE = MODE_DIE

    def __init__(self, endpoint: str, work: Path, command: JobCommand) -> None:
        self.endpoint = endpoint
        self.work = work
        self.command = command
        self.modes: dict[str, str] = {}  # run_id -> mode; default MODE_HOLD
        self.plays: dict[str, Play] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []
        # Boxes are launched in the deployment's region: the bundled table's, or one it lacks.
        self._ec2 = {
            region: boto3.client("ec2", region_name=region, endpoint_url=endpoint)
            for region in (REGION, FAR_REGION)
        }
        self._watcher = threading.Thread(target=self._watch, name="instance-player", daemon=True)

    def start(self) -> InstancePlayer:
        """Start watching."""
        self._watcher.start()
        return self

    def stop(self) -> None:
        """Stop watching and wait for the instances being played."""
        self._stop.set()
        self._watcher.join(timeout=10)
        for worker in self._workers:
            worker.join(timeout=60)

    def wait_played(self, run_id: str, timeout_s: float = 30.0) -> Play:
        """Return the finished play of the run's (first) instance."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                done = [p for p in self.plays.values() if p.run_id == run_id and p.finished]
            if done:
                return done[0]
            time.sleep(0.05)
        raise TimeoutError(f"no instance of run {run_id} finished within {timeout_s} s")

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                found = [
                    (region, inst)
                    for region, client in self._ec2.items()
                    for r in client.describe_instances(
                        Filters=[
                            {"Name": f"tag:{TAG_MANAGED}", "Values": ["true"]},
                            {"Name": "instance-state-name", "Values": ["pending", "running"]},
                        ]
                    )["Reservations"]
                    for inst in r["Instances"]
                ]
            except Exception as exc:
                logging.getLogger(__name__).warning("player: describe failed: %s", exc)
                time.sleep(0.2)
                continue
            for region, inst in found:
                iid = inst["InstanceId"]
                with self._lock:
                    if iid in self.plays:
                        continue
                    tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
                    run_id = tags.get(TAG_RUN_ID, "")
                    play = Play(iid, run_id, self.modes.get(run_id, MODE_HOLD), region)
                    self.plays[iid] = play
                if play.mode == MODE_HOLD:
                    continue
                worker = threading.Thread(target=self._play, args=(play,), daemon=True)
                self._workers.append(worker)
                worker.start()
            self._stop.wait(0.1)

    def _play(self, play: Play) -> None:
        box = self.work / play.instance_id
        box.mkdir(parents=True)
        play.dir = box
        ec2 = self._ec2[play.region]
        raw = ec2.describe_instance_attribute(InstanceId=play.instance_id, Attribute="userData")[
            "UserData"
        ]["Value"]
        play.user_data = base64.b64decode(raw).decode()
        play.config = parse_config(play.user_data)
        job_uri = play.config["JOB_URI"]
        play.started = time.time()
        try:
            with open(box / "job.log", "wb") as log:
                play.exit_code = subprocess.call(
                    self.command(job_uri),
                    env=dict(os.environ),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=120,
                )
            ec2.terminate_instances(InstanceIds=[play.instance_id])
            play.powered_off_at = time.time()
        except Exception as exc:
            play.error = repr(exc)
        finally:
            play.finished = time.time()


def _shell_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


@pytest.fixture
def player_command(request: pytest.FixtureRequest, fake_train: JobCommand) -> JobCommand:
    """Return the command the played instances run: the stand-in, or ``"real"`` (indirect)."""
    if getattr(request, "param", None) == "real":
        return real_train_command
    return fake_train


@pytest.fixture
def player(aws: str, tmp_path: Path, player_command: JobCommand) -> Iterator[InstancePlayer]:
    """Play every burstcv instance launched on the emulator during the test."""
    harness = InstancePlayer(aws, tmp_path / "instances", player_command).start()
    try:
        yield harness
    finally:
        harness.stop()


class Kit:
    """Bundle the constants and helpers tests need (a fixture: test modules never import conftest).

    Several conftest.py files share the module name ``conftest``, so ``from conftest import``
    would pick whichever loaded first.
    """

    region = REGION
    far_region = FAR_REGION
    bucket = BUCKET
    artifact_root = ARTIFACT_ROOT
    ami_parameter = AMI_PARAMETER
    HOLD = MODE_HOLD
    DIE = MODE_DIE

    def __init__(self, ec2_client: Any, s3_client: Any) -> None:
        self.ec2 = ec2_client
        self.s3 = s3_client

    def live_managed(self) -> list[str]:
        """Return ids of burstcv instances that still exist on the emulator."""
        return live_managed(self.ec2)

    def write_job(self, run_id: str, **fake: Any) -> str:
        """Write a stand-in job.json for the run and return its URI."""
        return write_job(run_id, **fake)

    def last_modified(self, uri: str) -> datetime:
        """Return when the emulated S3 object at ``uri`` was written."""
        return s3_last_modified(self.s3, uri)

    def job_dir(self, run_id: str) -> str:
        """Return the run's job folder URI."""
        return f"{ARTIFACT_ROOT}/runs/{run_id}/job"


@pytest.fixture
def kit(ec2_client: Any, s3_client: Any, ec2_account: None) -> Kit:
    """Return the emulator constants and helpers."""
    return Kit(ec2_client, s3_client)


def s3_last_modified(s3_client: Any, uri: str) -> datetime:
    """Return when an object was written, as the emulated S3 says."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return s3_client.head_object(Bucket=bucket, Key=key)["LastModified"]  # type: ignore[no-any-return]


# --- the call audit: every AWS call the orchestrator makes, judged by the shipped policy -----

# What the docs tell a user to substitute in deploy/iam-policy.json, as this emulated account.
AUDIT_POLICY_PATH = _HERE.parents[1] / "deploy" / "iam-policy.json"
AUDIT_VARIABLES = {"ACCOUNT_ID": "123456789012", "BURSTCV_BUCKET": BUCKET}


def audit_policy() -> dict[str, Any]:
    """Return the shipped policy as this test deployment uses it.

    The one edit is the one docs/aws.md asks of anyone whose AMI parameter is not a Deep
    Learning AMI one: its ARN is added to ReadTheAmiParameter.
    """
    policy: dict[str, Any] = json.loads(AUDIT_POLICY_PATH.read_text())
    for statement in policy["Statement"]:
        if statement.get("Sid") == "ReadTheAmiParameter":
            resources = statement["Resource"]
            resources = [resources] if isinstance(resources, str) else list(resources)
            statement["Resource"] = [*resources, f"arn:aws:ssm:*::parameter{AMI_PARAMETER}"]
    return policy


@pytest.fixture(scope="session")
def aws_proxy(moto_url: str) -> Iterator[Any]:
    """Run one recording proxy in front of the emulator for the session."""
    from awsaudit import RecordingProxy

    proxy = RecordingProxy(moto_url)
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture(autouse=True)
def audited_calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Route the orchestrator's AWS calls through the recording proxy; refuse any denied one.

    Applies to every test that uses the emulator (the ``aws`` fixture): the backend's hooks
    (the ``aws_default`` connection) and the artifact store's S3 client go through the proxy;
    the test's own clients and the emulated boxes talk to the emulator directly, so only
    what the orchestrator does is judged. At the end of the test every recorded call is
    evaluated against deploy/iam-policy.json: one denied call fails the test, naming it.
    """
    if "aws" not in request.fixturenames or "unaudited" in request.fixturenames:
        yield None
        return
    from awsaudit import denied

    request.getfixturevalue("aws")
    proxy = request.getfixturevalue("aws_proxy")
    conn = {"conn_type": "aws", "extra": {"endpoint_url": proxy.url, "region_name": REGION}}
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps(conn))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    proxy.clear()
    yield proxy
    refused = denied(audit_policy(), proxy.snapshot(), AUDIT_VARIABLES)
    assert not refused, "calls deploy/iam-policy.json denies:\n" + "\n".join(refused)


@pytest.fixture
def deployment_policy() -> tuple[dict[str, Any], dict[str, str]]:
    """Return (the policy as this test deployment uses it, the placeholders' values)."""
    return audit_policy(), dict(AUDIT_VARIABLES)


@pytest.fixture
def unaudited() -> None:
    """Request this to leave a test's AWS clients pointed straight at the emulator (no audit).

    For tests whose processes cannot reach the proxy on this host's loopback (a network
    namespace, say): they run their own ``RecordingProxy`` on a socket made there instead.
    """


@pytest.fixture
def s3_deployment(ec2_settings: Ec2Settings, kit: Kit, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Configure burstcv as a user of AWS would (docs/aws.md): S3 store, EC2 compute."""
    from burstcv.settings import get_settings

    env = {
        "BURSTCV_ARTIFACT_ROOT": kit.artifact_root,
        "BURSTCV_REGISTRY_URI": f"s3://{kit.bucket}/registry",
        "BURSTCV_COMPUTE_BACKEND": "ec2",
        "BURSTCV_REAPER_REGIONS": kit.region,
    }
    for name, value in ec2_settings.model_dump().items():
        if value is not None:
            env[f"BURSTCV_EC2_{name.upper()}"] = (
                ",".join(value) if isinstance(value, tuple) else str(value)
            )
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    yield get_settings()
    get_settings.cache_clear()


@pytest.fixture
def iam_resources_audited(audited_calls: Any, aws: str) -> Iterator[None]:
    """Give the orchestrator's IAM and KMS reads the resource ARNs AWS authorizes them on.

    The proxy records calls of services without resource-level parsing as on ``*``; the
    policy scopes these reads to the training role, the Spot role and the account's keys, so
    before the audit judges the test's calls each is given its real resource.
    """
    yield
    if audited_calls is None:
        return
    iam = boto3.client("iam", region_name="us-east-1", endpoint_url=aws)
    kms = boto3.client("kms", region_name="us-east-1", endpoint_url=aws)
    for call in audited_calls.snapshot():
        params = call.params
        if call.action == "iam:GetInstanceProfile":
            name = params["InstanceProfileName"]
            resource = f"arn:aws:iam::{MOTO_ACCOUNT_ID}:instance-profile/{name}"
        elif call.action == "iam:SimulatePrincipalPolicy":
            resource = params["PolicySourceArn"]
        elif call.action == "iam:GetRole":
            try:
                resource = iam.get_role(RoleName=params["RoleName"])["Role"]["Arn"]
            except iam.exceptions.NoSuchEntityException:
                resource = f"arn:aws:iam::{MOTO_ACCOUNT_ID}:role/{params['RoleName']}"
        elif call.action in ("kms:DescribeKey", "kms:GetKeyPolicy"):
            resource = kms.describe_key(KeyId=params["KeyId"])["KeyMetadata"]["Arn"]
        else:
            continue
        call.checks = [Check(call.action, resource)]
