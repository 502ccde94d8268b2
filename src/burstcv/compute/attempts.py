"""Follow a run's training attempts: launch one, read its state, progress and box logs.

Everything is read from the job folder (where each attempt's boxes write their markers,
progress and logs) and the backend's description of the boxes: no GPU time is spent to look.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import datetime
from typing import TYPE_CHECKING

from burstcv import lineage
from burstcv.compute.backends import get_backend
from burstcv.compute.base import STOPPED, WORKING, ComputeBackend, InstanceInfo, job_outcome
from burstcv.compute.billing import record_end, record_launch, run_bill
from burstcv.cost.model import LOCAL_RATE
from burstcv.settings import Settings, get_settings
from burstcv.training.job import (
    STAGE_BOOT,
    attempt_dir,
    load_job,
    owning_rank_failure,
    write_failed,
)
from burstcv_spec import storage
from burstcv_spec.contracts import (
    ArtifactError,
    AttemptBill,
    AttemptRecord,
    BoxRate,
    FailedMarker,
    Launch,
    TrainingOutcome,
    TrainingProgress,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import ATTEMPT_RECORD, FAILED_MARKER, JOB_SPEC, LAUNCH_RECORD, PROGRESS
from burstcv_spec.storage import safe_run_id

if TYPE_CHECKING:
    from burstcv.compute.ec2 import Ec2Backend

log = logging.getLogger(__name__)


def launch_attempt(
    backend_name: str, launch: Launch, job_dir: str, attempt: int, settings: Settings
) -> list[str]:
    """Start an attempt's boxes once every box of an earlier attempt has ended; record the
    attempt and each box's place and price."""
    backend = get_backend(backend_name, settings)
    if attempt > 1:
        end_earlier_attempts(backend, launch, job_dir, attempt, settings)
    ids = backend.launch(launch, attempt)
    write_artifact(
        storage.join(job_dir, ATTEMPT_RECORD),
        AttemptRecord(attempt=attempt, instance_ids=ids, launched_at=lineage.utc_now_iso()),
    )
    _record_boxes(backend, launch, job_dir, attempt, ids)
    return ids


def _record_boxes(
    backend: ComputeBackend, launch: Launch, job_dir: str, attempt: int, ids: list[str]
) -> None:
    """Write the attempt's launch record of boxes ``ids``, each at its quoted (or bound) rate."""
    from burstcv.compute.ec2 import Ec2Backend

    def rate_of(info: InstanceInfo) -> BoxRate:
        if isinstance(backend, Ec2Backend):
            return backend.box_rate(info, bound=launch.bound_rate)
        return LOCAL_RATE.model_copy(update={"instance_type": info.instance_type})

    record_launch(
        job_dir,
        attempt,
        run_key=launch.run.run_key,
        dag_id=launch.dag_id,
        backend=backend.name,
        region=backend.settings.region if isinstance(backend, Ec2Backend) else "",
        boxes=[i for i in backend.describe(launch.run.run_key) if i.instance_id in ids],
        rate_of=rate_of,
        now=lineage.utc_now(),
    )


def end_earlier_attempts(
    backend: ComputeBackend, launch: Launch, job_dir: str, attempt: int, settings: Settings
) -> list[str]:
    """End the boxes of the run's earlier attempts still pending or running (a try of
    provision whose worker died after its launch left them) and record their end for the
    bill; return their ids. A box no record holds (its try died before writing one) is
    recorded from its launch: it is billed all the same."""
    run_key = launch.run.run_key
    earlier = [i for i in backend.describe(run_key) if i.attempt < attempt]
    up = [i.instance_id for i in earlier if i.state in WORKING]
    if up:
        log.warning(
            "run %s: ending %s of an earlier attempt before attempt %d", run_key, up, attempt
        )
        backend.terminate(up)
        earlier = wait_ended(
            backend,
            run_key,
            attempt - 1,
            settings.relaunch_wait_s,
            launch.deadline_at,
            terminated=launch.count > 1,
        )
    now = lineage.utc_now()
    for before in sorted({i.attempt for i in earlier if i.attempt < attempt}):
        if not storage.exists(attempt_dir(job_dir, before, LAUNCH_RECORD)):
            # Recorded once ended: not seen running, so billed from its launch (an upper bound).
            ids = [i.instance_id for i in earlier if i.attempt == before]
            _record_boxes(backend, launch, job_dir, before, ids)
        record_end(job_dir, before, earlier, now)
    return up


