"""Start, watch, relaunch and end a run's training boxes, and bill them: every box is tagged
with the run and terminated by that tag."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from burstcv import lineage
from burstcv.compute.attempts import (
    current_attempt,
    launch_attempt,
    measured_boots,
    resumable,
    training_outcome,
    wait_ended,
)
from burstcv.compute.backends import get_backend
from burstcv.compute.base import WORKING
from burstcv.cost.boot import record_boots
from burstcv.cost.budget import relaunch_refusal
from burstcv.params import job_values
from burstcv.settings import Settings, get_settings
from burstcv.stages.resolve import StageError, TrainingFailed, derived, resolved_run, run_layout
from burstcv_spec import storage
from burstcv_spec.contracts import (
    Billing,
    Launch,
    Packed,
    Provisioned,
    RunRef,
    Trained,
    TrainingMetrics,
    TrainingOutcome,
    read_artifact,
    write_artifact,
)

if TYPE_CHECKING:
    from burstcv.training.job import JobSpec

log = logging.getLogger(__name__)


def training_job(
    run: RunRef,
    packed: Packed,
    *,
    deadline_at: datetime | None = None,
    settings: Settings | None = None,
) -> JobSpec:
    """Return the job.json of a run: the packed shards, its model params as validate chose."""
    from burstcv.training.job import JobSpec
    from burstcv.training.weights import weights_store_uri

    s = settings or get_settings()
    resolved = resolved_run(run, s)
    _, training = derived(resolved)
    return JobSpec(
        **job_values(resolved.params, training),
        run_id=run.run_key,
        classes=packed.classes,
        train_shards=packed.train_shards,
        val_shards=packed.val_shards,
        preprocess=packed.preprocess.model_dump(mode="json"),
        output_uri=run_layout(run, s).job,
        weights_store_uri=weights_store_uri(s.artifact_root),
        time_budget_s=resolved.costs.time_budget_s,
        deadline_at=deadline_at,
        source_commit=lineage.source_commit(),
        dataset_fingerprint=packed.fingerprint,
    )


def provision(
    run: RunRef, dag_id: str, packed: Packed, settings: Settings | None = None, *, attempt: int = 1
) -> Provisioned:
    """Write job.json and start the training box(es) for this run.

    The time budget becomes a deadline armed once: a relaunch or a retry (``attempt``, part of
    the launch's idempotency token) launches against the first try's, so no try gets a fresh
    budget. Whatever interrupts the launch (a timeout too), the run's boxes are terminated."""
    from burstcv.training.job import load_job, write_job

    s = settings or get_settings()
    paths = run_layout(run, s)
    resolved = resolved_run(run, s)
    params, costs = resolved.params, resolved.costs
    armed = None  # a retry launches against the deadline the first try armed in its job.json
    if attempt > 1 and storage.exists(paths.job_spec):
        armed = load_job(paths.job_spec).deadline_at
    if armed is not None:
        left_s = (armed - lineage.utc_now()).total_seconds()
        if left_s < MIN_TRAINING_LEFT_S:
            raise StageError(
                f"the run's time budget is spent: its deadline {armed.isoformat()} (armed by "
                f"the first try of provision) leaves {max(0.0, left_s):.0f} s; nothing launched"
            )
    deadline_at = armed or lineage.utc_now() + timedelta(seconds=costs.time_budget_s)
    wheel_uri, wheel_sha256, require_cuda = "", "", False
    if params.compute_backend == "ec2":
        from burstcv.compute.runtime import stage_training_wheel, training_tags

        if not storage.is_s3(s.artifact_root):
            raise StageError(
                "the ec2 backend needs BURSTCV_ARTIFACT_ROOT=s3://bucket/prefix: the training "
                f"box reads its job and writes its results there (now {s.artifact_root!r})"
            )
        tags = training_tags(s.ec2.python, params.instance_types)
        staged = stage_training_wheel(s.artifact_root, tags)
        wheel_uri, wheel_sha256 = staged.uri, staged.sha256
        require_cuda = s.ec2.require_gpu
    job = training_job(run, packed, deadline_at=deadline_at, settings=s).model_copy(
        update={"require_cuda": require_cuda, "runtime_sha256": wheel_sha256}
    )
    job_uri = write_job(job, paths.job_spec)
    launch = Launch(
        run=run,
        dag_id=dag_id,
        job_uri=job_uri,
        time_budget_s=costs.time_budget_s,
        instance_types=list(params.instance_types),
        use_spot=params.use_spot,
        count=params.num_nodes,
        deadline_at=deadline_at,
        wheel_uri=wheel_uri,
        wheel_sha256=wheel_sha256,
        bound_rate=costs.box_rate,
    )
    try:
        ids = launch_attempt(params.compute_backend, launch, paths.job, attempt, s)
    except BaseException:
        log.error("provision of run %s failed; terminating whatever it started", run.airflow_run_id)
        clean_up_provision(run, params.compute_backend, s)
        raise
    return Provisioned(
        run=run,
        job_uri=job_uri,
        output_uri=paths.job,
        instance_ids=ids,
        backend=params.compute_backend,
        launch=launch,  # what a retry of the train task needs to start a box again
    )


MIN_TRAINING_LEFT_S = 120.0  # a retry of provision launches only with this much time left


def clean_up_provision(
    run: RunRef, backend_name: str, settings: Settings | None = None
) -> list[str]:
    """Terminate every box tagged with the run after a failed provision; return their ids
    (Airflow runs no teardown for a setup that failed)."""
    try:
        return get_backend(backend_name, settings).terminate_run(run.run_key)
    # Broad on purpose: logged, not raised over the original failure (which the task reports);
    # the reaper and the AWS-side backstop remain.
    except Exception:
        log.exception(
            "could not clean up run %s on %s; the reaper will", run.airflow_run_id, backend_name
        )
        return []


def relaunch(provisioned: Provisioned, settings: Settings | None = None) -> int:
    """Start the run's next attempt after a lost or interrupted box; return the attempt.

    The new boxes start from the checkpoint once every earlier box has ended (several boxes hold
    one placement group), within the run's deadline, training budget and BURSTCV_MAX_RELAUNCHES
    (boxes that keep vanishing are more likely broken than unlucky)."""
    s = settings or get_settings()
    backend_name, run_key = provisioned.backend, provisioned.run.run_key
    attempt = current_attempt(provisioned.output_uri)
    outcome = training_outcome(
        run_key, backend_name, provisioned.output_uri, attempt, s, provisioned.launch.count
    )
    if outcome.status in ("running", "done"):
        return attempt
    if not resumable(outcome):
        raise TrainingFailed(outcome.line())
    backend = get_backend(backend_name, s)
    still_up = [i.instance_id for i in backend.describe(run_key) if i.state in WORKING]
    if still_up:
        log.warning(
            "run %s: attempt %d ended (%s); terminating its boxes still up %s",
            run_key,
            attempt,
            outcome.line(),
            still_up,
        )
        backend.terminate(still_up)
    launch = provisioned.launch
    deadline = launch.deadline_at
    if lineage.utc_now() >= deadline:
        raise TrainingFailed(
            f"the run's deadline {deadline.isoformat()} has passed; no relaunch after attempt "
            f"{attempt} (raise max_cost_usd or time_budget_s for a longer run)"
        )
    if attempt > s.max_relaunches:
        raise TrainingFailed(
            f"attempt {attempt} ended ({outcome.line()}) and the run has been "
            f"relaunched {attempt - 1} times, its limit; no relaunch (BURSTCV_MAX_RELAUNCHES)"
        )
    from burstcv.compute.billing import record_end, run_bill

    instances = wait_ended(
        backend, run_key, attempt, s.relaunch_wait_s, deadline, terminated=launch.count > 1
    )
    now = lineage.utc_now()
    record_end(provisioned.output_uri, attempt, instances, now)  # the attempt is over
    spent = run_bill(provisioned.output_uri, attempt, now, backend=backend_name).cost_usd
    # Within the training boxes' share: the sizing boxes' reserve (size_on ec2) is theirs.
    refused = relaunch_refusal(resolved_run(provisioned.run, s).costs, spent)
    if refused is not None:
        raise TrainingFailed(refused)
    ids = launch_attempt(backend_name, launch, provisioned.output_uri, attempt + 1, s)
    log.warning(
        "run %s: attempt %d ended (%s); attempt %d on %s resumes from the checkpoint "
        "(spent so far $%.2f)",
        run_key,
        attempt,
        outcome.reason or outcome.status,
        attempt + 1,
        ids,
        spent,
    )
    return attempt + 1


def collect_training(
    run: RunRef, outcome: TrainingOutcome, settings: Settings | None = None
) -> Trained:
    """Turn the training outcome into figures, or raise TrainingFailed with the box's reason.
    How long its boxes took to boot is kept for the budgets of later runs."""
    s = settings or get_settings()
    paths = run_layout(run, s)
    for instance_type, seconds in measured_boots(paths.job, outcome.attempt).items():
        record_boots(s.artifact_root, instance_type, seconds)
    if outcome.status != "done":
        raise TrainingFailed(outcome.line())
    metrics = read_artifact(paths.metrics, TrainingMetrics)
    return Trained(
        model_uri=paths.weights,
        metrics_uri=paths.metrics,
        val_accuracy=metrics.val_accuracy,
        epochs=len(metrics.epochs),
        train_wall_s=metrics.train_wall_s,
        device=metrics.device,
    )


def terminate(run: RunRef, backend_name: str, settings: Settings | None = None) -> Billing:
    """Terminate every instance tagged with the run and write the run's whole bill (its
    training attempts and its sizing boxes) from their launch and end records, never from
    DescribeInstances (it forgets terminated instances in an hour)."""
    from burstcv.compute.billing import record_end, whole_bill

    backend = get_backend(backend_name, settings)
    gone = backend.terminate_run(run.run_key)
    paths = run_layout(run, settings)
    last = current_attempt(paths.job)
    described, now = backend.describe(run.run_key), lineage.utc_now()
    for attempt in range(1, last + 1):
        record_end(paths.job, attempt, described, now)
    bill = whole_bill(paths, now, backend=backend_name, airflow_run_id=run.airflow_run_id)
    unbilled = sorted(set(gone) - set(bill.billed_seconds))
    if unbilled:  # launched without a launch record: nothing says what it cost
        log.warning("no launch record for %s: not in the bill", unbilled)
    billing = bill.model_copy(
        update={
            "instance_ids": bill.instance_ids + unbilled,
            "terminated_at": lineage.utc_now_iso(),
        }
    )
    write_artifact(paths.billing, billing)
    log.info(
        "terminated %s; billed seconds %s; cost $%.4f",
        billing.instance_ids,
        billing.billed_seconds,
        billing.cost_usd,
    )
    return billing
