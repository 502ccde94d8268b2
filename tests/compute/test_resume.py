"""Resume a lost or interrupted attempt in the same train task try, against the EC2 emulator.

A reclaimed spot box stays ``shutting-down`` for minutes and writes no marker (or a resumable
FAILED on its notice): the train task relaunches at once, without spending an Airflow retry,
and stops relaunching at the run's bound. The full boot of both attempts runs in the sandbox
(test_box_boot.py); here the boxes are held, their markers written as a box would.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred
from awsaudit import RecordingProxy, console_answer
from burstcv_testkit import (
    HELD_WHEEL,
    power_off_in_emulator,
    reclaim_in_emulator,
    resolve_validated,
)
from test_ec2 import packed_for

from burstcv.airflow.operators import WaitForTrainingOperator
from burstcv.compute import attempts
from burstcv.compute.ec2 import Ec2Backend
from burstcv.cost.boot import record_boots
from burstcv.params import RunParams
from burstcv.settings import Settings
from burstcv.stages import boxes as boxes_stage
from burstcv.stages import resolve
from burstcv.training.job import attempt_dir, write_failed
from burstcv_spec import storage
from burstcv_spec.contracts import (
    AttemptBill,
    BoxBill,
    Launch,
    Provisioned,
    RunRef,
    TrainingOutcome,
    read_artifact,
)
from burstcv_spec.layout import END_RECORD

DAG_ID = "burstcv_pipeline"


@pytest.fixture
def provisioned(
    backend: Ec2Backend, player: Any, kit: Any, monkeypatch: pytest.MonkeyPatch
) -> Provisioned:
    """Launch attempt 1 of a run through the pipeline, its box held; return provision's result."""
    run = RunRef.of("manual__reclaimed")
    player.modes[run.run_key] = kit.HOLD
    for module in (boxes_stage, attempts):
        monkeypatch.setattr(module, "get_backend", lambda name, settings=None: backend)
    launch = Launch(
        run=run,
        dag_id=DAG_ID,
        job_uri=f"{kit.job_dir(run.run_key)}/job.json",
        time_budget_s=600,
        instance_types=["g6.xlarge"],
        use_spot=True,
        deadline_at=datetime.now(UTC) + timedelta(seconds=600),
        **HELD_WHEEL,
    )
    settings = Settings()
    # The run as its first task resolved it: a relaunch reads its budget from run.json.
    given = {"compute_backend": "ec2", "instance_types": ["g6.xlarge"], "use_spot": True}
    resolve.resolve_run(run, RunParams.resolve(given, settings), settings)
    ids = attempts.launch_attempt("ec2", launch, kit.job_dir(run.run_key), 1, settings)
    return Provisioned(
        run=run,
        job_uri=launch.job_uri,
        output_uri=kit.job_dir(run.run_key),
        instance_ids=ids,
        backend="ec2",
        launch=launch,
    )


def states(kit: Any, run_key: str) -> dict[str, str]:
    """Return each emulated instance of the run and its EC2 state."""
    pages = kit.ec2.get_paginator("describe_instances").paginate(
        Filters=[{"Name": "tag:burstcv:run-id", "Values": [run_key]}]
    )
    return {
        i["InstanceId"]: i["State"]["Name"]
        for p in pages
        for r in p["Reservations"]
        for i in r["Instances"]
    }


def wait_event(provisioned: Provisioned, attempt: int) -> TrainingOutcome:
    """Return what the trigger would fire now for the attempt."""
    run = provisioned.run.run_key
    return attempts.training_outcome(run, "ec2", provisioned.output_uri, attempt)


def resumed_in_this_try(operator: WaitForTrainingOperator, event: TrainingOutcome) -> int:
    """Hand the trigger's event to the task; return the attempt it now defers on."""
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute_complete({"run_id": "manual__reclaimed"}, event.model_dump(mode="json"))
    return int(deferred.value.trigger.attempt)


