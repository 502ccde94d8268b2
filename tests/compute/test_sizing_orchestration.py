"""The sizing boxes' orchestrator decides: how many at once, when a type is skipped, and that
every box it launched is gone when it returns.

The real ``size_on_boxes`` and ``Ec2Backend`` against moto (every call audited by the compute
conftest); the boxes themselves are played from outside (the sandbox test boots their real
script): one answers with figures written as a box writes them, one halts without any, one
never answers.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from html import escape
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from awsaudit import MOTO_ACCOUNT_ID, AwsCall, Check, RecordingProxy, console_answer, evaluate
from burstcv_testkit import power_off_in_emulator

from burstcv.compute.base import TAG_EXPIRES_AT, TAG_RUN_ID
from burstcv.compute.billing import whole_bill
from burstcv.compute.ec2 import Ec2Backend, Ec2Settings, parse_expiry
from burstcv.compute.sizing_boxes import SizingRequest, box_run_key, size_on_boxes
from burstcv.compute.userdata import parse_config
from burstcv.gate.sizing import recommend
from burstcv.params import RunParams
from burstcv.settings import Settings
from burstcv.stages import resolve
from burstcv.stages import sizing as sizing_stage
from burstcv.training.job import attempt_dir
from burstcv_spec import storage
from burstcv_spec.contracts import (
    AttemptBill,
    Billing,
    BoxSizing,
    InstanceRecord,
    RunRef,
    SizePoint,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import END_RECORD, LAUNCH_RECORD, RunLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from servingkit import make_classifier_onnx, model_json

REGION = "us-east-1"
PROFILE = "burstcv-training"
ARTIFACT_ROOT = "s3://burstcv-test/artifacts"
RUN = RunRef.of("manual__orchestration")
PATHS = RunLayout.of(ARTIFACT_ROOT, RUN.run_key)
IMAGES = [b"\x89PNG not decoded by anyone here"]

# What each played box does: write its figures, halt without them, or never answer.
ANSWER, HALT, SILENT = "answer", "halt", "silent"


@pytest.fixture
def backend(ec2_account: None) -> Ec2Backend:
    return Ec2Backend(
        Ec2Settings(
            region=REGION,
            instance_profile="burstcv-training",
            waiter_delay_s=0.05,
            waiter_max_attempts=200,
        )
    )


class Boxes:
    """Play the run's sizing boxes by type; record the most that were up at once."""

    def __init__(self, ec2: Any, behaviour: dict[str, str], answer_after_s: float = 0.0) -> None:
        self.ec2, self.behaviour, self.answer_after_s = ec2, behaviour, answer_after_s
        self.most_at_once = 0
        self.started: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._timers: list[threading.Timer] = []

    def __enter__(self) -> Boxes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for timer in self._timers:
            timer.join(timeout=10)

    def _watch(self) -> None:
        seen: set[str] = set()
        while not self._stop.is_set():
            up = [
                i
                for r in self.ec2.describe_instances(
                    Filters=[
                        {"Name": f"tag:{TAG_RUN_ID}", "Values": [f"{RUN.run_key}.size-*"]},
                        {"Name": "instance-state-name", "Values": ["pending", "running"]},
                    ]
                )["Reservations"]
                for i in r["Instances"]
            ]
            self.most_at_once = max(self.most_at_once, len(up))
            for box in up:
                if box["InstanceId"] in seen:
                    continue
                seen.add(box["InstanceId"])
                instance_type = box["InstanceType"]
                self.started.append(instance_type)
                what = self.behaviour[instance_type]
                if what in (ANSWER, HALT):
                    delay = self.answer_after_s if what == ANSWER else 0.0
                    timer = threading.Timer(
                        delay, self._end, args=(box["InstanceId"], instance_type, what)
                    )
                    self._timers.append(timer)
                    timer.start()
            time.sleep(0.05)

    def _end(self, instance_id: str, instance_type: str, what: str) -> None:
        if what == ANSWER:  # where its user data says, as a box writes them
            config = parse_config(user_data(self.ec2, instance_id))
            write_artifact(
                config["OUT_URI"],
                BoxSizing(
                    instance_type=instance_type,
                    instance_id=instance_id,
                    region=REGION,
                    sizes=[SizePoint(vcpus=1, measured=True, sustainable_rps=50.0)],
                ),
            )
        power_off_in_emulator(instance_id, REGION)


