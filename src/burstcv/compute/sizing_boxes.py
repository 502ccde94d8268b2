"""Size a model on boxes of the CPU types it may serve on: one short-lived box per type.

Each candidate type (at most ``parallel`` at once) gets one on-demand box with every leak
layer of a training box; it runs the staging service and the load generator on its own CPUs,
writes its BoxSizing to its try's ``bench/sizing/boxes/tries/<n>/<type>.json`` and powers off; the
run's record of the type is ``bench/sizing/boxes/<type>.json``. A type that cannot be launched,
for any reason, or whose box ends without figures (said from its console), is recorded as
skipped with the reason; it never fails the run. Each box has its own run key (its teardown,
backstop and bill); each call is a try of its own (a benchmark tried again reads only its own
boxes' figures).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from botocore.exceptions import BotoCoreError, ClientError

from burstcv.compute.attempts import _last_step
from burstcv.compute.base import STOPPED, WORKING, InstanceInfo
from burstcv.compute.billing import record_end, record_launch
from burstcv.compute.ec2 import Ec2Backend
from burstcv.compute.runtime import StagedRuntime, sizing_tags, stage_sizing_wheel
from burstcv.compute.userdata import SizingBoxSpec, render_sizing_user_data
from burstcv_spec import storage
from burstcv_spec.contracts import (
    ArtifactError,
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
TRY_MARKER = "STARTED"  # bench/sizing/boxes/tries/<n>/STARTED: the try's number is taken


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
    Every box launched is terminated before this returns (or raises). Each call is a try of
    its own: it first ends what an earlier try left, and reads only its own boxes' figures."""
    for no, data in enumerate(images):  # the requests a box sends
        storage.write_bytes(storage.join(paths.sizing_requests, f"{no:04d}.img"), data)
    tags = sizing_tags(backend.settings.sizing_python, request.instance_types)
    wheel = stage_sizing_wheel(artifact_root, tags)
    deadline_at = datetime.now(UTC) + timedelta(seconds=request.max_s)
    boxes = _Boxes(backend, request, paths, wheel, deadline_at, _claim_try(paths))
    types = list(dict.fromkeys(request.instance_types))
    boxes.end_earlier(types)
    ends = clock() + request.max_s
    results: dict[str, BoxSizing] = {}
    waiting = list(types)
    live: dict[str, tuple[str, list[str]]] = {}  # type -> its box's run key and id
    try:
        while waiting or live:
            while waiting and len(live) < max(1, request.parallel) and clock() < ends:
                instance_type = waiting.pop(0)
                key = box_run_key(request.run.run_key, instance_type)
                try:
                    ids = boxes.launch(instance_type, key)
                # Broad on purpose: whatever refuses one type (a dry run, a quota, capacity,
                # its image) skips that type, with the reason; the others are measured.
                except Exception as exc:
                    log.warning("sizing box %s: not launched", instance_type, exc_info=True)
                    results[instance_type] = boxes.settle(instance_type, f"not launched: {exc}")
                    continue
                live[instance_type] = key, ids
                boxes.record(instance_type, key, ids)
            for instance_type, (key, ids) in list(live.items()):
                measured = _figures(boxes.out_uri(instance_type)) is not None
                if not measured and any(i.state in WORKING for i in backend.describe(key)):
                    continue
                why = "" if measured else boxes.unmeasured(instance_type, ids)
                results[instance_type] = boxes.settle(instance_type, why)
                boxes.end(instance_type, key)
                del live[instance_type]
            if clock() >= ends:
                why = f"no figures within the sizing's time bound ({request.max_s:g} s)"
                for instance_type in [*live, *waiting]:
                    results[instance_type] = boxes.settle(instance_type, why)
                break
            if live:
                time.sleep(poll_s)
    finally:
        for instance_type, (key, _) in live.items():
            try:
                boxes.end(instance_type, key)
            except (ClientError, BotoCoreError) as exc:  # the backstop and reaper remain
                log.error("sizing box %s: terminate failed (%s); its backstop ends it", key, exc)
    return [results[t] for t in types if t in results]


def _try_uri(paths: RunLayout, sizing_try: int, *parts: str) -> str:
    """Return bench/sizing/boxes/tries/<n>/<parts>: under boxes/, where a box may write."""
    return storage.join(paths.sizing_boxes, "boxes", "tries", str(sizing_try), *parts)


