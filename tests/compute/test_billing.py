"""Bill a run from its attempts' launch and end records, never from the cloud's memory alone.

EC2 lists a terminated instance for about an hour: a run whose first attempt ended earlier
than that must still pay for it, in billing.json and in the budget a relaunch checks. Each
box is billed by the one cost model: its instance from when it was seen running (else from
its launch), at least 60 s; its root volume and public IPv4 from its launch.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from burstcv_testkit import HELD_WHEEL, forget_in_emulator, g6_box_rate, reclaim_in_emulator

from burstcv.compute import attempts
from burstcv.compute.base import ENDING, PENDING, RUNNING, STOPPED, InstanceInfo
from burstcv.compute.billing import record_end, record_launch, run_bill, whole_bill
from burstcv.compute.ec2 import Ec2Backend
from burstcv.params import RunParams
from burstcv.settings import Settings
from burstcv.stages import boxes as boxes_stage
from burstcv.stages import resolve
from burstcv.stages import sizing as sizing_stage
from burstcv.training.job import attempt_dir
from burstcv_spec import storage
from burstcv_spec.contracts import (
    AttemptBill,
    Billing,
    BoxBill,
    BoxRate,
    Launch,
    Provisioned,
    RunRef,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import END_RECORD, LAUNCH_RECORD, RunLayout

HOURS_PER_MONTH = 730  # AWS prices an EBS GB-month as 730 hours


def attached_usd_per_hour(box: BoxRate) -> float:
    """Return what a box's root volume and public IPv4 cost an hour (billed from launch)."""
    return box.volume_gb * box.ebs_usd_per_gb_month / HOURS_PER_MONTH + box.public_ipv4_usd_per_hour


def expected_cost(box: BoxBill) -> float:
    """Return what EC2 bills an ended box, by its rules, computed here from the record alone."""
    launched = datetime.fromisoformat(box.launched_at)
    running = datetime.fromisoformat(box.running_at) if box.running_at else launched
    assert box.ended_at is not None
    ended = datetime.fromisoformat(box.ended_at)
    instance_s = max(60, math.ceil((ended - running).total_seconds()))
    attached_s = max(60, math.ceil((ended - launched).total_seconds()))
    return (box.usd_per_hour * instance_s + attached_usd_per_hour(box) * attached_s) / 3600


def launch_run(
    settings: Settings, backend: Ec2Backend, player: Any, kit: Any, monkeypatch: Any, **given: Any
) -> Provisioned:
    """Resolve a run (run.json), launch attempt 1 of its held box(es) as provision does, and
    return provision's result."""
    run = RunRef.of(given.pop("run_key", "manual__billed"))
    player.modes[run.run_key] = kit.HOLD
    for module in (boxes_stage, attempts):
        monkeypatch.setattr(module, "get_backend", lambda name, settings=None: backend)
    fields = {"compute_backend": "ec2", "instance_types": ["g6.xlarge"], "use_spot": True}
    given = {**fields, "max_cost_usd": 5.0, "time_budget_s": 600, **given}
    params = RunParams.resolve(given, settings)
    costs = resolve.resolve_run(run, params, settings).costs
    launch = Launch(
        run=run,
        dag_id="burstcv_pipeline",
        job_uri=f"{kit.job_dir(run.run_key)}/job.json",
        time_budget_s=costs.time_budget_s,
        instance_types=["g6.xlarge"],
        use_spot=True,
        count=params.num_nodes,
        deadline_at=datetime.now(UTC) + timedelta(seconds=costs.time_budget_s),
        bound_rate=costs.box_rate,
        **HELD_WHEEL,
    )
    ids = attempts.launch_attempt("ec2", launch, kit.job_dir(run.run_key), 1, settings)
    return Provisioned(
        run=run,
        job_uri=launch.job_uri,
        output_uri=kit.job_dir(run.run_key),
        instance_ids=ids,
        backend="ec2",
        launch=launch,
    )


def set_budget(run: RunRef, settings: Settings, max_cost_usd: float) -> None:
    """Rewrite the budget in the run's run.json, as for a run whose money is nearly spent.

    resolve_run refuses a budget that does not buy its boxes' minimum minute and the
    watchdog's margin, so a run already at its budget is written here; the relaunch check
    reads only ``costs.max_cost_usd``.
    """
    uri = resolve.run_layout(run, settings).record
    resolved = resolve.resolved_run(run, settings)
    costs = resolved.costs.model_copy(update={"max_cost_usd": max_cost_usd})
    write_artifact(uri, resolved.model_copy(update={"costs": costs}))


