"""The sizing boxes' orchestrator decides: how many at once, when a type is skipped, and that
every box it launched is gone when it returns.

The real ``size_on_boxes`` and ``Ec2Backend`` against moto (every call audited by the compute
conftest); the boxes themselves are played from outside (the sandbox test boots their real
script): one answers with figures written as a box writes them, one halts without any, one
never answers.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any

import pytest
from burstcv_testkit import power_off_in_emulator

from burstcv.compute.base import TAG_EXPIRES_AT, TAG_RUN_ID
from burstcv.compute.billing import whole_bill
from burstcv.compute.ec2 import Ec2Backend, Ec2Settings, parse_expiry
from burstcv.compute.sizing_boxes import SizingRequest, box_run_key, size_on_boxes
from burstcv.compute.userdata import parse_config
from burstcv_spec.contracts import BoxSizing, InstanceRecord, RunRef, SizePoint, write_artifact
from burstcv_spec.layout import RunLayout

REGION = "us-east-1"
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

    def __init__(self, ec2: Any, behaviour: dict[str, str]) -> None:
        self.ec2, self.behaviour = ec2, behaviour
        self.most_at_once = 0
        self.started: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Boxes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

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
                if what == ANSWER:  # where its user data says, as a box writes them
                    config = parse_config(user_data(self.ec2, box["InstanceId"]))
                    write_artifact(
                        config["OUT_URI"],
                        BoxSizing(
                            instance_type=instance_type,
                            instance_id=box["InstanceId"],
                            region=REGION,
                            sizes=[SizePoint(vcpus=1, measured=True, sustainable_rps=50.0)],
                        ),
                    )
                if what in (ANSWER, HALT):
                    power_off_in_emulator(box["InstanceId"], REGION)
            time.sleep(0.05)


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
