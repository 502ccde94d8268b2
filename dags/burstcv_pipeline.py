"""
# burstcv_pipeline

Validate a new image dataset, rent GPU compute **only for the training run**, destroy it on
completion whatever happens, convert the model to ONNX, and deploy it to the CPU prediction
service **only if** it meets the latency SLO and does not lose accuracy.

| stage | what it does | costs money? |
|---|---|---|
| `plan_scan` | resolves the run (params, prices, budget: run.json), chunks the data | no |
| `scan` (mapped) | a task per chunk: reads, hashes, decodes its files into a manifest part | no |
| `validate` | Great Expectations suite over the joined manifest; fails naming the bad files | no |
| `plan_pack` | cuts the shards into chunks (or skips: nothing new to train on) | no |
| `pack_shards` (mapped) | a task per chunk: decodes its images once into uint8 shards | no |
| `pack` | lists every shard; the training images' mean and std | no |
| `provision` (setup) | starts the training box(es), tagged with this run | **yes, from here** |
| `train` | waits (deferred, no worker slot held) for DONE / FAILED | yes |
| `terminate` (teardown) | terminates every box tagged with the run, bills it | stops it |
| `clean_up_failed_provision` | the same, when provision failed (then no teardown runs) | stops it |
| `export` | checkpoint → ONNX, parity-checked against torch on real images | no |
| `benchmark` | p50/p95/p99 over HTTP through a staging copy of the service | no |
| `gate` | latency SLO, accuracy floor, no regression; registers the version | no |
| `deploy` | moves the `production` alias, verifies the service serves it, else rolls back | no |
| `report` (teardown) | after the boxes end: one HTML page, cost and why it failed included | no |
| `outcome` (teardown) | fails the run when any task failed (a user's mark-failed too) | no |

A run whose validated dataset and training params are those of the production model has
nothing new to train on: `plan_pack` skips with that reason, and nothing after it runs (no GPU is
rented). Set **Force training** to train anyway.

Trigger it with the form (**Trigger**, top right of the DAG page) to change the dataset,
model, budget or gates for one run. Links to a run's Data Docs and report are on the
`validate` and `report` task instances' **Details** tab.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import Asset, AssetOrTimeSchedule, CronTriggerTimetable, dag, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from burstcv.airflow.callbacks import log_failure_summary
from burstcv.airflow.data_stages import SAFE_RETRY, data_stages
from burstcv.airflow.form import trigger_form
from burstcv.airflow.operators import WaitForTrainingOperator
from burstcv.settings import get_settings
from burstcv_spec.contracts import Benchmarked, Exported, Packed, Provisioned, RunRef, VerdictRecord

SETTINGS = get_settings()
# Updating this Asset (an ingestion job, or POST /api/v2/assets/events with
# {"extra": {"dataset_uri": ...}}) starts a run on that dataset.
DATASET = Asset(
    name="burstcv_dataset",
    uri=SETTINGS.dataset_uri if "://" in SETTINGS.dataset_uri else f"file://{SETTINGS.dataset_uri}",
)


# Stage results travel through XCom as JSON, rebuilt and validated (Model.model_validate) by the
# task that receives them. The run's params are resolved once, by plan_scan (run.json).
def _run(run_id: str | None) -> RunRef:
    return RunRef.of(str(run_id))


# Retried: a failed try terminated what it started (no second bill).
@task(
    execution_timeout=timedelta(minutes=15),
    pool=SETTINGS.gpu_pool,
    retries=2,
    retry_delay=timedelta(seconds=30),
)
def provision(
    packed: dict[str, Any], run_id: str | None = None, dag: Any = None, ti: Any = None
) -> dict[str, Any]:
    """Write job.json and start the training box(es), tagged with this run.

    Retried (no capacity yet, a throttled or dropped call) against the first try's
    deadline; a stage error (a setting, the time budget spent) is final.
    """
    from burstcv.stages import boxes

    attempt = int(getattr(ti, "try_number", 1) or 1)
    try:
        return boxes.provision(
            _run(run_id), dag.dag_id, Packed.model_validate(packed), SETTINGS, attempt=attempt
        ).model_dump(mode="json")
    except boxes.StageError as exc:
        raise AirflowFailException(str(exc)) from exc  # retrying cannot fix it


# Airflow runs no teardown for a setup that failed (or whose worker died): this does.
@task(
    execution_timeout=timedelta(minutes=30),
    trigger_rule="one_failed",
    retries=2,
    retry_delay=timedelta(seconds=30),
)
def clean_up_failed_provision(
    params: dict[str, Any] | None = None, run_id: str | None = None
) -> list[str]:
    """Terminate every box tagged with this run when provision failed."""
    from burstcv.stages import boxes, resolve

    run = _run(run_id)
    return boxes.clean_up_provision(run, resolve.run_backend(run, params or {}, SETTINGS), SETTINGS)


@task(execution_timeout=timedelta(minutes=30), **SAFE_RETRY)
def terminate(provisioned: dict[str, Any]) -> dict[str, Any]:
    """Terminate every box tagged with this run and record what it cost."""
    from burstcv.stages.boxes import terminate

    boxes = Provisioned.model_validate(provisioned)
    return terminate(boxes.run, boxes.backend, SETTINGS).model_dump(mode="json")


@task(execution_timeout=timedelta(minutes=30), **SAFE_RETRY)
def export(run_id: str | None = None) -> dict[str, Any]:
    """Convert the run's checkpoint to ONNX and prove it equals torch on real images."""
    from burstcv.stages import export as stage

    return stage.export(_run(run_id), SETTINGS).model_dump(mode="json")