@pytest.fixture
def provisioned(
    s3_deployment: Settings, backend: Ec2Backend, player: Any, kit: Any, monkeypatch: Any
) -> Provisioned:
    """Launch attempt 1 of a one-box run through the pipeline, its box held."""
    return launch_run(s3_deployment, backend, player, kit, monkeypatch)


def test_billing_json_is_the_same_when_the_cloud_has_forgotten_the_instances(
    provisioned: Provisioned, kit: Any
) -> None:
    (first,) = provisioned.instance_ids
    launched = read_artifact(attempt_dir(provisioned.output_uri, 1, LAUNCH_RECORD), AttemptBill)
    (box,) = launched.boxes
    assert (box.instance_id, box.instance_type, box.market) == (first, "g6.xlarge", "spot")
    assert box.zone == "us-east-1a" and box.ended_at is None
    assert "DescribeSpotPriceHistory" in box.price_source
    # Every part of its rate: its 50 GB gp3 root volume at us-east-1's $0.08 per GB-month and
    # the public IPv4 the default subnet gave it; the launch waited for it to run.
    assert (box.volume_gb, box.ebs_usd_per_gb_month, box.public_ipv4_usd_per_hour) == (
        50,
        0.08,
        0.005,
    )
    assert box.running_at is not None
    assert datetime.fromisoformat(box.launched_at) <= datetime.fromisoformat(box.running_at)

    reclaim_in_emulator(first)  # shutting-down for minutes, as EC2 shows a reclaimed box
    assert boxes_stage.relaunch(provisioned) == 2
    # Not terminated yet: AWS has not said it ended, so it is billed on.
    ended = read_artifact(attempt_dir(provisioned.output_uri, 1, END_RECORD), AttemptBill)
    assert ended.boxes[0].ended_at is None
    relaunched_at = datetime.now(UTC)
    time.sleep(1.5)

    remembered = boxes_stage.terminate(provisioned.run, "ec2")
    # Billed until AWS confirmed its termination, at teardown: after the relaunch.
    ended = read_artifact(attempt_dir(provisioned.output_uri, 1, END_RECORD), AttemptBill)
    assert ended.boxes[0].ended_at is not None
    assert datetime.fromisoformat(ended.boxes[0].ended_at) > relaunched_at
    billing_uri = resolve.run_layout(provisioned.run).billing
    first_billing = read_artifact(billing_uri, Billing)
    assert len(first_billing.instances) == 2 and remembered.cost_usd > 0
    assert all(s >= 60 for s in first_billing.billed_seconds.values())
    # The bill is the records' boxes priced by EC2's rules (the instance from running, the
    # volume and the address from launch), and each box's rate is the whole box's.
    boxes = [
        b
        for attempt in (1, 2)
        for b in read_artifact(
            attempt_dir(provisioned.output_uri, attempt, END_RECORD), AttemptBill
        ).boxes
    ]
    assert first_billing.cost_usd == pytest.approx(sum(expected_cost(b) for b in boxes))
    by_id = {b.instance_id: b for b in boxes}
    for record in first_billing.instances:
        rate = by_id[record.instance_id]
        assert record.usd_per_hour == pytest.approx(rate.usd_per_hour + attached_usd_per_hour(rate))

    # An hour on, EC2 no longer lists them: the bill does not change.
    forget_in_emulator(first_billing.instance_ids)
    assert Ec2Backend().describe(provisioned.run.run_key) == []
    forgotten = boxes_stage.terminate(provisioned.run, "ec2")
    second_billing = read_artifact(billing_uri, Billing)
    assert (remembered, forgotten) == (first_billing, second_billing)  # what the stage returns
    assert second_billing.model_dump(exclude={"terminated_at"}) == first_billing.model_dump(
        exclude={"terminated_at"}
    )


def test_the_budget_counts_an_attempt_the_cloud_has_forgotten(
    provisioned: Provisioned, s3_deployment: Settings, kit: Any
) -> None:
    (first,) = provisioned.instance_ids
    box = read_artifact(attempt_dir(provisioned.output_uri, 1, LAUNCH_RECORD), AttemptBill).boxes[0]
    Ec2Backend().terminate([first])
    forget_in_emulator([first])
    # A budget just under the first box's minimum minute: nothing more may be rented. The
    # minute is the whole box's (the cost model): instance, root volume and public IPv4.
    box_usd_per_hour = box.usd_per_hour + attached_usd_per_hour(box)
    set_budget(provisioned.run, s3_deployment, box_usd_per_hour * 59 / 3600)
    with pytest.raises(resolve.TrainingFailed, match="budget; no relaunch"):
        boxes_stage.relaunch(provisioned)
    assert attempts.current_attempt(provisioned.output_uri) == 1
    assert kit.live_managed() == []


