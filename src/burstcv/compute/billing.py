"""Write each training attempt's launch and end records, and bill a run from those records only.

EC2 lists a terminated instance for only about an hour: a bill remembered by the cloud would
forget early attempts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from burstcv.compute.base import RUNNING, STOPPED, InstanceInfo
from burstcv.cost.model import box_cost, box_usd_per_hour
from burstcv.training.job import attempt_dir
from burstcv_spec import storage
from burstcv_spec.contracts import (
    AttemptBill,
    Billing,
    BoxBill,
    BoxRate,
    InstanceRecord,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import END_RECORD, LAUNCH_RECORD

log = logging.getLogger(__name__)

# Returns a box's rate, every part priced (the backend's quote, or the run's bound rate).
RateOf = Callable[[InstanceInfo], BoxRate]


def record_launch(
    job_dir: str,
    attempt: int,
    *,
    run_key: str,
    dag_id: str,
    backend: str,
    region: str,
    boxes: list[InstanceInfo],
    rate_of: RateOf,
    now: datetime,
) -> AttemptBill:
    """Write the attempt's launch.json: each box with its place, rate, launch and running time.
    A box still pending is billed from its launch time (an upper bound); one the record already
    holds (a retried launch found it up) keeps its record: it has run since then."""
    uri = attempt_dir(job_dir, attempt, LAUNCH_RECORD)
    recorded = (
        {b.instance_id: b for b in read_artifact(uri, AttemptBill).boxes}
        if storage.exists(uri)
        else {}
    )
    bill = AttemptBill(
        attempt=attempt,
        run_key=run_key,
        dag_id=dag_id,
        backend=backend,
        region=region,
        boxes=[recorded.get(info.instance_id) or _box(info, rate_of(info), now) for info in boxes],
    )
    write_artifact(uri, bill)
    return bill


def record_end(job_dir: str, attempt: int, described: list[InstanceInfo], now: datetime) -> None:
    """Write the attempt's end.json once (end times: as the backend saw them, else now); an
    attempt never launched (no launch record) gets none."""
    end_uri = attempt_dir(job_dir, attempt, END_RECORD)
    launch_uri = attempt_dir(job_dir, attempt, LAUNCH_RECORD)
    if storage.exists(end_uri) or not storage.exists(launch_uri):
        return
    launched = read_artifact(launch_uri, AttemptBill)
    seen = {info.instance_id: info for info in described}
    boxes = []
    for box in launched.boxes:
        info = seen.get(box.instance_id)
        ended = info.stopped_at if info is not None and info.stopped_at is not None else now
        boxes.append(box.model_copy(update={"ended_at": ended.isoformat()}))
    write_artifact(end_uri, launched.model_copy(update={"boxes": boxes}))


def attempt_bills(job_dir: str, last_attempt: int) -> list[AttemptBill]:
    """Return the record of each attempt up to ``last_attempt``: end.json, else launch.json."""
    bills = []
    for attempt in range(1, last_attempt + 1):
        for name in (END_RECORD, LAUNCH_RECORD):
            uri = attempt_dir(job_dir, attempt, name)
            if storage.exists(uri):
                bills.append(read_artifact(uri, AttemptBill))
                break
    return bills


def recorded_attempts(job_dir: str) -> int:
    """Return how many attempts have a launch record in ``job_dir`` (0: none)."""
    count = 0
    while storage.exists(attempt_dir(job_dir, count + 1, LAUNCH_RECORD)):
        count += 1
    return count


def run_bill(
    job_dir: str, last_attempt: int, now: datetime, *, backend: str, airflow_run_id: str = ""
) -> Billing:
    """Return the run's bill from its attempt records (a box still running: until now)."""
    instances: list[InstanceRecord] = []
    seconds_by_box: dict[str, float] = {}
    total_usd = 0.0
    for attempt in attempt_bills(job_dir, last_attempt):
        for box in attempt.boxes:
            cost = box_cost(box, now)
            seconds_by_box[box.instance_id] = cost.instance_s
            total_usd += cost.usd
            instances.append(
                InstanceRecord(
                    instance_id=box.instance_id,
                    run_id=attempt.run_key,
                    dag_id=attempt.dag_id,
                    state=STOPPED if box.ended_at else RUNNING,
                    instance_type=box.instance_type,
                    lifecycle=box.market,
                    launched_at=box.launched_at,
                    stopped_at=box.ended_at,
                    airflow_run_id=airflow_run_id,
                    image_id=box.image_id,
                    zone=box.zone,
                    usd_per_hour=box_usd_per_hour(box),
                    cost_usd=cost.usd,
                )
            )
    return Billing(
        instance_ids=[box.instance_id for box in instances],
        billed_seconds=seconds_by_box,
        cost_usd=total_usd,
        backend=backend,
        instances=instances,
    )


def _box(info: InstanceInfo, rate: BoxRate, now: datetime) -> BoxBill:
    launched = info.launched_at or now
    return BoxBill(
        **dict(rate),
        instance_id=info.instance_id,
        zone=info.zone,
        image_id=info.image_id,
        launched_at=launched.isoformat(),
        running_at=now.isoformat() if info.state == RUNNING else None,
    )