def wait_ended(
    backend: ComputeBackend,
    run_key: str,
    attempt: int,
    wait_s: float,
    deadline: datetime,
    *,
    terminated: bool,
) -> list[InstanceInfo]:
    """Wait until the boxes of attempts up to ``attempt`` have ended; return the run's boxes.
    With ``terminated`` (several boxes hold the run's placement group until then), until
    terminated. Bounded by ``wait_s`` and the run's deadline: a box left is the teardown's."""
    bound = min(wait_s, max(0.0, (deadline - lineage.utc_now()).total_seconds()))
    until = time.monotonic() + bound
    while True:
        instances = backend.describe(run_key)
        waiting = [
            i.instance_id
            for i in instances
            if i.attempt <= attempt and (i.state != STOPPED if terminated else i.state in WORKING)
        ]
        if not waiting:
            return instances
        if time.monotonic() >= until:
            log.warning(
                "run %s: %s of attempt %d not %s after %g s; relaunching beside them "
                "(the teardown terminates every box of the run)",
                run_key,
                waiting,
                attempt,
                "terminated" if terminated else "ended",
                bound,
            )
            return instances
        time.sleep(backend.poll_s)


# The stamp a training box's script writes once its preflight passed: where its boot ends.
_PREFLIGHT_PASSED = re.compile(r"burstcv: (\d{4}-\d\d-\d\dT[\d:.]+Z) preflight passed")


def measured_boots(output_uri: str, attempt: int) -> dict[str, list[float]]:
    """Return, by instance type, how long each box of the attempt took from its launch to its
    passed preflight: its launch record's time and the stamp in the log it shipped."""
    uri = attempt_dir(output_uri, attempt, LAUNCH_RECORD)
    if not storage.exists(uri):
        return {}
    boots: dict[str, list[float]] = {}
    for box in read_artifact(uri, AttemptBill).boxes:
        log_uri = attempt_dir(output_uri, attempt, "logs", f"{box.instance_id}.log")
        if box.market == "local" or not storage.exists(log_uri):
            continue
        passed = _PREFLIGHT_PASSED.search(storage.read_bytes(log_uri).decode(errors="replace"))
        if passed is not None:
            at = datetime.fromisoformat(passed.group(1))
            seconds = (at - datetime.fromisoformat(box.launched_at)).total_seconds()
            boots.setdefault(box.instance_type, []).append(seconds)
    return boots


def current_attempt(output_uri: str) -> int:
    """Return the run's latest launched attempt (1 before any relaunch)."""
    uri = storage.join(output_uri, ATTEMPT_RECORD)
    return read_artifact(uri, AttemptRecord).attempt if storage.exists(uri) else 1


def resumable(outcome: TrainingOutcome) -> bool:
    """Return whether an attempt's outcome may be resumed by a new box: a box that vanished
    or was interrupted left a checkpoint; a job that failed on its own would fail again."""
    return outcome.status == "lost" or (outcome.status == "failed" and outcome.resumable)