def test_the_relaunch_budget_counts_every_box_of_a_two_box_attempt(
    s3_deployment: Settings,
    backend: Ec2Backend,
    player: Any,
    kit: Any,
    ec2_client: Any,
    monkeypatch: Any,
) -> None:
    provisioned = launch_run(
        s3_deployment, backend, player, kit, monkeypatch, run_key="two-billed", num_nodes=2
    )
    ids = provisioned.instance_ids
    launched = read_artifact(attempt_dir(provisioned.output_uri, 1, LAUNCH_RECORD), AttemptBill)
    assert sorted(b.instance_id for b in launched.boxes) == sorted(ids) and len(ids) == 2
    # A budget that buys one box's minimum minute but not two: a bill of one box would relaunch.
    one_minute = max(b.usd_per_hour + attached_usd_per_hour(b) for b in launched.boxes) * 60 / 3600
    budget = 1.9 * one_minute
    set_budget(provisioned.run, s3_deployment, budget)

    ec2_client.terminate_instances(InstanceIds=[ids[1]])  # one box lost loses the attempt
    with pytest.raises(resolve.TrainingFailed, match="budget; no relaunch"):
        boxes_stage.relaunch(provisioned, s3_deployment)

    assert attempts.current_attempt(provisioned.output_uri) == 1
    assert kit.live_managed() == []  # the survivor was ended, nothing new started
    ended = read_artifact(attempt_dir(provisioned.output_uri, 1, END_RECORD), AttemptBill)
    costs = [expected_cost(b) for b in ended.boxes]
    # Each box alone is within the budget; the two together are not.
    assert len(costs) == 2 and max(costs) < budget <= sum(costs)
    boxes_stage.terminate(provisioned.run, "ec2", s3_deployment)


# --- the records, box by box: when each part of a box's bill starts --------------------------

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
RATE = g6_box_rate(price_source="bundled table")
# Its root volume and public IPv4, an hour: 100 GB x $0.08 / 730 h + $0.005.
ATTACHED_USD_PER_HOUR = 100 * 0.08 / 730 + 0.005


def box(state: str, launched_at: datetime | None, **fields: Any) -> InstanceInfo:
    """Return one box as the backend describes it."""
    return InstanceInfo(
        instance_id="i-0b1",
        run_id="billed",
        dag_id="burstcv_pipeline",
        state=state,
        instance_type="g6.xlarge",
        lifecycle="on-demand",
        launched_at=launched_at,
        zone="us-east-1a",
        public_ipv4=True,
        **fields,
    )


def record(job_dir: str, described: InstanceInfo, now: datetime) -> BoxBill:
    """Write attempt 1's launch record of one box, seen at ``now``; return its box."""
    (recorded,) = record_launch(
        job_dir,
        1,
        run_key="billed",
        dag_id="burstcv_pipeline",
        backend="ec2",
        region="us-east-1",
        boxes=[described],
        rate_of=lambda info: RATE,
        now=now,
    ).boxes
    return recorded


def bill_after(job_dir: str, ended_at: datetime) -> Billing:
    """End attempt 1 when the backend saw the box stop, and return the run's bill."""
    stopped = box(STOPPED, None, stopped_at=ended_at)
    record_end(job_dir, 1, [stopped], ended_at + timedelta(minutes=5))
    return run_bill(job_dir, 1, ended_at + timedelta(minutes=5), backend="ec2")


def test_a_box_seen_running_is_billed_its_instance_from_then_its_volume_and_ip_from_launch(
    tmp_path: Path,
) -> None:
    job_dir = str(tmp_path / "job")
    seen = T0 + timedelta(seconds=40)  # 40 s pending: EC2 does not bill the instance for them
    recorded = record(job_dir, box(RUNNING, T0), seen)
    assert (recorded.launched_at, recorded.running_at) == (T0.isoformat(), seen.isoformat())

    bill = bill_after(job_dir, seen + timedelta(seconds=600))

    assert bill.billed_seconds == {"i-0b1": 600.0}
    (instance,) = bill.instances
    # The instance: 600 s from running; the volume and the address: 640 s from launch.
    assert bill.cost_usd == pytest.approx(0.8048 * 600 / 3600 + ATTACHED_USD_PER_HOUR * 640 / 3600)
    assert instance.cost_usd == pytest.approx(bill.cost_usd)
    assert instance.usd_per_hour == pytest.approx(0.8048 + ATTACHED_USD_PER_HOUR)


