"""Size a model on boxes of its candidate CPU types: the real orchestrator, the real boot script.

The orchestrator (``size_on_boxes``) launches one box per candidate type through the real
``Ec2Backend`` against moto (its calls audited against deploy/iam-policy.json by the
compute conftest). Each box's own user-data, as EC2 would hand it over, boots unmodified in a
network-namespace sandbox (tests/boxsandbox.py) on one CPU of this machine, shaped like
Amazon Linux 2023 with the shipped defaults: its ``python3`` has no boto3, so S3 goes through
the AWS CLI (a v2 stand-in) until ``dnf`` has installed Python 3.11 and the ``burstcv-size``
wheel is installed from its wheelhouse (the namespace has no route to a package index). The
box fetches the model and the request images from "S3", runs the real staging service and
load generator on its CPU, writes its figures and powers off; every call a box makes is
audited against deploy/instance-role-policy.json.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from awsaudit import RecordingProxy, denied
from botocore.exceptions import ClientError
from boxsandbox import Boot, BoxSandbox, SandboxUnavailable
from burstcv_testkit import power_off_in_emulator

from burstcv.compute.base import TAG_RUN_ID
from burstcv.compute.ec2 import Ec2Backend, Ec2Settings
from burstcv.compute.sizing_boxes import SizingRequest, box_run_key, size_on_boxes
from burstcv.compute.userdata import (
    SizingBoxSpec,
    parse_config,
    render_sizing_user_data,
    stamps,
)
from burstcv.gate.sizing import host_cpus, recommend
from burstcv.params import RunParams
from burstcv.settings import Settings
from burstcv.stages import resolve
from burstcv.stages import sizing as sizing_stage
from burstcv_spec import storage
from burstcv_spec.contracts import Billing, BoxSizing, RunRef, SizePoint, read_artifact
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
    # The shipped sizing image and interpreter (Amazon Linux 2023, python3.11 from dnf).
    settings = Ec2Settings(
        region=REGION,
        instance_profile=PROFILE,
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
                where = tmp_path / f"sandbox{len(boxes)}"
                boxes.append(BoxSandbox(where, proxy.url, image="al2023").__enter__())
            except SandboxUnavailable as exc:
                pytest.skip(f"network namespaces are not permitted here: {exc}")
        assert [box.routes() for box in boxes] == ["", ""]  # nothing but the emulator
        orchestrator = threading.Thread(target=orchestrate)
        orchestrator.start()
        launched = wait_for_boxes(ec2_client, run.run_key, 2)
        boots: dict[str, Boot] = {}

        def boot(box: BoxSandbox, instance_id: str, cpu: int) -> None:
            box.imds.instance_id = instance_id
            box.imds.instance_type = launched[instance_id]
            boots[instance_id] = box.boot(
                user_data(ec2_client, instance_id), timeout_s=400, cpus=[cpu]
            )
            if boots[instance_id].powered_off:
                power_off_in_emulator(instance_id, REGION)

        threads = [
            threading.Thread(target=boot, args=(box, iid, cpu))
            for box, iid, cpu in zip(boxes, sorted(launched), host_cpus()[:2], strict=True)
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
        steps = stamps(run_boot.console)
        # No boto3 at first: the AWS CLI, until dnf's Python 3.11 has the wheel's own boto3.
        assert any("S3 through the AWS CLI" in step for step in steps), steps
        assert "installing python3.11" in steps and "cannot reach S3" not in run_boot.console
        assert "installed from the wheelhouse (cp311-x86_64)" in steps, steps
        assert f"sized {launched[iid]}" in steps
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


def test_a_sizing_box_that_cannot_reach_s3_says_so_and_powers_off_at_once(
    aws: str, tmp_path: Path
) -> None:
    try:
        box = BoxSandbox(tmp_path / "sandbox", aws, image="al2023").__enter__()
    except SandboxUnavailable as exc:
        pytest.skip(f"network namespaces are not permitted here: {exc}")
    paths = RunLayout.of(ARTIFACT_ROOT, "manual__no-s3")
    wheel_uri = f"{ARTIFACT_ROOT}/runtime/{'a' * 64}/burstcv_size-0.1.0-py3-none-any.whl"
    try:
        box.cut_s3()  # a security group with no egress rule
        boot = box.boot(
            render_sizing_user_data(
                SizingBoxSpec(
                    run_id=box_run_key("manual__no-s3", "c7i.large"),
                    instance_type="c7i.large",
                    model_uri=paths.model,
                    requests_uri=paths.sizing_requests,
                    out_uri=paths.box_sizing("c7i.large"),
                    log_uri=storage.join(paths.sizing_boxes, "logs", "c7i.large.log"),
                    wheel_uri=wheel_uri,
                    wheel_sha256="a" * 64,
                    latency_slo_ms=200,
                    step_s=1,
                    deadline_at=datetime.now(UTC) + timedelta(minutes=10),
                    region=REGION,
                )
            ),
            timeout_s=300,
        )
        assert box.reap_processes() == [], "a process of the box outlived its script"
    finally:
        box.close()
    # Its last step names what it could not do, on the console (all EC2 keeps of it).
    assert boot.exit_code == 4, boot.console
    last = stamps(boot.console)[-1]
    assert last.startswith(f"cannot reach S3: s3: exists {wheel_uri}: aws exit code 255: "), last
    assert "installing" not in boot.console
    assert boot.shutdown_calls[-1] == ["shutdown", "-h", "now"]


class SizingBoxPlayer:
    """Play each sizing box the run launches: its own command, from its own user-data's
    config, on one CPU of this machine; then power it off as EC2 would. (The boot script
    around that command is the sandbox test's above.)"""

    def __init__(self, ec2: Any, endpoint: str, run_key: str) -> None:
        self.ec2, self.endpoint, self.run_key = ec2, endpoint, run_key
        self.played: dict[str, int] = {}  # instance id -> exit code
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> SizingBoxPlayer:
        self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._watcher.join(timeout=10)
        for thread in self._threads:
            thread.join(timeout=120)

    def _watch(self) -> None:
        seen: set[str] = set()
        while not self._stop.is_set():
            reservations = self.ec2.describe_instances(
                Filters=[
                    {"Name": f"tag:{TAG_RUN_ID}", "Values": [f"{self.run_key}.size-*"]},
                    {"Name": "instance-state-name", "Values": ["running"]},
                ]
            )["Reservations"]
            for iid in [i["InstanceId"] for r in reservations for i in r["Instances"]]:
                if iid not in seen:
                    seen.add(iid)
                    cpu = host_cpus()[len(seen) % len(host_cpus())]
                    thread = threading.Thread(target=self._play, args=(iid, cpu))
                    thread.start()
                    self._threads.append(thread)
            time.sleep(0.2)

    def _play(self, instance_id: str, cpu: int) -> None:
        config = parse_config(user_data(self.ec2, instance_id))
        command = [
            "taskset",
            "-c",
            str(cpu),
            sys.executable,
            "-m",
            "burstcv.gate.sizebox",
            "measure",
            *("--model", config["MODEL_URI"], "--requests", config["REQUESTS_URI"]),
            *("--out", config["OUT_URI"], "--slo-ms", config["SLO_MS"]),
            *("--step-s", config["STEP_S"], "--instance-type", config["SIZED_TYPE"]),
            *("--instance-id", instance_id, "--region", REGION),
        ]
        env = {**os.environ, "AWS_ENDPOINT_URL": self.endpoint}
        env.pop("AWS_ENDPOINT_URL_S3", None)
        self.played[instance_id] = subprocess.run(command, env=env, timeout=300).returncode
        power_off_in_emulator(instance_id, REGION)


def test_a_local_run_sized_on_ec2_chooses_from_its_boxes_figures_and_bills_them(
    aws: str, ec2_client: Any, ec2_account: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local training, ec2 sizing, an x86 and a Graviton candidate: the whole run's view."""
    for key, value in {
        "REGION": REGION,
        "INSTANCE_PROFILE": PROFILE,
        "WAITER_DELAY_S": "0.1",
    }.items():
        monkeypatch.setenv(f"BURSTCV_EC2_{key}", value)
    settings = Settings(
        artifact_root=ARTIFACT_ROOT,
        registry_uri=f"{ARTIFACT_ROOT}/registry",
        sizing_step_s=0.5,
        sizing_parallel=2,
    )
    run = RunRef.of("manual__local-train-ec2-sizing")
    params = RunParams.resolve(
        {
            "dataset_uri": "s3://unused/dataset",
            "compute_backend": "local",
            "size_on": "ec2",
            "serving_families": ["c7g", "c7i"],
            "sizing_boxes": 2,
            "sizing_max_s": 300,
            "target_rps": 50,
            "latency_slo_ms": 200,
        },
        settings,
    )
    resolved = resolve.resolve_run(run, params, settings)
    assert resolved.costs.sizing is not None
    paths = RunLayout.of(ARTIFACT_ROOT, run.run_key)
    upload_model(paths.model)
    # What the worker measured: 100 req/s a vCPU. Its cheapest fleets: c7g.large, c7i.large.
    host = recommend(
        [
            SizePoint(vcpus=1, measured=True, sustainable_rps=100, p95_ms=5, rss_mb=90),
            SizePoint(vcpus=2, measured=True, sustainable_rps=200, p95_ms=5, rss_mb=90),
        ],
        latency_slo_ms=200,
        target_rps=50,
        prices=resolved.costs.serving,
        region=REGION,
        families=params.serving_families,
        host_cores=2,
    )
    images = [image_bytes(fmt, (48 + n, 40)) for n, fmt in enumerate(["PNG", "JPEG"] * 4)]
    with SizingBoxPlayer(ec2_client, aws, run.run_key) as player:
        report = sizing_stage.size_fleet_on_boxes(run, resolved, settings, host, images)
    assert sorted(player.played.values()) == [0, 0]
    by_type = {b.instance_type: b for b in report.boxes}
    assert sorted(by_type) == ["c7g.large", "c7i.large"]
    assert all(b.skipped is None and b.sizes[0].sustainable_rps > 0 for b in by_type.values())
    chosen = report.chosen
    # Each played box had one CPU of this machine where its type has two: its own figure at
    # one vCPU is scaled to two (extrapolated, but on its own box's figures).
    assert chosen is not None and chosen.measured_on in by_type
    measured = by_type[chosen.measured_on].sizes[0].sustainable_rps
    assert chosen.rps_per_replica >= measured
    assert all(o.extrapolated for o in report.options if o.measured_on is None)
    # The Graviton box ran Amazon Linux for arm64, the x86 one for x86_64.
    reservations = ec2_client.describe_instances(
        Filters=[{"Name": f"tag:{TAG_RUN_ID}", "Values": [f"{run.run_key}.size-*"]}]
    )["Reservations"]
    boxes = {i["InstanceType"]: i for r in reservations for i in r["Instances"]}
    images_of = ec2_client.describe_images(ImageIds=[b["ImageId"] for b in boxes.values()])
    arch = {i["ImageId"]: i["Architecture"] for i in images_of["Images"]}
    assert arch[boxes["c7g.large"]["ImageId"]] == "arm64"
    assert arch[boxes["c7i.large"]["ImageId"]] == "x86_64"
    assert {b["State"]["Name"] for b in boxes.values()} == {"terminated"}
    # The boxes are in the run's bill, each under its own run key, priced by the cost model.
    billing = read_artifact(paths.billing, Billing)
    assert {i.run_id for i in billing.instances} == {
        box_run_key(run.run_key, t) for t in ("c7g.large", "c7i.large")
    }
    assert all(i.stopped_at and (i.cost_usd or 0) > 0 for i in billing.instances)
    assert billing.cost_usd == pytest.approx(sum(i.cost_usd or 0 for i in billing.instances))
    assert billing.cost_usd <= resolved.costs.sizing.reserve_usd
    # Billed again (a benchmark tried again): the same boxes, never counted twice.
    again = sizing_stage.bill_sizing_boxes(run, settings)
    assert again is not None and again.cost_usd == pytest.approx(billing.cost_usd, rel=0.05)
    assert len(again.instances) == 2
    # What the boxes measured is kept by speed key, named by the run that measured it.
    assert {b.measured_in for b in report.boxes} == {run.airflow_run_id}
    # A later run of a model of the same speed key (architecture, input, export, SLO) reuses
    # the figures: no box is launched, and the fleet rests on the same measurements.
    later = RunRef.of("manual__same-architecture-later")
    later_resolved = resolve.resolve_run(later, params, settings)
    upload_model(RunLayout.of(ARTIFACT_ROOT, later.run_key).model)
    with SizingBoxPlayer(ec2_client, aws, later.run_key) as player:
        reused = sizing_stage.size_fleet_on_boxes(later, later_resolved, settings, host, images)
    assert player.played == {}
    assert reused.boxes == report.boxes and reused.chosen == report.chosen
    assert not storage.exists(RunLayout.of(ARTIFACT_ROOT, later.run_key).billing)