def test_a_reclaimed_box_still_shutting_down_is_relaunched_in_the_same_try(
    provisioned: Provisioned, kit: Any
) -> None:
    (first,) = provisioned.instance_ids
    reclaim_in_emulator(first)  # no marker: reclaimed without (or before) its notice

    event = wait_event(provisioned, 1)
    assert event.status == "lost", event  # shutting-down is gone, not running
    operator = WaitForTrainingOperator(task_id="train", provisioned=provisioned.model_dump())
    assert resumed_in_this_try(operator, event) == 2

    assert attempts.current_attempt(provisioned.output_uri) == 2
    boxes = states(kit, provisioned.run.run_key)
    (second,) = [iid for iid in boxes if iid != first]
    assert boxes == {first: "shutting-down", second: "running"}
    assert wait_event(provisioned, 2).status == "running"
    Ec2Backend().terminate_run(provisioned.run.run_key)
    assert kit.live_managed() == []


def test_a_resumable_failed_with_its_box_still_up_relaunches_and_ends_that_box(
    provisioned: Provisioned, kit: Any
) -> None:
    (first,) = provisioned.instance_ids
    write_failed(provisioned.output_uri, 1, "train", "spot interruption notice", resumable=True)

    event = wait_event(provisioned, 1)
    assert event.status == "failed" and event.resumable is True
    operator = WaitForTrainingOperator(task_id="train", provisioned=provisioned.model_dump())
    assert resumed_in_this_try(operator, event) == 2

    boxes = states(kit, provisioned.run.run_key)
    assert boxes[first] == "terminated"  # it wrote its checkpoint and marker: done with it
    assert sorted(boxes.values()) == ["running", "terminated"]
    Ec2Backend().terminate_run(provisioned.run.run_key)