def _claim_try(paths: RunLayout) -> int:
    """Return this sizing's try number, marked in the store before any box launches: a
    benchmark tried again sizes as the next try, with records of its own."""
    sizing_try = 1
    while storage.exists(_try_uri(paths, sizing_try, TRY_MARKER)):
        sizing_try += 1
    storage.write_bytes(
        _try_uri(paths, sizing_try, TRY_MARKER), datetime.now(UTC).isoformat().encode()
    )
    return sizing_try


@dataclass(frozen=True)
class _Boxes:
    """Launch, record and end the boxes of one sizing: what they share, and until when."""

    backend: Ec2Backend
    request: SizingRequest
    paths: RunLayout
    wheel: StagedRuntime
    deadline_at: datetime
    sizing_try: int  # this call's try: its boxes' figures and launch records are its own

    def out_uri(self, instance_type: str) -> str:
        """Return where this try's box of ``instance_type`` writes its figures."""
        return _try_uri(self.paths, self.sizing_try, f"{instance_type}.json")

    def launch(self, instance_type: str, key: str) -> list[str]:
        """Start the box that sizes ``instance_type``, under its own run key; return its id."""
        s, request, paths = self.backend.settings, self.request, self.paths
        user_data = render_sizing_user_data(
            SizingBoxSpec(
                run_id=key,
                instance_type=instance_type,
                model_uri=request.model_uri,
                requests_uri=paths.sizing_requests,
                out_uri=self.out_uri(instance_type),
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
            job_uri=self.out_uri(instance_type),
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

        record_launch(
            self.paths.sizing_bill(instance_type),
            self.sizing_try,
            run_key=key,
            dag_id=self.request.dag_id,
            backend="ec2",
            region=backend.settings.region,
            boxes=[i for i in backend.describe(key) if i.instance_id in ids],
            rate_of=rate_of,
            now=datetime.now(UTC),
        )

    def end(self, instance_type: str, key: str) -> None:
        """Terminate the box and write its end record (its bill is final once AWS says so)."""
        self.backend.terminate_run(key)
        described = self.backend.describe(key)
        record_end(
            self.paths.sizing_bill(instance_type), self.sizing_try, described, datetime.now(UTC)
        )

    def end_earlier(self, types: Sequence[str]) -> None:
        """End the boxes an earlier try left up (its worker died, say) and record their end:
        this try launches its own, never adopts one writing an earlier try's figures."""
        if self.sizing_try == 1:
            return
        root = storage.join(self.paths.sizing_boxes, "bills")
        recorded = {
            uri[len(root) :].strip("/").split("/", 1)[0]
            for uri in storage.list_files(root)
            if uri.endswith(LAUNCH_RECORD)
        }
        for instance_type in sorted(recorded | set(types)):
            key = box_run_key(self.request.run.run_key, instance_type)
            described = self.backend.describe(key)
            if any(i.state != STOPPED for i in described):
                log.warning("sizing box %s: left up by an earlier try; terminating it", key)
                self.backend.terminate_run(key)
                described = self.backend.describe(key)
            folder = self.paths.sizing_bill(instance_type)
            for earlier in range(1, self.sizing_try):
                record_end(folder, earlier, described, datetime.now(UTC))

    def settle(self, instance_type: str, why: str) -> BoxSizing:
        """Return the type's figures from this try's box, else a record of why it has none;
        either is the run's record of the type."""
        record = _figures(self.out_uri(instance_type))
        if record is None:
            log.warning("sizing box %s skipped: %s", instance_type, why)
            region = self.backend.settings.region
            record = BoxSizing(instance_type=instance_type, region=region, skipped=why)
        write_artifact(self.paths.box_sizing(instance_type), record)
        return record

    def unmeasured(self, instance_type: str, ids: list[str]) -> str:
        """Return why a box ended without figures, in its own words: the last step its console
        shows, and its log where it left one."""
        said = "".join(_last_step(self.backend, i) for i in ids)
        said = said or "; no step of its script in its console output"
        log_uri = _log_uri(self.paths, instance_type)
        if storage.exists(log_uri):
            said += f"; its log: {log_uri}"
        return f"its box {', '.join(ids)} ended without figures{said}"


def _log_uri(paths: RunLayout, instance_type: str) -> str:
    return storage.join(paths.sizing_boxes, "logs", f"{instance_type}.log")


def _figures(uri: str) -> BoxSizing | None:
    """Return the figures a box wrote at ``uri``, or None (none yet, or unreadable)."""
    if not storage.exists(uri):
        return None
    try:
        return read_artifact(uri, BoxSizing)
    except (OSError, ArtifactError) as exc:
        log.warning("sizing box: unreadable figures at %s (%s)", uri, exc)
        return None
