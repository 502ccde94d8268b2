"""Bill a run from its attempts' launch and end records, never from the cloud's memory alone.

EC2 lists a terminated instance for about an hour: a run whose first attempt ended earlier
than that must still pay for it, in billing.json and in the budget a relaunch checks.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from burstcv_testkit import HELD_WHEEL, forget_in_emulator, reclaim_in_emulator

from burstcv import pipeline
from burstcv.compute import attempts
from burstcv.compute.ec2 import Ec2Backend
from burstcv.settings import Settings
from burstcv.training.job import attempt_dir
from burstcv_spec.contracts import AttemptBill, Billing, Launch, Provisioned, RunRef, read_artifact
from burstcv_spec.layout import END_RECORD, LAUNCH_RECORD


@pytest.fixture
def provisioned(
    s3_deployment: Settings, backend: Ec2Backend, player: Any, kit: Any, monkeypatch: Any
) -> Provisioned:
    """Launch attempt 1 of a run through the pipeline, its box held; return provision's result."""
    run = RunRef.of("manual__billed")
    player.modes[run.run_key] = kit.HOLD
    for module in (pipeline, attempts):
        monkeypatch.setattr(module, "get_backend", lambda name, settings=None: backend)
    launch = Launch(
        run=run,
        dag_id="burstcv_pipeline",
        job_uri=f"{kit.job_dir(run.run_key)}/job.json",
        time_budget_s=600,
        instance_types=["g6.xlarge"],
        use_spot=True,
        deadline_at=datetime.now(UTC) + timedelta(seconds=600),
        **HELD_WHEEL,
    )
    ids = attempts.launch_attempt("ec2", launch, kit.job_dir(run.run_key), 1, s3_deployment)
    return Provisioned(
        run=run,
        job_uri=launch.job_uri,
        output_uri=kit.job_dir(run.run_key),
        instance_ids=ids,
        backend="ec2",
        max_cost_usd=5.0,
        launch=launch,
    )


def test_billing_json_is_the_same_when_the_cloud_has_forgotten_the_instances(
    provisioned: Provisioned, kit: Any
) -> None:
    (first,) = provisioned.instance_ids
    launched = read_artifact(attempt_dir(provisioned.output_uri, 1, LAUNCH_RECORD), AttemptBill)
    (box,) = launched.boxes
    assert (box.instance_id, box.instance_type, box.market) == (first, "g6.xlarge", "spot")
    assert box.zone == "us-east-1a" and box.ended_at is None
    assert "DescribeSpotPriceHistory" in box.price_source

    reclaim_in_emulator(first)
    assert pipeline.relaunch(provisioned) == 2  # attempt 1 ends: its end.json is written
    ended = read_artifact(attempt_dir(provisioned.output_uri, 1, END_RECORD), AttemptBill)
    assert ended.boxes[0].ended_at is not None

    remembered = pipeline.terminate(provisioned.run, "ec2")
    billing_uri = pipeline.run_layout(provisioned.run).billing
    first_billing = read_artifact(billing_uri, Billing)
    assert len(first_billing.instances) == 2 and remembered.cost_usd > 0
    assert all(s >= 60 for s in first_billing.billed_seconds.values())

    # An hour on, EC2 no longer lists them: the bill does not change.
    forget_in_emulator(first_billing.instance_ids)
    assert Ec2Backend().describe(provisioned.run.run_key) == []
    forgotten = pipeline.terminate(provisioned.run, "ec2")
    second_billing = read_artifact(billing_uri, Billing)
    assert (remembered, forgotten) == (first_billing, second_billing)  # what the stage returns
    assert second_billing.model_dump(exclude={"terminated_at"}) == first_billing.model_dump(
        exclude={"terminated_at"}
    )


def test_the_budget_counts_an_attempt_the_cloud_has_forgotten(
    provisioned: Provisioned, kit: Any
) -> None:
    (first,) = provisioned.instance_ids
    box = read_artifact(attempt_dir(provisioned.output_uri, 1, LAUNCH_RECORD), AttemptBill).boxes[0]
    Ec2Backend().terminate([first])
    forget_in_emulator([first])
    # A budget just under the first box's minimum minute: nothing more may be rented.
    tight = provisioned.model_copy(update={"max_cost_usd": box.usd_per_hour * 59 / 3600})
    with pytest.raises(pipeline.TrainingFailed, match="budget; no relaunch"):
        pipeline.relaunch(tight)
    assert attempts.current_attempt(provisioned.output_uri) == 1
    assert kit.live_managed() == []
