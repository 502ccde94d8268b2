"""Size a model on boxes of its candidate CPU types: the real orchestrator, the real boot script.

The orchestrator (``size_on_boxes``) launches one box per candidate type through the real
``Ec2Backend`` against moto (its calls audited against deploy/iam-policy.json by the
compute conftest). Each box's own user-data, as EC2 would hand it over, boots unmodified in a
network-namespace sandbox (tests/boxsandbox.py) on one CPU of this machine: it installs the
``burstcv-size`` wheel into the "AMI's" Python, fetches the model and the request images from
"S3", runs the real staging service and load generator on its CPU, writes its figures and
powers off; every call a box makes is audited against deploy/instance-role-policy.json.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from awsaudit import RecordingProxy, denied
from botocore.exceptions import ClientError
from boxsandbox import Boot, BoxSandbox, SandboxUnavailable, make_ami_python
from burstcv_testkit import power_off_in_emulator

from burstcv.compute.base import TAG_RUN_ID
from burstcv.compute.ec2 import Ec2Backend, Ec2Settings
from burstcv.compute.sizing_boxes import SizingRequest, box_run_key, size_on_boxes
from burstcv.gate.sizing import host_cpus
from burstcv_spec import storage
from burstcv_spec.contracts import BoxSizing, RunRef, read_artifact
from burstcv_spec.layout import RunLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from servingkit import image_bytes, make_classifier_onnx, model_json

REGION = "us-east-1"
BUCKET = "burstcv-test"
ARTIFACT_ROOT = f"s3://{BUCKET}/artifacts"
PROFILE = "burstcv-training"
INSTANCE_POLICY = Path(__file__).resolve().parents[2] / "deploy" / "instance-role-policy.json"
MEASURED = ["c7i.large", "m7i.large"]
REFUSED = "c6i.large"  # its vCPU quota is spent


def upload_model(root: str) -> str:
    """Write a small classifier (model.onnx and its model.json) under ``root``; return it."""
    onnx_bytes = make_classifier_onnx(1)
    storage.write_bytes(storage.join(root, "model.onnx"), onnx_bytes)
    meta = model_json(None, hashlib.sha256(onnx_bytes).hexdigest())
    storage.write_bytes(storage.join(root, "model.json"), json.dumps(meta).encode())
    return root


def refuse_for_quota(backend: Ec2Backend, instance_type: str) -> None:
    """Make RunInstances of ``instance_type`` fail as EC2 does when its vCPU quota is spent."""

    def before(params: dict[str, Any], **_: Any) -> None:
        if params.get("InstanceType") == instance_type and not params.get("DryRun"):
            raise ClientError(
                {
                    "Error": {
                        "Code": "VcpuLimitExceeded",
                        "Message": "You have requested more vCPU capacity than your current "
                        "vCPU limit of 0 allows",
                    }
                },
                "RunInstances",
            )

    backend.client.meta.events.register("before-parameter-build.ec2.RunInstances", before)


def wait_for_boxes(ec2: Any, run_key: str, count: int, timeout_s: float = 120) -> dict[str, str]:
    """Return {instance id: type} of the run's sizing boxes once ``count`` are running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {
            i["InstanceId"]: i["InstanceType"]
            for r in ec2.describe_instances(
                Filters=[
                    {"Name": f"tag:{TAG_RUN_ID}", "Values": [f"{run_key}.size-*"]},
                    {"Name": "instance-state-name", "Values": ["running"]},
                ]
            )["Reservations"]
            for i in r["Instances"]
        }
        if len(found) >= count:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{count} sizing boxes did not start in {timeout_s} s")


def user_data(ec2: Any, instance_id: str) -> str:
    raw = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    return base64.b64decode(raw["UserData"]["Value"]).decode()


