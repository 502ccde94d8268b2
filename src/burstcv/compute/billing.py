"""Write each box's launch and end records (a training attempt's boxes, a sizing box), and bill
a run from those records only.

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
from burstcv_spec.layout import END_RECORD, LAUNCH_RECORD, RunLayout

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
    earlier = read_artifact(uri, AttemptBill).boxes if storage.exists(uri) else []
    recorded = {box.instance_id: box for box in earlier}
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
    """Write the attempt's end.json: each box's end as AWS reports it (its state-transition
    time, else ``now``; a box EC2 no longer lists: ``now``). A box EC2 still describes as not
    terminated has no end yet: it is billed on until a later call sees it end. An attempt
    never launched (no launch record) gets none; an end once recorded never moves."""
    end_uri = attempt_dir(job_dir, attempt, END_RECORD)
    launch_uri = attempt_dir(job_dir, attempt, LAUNCH_RECORD)
    if not storage.exists(launch_uri):
        return
    ended = storage.exists(end_uri)
    recorded = read_artifact(end_uri if ended else launch_uri, AttemptBill)
    if ended and all(box.ended_at for box in recorded.boxes):
        return
    seen = {info.instance_id: info for info in described}
    boxes = []
    for box in recorded.boxes:
        info = seen.get(box.instance_id)
        if box.ended_at is None and (info is None or info.state == STOPPED):
            at = info.stopped_at if info is not None and info.stopped_at is not None else now
            box = box.model_copy(update={"ended_at": at.isoformat()})
        boxes.append(box)
    write_artifact(end_uri, recorded.model_copy(update={"boxes": boxes}))


def attempt_bills(job_dir: str, last_attempt: int) -> list[AttemptBill]:
    """Return the record of each attempt up to ``last_attempt``: end.json, else launch.json."""
    folder = storage.join(job_dir, "attempts")
    found = (_record(folder, attempt) for attempt in range(1, last_attempt + 1))
    return [bill for bill in found if bill is not None]


def _record(attempts: str, attempt: int) -> AttemptBill | None:
    """Return the attempt's end.json, else its launch.json (None: neither) under ``attempts``."""
    for name in (END_RECORD, LAUNCH_RECORD):
        if storage.exists(uri := storage.join(attempts, str(attempt), name)):
            return read_artifact(uri, AttemptBill)
    return None


def run_bill(
    job_dir: str, last_attempt: int, now: datetime, *, backend: str, airflow_run_id: str = ""
) -> Billing:
    """Return the bill of one folder's attempts up to ``last_attempt`` (a box still running:
    until now)."""
    return _billing(attempt_bills(job_dir, last_attempt), now, backend, airflow_run_id)


def whole_bill(
    paths: RunLayout, now: datetime, *, backend: str, airflow_run_id: str = ""
) -> Billing:
    """Return the run's whole bill (billing.json) from its durable records alone: every
    training attempt's boxes and every sizing box of every try, each once. Whoever writes
    billing.json writes all of it: no writer can drop another's boxes."""
    records = _recorded(storage.join(paths.job, "attempts"))
    records += _recorded(storage.join(paths.sizing_boxes, "bills"))
    return _billing(records, now, backend, airflow_run_id)


def _recorded(root: str) -> list[AttemptBill]:
    """Return every attempt recorded under ``root`` (``<folder>/attempts/<n>/``: end.json,
    else launch.json), by folder, then attempt."""
    launched = sorted(
        (folder, int(attempt))
        for folder, attempt, name in (
            uri.rsplit("/", 2) for uri in storage.list_files(root) if uri.count("/") >= 2
        )
        if name == LAUNCH_RECORD and attempt.isdigit()
    )
    return [bill for folder, attempt in launched if (bill := _record(folder, attempt)) is not None]


def _billing(
    attempts: list[AttemptBill], now: datetime, backend: str, airflow_run_id: str
) -> Billing:
    instances: list[InstanceRecord] = []
    seconds_by_box: dict[str, float] = {}
    total_usd = 0.0
    for attempt in attempts:
        for box in attempt.boxes:
            if box.instance_id in seconds_by_box:  # recorded twice: billed once
                continue
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