def test_relaunches_stop_at_the_runs_bound_with_one_line(
    provisioned: Provisioned, kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(boxes_stage, "get_settings", lambda: Settings(max_relaunches=1))
    operator = WaitForTrainingOperator(task_id="train", provisioned=provisioned.model_dump())
    (first,) = provisioned.instance_ids
    reclaim_in_emulator(first)
    assert resumed_in_this_try(operator, wait_event(provisioned, 1)) == 2

    (second,) = [i for i in states(kit, provisioned.run.run_key) if i != first]
    reclaim_in_emulator(second)
    with pytest.raises(AirflowFailException) as failed:
        operator.execute_complete({}, wait_event(provisioned, 2).model_dump(mode="json"))
    assert "relaunched 1 times, its limit" in str(failed.value)
    assert "BURSTCV_MAX_RELAUNCHES" in str(failed.value) and "\n" not in str(failed.value)
    assert len(states(kit, provisioned.run.run_key)) == 2  # no third box
    Ec2Backend().terminate_run(provisioned.run.run_key)


def test_a_final_failure_is_never_relaunched(provisioned: Provisioned, kit: Any) -> None:
    write_failed(provisioned.output_uri, 1, "train", "loss is NaN", resumable=False)
    operator = WaitForTrainingOperator(task_id="train", provisioned=provisioned.model_dump())
    with pytest.raises(AirflowFailException, match="loss is NaN"):
        operator.execute_complete({}, wait_event(provisioned, 1).model_dump(mode="json"))
    assert attempts.current_attempt(provisioned.output_uri) == 1
    assert len(states(kit, provisioned.run.run_key)) == 1
    Ec2Backend().terminate_run(provisioned.run.run_key)


# --- a box never paid twice: one attempt's boxes at a time, and a relaunch within the budget --


def billed_by_hand(box: BoxBill) -> float:
    """Price one ended box as EC2 bills it: the instance from running (else from launch), the
    volume and the address from launch, each at least 60 s."""
    launched, ended = (
        datetime.fromisoformat(box.launched_at),
        datetime.fromisoformat(box.ended_at or ""),
    )
    running = datetime.fromisoformat(box.running_at) if box.running_at else launched
    instance_s = max(60, math.ceil((ended - running).total_seconds()))
    attached_s = max(60, math.ceil((ended - launched).total_seconds()))
    attached_per_hour = (
        box.volume_gb * box.ebs_usd_per_gb_month / 730 + box.public_ipv4_usd_per_hour
    )
    return (box.usd_per_hour * instance_s + attached_per_hour * attached_s) / 3600


def ended_boxes(job_dir: str, attempts_made: int) -> list[BoxBill]:
    """Return every box of the run's attempts as their end records hold them."""
    return [
        box
        for attempt in range(1, attempts_made + 1)
        for box in read_artifact(attempt_dir(job_dir, attempt, END_RECORD), AttemptBill).boxes
    ]


@pytest.mark.parametrize("recorded", [True, False], ids=["after-its-records", "before-them"])
def test_a_provision_killed_after_its_launch_and_retried_runs_one_box_and_bills_both(
    s3_deployment: Settings, player: Any, kit: Any, recorded: bool
) -> None:
    run = RunRef.of(f"manual__killed-{'late' if recorded else 'early'}")
    player.modes[run.run_key] = kit.HOLD
    packed = packed_for(kit, run.run_key)
    params = RunParams.resolve({"compute_backend": "ec2", "time_budget_s": 600}, s3_deployment)
    resolve_validated(run, params, s3_deployment, packed)
    job_dir = kit.job_dir(run.run_key)
    # The first try launched its box, then its worker died: no clean-up ran, the box runs on.
    (first,) = boxes_stage.provision(run, DAG_ID, packed, s3_deployment).instance_ids
    if not recorded:  # it died as RunInstances answered: no record holds the box
        client = storage.s3_client()
        for uri in (f"{job_dir}/attempt.json", f"{job_dir}/attempts/1/launch.json"):
            bucket, _, key = uri.removeprefix("s3://").partition("/")
            client.delete_object(Bucket=bucket, Key=key)

    second = boxes_stage.provision(run, DAG_ID, packed, s3_deployment, attempt=2)

    (box,) = second.instance_ids
    boxes = states(kit, run.run_key)
    assert box != first and boxes[box] == "running"
    assert boxes[first] in ("shutting-down", "terminated")  # ended before the launch
    ended = read_artifact(attempt_dir(job_dir, 1, END_RECORD), AttemptBill)
    assert [b.instance_id for b in ended.boxes] == [first] and ended.boxes[0].ended_at
    # The teardown bills both boxes, each from its own records.
    billing = boxes_stage.terminate(run, "ec2", s3_deployment)
    assert sorted(billing.billed_seconds) == sorted([first, box])
    assert billing.cost_usd == pytest.approx(sum(map(billed_by_hand, ended_boxes(job_dir, 2))))
    assert kit.live_managed() == []


# A g6.xlarge on demand in us-east-1 an hour, as AWS publishes it: the instance at $0.8048, its
# 50 GB gp3 root volume at $0.08 per GB-month (730 h) and a public IPv4 address at $0.005.
G6_PER_HOUR = 0.8048 + 50 * 0.08 / 730 + 0.005
MINUTE_USD = G6_PER_HOUR * 60 / 3600  # what an attempt that lived under a minute costs
# What another attempt needs: its box's minimum and the 6 min it may outlive the deadline.
ATTEMPT_USD = G6_PER_HOUR * (60 + 360) / 3600


def test_a_relaunch_the_budget_cannot_cover_launches_nothing_and_the_bill_stays_within_it(
    s3_deployment: Settings, backend: Ec2Backend, player: Any, kit: Any
) -> None:
    # One attempt of a minute fits beside another attempt's reserve; two do not.
    max_cost_usd = MINUTE_USD + ATTEMPT_USD + 0.95 * MINUTE_USD
    run = RunRef.of("manual__spent")
    player.modes[run.run_key] = kit.HOLD
    # This deployment's g6 boxes boot in 40 s: the 177 s the budget buys pass their boot.
    record_boots(s3_deployment.artifact_root, "g6.xlarge", [40.0])
    given = {"instance_types": ["g6.xlarge"], "use_spot": False, "max_cost_usd": max_cost_usd}
    params = RunParams.resolve({"compute_backend": "ec2", **given}, s3_deployment)
    costs = resolve.resolve_run(run, params, s3_deployment).costs
    assert costs.time_budget_s == 177 and costs.box_rate.usd_per_hour == 0.8048
    # Attempt 1 launched as provision launches it, against the deadline the budget buys.
    launch = Launch(
        run=run,
        dag_id=DAG_ID,
        job_uri=f"{kit.job_dir(run.run_key)}/job.json",
        time_budget_s=costs.time_budget_s,
        instance_types=["g6.xlarge"],
        use_spot=False,
        deadline_at=datetime.now(UTC) + timedelta(seconds=costs.time_budget_s),
        bound_rate=costs.box_rate,
        **HELD_WHEEL,
    )
    job_dir = kit.job_dir(run.run_key)
    provisioned = Provisioned(
        run=run,
        job_uri=launch.job_uri,
        output_uri=job_dir,
        instance_ids=attempts.launch_attempt("ec2", launch, job_dir, 1, s3_deployment),
        backend="ec2",
        launch=launch,
    )
    operator = WaitForTrainingOperator(task_id="train", provisioned=provisioned.model_dump())

    (first,) = provisioned.instance_ids
    reclaim_in_emulator(first)
    assert resumed_in_this_try(operator, wait_event(provisioned, 1)) == 2
    (second,) = [i for i in states(kit, run.run_key) if i != first]
    reclaim_in_emulator(second)
    with pytest.raises(AirflowFailException) as refused:
        operator.execute_complete({}, wait_event(provisioned, 2).model_dump(mode="json"))

    assert len(states(kit, run.run_key)) == 2  # no third box
    assert attempts.current_attempt(provisioned.output_uri) == 2
    message = str(refused.value)
    assert f"another attempt of 1 x g6.xlarge needs ${ATTEMPT_USD:.4f}" in message
    assert "60 s minimum and the watchdog's 360 s margin" in message
    assert message.endswith("over the budget; no relaunch") and "\n" not in message
    billing = boxes_stage.terminate(run, "ec2", s3_deployment)
    by_hand = sum(map(billed_by_hand, ended_boxes(provisioned.output_uri, 2)))
    assert billing.cost_usd == pytest.approx(by_hand)
    assert by_hand <= max_cost_usd
    assert kit.live_managed() == []


def test_an_attempts_end_keeps_how_long_its_boxes_took_to_boot(
    s3_deployment: Settings, provisioned: Provisioned, kit: Any
) -> None:
    from burstcv.cost.boot import boot_estimate
    from burstcv.stages.resolve import TrainingFailed

    (first,) = provisioned.instance_ids
    launch = read_artifact(f"{provisioned.output_uri}/attempts/1/launch.json", AttemptBill)
    launched = datetime.fromisoformat(launch.boxes[0].launched_at)
    passed = (launched + timedelta(seconds=95.25)).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    # The log the box shipped, its script's stamps in it.
    storage.write_bytes(
        f"{provisioned.output_uri}/attempts/1/logs/{first}.log",
        f"burstcv: {passed[:-5]}Z installed\nburstcv: {passed} preflight passed\n".encode(),
    )
    root = s3_deployment.artifact_root
    assert boot_estimate(root, "g6.xlarge").source == "assumed: the g6 family's floor"
    lost = TrainingOutcome(status="lost", attempt=1, reason="gone", resumable=True)
    with pytest.raises(TrainingFailed):
        boxes_stage.collect_training(provisioned.run, lost, s3_deployment)
    measured = boot_estimate(root, "g6.xlarge")
    assert (measured.seconds, measured.source) == (95.2, "measured: the slowest of its last 1")
    Ec2Backend().terminate_run(provisioned.run.run_key)


# --- boot health: a box that never got through to S3 is not relaunched ----------------------


def default_group(kit: Any) -> dict[str, Any]:
    """Return the emulated default VPC's default security group."""
    (vpc,) = kit.ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"]
    (group,) = kit.ec2.describe_security_groups(
        Filters=[
            {"Name": "group-name", "Values": ["default"]},
            {"Name": "vpc-id", "Values": [vpc["VpcId"]]},
        ]
    )["SecurityGroups"]
    return dict(group)


def test_a_box_that_powered_itself_off_without_reaching_s3_fails_at_boot_once(
    provisioned: Provisioned, kit: Any
) -> None:
    # CIS 4.3: the default security group the box got has no rules: nothing gets out.
    group = default_group(kit)
    kit.ec2.revoke_security_group_egress(
        GroupId=group["GroupId"], IpPermissions=group["IpPermissionsEgress"]
    )
    try:
        (first,) = provisioned.instance_ids
        power_off_in_emulator(first)  # its script found no S3, gave up and halted the box

        event = wait_event(provisioned, 1)
        assert (event.status, event.stage, event.resumable) == ("failed", "boot", False), event
        assert f"box {first} powered off without reaching S3 (no log, no marker)" in event.reason
        # The cause, read from the account: the group lets nothing out; and the rule to add.
        assert f"({group['GroupId']}): no egress rule lets a box reach S3" in event.reason
        assert f"authorize-security-group-egress --group-id {group['GroupId']}" in event.reason
        # EC2 had captured nothing of the box's own (no stamp on its console): nothing more.
        assert "its console" not in event.reason
        # The record: a FAILED marker at boot, read back as the same outcome.
        failed = storage.read_json(f"{provisioned.output_uri}/attempts/1/FAILED")
        assert failed["stage"] == "boot" and failed["resumable"] is False
        operator = WaitForTrainingOperator(task_id="train", provisioned=provisioned.model_dump())
        with pytest.raises(AirflowFailException, match="powered off without reaching S3"):
            operator.execute_complete({}, event.model_dump(mode="json"))
        assert list(states(kit, provisioned.run.run_key)) == [first]  # one launch, paid once
    finally:
        kit.ec2.authorize_security_group_egress(
            GroupId=group["GroupId"],
            IpPermissions=[{"IpProtocol": "-1", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}],
        )
    Ec2Backend().terminate_run(provisioned.run.run_key)


def test_a_box_that_reached_s3_and_vanished_is_lost_and_relaunched(
    provisioned: Provisioned, kit: Any
) -> None:
    (first,) = provisioned.instance_ids
    # Its log is in the store: its boot got through; it ended later without a marker.
    storage.write_bytes(f"{provisioned.output_uri}/attempts/1/logs/{first}.log", b"booted\n")
    power_off_in_emulator(first)
    event = wait_event(provisioned, 1)
    assert (event.status, event.resumable) == ("lost", True), event
    Ec2Backend().terminate_run(provisioned.run.run_key)


def test_a_box_silent_past_the_boot_bound_ends_failed_at_boot(
    provisioned: Provisioned,
    kit: Any,
    monkeypatch: pytest.MonkeyPatch,
    audited_calls: RecordingProxy,
) -> None:
    (first,) = provisioned.instance_ids
    run, out = provisioned.run.run_key, provisioned.output_uri
    quick = Settings(boot_bound_s=60)
    # Within the bound: still booting.
    assert attempts.training_outcome(run, "ec2", out, 1, quick).status == "running"
    # Its console, as EC2 captured it: the script stuck on its first try at S3, a proxy's
    # long answer in its last stamp.
    stuck = "cannot reach S3: s3: exists " + out + ": ProxyConnectionError: " + "x" * 600
    console = (
        f"boot\nburstcv: 2026-12-05T05:00:00.000Z run {run}\n"
        f"burstcv: 2026-12-05T05:01:00.000Z {stuck}\n"
    )
    monkeypatch.setitem(
        audited_calls.answers, "ec2:GetConsoleOutput", console_answer(first, console)
    )
    launched_long_ago(first, seconds=61)
    outcome = attempts.training_outcome(run, "ec2", out, 1, quick)
    assert (outcome.status, outcome.stage, outcome.resumable) == ("failed", "boot", False)
    assert f"box {first} reached no S3 in 60 s after its launch" in outcome.reason
    # Its own last step, cut to the first 400 characters.
    said = outcome.reason.split("its console's last step: ")[1]
    assert said.startswith(f'"cannot reach S3: s3: exists {out}: ProxyConnectionError: xxx')
    assert said.index('…"') == 1 + attempts.STEP_SHOWN_CHARS - 1
    assert states(kit, run) == {first: "running"}  # the task's teardown terminates it
    # With its log in the store, the same box would be training, whatever its age.
    bucket, _, key = f"{out}/attempts/1/FAILED".removeprefix("s3://").partition("/")
    storage.s3_client().delete_object(Bucket=bucket, Key=key)
    storage.write_bytes(f"{out}/attempts/1/logs/{first}.log", b"booted\n")
    assert attempts.training_outcome(run, "ec2", out, 1, quick).status == "running"
    Ec2Backend().terminate_run(run)


def launched_long_ago(instance_id: str, seconds: float) -> None:
    """Move an emulated instance's launch time back (the emulator runs in this process)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends

    instance = ec2_backends[DEFAULT_ACCOUNT_ID]["us-east-1"].get_instance(instance_id)
    instance.launch_time = (datetime.now(UTC) - timedelta(seconds=seconds)).replace(tzinfo=None)