def test_a_box_not_seen_running_is_billed_its_instance_from_its_launch(tmp_path: Path) -> None:
    job_dir = str(tmp_path / "job")
    recorded = record(job_dir, box(PENDING, T0), T0 + timedelta(seconds=40))
    assert (recorded.launched_at, recorded.running_at) == (T0.isoformat(), None)

    bill = bill_after(job_dir, T0 + timedelta(seconds=640))

    # Unknown when it started running: from its launch, an upper bound.
    assert bill.billed_seconds == {"i-0b1": 640.0}
    assert bill.cost_usd == pytest.approx((0.8048 + ATTACHED_USD_PER_HOUR) * 640 / 3600)


def test_a_launch_recorded_again_keeps_when_its_boxes_started(tmp_path: Path) -> None:
    """A retried provision finds the attempt's box up and records it again: not from then."""
    job_dir = str(tmp_path / "job")
    seen = T0 + timedelta(seconds=40)
    first = record(job_dir, box(RUNNING, T0), seen)
    again = record(job_dir, box(RUNNING, T0), seen + timedelta(minutes=9))
    assert again == first and again.running_at == seen.isoformat()

    bill = bill_after(job_dir, seen + timedelta(seconds=600))
    assert bill.billed_seconds == {"i-0b1": 600.0}


def test_an_attempt_ends_once_and_a_later_end_changes_nothing(tmp_path: Path) -> None:
    """Teardown ends every attempt again: an attempt a relaunch already ended keeps its end."""
    job_dir = str(tmp_path / "job")
    record(job_dir, box(RUNNING, T0), T0)
    first = bill_after(job_dir, T0 + timedelta(seconds=300))
    later = T0 + timedelta(hours=2)
    record_end(job_dir, 1, [box(STOPPED, None, stopped_at=later)], later)
    assert run_bill(job_dir, 1, later, backend="ec2") == first
    assert first.billed_seconds == {"i-0b1": 300.0}


def test_an_attempt_never_launched_gets_no_end_record(tmp_path: Path) -> None:
    job_dir = str(tmp_path / "job")
    record_end(job_dir, 1, [], T0)
    assert run_bill(job_dir, 1, T0, backend="ec2").instances == []
    assert not storage.exists(f"{job_dir}/attempts/1/end.json")


def test_a_record_without_a_running_time_is_billed_from_its_launch(tmp_path: Path) -> None:
    # A launch.json written before boxes had a running time: read and billed from launch.
    job_dir = str(tmp_path / "job")
    recorded = record(job_dir, box(RUNNING, T0), T0 + timedelta(seconds=40))
    uri = attempt_dir(job_dir, 1, LAUNCH_RECORD)
    old = read_artifact(uri, AttemptBill)
    write_artifact(
        uri, old.model_copy(update={"boxes": [recorded.model_copy(update={"running_at": None})]})
    )

    bill = bill_after(job_dir, T0 + timedelta(seconds=640))

    assert bill.billed_seconds == {"i-0b1": 640.0}
    assert bill.cost_usd == pytest.approx((0.8048 + ATTACHED_USD_PER_HOUR) * 640 / 3600)


@pytest.mark.parametrize("state", [PENDING, RUNNING])
def test_a_box_without_a_launch_time_is_recorded_at_now_and_billed_its_minimum(
    tmp_path: Path, state: str
) -> None:
    job_dir = str(tmp_path / "job")
    recorded = record(job_dir, box(state, None), T0)
    assert recorded.launched_at == T0.isoformat()
    assert recorded.running_at == (T0.isoformat() if state == RUNNING else None)

    bill = bill_after(job_dir, T0 + timedelta(seconds=30))

    # 30 s up: every part is billed its 60 s minimum.
    assert bill.billed_seconds == {"i-0b1": 60.0}
    assert bill.cost_usd == pytest.approx((0.8048 + ATTACHED_USD_PER_HOUR) * 60 / 3600)


