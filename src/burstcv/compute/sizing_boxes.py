"""Size a model on boxes of the CPU types it may serve on: one short-lived box per type.

Each candidate type (at most ``parallel`` at once) gets one on-demand box with every leak
layer of a training box; it runs the staging service and the load generator on its own CPUs,
writes its BoxSizing to ``bench/sizing/boxes/<type>.json`` and powers off. A type that cannot
be launched, or whose box ends without figures, is recorded as skipped with the reason; it
never fails the run. Each box has its own run key (its teardown, backstop and bill).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from botocore.exceptions import BotoCoreError, ClientError

from burstcv.compute.base import WORKING, InstanceInfo
from burstcv.compute.billing import record_end, record_launch, recorded_attempts, run_bill
from burstcv.compute.ec2 import CapacityUnavailableError, Ec2Backend
from burstcv.compute.runtime import StagedRuntime, stage_sizing_wheel
from burstcv.compute.userdata import SizingBoxSpec, render_sizing_user_data
from burstcv_spec import storage
from burstcv_spec.contracts import (
    ArtifactError,
    Billing,
    BoxRate,
    BoxSizing,
    Launch,
    RunRef,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import LAUNCH_RECORD, RunLayout

log = logging.getLogger(__name__)

POLL_S = 5.0


def box_run_key(run_key: str, instance_type: str) -> str:
    """Return a sizing box's own run key: the run's, suffixed by its type (path-safe)."""
    return f"{run_key}.size-{instance_type.replace('.', '-')}"


@dataclass(frozen=True)
class SizingRequest:
    """Say what to size, where, and for how long."""

    run: RunRef
    dag_id: str
    model_uri: str  # the model folder boxes fetch (the run's model/, in S3)
    instance_types: Sequence[str]  # the candidates, cheapest first
    latency_slo_ms: float
    step_s: float
    max_s: float  # the sizing's time bound: no box lives past it (plus its watchdog's margin)
    parallel: int = 2  # boxes at once
    bound_rate: BoxRate | None = None  # what a box nobody can quote is billed at


def size_on_boxes(
    backend: Ec2Backend,
    request: SizingRequest,
    paths: RunLayout,
    images: Sequence[bytes],
    *,
    artifact_root: str,
    poll_s: float = POLL_S,
    clock: Callable[[], float] = time.monotonic,
) -> list[BoxSizing]:
    """Launch one sizing box per candidate type; return each type's BoxSizing, in order.
    Every box launched is terminated before this returns (or raises)."""
    for no, data in enumerate(images):  # the requests a box sends
        storage.write_bytes(storage.join(paths.sizing_requests, f"{no:04d}.img"), data)
    wheel = stage_sizing_wheel(artifact_root)
    deadline_at = datetime.now(UTC) + timedelta(seconds=request.max_s)
    boxes = _Boxes(backend, request, paths, wheel, deadline_at)
    ends = clock() + request.max_s
    results: dict[str, BoxSizing] = {}
    waiting = list(dict.fromkeys(request.instance_types))
    live: dict[str, str] = {}  # type -> its box's run key
    try:
        while waiting or live:
            while waiting and len(live) < max(1, request.parallel) and clock() < ends:
                instance_type = waiting.pop(0)
                key = box_run_key(request.run.run_key, instance_type)
                try:
                    ids = boxes.launch(instance_type, key)
                except (CapacityUnavailableError, ClientError, BotoCoreError, ValueError) as exc:
                    why = f"not launched: {exc}"
                    results[instance_type] = _skip(paths, backend, instance_type, why)
                    continue
                live[instance_type] = key
                boxes.record(instance_type, key, ids)
            for instance_type, key in list(live.items()):
                record = _figures(paths, instance_type)
                if record is None and any(i.state in WORKING for i in backend.describe(key)):
                    continue
                why = f"its box ended without figures; its log: {_log_uri(paths, instance_type)}"
                results[instance_type] = record or _skip(paths, backend, instance_type, why)
                boxes.end(instance_type, key)
                del live[instance_type]
            if clock() >= ends:
                why = f"no figures within the sizing's time bound ({request.max_s:g} s)"
                for instance_type in [*live, *waiting]:
                    results[instance_type] = _figures(paths, instance_type) or _skip(
                        paths, backend, instance_type, why
                    )
                break
            if live:
                time.sleep(poll_s)
    finally:
        for instance_type, key in live.items():
            try:
                boxes.end(instance_type, key)
            except (ClientError, BotoCoreError) as exc:  # the backstop and reaper remain
                log.error("sizing box %s: terminate failed (%s); its backstop ends it", key, exc)
    return [results[t] for t in dict.fromkeys(request.instance_types) if t in results]


@dataclass(frozen=True)
class _Boxes:
    """Launch, record and end the boxes of one sizing: what they share, and until when."""

    backend: Ec2Backend
    request: SizingRequest
    paths: RunLayout
    wheel: StagedRuntime
    deadline_at: datetime

    def launch(self, instance_type: str, key: str) -> list[str]:
        """Start the box that sizes ``instance_type``, under its own run key; return its id."""
        s, request, paths = self.backend.settings, self.request, self.paths
        user_data = render_sizing_user_data(
            SizingBoxSpec(
                run_id=key,
                instance_type=instance_type,
                model_uri=request.model_uri,
                requests_uri=paths.sizing_requests,
                out_uri=paths.box_sizing(instance_type),
                log_uri=_log_uri(paths, instance_type),
                wheel_uri=self.wheel.uri,
                wheel_sha256=self.wheel.sha256,
                latency_slo_ms=request.latency_slo_ms,
                step_s=request.step_s,
                deadline_at=self.deadline_at,
                region=s.region,
                margin_min=s.sizing_margin_min,
                python=s.sizing_python,
                log_every_s=s.log_every_s,
            )
        )
        image_id = self.backend.resolve_sizing_ami(self.backend.architecture(instance_type))
        launch = Launch(
            run=RunRef(airflow_run_id=request.run.airflow_run_id, run_key=key),
            dag_id=request.dag_id,
            job_uri=paths.box_sizing(instance_type),
            time_budget_s=int(request.max_s),
            instance_types=[instance_type],
            use_spot=False,
            deadline_at=self.deadline_at,
            wheel_uri=self.wheel.uri,
            wheel_sha256=self.wheel.sha256,
        )
        ids = self.backend.launch_sizing_box(launch, user_data, image_id)
        log.info("sizing box %s: %s launched as %s", instance_type, ids, key)
        return ids

    def record(self, instance_type: str, key: str, ids: list[str]) -> None:
        """Write the box's launch record (its rate as quoted now), as a training attempt's."""
        backend = self.backend

        def rate_of(info: InstanceInfo) -> BoxRate:
            rate = backend.box_rate(info, bound=self.request.bound_rate)
            return rate.model_copy(update={"volume_gb": backend.settings.sizing_volume_gb})

        folder = self.paths.sizing_bill(instance_type)
        # A benchmark tried again sizes again: its boxes are the folder's next attempt.
        record_launch(
            folder,
            recorded_attempts(folder) + 1,
            run_key=key,
            dag_id=self.request.dag_id,
            backend="ec2",
            region=backend.settings.region,
            boxes=[i for i in backend.describe(key) if i.instance_id in ids],
            rate_of=rate_of,
            now=datetime.now(UTC),
        )

    def end(self, instance_type: str, key: str) -> None:
        """Terminate the box and write its end record (its bill is final)."""
        self.backend.terminate_run(key)
        folder = self.paths.sizing_bill(instance_type)
        now = datetime.now(UTC)
        record_end(folder, recorded_attempts(folder), self.backend.describe(key), now)


def bill_sizing(paths: RunLayout, now: datetime, airflow_run_id: str = "") -> list[Billing]:
    """Return the bill of each type's sizing boxes, every attempt (the one cost model)."""
    root = storage.join(paths.sizing_boxes, "bills")
    types = {
        uri[len(root) :].strip("/").split("/", 1)[0]
        for uri in storage.list_files(root)
        if uri.endswith(LAUNCH_RECORD)
    }
    bills = []
    for instance_type in sorted(types):
        folder = paths.sizing_bill(instance_type)
        last = recorded_attempts(folder)
        bills.append(run_bill(folder, last, now, backend="ec2", airflow_run_id=airflow_run_id))
    return bills


def _log_uri(paths: RunLayout, instance_type: str) -> str:
    return storage.join(paths.sizing_boxes, "logs", f"{instance_type}.log")


def _figures(paths: RunLayout, instance_type: str) -> BoxSizing | None:
    uri = paths.box_sizing(instance_type)
    if not storage.exists(uri):
        return None
    try:
        return read_artifact(uri, BoxSizing)
    except (OSError, ArtifactError) as exc:
        log.warning("sizing box %s: unreadable figures (%s)", instance_type, exc)
        return None


def _skip(paths: RunLayout, backend: Ec2Backend, instance_type: str, why: str) -> BoxSizing:
    log.warning("sizing box %s skipped: %s", instance_type, why)
    record = BoxSizing(instance_type=instance_type, region=backend.settings.region, skipped=why)
    write_artifact(paths.box_sizing(instance_type), record)
    return record