def user_data(ec2: Any, instance_id: str) -> str:
    raw = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    return base64.b64decode(raw["UserData"]["Value"]).decode()


def billed(now: datetime) -> dict[str, list[InstanceRecord]]:
    """Return the sizing boxes of the run's whole bill, by type."""
    by_type: dict[str, list[InstanceRecord]] = {}
    for record in whole_bill(PATHS, now, backend="ec2").instances:
        by_type.setdefault(record.instance_type, []).append(record)
    return by_type


def request(types: list[str], parallel: int, max_s: float = 600.0) -> SizingRequest:
    return SizingRequest(
        run=RUN,
        dag_id="burstcv_pipeline",
        model_uri=PATHS.model,
        instance_types=types,
        latency_slo_ms=50.0,
        step_s=1.0,
        max_s=max_s,
        parallel=parallel,
    )


def live(ec2: Any) -> list[str]:
    return [
        i["InstanceId"]
        for r in ec2.describe_instances(
            Filters=[
                {"Name": f"tag:{TAG_RUN_ID}", "Values": [f"{RUN.run_key}.size-*"]},
                {"Name": "instance-state-name", "Values": ["pending", "running", "stopped"]},
            ]
        )["Reservations"]
        for i in r["Instances"]
    ]


def test_at_most_parallel_boxes_are_up_and_a_box_without_figures_is_skipped(
    backend: Ec2Backend, ec2_client: Any
) -> None:
    behaviour = {"c7i.large": ANSWER, "m7i.large": HALT, "c6i.large": ANSWER}
    with Boxes(ec2_client, behaviour) as boxes:
        records = size_on_boxes(
            backend,
            request(list(behaviour), parallel=1),
            PATHS,
            IMAGES,
            artifact_root=ARTIFACT_ROOT,
            poll_s=0.05,
        )
    assert boxes.most_at_once == 1 and boxes.started == list(behaviour)
    by_type = {r.instance_type: r for r in records}
    assert [r.instance_type for r in records] == list(behaviour)
    assert by_type["c7i.large"].skipped is None and by_type["c6i.large"].skipped is None
    halted = by_type["m7i.large"]
    assert halted.skipped is not None and not halted.sizes
    # Said from its console: EC2 holds none of its script's steps here (nothing booted it).
    assert "ended without figures; no step of its script in its console output" in halted.skipped
    assert "its log" not in halted.skipped  # it left none
    assert live(ec2_client) == []
    # Each box's watchdog and backstop are armed from the sizing's bound, never past it.
    expiries = [
        parse_expiry(t["Value"])
        for r in ec2_client.describe_instances()["Reservations"]
        for i in r["Instances"]
        for t in i["Tags"]
        if t["Key"] == TAG_EXPIRES_AT
    ]
    now = datetime.now(UTC)
    assert len(expiries) == 3
    assert all(
        e and now + timedelta(seconds=540) < e < now + timedelta(seconds=900) for e in expiries
    )
    # Each box is billed under its own key, from its launch and end records.
    bills = billed(datetime.now(UTC))
    assert sorted(bills) == sorted(behaviour)
    assert all(len(b) == 1 for b in bills.values())
    assert {t: b[0].run_id for t, b in bills.items()} == {
        t: box_run_key(RUN.run_key, t) for t in behaviour
    }
    assert all(b[0].stopped_at and (b[0].cost_usd or 0) > 0 for b in bills.values())
    # One at a time: each box launched after the one before it ended.
    spans = sorted((b[0].launched_at, b[0].stopped_at or "") for b in bills.values())
    assert all(later[0] >= earlier[1] for earlier, later in pairwise(spans))
    # Sized again (a benchmark tried again): a second box of the type, both billed.
    with Boxes(ec2_client, {"c7i.large": ANSWER}):
        size_on_boxes(
            backend,
            request(["c7i.large"], parallel=1),
            PATHS,
            IMAGES,
            artifact_root=ARTIFACT_ROOT,
            poll_s=0.05,
        )
    again = billed(datetime.now(UTC))
    assert len(again["c7i.large"]) == 2 and len(again["m7i.large"]) == 1