# In a pool of its own: two runs' measurements on one host would measure each other; on
# the CeleryExecutor, on a queue a worker of its own serves (BURSTCV_BENCH_QUEUE). A
# host too busy to measure on fails it as inconclusive (GateInconclusive), and
# the retries measure again later; nothing is judged meanwhile.
@task(
    execution_timeout=timedelta(minutes=30),
    pool=SETTINGS.bench_pool,
    **({"queue": SETTINGS.bench_queue} if SETTINGS.bench_queue else {}),
    **SAFE_RETRY,
)
def benchmark(run_id: str | None = None) -> dict[str, Any]:
    """Measure candidate and production latency, and size the candidate's CPU fleet."""
    from burstcv.stages import benchmark as stage

    return stage.benchmark(_run(run_id), SETTINGS).model_dump(mode="json")


# Retried: a retry finds the version an earlier try registered and keeps its verdict.
@task(execution_timeout=timedelta(minutes=10), **SAFE_RETRY)
def gate(
    exported: dict[str, Any], bench: dict[str, Any], run_id: str | None = None
) -> dict[str, Any]:
    """Judge latency and accuracy, and register the version as accepted or rejected."""
    from burstcv.stages import gate as stage

    return stage.gate(
        _run(run_id), Exported.model_validate(exported), Benchmarked.model_validate(bench), SETTINGS
    ).model_dump(mode="json")


# Retried: a deploy that failed left production as it was; the next try stages again.
@task(execution_timeout=timedelta(minutes=10), **SAFE_RETRY)
def deploy(verdict: dict[str, Any], run_id: str | None = None) -> dict[str, Any]:
    """Move the production alias and verify the service serves the new version."""
    from burstcv.stages import deploy as stage
    from burstcv.stages.resolve import resolved_run

    run, judged = _run(run_id), VerdictRecord.model_validate(verdict)
    promote = resolved_run(run, SETTINGS).params.promote
    if reason := stage.deploy_skip_reason(judged, promote=promote):
        raise AirflowSkipException(reason)
    return stage.deploy(run, judged, SETTINGS).model_dump(mode="json")


# A teardown (all_done once its upstream tasks are): the report is the page that says what
# went wrong, so it runs whatever failed, and after a user marks the run failed too. It waits
# for the boxes' end (terminate writes the bill; clean_up_failed_provision), so it has the cost.
@task(execution_timeout=timedelta(minutes=10), **SAFE_RETRY)
def report(run_id: str | None = None) -> str:
    """Write the run's one-page HTML report (data checks, curves, latency, verdict, cost)."""
    from burstcv.stages import report as stage

    return stage.report(_run(run_id), SETTINGS)


# A teardown, so that it runs even after a user marks the run failed (Airflow skips every
# other pending task then, and leaves the run running until its teardowns are done), and
# counted in the run's state (on_failure_fail_dagrun): without it, an all_done report and
# the skipped rest would end such a run, or one whose deploy failed, as a success.
# Retried when its own worker fails; the failure it reports (AirflowFailException) is final.
@task(execution_timeout=timedelta(minutes=5), **SAFE_RETRY)
def outcome(run_id: str | None = None, dag: Any = None, ti: Any = None) -> None:
    """Fail the run when any of its tasks failed (a user's mark-failed included)."""
    from burstcv.airflow.runs import failed_tasks

    if failed := failed_tasks(dag.dag_id, str(run_id), besides=ti.task_id):
        raise AirflowFailException(f"the run failed: {', '.join(failed)} failed")


@dag(
    dag_id="burstcv_pipeline",
    schedule=(
        AssetOrTimeSchedule(
            timetable=CronTriggerTimetable(SETTINGS.schedule, timezone="UTC"), assets=[DATASET]
        )
        if SETTINGS.schedule
        else [DATASET]
    ),
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    doc_md=__doc__,
    tags=["burstcv", "training", "deploy"],
    # Retries only where a retry is safe (idempotent stages: SAFE_RETRY).
    default_args={"owner": "burstcv", "retries": 0, "on_failure_callback": log_failure_summary},
    on_failure_callback=log_failure_summary,
    # The trigger form: one typed field per RunParams field (burstcv.airflow.form).
    params=trigger_form(SETTINGS),
)
def burstcv_pipeline() -> None:
    """Wire the stages; every task body is one call into a module of burstcv.stages."""

    # validate and pack: a plan, one mapped task per chunk and a join each (data_stages).
    packed = data_stages()
    provisioned = provision(packed)
    trained = WaitForTrainingOperator(
        task_id="train",
        provisioned=provisioned,
        execution_timeout=timedelta(seconds=SETTINGS.train_timeout_s + 600),
        pool=SETTINGS.gpu_pool,  # deferred tasks hold their slot: runs queue for a GPU
        # A lost or interrupted box (spot reclaim) is relaunched by the retry and resumes
        # from its checkpoint; a job that failed by itself fails at once (no retry).
        retries=2,
        retry_delay=timedelta(seconds=15),
        doc_md="Wait (deferred: no worker slot held) for the training job's DONE or FAILED marker.",
    )
    teardown = terminate(provisioned).as_teardown(setups=provisioned)
    provisioned >> trained >> teardown
    # Hung on train (upstream_failed when provision failed): a setup's own downstream tasks
    # must wait for its success. It also runs, harmlessly, when training failed.
    cleaned = clean_up_failed_provision()
    trained >> cleaned
    # Export reads the trained run's folder, the benchmark its exported model: ordering only.
    exported = export()
    trained >> exported
    bench = benchmark()
    exported >> bench
    verdict = gate(exported, bench)
    # After the verdict and the boxes' end: it reads the run's folder (ordering only), the
    # bill terminate writes and the reason training failed included.
    reported = report().as_teardown()
    [verdict, deploy(verdict), teardown, cleaned] >> reported
    reported >> outcome().as_teardown(on_failure_fail_dagrun=True)


burstcv_pipeline()