def test_two_sizing_boxes_measure_in_parallel_and_a_refused_type_is_skipped(
    aws: str,
    ec2_client: Any,
    s3_client: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if len(host_cpus()) < 2:
        pytest.skip("two boxes of one CPU each need 2 CPUs")
    s3_client.create_bucket(Bucket=BUCKET)
    import boto3

    iam = boto3.client("iam", region_name=REGION, endpoint_url=aws)
    iam.create_role(RoleName=PROFILE, AssumeRolePolicyDocument="{}")
    iam.create_instance_profile(InstanceProfileName=PROFILE)
    iam.add_role_to_instance_profile(InstanceProfileName=PROFILE, RoleName=PROFILE)
    # Each box installs into "the AMI's" Python: one each, as two instances have two disks.
    ami = make_ami_python(tmp_path / "ami" / "py")
    own = [make_ami_python(tmp_path / f"box{n}" / "py") for n in range(2)]
    settings = Ec2Settings(
        region=REGION,
        instance_profile=PROFILE,
        sizing_python=str(ami),
        waiter_delay_s=0.1,
        waiter_max_attempts=100,
        log_every_s=5,
    )
    backend = Ec2Backend(settings)
    refuse_for_quota(backend, REFUSED)
    run = RunRef.of("manual__sizing-boxes")
    paths = RunLayout.of(ARTIFACT_ROOT, run.run_key)
    model_uri = upload_model(paths.model)
    images = [image_bytes(fmt, (48 + n, 40)) for n, fmt in enumerate(["PNG", "JPEG"] * 4)]
    request = SizingRequest(
        run=run,
        dag_id="burstcv_pipeline",
        model_uri=model_uri,
        instance_types=[REFUSED, *MEASURED],
        latency_slo_ms=200.0,
        step_s=1.0,
        max_s=600.0,
        parallel=2,
    )
    outcome: dict[str, Any] = {}

    def orchestrate() -> None:
        try:
            outcome["records"] = size_on_boxes(
                backend, request, paths, images, artifact_root=ARTIFACT_ROOT, poll_s=0.2
            )
        except BaseException as exc:  # re-raised below, in the test's thread
            outcome["error"] = exc

    proxy = RecordingProxy(aws)
    boxes: list[BoxSandbox] = []
    try:
        for _ in range(2):
            try:
                boxes.append(BoxSandbox(tmp_path / f"sandbox{len(boxes)}", proxy.url).__enter__())
            except SandboxUnavailable as exc:
                pytest.skip(f"network namespaces are not permitted here: {exc}")
        orchestrator = threading.Thread(target=orchestrate)
        orchestrator.start()
        launched = wait_for_boxes(ec2_client, run.run_key, 2)
        boots: dict[str, Boot] = {}

        def boot(box: BoxSandbox, instance_id: str, cpu: int, python: Path) -> None:
            box.imds.instance_id = instance_id
            box.imds.instance_type = launched[instance_id]
            boots[instance_id] = box.boot(
                user_data(ec2_client, instance_id),
                timeout_s=400,
                mounts={ami.parent.parent: python.parent.parent},
                cpus=[cpu],
            )
            if boots[instance_id].powered_off:
                power_off_in_emulator(instance_id, REGION)

        threads = [
            threading.Thread(target=boot, args=(box, iid, cpu, python))
            for box, iid, cpu, python in zip(
                boxes, sorted(launched), host_cpus()[:2], own, strict=True
            )
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        orchestrator.join(timeout=120)
        assert not orchestrator.is_alive(), "the orchestrator did not return"
        if "error" in outcome:
            raise outcome["error"]
        for box in boxes:
            assert box.reap_processes() == [], "a process of a box outlived its script"
    finally:
        for box in boxes:
            box.close()
        proxy.stop()

    for iid, run_boot in boots.items():
        assert run_boot.exit_code == 0, run_boot.console[-3000:]
        assert run_boot.powered_off, run_boot.console[-2000:]
        assert "installed" in run_boot.console and f"sized {launched[iid]}" in run_boot.console
    records = {r.instance_type: r for r in outcome["records"]}
    assert list(records) == [REFUSED, *MEASURED]
    refused = records[REFUSED]
    assert refused.skipped and "VcpuLimitExceeded" in refused.skipped and not refused.sizes
    for instance_type in MEASURED:
        record = records[instance_type]
        assert record.skipped is None
        assert record.instance_id in launched and launched[record.instance_id] == instance_type
        # Measured on the box's one CPU, by the real service under the real generator.
        (point,) = record.sizes
        assert point.measured and point.vcpus == 1 and point.sustainable_rps > 0
        assert point.p95_ms is not None and point.p95_ms <= request.latency_slo_ms
        assert point.generator_rps is not None and point.generator_shares_cpus
        assert record.host is not None and record.host.cpu_count >= 1
        # What the run keeps: the same record, read back through the contract.
        kept = read_artifact(paths.box_sizing(instance_type), BoxSizing)
        assert kept == record
        # The box's log reached the run's folder.
        assert storage.exists(storage.join(paths.sizing_boxes, "logs", f"{instance_type}.log"))
    # Every box the orchestrator launched is gone, each under its own run key.
    described = ec2_client.describe_instances(InstanceIds=list(launched))["Reservations"]
    states = {i["InstanceId"]: i["State"]["Name"] for r in described for i in r["Instances"]}
    assert set(states.values()) == {"terminated"}, states
    tags = {
        i["InstanceId"]: {t["Key"]: t["Value"] for t in i["Tags"]}
        for r in described
        for i in r["Instances"]
    }
    assert {tags[i][TAG_RUN_ID] for i in launched} == {
        box_run_key(run.run_key, t) for t in MEASURED
    }
    # Every AWS call a box made is one its instance role allows.
    calls = proxy.snapshot()
    assert calls, "the boxes made no AWS call through the sandbox"
    policy = json.loads(INSTANCE_POLICY.read_text())
    variables = {"ARTIFACT_ROOT": f"{BUCKET}/artifacts", "BURSTCV_BUCKET": BUCKET}
    refused_calls = denied(policy, calls, variables)
    assert not refused_calls, "calls the instance role denies:\n" + "\n".join(refused_calls)