def test_a_sizing_box_is_launched_on_demand_where_the_deployment_launches_spot(
    ec2_account: None, ec2_client: Any, audited_calls: Any
) -> None:
    """A spot box could be reclaimed mid-measurement: the figures would be lost, or measured
    on a box about to go. The sizing asks for on-demand whatever the deployment's default."""
    backend = Ec2Backend(
        Ec2Settings(
            region=REGION,
            instance_profile="burstcv-training",
            use_spot=True,
            waiter_delay_s=0.05,
            waiter_max_attempts=200,
        )
    )
    with Boxes(ec2_client, {"c7i.large": ANSWER}):
        (record,) = size_on_boxes(
            backend,
            request(["c7i.large"], parallel=1),
            PATHS,
            IMAGES,
            artifact_root=ARTIFACT_ROOT,
            poll_s=0.05,
        )
    assert record.skipped is None and record.sizes
    (launch,) = [
        c.params
        for c in audited_calls.snapshot()
        if c.action == "ec2:RunInstances" and c.status == 200 and "DryRun" not in c.params
    ]
    assert launch["InstanceType"] == "c7i.large"
    assert not [k for k in launch if k.startswith("InstanceMarketOptions")]
    (box,) = [i for r in ec2_client.describe_instances()["Reservations"] for i in r["Instances"]]
    assert "InstanceLifecycle" not in box  # EC2 marks a spot instance "spot"
    # It is billed as what it is: on-demand.
    (billed_box,) = billed(datetime.now(UTC))["c7i.large"]
    assert (billed_box.instance_id, billed_box.lifecycle) == (box["InstanceId"], "on-demand")


def test_the_time_bound_skips_a_silent_box_and_the_types_never_launched(
    backend: Ec2Backend, ec2_client: Any
) -> None:
    behaviour = {"c7i.large": SILENT, "m7i.large": ANSWER}
    ticks = iter(range(10_000))
    clock: Callable[[], float] = lambda: float(next(ticks))  # noqa: E731  a second a reading
    with Boxes(ec2_client, behaviour) as boxes:
        records = size_on_boxes(
            backend,
            request(list(behaviour), parallel=1, max_s=5.0),
            PATHS,
            IMAGES,
            artifact_root=ARTIFACT_ROOT,
            poll_s=0.05,
            clock=clock,
        )
    assert boxes.started == ["c7i.large"]  # the bound came before the second type's turn
    assert [r.instance_type for r in records] == ["c7i.large", "m7i.large"]
    assert all(r.skipped and "time bound (5 s)" in r.skipped for r in records)
    assert live(ec2_client) == []  # the silent box was terminated, not left to its watchdog
    keys = {
        t["Value"]
        for r in ec2_client.describe_instances()["Reservations"]
        for i in r["Instances"]
        for t in i["Tags"]
        if t["Key"] == TAG_RUN_ID
    }
    assert box_run_key(RUN.run_key, "c7i.large") in keys