def training_outcome(
    run_id: str,
    backend_name: str,
    output_uri: str,
    attempt: int = 1,
    settings: Settings | None = None,
    boxes: int = 1,
) -> TrainingOutcome:
    """Return an attempt's state: done, failed (stage, reason), lost (no marker) or running.
    A rank's own error decides (never relaunched), even over a peer box lost. Rank markers are
    read on every poll for several ``boxes`` (the other boxes' ranks wait out their timeouts),
    and for one box only once it has ended (torchrun ends its other processes at once)."""
    status = job_outcome(
        get_backend(backend_name, settings), safe_run_id(run_id), output_uri, attempt
    )
    if status == "done":
        return TrainingOutcome(status="done", attempt=attempt)
    owned = rank_error(run_id, output_uri, attempt) if boxes > 1 or status != "running" else None
    if status == "failed":
        return _marked_failure(output_uri, attempt, owned)
    if owned is not None:
        return owned
    boot = boot_failure(run_id, backend_name, output_uri, attempt, settings or get_settings())
    if boot is not None:
        log.error("run %s attempt %d: %s", run_id, attempt, boot)
        # The record of it: a box still up is terminated by the task's teardown.
        write_failed(output_uri, attempt, STAGE_BOOT, boot, resumable=False)
        return TrainingOutcome(
            status="failed", attempt=attempt, stage=STAGE_BOOT, reason=boot, resumable=False
        )
    if status == "lost":
        reason = "every training instance stopped without writing DONE or FAILED"
        return TrainingOutcome(status="lost", attempt=attempt, reason=reason, resumable=True)
    return TrainingOutcome(status=status, attempt=attempt)


def _marked_failure(
    output_uri: str, attempt: int, owned: TrainingOutcome | None
) -> TrainingOutcome:
    """Return the outcome of the attempt's FAILED marker; ``owned`` wins over a resumable one."""
    try:
        failed = read_artifact(attempt_dir(output_uri, attempt, FAILED_MARKER), FailedMarker)
    except ArtifactError as exc:  # failed all the same: say so rather than crash the wait
        reason = f"unreadable FAILED marker: {exc}"
        return owned or TrainingOutcome(status="failed", attempt=attempt, reason=reason)
    if owned is not None and failed.resumable:
        return owned
    return TrainingOutcome(
        status="failed",
        attempt=attempt,
        stage=failed.stage,
        reason=failed.reason,
        resumable=failed.resumable,
    )


def rank_error(run_id: str, output_uri: str, attempt: int) -> TrainingOutcome | None:
    """Return the outcome a rank's own error gives the attempt, or None: the lowest rank whose
    marker is not resumable owns it. Its traceback's last lines go to the task log."""
    owner = owning_rank_failure(output_uri, attempt)
    if owner is None:
        return None
    log.error(
        "run %s attempt %d: rank %s (node %s) failed at %s: %s%s",
        run_id,
        attempt,
        owner.rank,
        owner.node,
        owner.stage,
        owner.reason,
        "".join(f"\n  {line}" for line in owner.traceback or []),
    )
    return TrainingOutcome(
        status="failed",
        attempt=attempt,
        stage=owner.stage,
        reason=f"rank {owner.rank} (node {owner.node}): {owner.reason}",
        resumable=False,
    )


# EC2's StateReason for a box that powered itself off (its script ended, or its watchdog).
POWERED_ITSELF_OFF = "Client.InstanceInitiatedShutdown"


def boot_failure(
    run_id: str, backend_name: str, output_uri: str, attempt: int, settings: Settings
) -> str | None:
    """Return why an attempt's boxes never got through their boot to S3, or None. A box ships
    its log as soon as it reaches S3: one with no log that powered itself off, or is up
    BURSTCV_BOOT_BOUND_S after its launch, never will (a relaunch would fail alike)."""
    if backend_name != "ec2":
        return None
    from burstcv.compute.awscheck import no_s3_cause
    from burstcv.compute.ec2 import Ec2Backend

    backend = get_backend(backend_name, settings)
    now = lineage.utc_now()
    boxes = [i for i in backend.describe(safe_run_id(run_id)) if i.of_attempt(attempt)]

    def silent(info: InstanceInfo) -> bool:
        log_uri = attempt_dir(output_uri, attempt, "logs", f"{info.instance_id}.log")
        return not storage.exists(log_uri)

    ended = [i for i in boxes if i.state not in WORKING and i.ended_by == POWERED_ITSELF_OFF]
    off = [i for i in ended if silent(i)]
    late = [
        i
        for i in boxes
        if i.state in WORKING
        and i.launched_at is not None
        and (now - i.launched_at).total_seconds() > settings.boot_bound_s
        and silent(i)
    ]
    if off:
        what = "powered off without reaching S3"
    elif late:
        what = f"reached no S3 in {settings.boot_bound_s:g} s after its launch"
    else:
        return None
    stuck = off or late
    ids = ", ".join(i.instance_id for i in stuck)
    cause, said = "no cause read", ""
    if isinstance(backend, Ec2Backend):
        try:
            cause = no_s3_cause(backend, stuck[0].instance_id, settings.artifact_root)
        # Broad on purpose: the verdict stands without its diagnosis.
        except Exception as exc:
            cause = f"the account could not be read for a cause ({type(exc).__name__}: {exc})"
        said = _last_step(backend, stuck[0].instance_id)
    return (
        f"box {ids} {what} (no log, no marker): {cause}{said}; not relaunched: a new box would "
        "fail alike"
    )