def test_a_box_is_billed_until_aws_says_it_ended(tmp_path: Path) -> None:
    """A box still running when an attempt is closed (a relaunch's wait ran out) has no end:
    billed on. Its end is the time AWS reports, once it reports one; a box EC2 no longer lists
    ends when it was last looked for."""
    job_dir = str(tmp_path / "job")
    record(job_dir, box(RUNNING, T0), T0)
    closed = T0 + timedelta(minutes=3)
    record_end(job_dir, 1, [box(RUNNING, T0)], closed)
    (still,) = read_artifact(attempt_dir(job_dir, 1, END_RECORD), AttemptBill).boxes
    assert still.ended_at is None
    later = T0 + timedelta(minutes=20)
    assert run_bill(job_dir, 1, later, backend="ec2").billed_seconds == {"i-0b1": 1200.0}
    # A box shutting down or stopped still bills its volume: not ended either.
    record_end(job_dir, 1, [box(ENDING, T0)], later)
    assert run_bill(job_dir, 1, later, backend="ec2").instances[0].stopped_at is None
    # Terminated: its end is when EC2 says it left running, not when it was seen.
    gone_at = T0 + timedelta(minutes=12)
    record_end(job_dir, 1, [box(STOPPED, T0, stopped_at=gone_at)], later)
    bill = run_bill(job_dir, 1, later + timedelta(hours=1), backend="ec2")
    assert bill.billed_seconds == {"i-0b1": 720.0}
    assert bill.instances[0].stopped_at == gone_at.isoformat()
    # Forgotten by EC2 before anyone saw it end: ended when it was last looked for.
    other = str(tmp_path / "other")
    record(other, box(RUNNING, T0), T0)
    record_end(other, 1, [], later)
    assert run_bill(other, 1, later + timedelta(hours=1), backend="ec2").billed_seconds == {
        "i-0b1": 1200.0
    }


def sizing_box_record(paths: RunLayout, run_key: str, sizing_try: int, launched: datetime) -> None:
    """Write the launch and end records of a sizing try's c7i.large box, ten minutes up."""
    folder = paths.sizing_bill("c7i.large")
    sized = replace(
        box(RUNNING, launched),
        instance_id=f"i-0size{sizing_try}",
        run_id=f"{run_key}.size-c7i-large",
        instance_type="c7i.large",
    )
    record_launch(
        folder,
        sizing_try,
        run_key=sized.run_id,
        dag_id="burstcv_pipeline",
        backend="ec2",
        region="us-east-1",
        boxes=[sized],
        rate_of=lambda info: RATE.model_copy(update={"instance_type": "c7i.large"}),
        now=launched,
    )
    ended = launched + timedelta(minutes=10)
    record_end(folder, sizing_try, [replace(sized, state=STOPPED, stopped_at=ended)], ended)


def test_teardown_after_the_sizing_bill_keeps_the_sizing_boxes(
    provisioned: Provisioned, s3_deployment: Settings
) -> None:
    """billing.json has two writers (teardown, the benchmark's sizing bill): whichever writes
    last writes every box of the run, each once."""
    run = provisioned.run
    paths = resolve.run_layout(run, s3_deployment)
    (trained,) = provisioned.instance_ids
    # A benchmark tried twice: a sizing box a try, the second try numbered 3 (a gap).
    sizing_box_record(paths, run.run_key, 1, T0)
    sizing_box_record(paths, run.run_key, 3, T0 + timedelta(hours=1))

    sized = sizing_stage.bill_sizing_boxes(run, s3_deployment)
    assert {i.instance_id for i in sized.instances} == {trained, "i-0size1", "i-0size3"}
    torn_down = boxes_stage.terminate(run, "ec2", s3_deployment)
    billing = read_artifact(paths.billing, Billing)
    assert billing == torn_down
    assert sorted(billing.instance_ids) == sorted([trained, "i-0size1", "i-0size3"])
    by_id = {i.instance_id: i for i in billing.instances}
    assert by_id[trained].stopped_at is not None  # teardown ended the training box
    # Each sizing box its ten minutes, once; the training box as its records say.
    assert billing.billed_seconds["i-0size1"] == billing.billed_seconds["i-0size3"] == 600.0
    assert billing.cost_usd == pytest.approx(sum(i.cost_usd or 0.0 for i in billing.instances))
    training = run_bill(provisioned.output_uri, 1, datetime.now(UTC), backend="ec2")
    assert by_id[trained].cost_usd == pytest.approx(training.instances[0].cost_usd)
    # And in the other order: the sizing bill after teardown keeps the training box.
    again = sizing_stage.bill_sizing_boxes(run, s3_deployment)
    assert again.model_dump(exclude={"terminated_at"}) == billing.model_dump(
        exclude={"terminated_at"}
    )
    assert whole_bill(paths, datetime.now(UTC), backend="ec2").cost_usd == pytest.approx(
        billing.cost_usd
    )