def test_every_box_is_terminated_when_the_orchestrator_fails(
    backend: Ec2Backend, ec2_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash while the boxes measure (here: reading their figures) still ends them all."""
    import burstcv.compute.sizing_boxes as sizing_boxes

    def broken(uri: str) -> BoxSizing | None:
        raise RuntimeError("the store went away")

    monkeypatch.setattr(sizing_boxes, "_figures", broken)
    with (
        Boxes(ec2_client, {"c7i.large": SILENT, "m7i.large": SILENT}),
        pytest.raises(RuntimeError, match="the store went away"),
    ):
        size_on_boxes(
            backend,
            request(["c7i.large", "m7i.large"], parallel=2),
            PATHS,
            IMAGES,
            artifact_root=ARTIFACT_ROOT,
            poll_s=0.05,
        )
    # Both were launched at once (two in parallel) before the failure, and both are gone.
    keys = {
        t["Value"]
        for r in ec2_client.describe_instances()["Reservations"]
        for i in r["Instances"]
        for t in i["Tags"]
        if t["Key"] == TAG_RUN_ID
    }
    assert keys == {box_run_key(RUN.run_key, t) for t in ("c7i.large", "m7i.large")}
    assert live(ec2_client) == []


# An organisation's policy (a service control policy): GPU types may be launched, Graviton
# types may not. EC2 refuses such a launch, dry run or not, as UnauthorizedOperation.
NO_GRAVITON = {
    "Version": "2012-10-17",
    "Statement": [
        {"Sid": "AllowAll", "Effect": "Allow", "Action": "*", "Resource": "*"},
        {
            "Sid": "DenyGraviton",
            "Effect": "Deny",
            "Action": "ec2:RunInstances",
            "Resource": "arn:aws:ec2:*:*:instance/*",
            "Condition": {"StringLike": {"ec2:InstanceType": ["*g.*", "*gd.*", "*gn.*"]}},
        },
    ],
}


def under_policy(proxy: RecordingProxy, policy: dict[str, Any]) -> Callable[[AwsCall], Any]:
    """Answer RunInstances as EC2 does under ``policy`` (refused where it denies the instance
    type), the emulator answering every launch it allows."""

    def answer(call: AwsCall) -> tuple[int, bytes]:
        instance = f"arn:aws:ec2:{call.region}:{MOTO_ACCOUNT_ID}:instance/*"
        context = {"ec2:InstanceType": call.params.get("InstanceType", "")}
        allowed, reason = evaluate(policy, Check("ec2:RunInstances", instance, context))
        if not allowed:
            return 403, (
                '<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error>'
                "<Code>UnauthorizedOperation</Code><Message>You are not authorized to perform "
                f"this operation: {escape(reason)}</Message></Error></Errors>"
                "<RequestID>7a62c49f-347e-4fc4-9331-6e8eEXAMPLE</RequestID></Response>"
            ).encode()
        signed = f"Credential=testing/20260101/{call.region}/ec2/aws4_request"
        headers = [
            ("Host", proxy.upstream.netloc),
            ("Content-Type", "application/x-www-form-urlencoded; charset=utf-8"),
            ("Authorization", f"AWS4-HMAC-SHA256 {signed}, SignedHeaders=host, Signature=0"),
        ]
        body = urllib.parse.urlencode(call.params).encode()
        status, _, data = proxy.forward("POST", "/", headers, body)
        return status, data

    return answer


def test_a_type_refused_at_its_dry_run_is_skipped_and_the_others_are_measured(
    backend: Ec2Backend,
    ec2_client: Any,
    audited_calls: RecordingProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(
        audited_calls.answers, "ec2:RunInstances", under_policy(audited_calls, NO_GRAVITON)
    )
    behaviour = {"c7g.large": ANSWER, "c7i.large": ANSWER, "m7i.large": ANSWER}
    with Boxes(ec2_client, behaviour) as boxes:
        records = size_on_boxes(
            backend,
            request(list(behaviour), parallel=2),
            PATHS,
            IMAGES,
            artifact_root=ARTIFACT_ROOT,
            poll_s=0.05,
        )
    by_type = {r.instance_type: r for r in records}
    assert list(by_type) == list(behaviour)
    refused = by_type["c7g.large"]
    assert refused.skipped and refused.skipped.startswith("not launched: ")
    assert "UnauthorizedOperation" in refused.skipped and not refused.sizes
    assert all(by_type[t].skipped is None and by_type[t].sizes for t in ("c7i.large", "m7i.large"))
    assert sorted(boxes.started) == ["c7i.large", "m7i.large"]
    # Refused before anything was rented: its only launch call was the dry run.
    graviton = [
        c
        for c in audited_calls.snapshot()
        if c.action == "ec2:RunInstances" and c.params["InstanceType"] == "c7g.large"
    ]
    assert graviton and all(c.params.get("DryRun") == "true" and c.status == 403 for c in graviton)
    assert read_artifact(PATHS.box_sizing("c7g.large"), BoxSizing) == refused
    assert live(ec2_client) == []


def test_a_benchmark_tried_again_measures_on_its_own_box_never_an_earlier_try_record(
    backend: Ec2Backend, ec2_client: Any
) -> None:
    """Try 1's box ends without figures: its type is skipped. Try 2's box answers a moment
    after it is up: the earlier try's skip record is not its answer."""
    with Boxes(ec2_client, {"c7i.large": HALT}):
        (first,) = size_on_boxes(
            backend,
            request(["c7i.large"], parallel=1),
            PATHS,
            IMAGES,
            artifact_root=ARTIFACT_ROOT,
            poll_s=0.05,
        )
    assert first.skipped and "ended without figures" in first.skipped
    with Boxes(ec2_client, {"c7i.large": ANSWER}, answer_after_s=1.0):
        (second,) = size_on_boxes(
            backend,
            request(["c7i.large"], parallel=1),
            PATHS,
            IMAGES,
            artifact_root=ARTIFACT_ROOT,
            poll_s=0.05,
        )
    assert second.skipped is None and second.sizes
    assert read_artifact(PATHS.box_sizing("c7i.large"), BoxSizing) == second
    # Each try's box has its own records, and both are billed, each once.
    (box_1, box_2) = billed(datetime.now(UTC))["c7i.large"]
    assert second.instance_id == box_2.instance_id != box_1.instance_id
    assert box_1.stopped_at and box_2.stopped_at
    folder = PATHS.sizing_bill("c7i.large")
    assert [
        read_artifact(attempt_dir(folder, n, END_RECORD), AttemptBill).boxes[0].instance_id
        for n in (1, 2)
    ] == [box_1.instance_id, box_2.instance_id]


# The sizing as a worker runs it: killed (SIGKILL, no cleanup) once its box is up.
ORCHESTRATOR = """
import sys
from burstcv.compute.ec2 import Ec2Backend, Ec2Settings
from burstcv.compute.sizing_boxes import SizingRequest, size_on_boxes
from burstcv_spec.contracts import RunRef
from burstcv_spec.layout import END_RECORD, LAUNCH_RECORD, RunLayout

run_key, root, region = sys.argv[1:4]
run = RunRef.of(run_key)
paths = RunLayout.of(root, run.run_key)
settings = Ec2Settings(
    region=region, instance_profile="burstcv-training", waiter_delay_s=0.05,
    waiter_max_attempts=200,
)
size_on_boxes(
    Ec2Backend(settings),
    SizingRequest(
        run=run, dag_id="burstcv_pipeline", model_uri=paths.model,
        instance_types=["c7i.large"], latency_slo_ms=50.0, step_s=1.0, max_s=600.0,
    ),
    paths, [b"image"], artifact_root=root, poll_s=0.05,
)
"""


def test_a_retry_after_its_worker_died_ends_the_earlier_box_and_bills_both(
    backend: Ec2Backend, ec2_client: Any
) -> None:
    key = box_run_key(RUN.run_key, "c7i.large")
    worker = subprocess.Popen(
        [sys.executable, "-c", ORCHESTRATOR, RUN.airflow_run_id, ARTIFACT_ROOT, REGION]
    )
    try:
        launched = attempt_dir(PATHS.sizing_bill("c7i.large"), 1, LAUNCH_RECORD)
        until = time.monotonic() + 120
        while not storage.exists(launched) and worker.poll() is None:
            assert time.monotonic() < until, "the first try's box was never recorded"
            time.sleep(0.1)
    finally:
        worker.kill()
        worker.wait(timeout=30)
    (left,) = [i.instance_id for i in backend.describe(key) if i.state == "running"]

    with Boxes(ec2_client, {"c7i.large": ANSWER}, answer_after_s=0.5):
        (record,) = size_on_boxes(
            backend,
            request(["c7i.large"], parallel=1),
            PATHS,
            IMAGES,
            artifact_root=ARTIFACT_ROOT,
            poll_s=0.05,
        )
    assert record.skipped is None and record.instance_id != left
    assert live(ec2_client) == []  # the box the dead worker left is gone too
    boxes = billed(datetime.now(UTC))["c7i.large"]
    assert [b.instance_id for b in boxes] == [left, record.instance_id]
    assert all(b.stopped_at for b in boxes)  # each billed until AWS said it ended


def test_a_benchmark_tried_again_reuses_what_its_earlier_try_measured_and_sizes_the_rest(
    ec2_account: None,
    ec2_client: Any,
    audited_calls: RecordingProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stage's view. Try 1: Graviton refused by the organisation's policy, the x86 type
    measured, and the fleet chosen all the same. Try 2 (the policy lifted): the x86 figures
    are reused by speed key, only the Graviton type gets a box; the bill holds both tries'
    boxes, each once."""
    ec2 = {"REGION": REGION, "INSTANCE_PROFILE": PROFILE, "WAITER_DELAY_S": "0.05"}
    for key, value in ec2.items():
        monkeypatch.setenv(f"BURSTCV_EC2_{key}", value)
    settings = Settings(
        artifact_root=ARTIFACT_ROOT, registry_uri=f"{ARTIFACT_ROOT}/registry", sizing_step_s=0.5
    )
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
    resolved = resolve.resolve_run(RUN, params, settings)
    onnx_bytes = make_classifier_onnx(1)
    storage.write_bytes(storage.join(PATHS.model, "model.onnx"), onnx_bytes)
    card = model_json(None, hashlib.sha256(onnx_bytes).hexdigest())
    storage.write_bytes(PATHS.model_card, json.dumps(card).encode())
    host = recommend(
        [SizePoint(vcpus=1, measured=True, sustainable_rps=100, p95_ms=5, rss_mb=90)],
        latency_slo_ms=200,
        target_rps=50,
        prices=resolved.costs.serving,
        region=REGION,
        families=params.serving_families,
        host_cores=2,
    )
    both = {"c7g.large": ANSWER, "c7i.large": ANSWER}

    refusing = under_policy(audited_calls, NO_GRAVITON)
    monkeypatch.setitem(audited_calls.answers, "ec2:RunInstances", refusing)
    with Boxes(ec2_client, both) as first:
        report = sizing_stage.size_fleet_on_boxes(RUN, resolved, settings, host, IMAGES)
    by_type = {b.instance_type: b for b in report.boxes}
    assert first.started == ["c7i.large"]
    assert by_type["c7g.large"].skipped and "UnauthorizedOperation" in by_type["c7g.large"].skipped
    assert by_type["c7i.large"].skipped is None and report.chosen is not None

    monkeypatch.delitem(audited_calls.answers, "ec2:RunInstances")
    with Boxes(ec2_client, both) as second:
        again = sizing_stage.size_fleet_on_boxes(RUN, resolved, settings, host, IMAGES)
    assert second.started == ["c7g.large"]  # the x86 type's figures stand: no box for it
    by_type = {b.instance_type: b for b in again.boxes}
    assert all(b.skipped is None for b in by_type.values()) and len(by_type) == 2
    assert by_type["c7i.large"].measured_in == RUN.airflow_run_id
    billing = read_artifact(PATHS.billing, Billing)
    assert sorted(i.instance_type for i in billing.instances) == ["c7g.large", "c7i.large"]
    assert billing.cost_usd == pytest.approx(sum(i.cost_usd or 0 for i in billing.instances))


def test_a_box_that_ends_without_figures_is_reported_from_its_console(
    backend: Ec2Backend,
    ec2_client: Any,
    audited_calls: RecordingProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A box that powered off before it could upload a log says why in its console: its own
    last stamped step is the skip's reason, and no log is pointed at."""
    stuck = "cannot reach S3 after 3 tries (aws s3api head-object: exit 255); powering off"
    console = (
        "[    0.000000] Linux version 6.1\n"
        "burstcv: 2026-12-05T05:00:00.000Z sizing c7i.large for run manual__orchestration\n"
        f"burstcv: 2026-12-05T05:00:24.000Z {stuck}\n"
        "reboot: Power down\n"
    )
    monkeypatch.setitem(
        audited_calls.answers,
        "ec2:GetConsoleOutput",
        lambda call: console_answer(call.params["InstanceId"], console),
    )
    with Boxes(ec2_client, {"c7i.large": HALT}):
        (record,) = size_on_boxes(
            backend,
            request(["c7i.large"], parallel=1),
            PATHS,
            IMAGES,
            artifact_root=ARTIFACT_ROOT,
            poll_s=0.05,
        )
    (box,) = billed(datetime.now(UTC))["c7i.large"]
    assert record.skipped == (
        f'its box {box.instance_id} ended without figures; its console\'s last step: "{stuck}"'
    )
    assert [c.params["InstanceId"] for c in audited_calls.snapshot() if "Console" in c.action] == [
        box.instance_id
    ]
    # A box that left its log is pointed at it as well.
    log_uri = storage.join(PATHS.sizing_boxes, "logs", "m7i.large.log")
    storage.write_bytes(log_uri, b"burstcv: booted\n")
    with Boxes(ec2_client, {"m7i.large": HALT}):
        (record,) = size_on_boxes(
            backend,
            request(["m7i.large"], parallel=1),
            PATHS,
            IMAGES,
            artifact_root=ARTIFACT_ROOT,
            poll_s=0.05,
        )
    assert record.skipped and record.skipped.endswith(f'"; its log: {log_uri}')