STEP_SHOWN_CHARS = 400  # of the last step a box stamped, in a boot failure's reason


def _last_step(backend: Ec2Backend, instance_id: str) -> str:
    """Return '; its console's last step: "…"' from the box's own stamps, or "" when EC2 has
    captured none (yet) or cannot be read."""
    from burstcv.compute.userdata import stamps

    try:
        steps = stamps(backend.console_output(instance_id))
    # Broad on purpose: the verdict stands without the box's words.
    except Exception as exc:
        log.warning("could not read the console output of %s: %s", instance_id, exc)
        return ""
    if not steps:
        return ""
    last = steps[-1]
    if len(last) > STEP_SHOWN_CHARS:
        last = last[: STEP_SHOWN_CHARS - 1] + "…"
    return f'; its console\'s last step: "{last}"'


def _usd(amount: float) -> str:
    return f"${amount:.2f}" if amount >= 0.1 or amount == 0 else f"${amount:.4f}"


def progress_lines(
    run_id: str,
    backend_name: str,
    output_uri: str,
    attempt: int,
    already_logged: int,
    max_cost_usd: float | None = None,
) -> list[str]:
    """Return a line per epoch the attempt finished after its first ``already_logged`` ones
    (what a reader scans for first, to fit the log viewer's width)."""
    uri = storage.join(output_uri, PROGRESS)
    if not storage.exists(uri):
        return []
    progress = read_artifact(uri, TrainingProgress)
    mine = [e for e in progress.epochs if e.attempt == attempt]
    epochs = mine[already_logged:]
    if not epochs:
        return []
    now = lineage.utc_now()
    bill = run_bill(output_uri, attempt, now, backend=backend_name)
    billed, spent = sum(bill.billed_seconds.values()), bill.cost_usd
    job = load_job(storage.join(output_uri, JOB_SPEC))
    time_left, money = "no deadline", f"{_usd(spent)} spent, no budget"
    if job.deadline_at is not None:
        left_s = max(0.0, (job.deadline_at - now).total_seconds())
        time_left = f"{left_s / 60:.1f} min to the deadline"
    if max_cost_usd is not None:
        left_usd = _usd(max(0.0, max_cost_usd - spent))
        money = f"{_usd(spent)} of {_usd(max_cost_usd)}, {left_usd} left"
    total = progress.epochs_total
    return [
        f"epoch {e.epoch}/{total} val_accuracy {e.val_accuracy:.4f} "
        f"val_loss {e.val_loss:.4f} | {money} | {time_left} | "
        f"train_loss {e.train_loss:.4f}, {e.images_per_s:.0f} images/s, "
        f"{e.elapsed_s:.0f} s, billed {billed:.0f} s, attempt {attempt}"
        for e in epochs
    ]


def box_log_tail(
    run_id: str,
    backend_name: str,
    output_uri: str,
    attempt: int,
    lines: int = 40,
    settings: Settings | None = None,
) -> list[str]:
    """Return the last lines of each log the attempt's boxes shipped (newest box last)."""
    tail: list[str] = []
    for info in get_backend(backend_name, settings).describe(safe_run_id(run_id)):
        uri = attempt_dir(output_uri, attempt, "logs", f"{info.instance_id}.log")
        if not storage.exists(uri):
            continue
        text = storage.read_bytes(uri).decode("utf-8", errors="replace")
        tail.append(f"--- {info.instance_id} ({uri}), last {lines} lines ---")
        tail.extend(text.splitlines()[-lines:])
    return tail
