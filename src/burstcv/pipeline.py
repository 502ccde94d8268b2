"""Implement each pipeline stage as one function: artifacts in the store, typed results out.

The Airflow tasks in dags/ are one-line calls to these functions, and ``burstcv`` CLI verbs
call them too; nothing here imports Airflow. A run is resolved once, by its first stage
(``plan_scan``, through ``resolve_run``): the trigger's params over the defaults, the prices
and the budget, written to the run's run.json; validate adds what it derives from the data.
Every later stage takes the run (``RunRef``) and the typed results of the stages before it,
reads the resolved run (``resolved_run``) and its inputs from the artifact store, and
returns a typed result of references and figures (``burstcv_spec.contracts``), which is all
that travels through XCom.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from burstcv import lineage
from burstcv.compute.attempts import (
    current_attempt,
    launch_attempt,
    resumable,
    training_outcome,
    wait_ended,
)
from burstcv.compute.backends import get_backend
from burstcv.compute.base import WORKING
from burstcv.cost.budget import UnpricedRunError, resolve_costs
from burstcv.cost.model import BudgetTooSmallError
from burstcv.data.imagesize import choose_image_size
from burstcv.data.manifest import read_manifest
from burstcv.links import DAG_ID
from burstcv.params import EXPORT_PARAMS, TRAINING_PARAMS, ResolvedRun, RunParams, job_values
from burstcv.settings import Settings, get_settings
from burstcv_spec import storage
from burstcv_spec.contracts import (
    ArtifactError,
    BenchFigures,
    Benchmarked,
    Billing,
    BoxSizing,
    DataChunk,
    Deployed,
    Exported,
    HostInfo,
    ImageSizeChoice,
    LatencyRecord,
    Launch,
    ModelCard,
    Packed,
    PackedPart,
    PackPlan,
    PreprocessBlock,
    Provisioned,
    RegistryDecision,
    RunRef,
    ScanPlan,
    SizingReport,
    SkipRecord,
    Trained,
    TrainingChoice,
    TrainingMetrics,
    TrainingOutcome,
    Validated,
    VerdictRecord,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import MODEL_CARD, RunLayout
from burstcv_spec.preprocess import PreprocessSpec

if TYPE_CHECKING:  # the training module is imported where it is used: it pulls in torch
    from burstcv.data.pack import ShardOrder
    from burstcv.gate.interference import BusyLimits
    from burstcv.registry.registry import Registry
    from burstcv.training.job import JobSpec

log = logging.getLogger(__name__)

PARITY_IMAGES = 256


class StageError(RuntimeError):
    """Raise when a stage cannot continue; the message is the one-line reason users see."""


class ValidationFailed(StageError):
    """Raise when the dataset fails its checks: nothing that costs money may run after it."""


class TrainingFailed(StageError):
    """Raise when the training box reported FAILED or vanished without a result."""


def run_layout(run: RunRef | str, settings: Settings | None = None) -> RunLayout:
    """Return the folders and files of a run under the configured artifact root."""
    s = settings or get_settings()
    return RunLayout.of(s.artifact_root, run.run_key if isinstance(run, RunRef) else run)


# ---------------------------------------------------------------------------------------------
# the run, resolved once


def resolve_run(
    run: RunRef, params: RunParams, settings: Settings | None = None, *, trigger: str = "cli"
) -> ResolvedRun:
    """Resolve the run once and write it to run.json: its params, prices and budget.

    The checks that need no data come first (the compute, the weights, the prices and the
    budget): a run that cannot be had or priced fails here, before anything is rented.
    Raises ValidationFailed with the one-line reason.
    """
    s = settings or get_settings()
    try:
        params.check_compute()
        params.check_weights()  # the form cannot check weights; fail before renting anything
        costs = resolve_costs(params, s)
    except (ValueError, UnpricedRunError, BudgetTooSmallError) as exc:
        raise ValidationFailed(str(exc)) from exc
    log.info("budget: %s", costs.budget_reason)
    resolved = ResolvedRun(
        run_id=run.airflow_run_id,
        trigger=trigger,
        started_at=lineage.utc_now_iso(),
        params=params,
        costs=costs,
    )
    write_artifact(run_layout(run, s).record, resolved)
    return resolved


def resolved_run(run: RunRef | str, settings: Settings | None = None) -> ResolvedRun:
    """Return the run as its first task resolved it (run.json), with what validate added."""
    uri = run_layout(run, settings).record
    if not storage.exists(uri):
        raise StageError(f"{uri} does not exist: the run's first task (plan_scan) resolves it")
    return read_artifact(uri, ResolvedRun)


def run_backend(run: RunRef, given: dict[str, Any], settings: Settings | None = None) -> str:
    """Return the run's compute backend: as resolved, or (no run.json: the run was refused
    before anything was rented) as the trigger gave it, whatever its other values."""
    if storage.exists(run_layout(run, settings).record):
        return resolved_run(run, settings).params.compute_backend
    return RunParams.backend_of(given, settings)


# ---------------------------------------------------------------------------------------------
# validate → pack


def plan_scan(
    run: RunRef, params: RunParams, settings: Settings | None = None, *, trigger: str = "cli"
) -> ScanPlan:
    """Resolve the run (``resolve_run``), list the dataset and cut it into scan chunks.

    Raises ValidationFailed for a run that cannot be had or priced, and for an unusable
    dataset.
    """
    from burstcv.data.chunks import MB, chunk_cap
    from burstcv.data.chunks import plan_scan as plan_dataset_scan
    from burstcv.data.validate import DatasetUnusableError

    s = settings or get_settings()
    paths = run_layout(run, s)
    resolve_run(run, params, s, trigger=trigger)
    try:
        plan = plan_dataset_scan(
            params.dataset_uri,
            paths.scan,
            paths.scan_part,
            max_files=params.chunk_files,
            max_bytes=params.chunk_mb * MB,
            max_chunks=chunk_cap(map_limit()),
        )
    except DatasetUnusableError as exc:
        raise ValidationFailed(f"dataset {params.dataset_uri} is unusable: {exc}") from exc
    log.info(
        "listed %d files (%.1f MB) of %s: %d scan chunk(s)",
        plan.files,
        plan.bytes / MB,
        params.dataset_uri,
        len(plan.chunks),
    )
    write_artifact(paths.scan_plan, plan)
    return plan


# Airflow's [core] max_map_length when its configuration cannot be read: its default.
AIRFLOW_MAP_LIMIT = 1024


def map_limit() -> int:
    """Return how many tasks Airflow maps over one list at most (``[core] max_map_length``)."""
    try:
        from airflow.configuration import conf

        return conf.getint("core", "max_map_length", fallback=AIRFLOW_MAP_LIMIT)
    # Broad on purpose: an Airflow that cannot be configured here has its default limit.
    except Exception:
        return AIRFLOW_MAP_LIMIT


def worker_task_slots() -> int:
    """Return the task slots of this Airflow worker: a CeleryExecutor's worker_concurrency,
    else 1 (this process is the only task the count is for)."""
    try:
        from airflow.configuration import conf

        if "Celery" not in conf.get("core", "executor", fallback=""):
            return 1
        return max(1, conf.getint("celery", "worker_concurrency"))
    # Broad on purpose: no readable Airflow configuration, no other slots known.
    except Exception:
        return 1


def task_processes(settings: Settings) -> int:
    """Return the processes one data task may run: BURSTCV_TASK_PROCESSES, else this host's
    usable CPUs shared between the worker's task slots (at least one)."""
    from burstcv.data.scanner.dispatch import usable_cpus

    if settings.task_processes:
        return settings.task_processes
    return max(1, usable_cpus() // worker_task_slots())


def scan_chunk(run: RunRef, chunk: DataChunk, settings: Settings | None = None) -> int:
    """Scan one chunk of the run's listing into its manifest part; return its files.

    Its process pool takes the CPUs one task slot may use (``task_processes``), so a
    worker's slots running chunks side by side do not oversubscribe its cores.
    """
    from burstcv.data.chunks import scan_chunk as scan_dataset_chunk

    s = settings or get_settings()
    params = resolved_run(run, s).params
    plan = read_artifact(run_layout(run, s).scan_plan, ScanPlan)
    files = scan_dataset_chunk(
        plan, chunk, params.validation_config(), max_workers=task_processes(s)
    )
    log.info("scanned chunk %d of %d: %d files", chunk.index + 1, len(plan.chunks), files)
    return files


def validate(
    run: RunRef, settings: Settings | None = None, *, params: RunParams | None = None
) -> Validated:
    """Run the dataset checks; raise ValidationFailed naming the failed checks and files.

    With ``params``, the run is resolved and its plan made and each chunk scanned here, one
    after another (the command line); without, the DAG's tasks did that already. The checks
    run once over the joined manifest. What validate derives from the data that passed (the
    image size, the training recipe) is added to the run's run.json.
    """
    from burstcv.data.chunks import join_scan
    from burstcv.data.validate import DatasetUnusableError, summary, validate_scanned

    s = settings or get_settings()
    paths = run_layout(run, s)
    if params is None:
        plan = read_artifact(paths.scan_plan, ScanPlan)
    else:
        plan = plan_scan(run, params, s)
        for chunk in plan.chunks:
            scan_chunk(run, chunk, s)
    resolved = resolved_run(run, s)
    try:
        record = validate_scanned(
            plan.dataset_uri,
            paths.dataset,
            join_scan(plan),
            plan.ignored,
            resolved.params.validation_config(),
            history_uri=storage.join(s.artifact_root, "datasets"),
        )
    except DatasetUnusableError as exc:
        raise ValidationFailed(f"dataset {plan.dataset_uri} is unusable: {exc}") from exc
    if not record.success:
        raise ValidationFailed(summary(record))  # logged once, as the task's failure
    log.info("%s", summary(record))
    manifest = read_manifest(record.manifest_uri)
    try:
        size = choose_image_size(manifest, resolved.params.image_size)
        usable = manifest[manifest["decode_ok"].astype(bool)]
        training = choose_training(
            resolved.params,
            train_images=int((usable["split"] == "train").sum()),
            photos=size.resize_short is not None,
            settings=s,
        )
    except ValueError as exc:
        raise ValidationFailed(str(exc)) from exc
    log.info("image size %d px: %s", size.px, size.reason)
    log.info("training: %s", training.reason)
    if training.warning:
        log.warning("%s", training.warning)
    write_artifact(paths.validation, record)
    write_artifact(
        paths.record, resolved.model_copy(update={"image_size": size, "training": training})
    )
    return Validated(
        fingerprint=record.fingerprint,
        manifest_uri=record.manifest_uri,
        validation_uri=paths.validation,
        data_docs_uri=record.data_docs_uri,
    )


def choose_training(
    params: RunParams, *, train_images: int, photos: bool, settings: Settings | None = None
) -> TrainingChoice:
    """Return how the run will train: its explicit values, the rest derived from the data.

    The recipe (``burstcv.training.recipe``) follows the training split's size and whether
    the images are photos; ``pretrained=auto`` fetches the model's ImageNet weights into the
    artifact store for photos, or falls back to training from scratch with a warning. Raises
    ValueError when the chosen weights cannot seed the chosen model.
    """
    from burstcv.training.names import MODEL_AUTO, pretrained_kind
    from burstcv.training.recipe import RecipeRequest, choose_recipe

    s = settings or get_settings()
    recipe = choose_recipe(
        train_images,
        photos=photos,
        request=RecipeRequest(
            model=None if params.model == MODEL_AUTO else params.model,
            batch_size=params.batch_size,
            learning_rate=params.learning_rate,
            epochs=params.epochs,
            optimizer=None if params.optimizer == "auto" else params.optimizer,
            warmup_steps=params.warmup_steps,
            early_stop_patience=params.early_stop_patience,
            batch_scaling=params.batch_scaling,
            nodes=params.num_nodes,
        ),
    )
    derived, reason, warning = list(recipe.derived), recipe.reason, None
    pretrained = params.pretrained
    if pretrained_kind(pretrained) == "auto":
        from burstcv.training.weights import auto_pretrained, weights_store_uri

        auto = auto_pretrained(
            recipe.model, photos=photos, store=weights_store_uri(s.artifact_root)
        )
        pretrained, warning = auto.pretrained, auto.warning
        derived.append("pretrained")
        reason = f"weights {auto.reason}; {reason}"
    if params.model == MODEL_AUTO or params.pretrained != pretrained:
        params.check_weights(recipe.model, pretrained)  # what the form could not check
    return TrainingChoice(
        model=recipe.model,
        pretrained=pretrained,
        batch_size=recipe.batch_size,
        learning_rate=recipe.learning_rate,
        epochs=recipe.epochs,
        optimizer=recipe.optimizer,
        warmup_steps=recipe.warmup_steps,
        early_stop_patience=recipe.early_stop_patience,
        derived=derived,
        reason=reason,
        warning=warning,
    )


def _derived(resolved: ResolvedRun) -> tuple[ImageSizeChoice, TrainingChoice]:
    """Return what validate derived from the data (run.json), or raise StageError."""
    if resolved.image_size is None or resolved.training is None:
        raise StageError(
            f"run {resolved.run_id} has no image size or training recipe in its run.json: "
            "validate chooses them (run validate first)"
        )
    return resolved.image_size, resolved.training


def _auto_choices(training: TrainingChoice | None) -> dict[str, Any]:
    """Return what validate chose for each param left on auto (none before validate)."""
    if training is None:
        return {}
    return training.model_dump(include=set(training.derived) & set(RunParams.model_fields))


def _as_chosen(name: str, value: Any, chosen: dict[str, Any]) -> Any:
    """Return ``value`` as the run trains it: auto (empty, or "auto") is what validate chose.

    The same data and the same other params make the same choice, so a run on auto and a
    recorded run that named the value auto chose are one choice, either way round.
    """
    if name in chosen and (value is None or value == "auto"):
        return chosen[name]
    return value


def nothing_new_to_train(
    run: RunRef, validated: Validated, *, settings: Settings | None = None
) -> str | None:
    """Return why this run need not train (it would remake production), or None to train.

    Production was made from the same validated data (its dataset fingerprint) with the same
    params that matter (``TRAINING_PARAMS``, ``EXPORT_PARAMS`` and the eval transform): a new
    run would rent a GPU to rebuild the model already serving. The reason is logged and
    written to runs/<id>/skip.json for the report and the Models page. ``force_train`` in
    the params, or a production version without recorded params, always trains.
    """
    from burstcv.registry.registry import PRODUCTION, Registry

    s = settings or get_settings()
    resolved = resolved_run(run, s)
    params, size = resolved.params, resolved.image_size
    if size is None:
        raise StageError(f"run {resolved.run_id} has no image size in its run.json: validate first")
    registry = Registry(s.registry_uri, s.model_name)
    alias = registry.get_alias(PRODUCTION)
    if alias is None:
        return None
    entry = registry.entry(alias.version)
    if entry.lineage.dataset_fingerprint != validated.fingerprint:
        return None
    if params.force_train:
        log.info(
            "the dataset is production v%d's (fingerprint %s); training anyway: force_train",
            alias.version,
            validated.fingerprint[:12],
        )
        return None
    recorded = entry.params
    if recorded is None:
        return None  # registered outside the pipeline: what made it is unknown
    mine = params.model_dump(mode="json")
    # A param production's record lacks (added since) had its default then.
    defaults = RunParams.defaults(s)
    chosen = _auto_choices(resolved.training)
    differing = [
        k
        for k in TRAINING_PARAMS + EXPORT_PARAMS
        if _as_chosen(k, recorded.get(k, defaults.get(k)), chosen)
        != _as_chosen(k, mine.get(k), chosen)
    ]
    preprocess = registry.model_card(alias.version).preprocess
    if (preprocess.height, preprocess.width, preprocess.resize_short) != (
        size.px,
        size.px,
        size.resize_short,
    ):
        differing.append("image size")
    if differing:
        log.info(
            "the dataset is production v%d's, but %s differ: training",
            alias.version,
            ", ".join(differing),
        )
        return None
    same = ", ".join(
        f"{k} {mine[k]}"
        for k in TRAINING_PARAMS + EXPORT_PARAMS
        if mine.get(k) not in (None, []) and not (k == "pretrained" and mine[k] == "none")
    )
    reason = (
        f"nothing new to train on: the validated dataset (fingerprint "
        f"{validated.fingerprint[:12]}) and the params that matter ({same}, image size "
        f"{size.px} px) are those of production version {alias.version} (run "
        f"{entry.lineage.run_id or '?'}); no compute was rented. Trigger "
        "with force_train to train anyway."
    )
    write_artifact(
        run_layout(run, s).skip,
        SkipRecord(
            reason=reason,
            production_version=alias.version,
            fingerprint=validated.fingerprint,
            decided_at=lineage.utc_now_iso(),
        ),
    )
    log.info("%s", reason)
    return reason


def shard_order(resolved: ResolvedRun, validated: Validated) -> ShardOrder:
    """Return the shard layout of the validated images (``burstcv.data.pack.shard_order``)."""
    from burstcv.data.pack import shard_order as order_of

    size, _ = _derived(resolved)
    return order_of(
        read_manifest(validated.manifest_uri),
        size.spec(),
        classes=resolved.params.expected_classes or None,
        margin=size.resize_short is not None,
    )


def _stored_spec(resolved: ResolvedRun) -> PreprocessSpec:
    """Return how the shards store each image: validate's size, with the margin for photos
    (as ``shard_order`` stores them)."""
    from burstcv_spec.preprocess import margin_spec

    size, _ = _derived(resolved)
    return margin_spec(size.spec()) if size.resize_short is not None else size.spec()


def plan_pack(run: RunRef, validated: Validated, settings: Settings | None = None) -> PackPlan:
    """Cut the validated images' shards into chunks (``chunk_files``, ``chunk_mb``) of whole
    shards: each shard is the one a one-pass pack writes, whichever task writes it.
    """
    from burstcv.data.chunks import MB, chunk_cap, data_chunks, ranges_within
    from burstcv.data.pack import choose_format, shard_rows

    paths = run_layout(run, settings)
    resolved = resolved_run(run, settings)
    params = resolved.params
    order = shard_order(resolved, validated)
    runs, _, _ = ranges_within(
        order.sizes(), params.chunk_files, params.chunk_mb * MB, chunk_cap(map_limit())
    )

    def rows_of(index: int, start: int, stop: int) -> str:
        # Each chunk's images, written once here: its task reads them, not the whole manifest.
        shards = [order.shard(n) for n in range(start, stop)]
        return storage.write_bytes(paths.pack_rows(index), shard_rows(shards))

    chunks = data_chunks(runs, paths.pack_part, rows_of)
    log.info(
        "%d shard(s) of %d images in %d pack chunk(s)", order.total, order.per_shard, len(chunks)
    )
    plan = PackPlan(
        shards=order.total,
        images_per_shard=order.per_shard,
        shard_format=choose_format((settings or get_settings()).shard_format, order.spec),
        classes=order.classes,
        chunks=chunks,
    )
    write_artifact(paths.pack_plan, plan)
    return plan


def pack_chunk(
    run: RunRef, validated: Validated, chunk: DataChunk, settings: Settings | None = None
) -> PackedPart:
    """Decode one chunk's shards and write them, and the chunk's part record."""
    from burstcv.data.pack import pack_shards, read_shard_rows

    paths = run_layout(run, settings)
    plan = read_artifact(paths.pack_plan, PackPlan)
    resolved = resolved_run(run, settings)
    if chunk.listing_uri:  # the chunk's own images, from the plan
        shards = read_shard_rows(storage.read_bytes(chunk.listing_uri))
        spec = _stored_spec(resolved)
    else:  # a plan from before them: the whole manifest, ordered again
        order = shard_order(resolved, validated)
        shards, spec = [order.shard(n) for n in range(chunk.start, chunk.stop)], order.spec
    part = pack_shards(
        shards,
        spec,
        plan.classes,
        paths.shards,
        index=chunk.index,
        shard_format=plan.shard_format,
    )
    write_artifact(chunk.part_uri, part)
    log.info(
        "packed chunk %d: shards %d-%d, %s", chunk.index, chunk.start, chunk.stop - 1, part.counts
    )
    return part


def pack(
    run: RunRef,
    validated: Validated,
    *,
    settings: Settings | None = None,
    packed_chunks: bool = False,
) -> Packed:
    """Join the packed chunks into the run's shards and fix the preprocessing spec.

    Images are stored at the size validate chose; photos with the margin training's random
    crops draw from (the centre of each stored image is exactly the eval transform).
    ``packed_chunks``: the run's plan was made and each chunk packed already (the DAG's
    mapped tasks); else they are, here, one after another.
    """
    from burstcv.data.pack import join_parts
    from burstcv.training.weights import normalization

    if packed_chunks:
        plan = read_artifact(run_layout(run, settings).pack_plan, PackPlan)
    else:
        plan = plan_pack(run, validated, settings)
        for chunk in plan.chunks:
            pack_chunk(run, validated, chunk, settings)
    parts = []
    for chunk in plan.chunks:
        if not storage.exists(chunk.part_uri):
            raise StageError(f"pack chunk {chunk.index} wrote no {chunk.part_uri} (did it run?)")
        parts.append(read_artifact(chunk.part_uri, PackedPart))
    size, training = _derived(resolved_run(run, settings))
    size_only = size.spec()
    packed = join_parts(parts, size_only, plan.classes, validated.fingerprint, plan.shard_format)
    log.info(
        "packed %s into %d shard(s), training shards %s",
        packed.counts,
        plan.shards,
        plan.shard_format,
    )
    # From scratch: the training split's own statistics (a model converges faster on centred
    # inputs). Pretrained: the weights' own. Recorded in the spec that serving reads.
    stats = packed.preprocess
    mean, std = normalization(training.model, training.pretrained, stats.mean, stats.std)
    spec = dataclasses.replace(size_only, mean=mean, std=std)
    return packed.model_copy(update={"preprocess": PreprocessBlock.of(spec)})


# ---------------------------------------------------------------------------------------------
# provision → train → terminate


def training_job(
    run: RunRef,
    packed: Packed,
    *,
    deadline_at: datetime | None = None,
    settings: Settings | None = None,
) -> JobSpec:
    """Return the job.json of a run: the packed shards, its model params as validate chose.

    Every model param reaches the job (``burstcv.params.job_values``): a new one is declared
    once in RunParams and used in training. ``deadline_at`` is the run's absolute deadline
    (provision sets it from the resolved time budget).
    """
    from burstcv.training.job import JobSpec
    from burstcv.training.weights import weights_store_uri

    s = settings or get_settings()
    resolved = resolved_run(run, s)
    _, training = _derived(resolved)
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
    run: RunRef,
    dag_id: str,
    packed: Packed,
    settings: Settings | None = None,
    *,
    attempt: int = 1,
) -> Provisioned:
    """Write job.json and start the training box(es) for this run.

    The run's resolved time budget (run.json: bounded so that ``num_nodes`` boxes stay in the
    money budget) becomes an absolute deadline here, shared by every attempt, so a relaunch
    never gets a fresh budget, and neither does a retry of this task: its first try armed the
    deadline in job.json, and a later try launches against that one (the boxes of a failed
    try were terminated, so the run's boxes never overlap and the bill stays in the budget).
    For EC2 the training wheel is staged first and its sha256 written into job.json.
    ``attempt`` is the try of this task (markers are per attempt, and it is part of the
    launch's idempotency token). Whatever interrupts the launch, a task timeout included, the
    run's boxes are terminated by tag before the failure goes on.
    """
    from burstcv.training.job import write_job

    s = settings or get_settings()
    paths = run_layout(run, s)
    resolved = resolved_run(run, s)
    params, costs = resolved.params, resolved.costs
    armed = armed_deadline(paths.job_spec, attempt)
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
        from burstcv.compute.runtime import stage_training_wheel

        if not storage.is_s3(s.artifact_root):
            raise StageError(
                "the ec2 backend needs BURSTCV_ARTIFACT_ROOT=s3://bucket/prefix: the training "
                f"box reads its job and writes its results there (now {s.artifact_root!r})"
            )
        staged = stage_training_wheel(s.artifact_root)
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


def armed_deadline(job_spec_uri: str, attempt: int) -> datetime | None:
    """Return the deadline an earlier try of provision armed (its job.json), or None on the
    first try (or when no earlier try got as far as writing it)."""
    from burstcv.training.job import load_job

    if attempt <= 1 or not storage.exists(job_spec_uri):
        return None
    return load_job(job_spec_uri).deadline_at


def clean_up_provision(
    run: RunRef, backend_name: str, settings: Settings | None = None
) -> list[str]:
    """Terminate every box tagged with the run after a failed provision; return their ids.

    Airflow runs no teardown for a setup task that failed (or whose worker died), so the
    pipeline DAG calls this from its own clean-up task; ``provision`` calls it on a failure
    it lives to see. A failure here is logged, not raised over the original one: the reaper
    and the AWS-side backstop remain.
    """
    try:
        backend = get_backend(backend_name, settings)
        return backend.terminate_run(run.run_key)
    # Broad on purpose: logged; the original failure is what the task reports.
    except Exception:
        log.exception(
            "could not clean up run %s on %s; the reaper will", run.airflow_run_id, backend_name
        )
        return []


def relaunch(provisioned: Provisioned, settings: Settings | None = None) -> int:
    """Start the run's next attempt after a lost or interrupted box; return the attempt.

    The job resumes from its last checkpoint. While the attempt still has a working box and no
    marker, or once it is done, nothing starts and its own number comes back. An attempt that
    ended resumable (its boxes shutting down, stopped or gone without a marker, or a resumable
    FAILED) is relaunched; any of its boxes still up is terminated first (its checkpoint is
    written before the marker), and the new boxes start once every earlier box has ended
    (terminated, for a run of several boxes: they hold its placement group), waiting
    BURSTCV_RELAUNCH_WAIT_S at most. A final failure raises TrainingFailed with the box's
    reason.

    Relaunches are bounded by the run, not the attempt: past the run's deadline, once its boxes
    (every box of every attempt) have cost max_cost_usd, or after BURSTCV_MAX_RELAUNCHES
    relaunches (a run whose boxes keep vanishing is more likely broken than unlucky), nothing
    is relaunched (TrainingFailed).
    """
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
    instances = backend.describe(run_key)
    still_up = [i.instance_id for i in instances if i.state in WORKING]
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
    # The training boxes' share: the sizing boxes' reserve (size_on ec2) is kept for them.
    budget = resolved_run(provisioned.run, s).costs.training_usd
    if spent >= budget:
        raise TrainingFailed(
            f"the run's boxes have cost ${spent:.2f} of its ${budget:.2f} training budget; "
            "no relaunch"
        )
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
    """Turn the training outcome into figures, or raise TrainingFailed with the box's reason."""
    if outcome.status != "done":
        raise TrainingFailed(outcome.line())
    return trained(run, settings)


def trained(run: RunRef, settings: Settings | None = None) -> Trained:
    """Return the figures of the run's trained model, from metrics.json."""
    paths = run_layout(run, settings)
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
    """Terminate every instance tagged with the run and record billed seconds and cost.

    The bill comes from the attempts' launch and end records (each attempt's end written now
    if it has none), never from DescribeInstances, which forgets terminated instances after
    about an hour: the same rule as the budget and the progress lines (``run_bill``).
    """
    from burstcv.compute.billing import record_end, run_bill

    backend = get_backend(backend_name, settings)
    gone = backend.terminate_run(run.run_key)
    job_dir = run_layout(run, settings).job
    last = current_attempt(job_dir)
    described, now = backend.describe(run.run_key), lineage.utc_now()
    for attempt in range(1, last + 1):
        record_end(job_dir, attempt, described, now)
    bill = run_bill(job_dir, last, now, backend=backend_name, airflow_run_id=run.airflow_run_id)
    unbilled = sorted(set(gone) - set(bill.billed_seconds))
    if unbilled:  # launched without a launch record: nothing says what it cost
        log.warning("no launch record for %s: not in the bill", unbilled)
    billing = bill.model_copy(
        update={
            "instance_ids": bill.instance_ids + unbilled,
            "terminated_at": lineage.utc_now_iso(),
        }
    )
    write_artifact(run_layout(run, settings).billing, billing)
    log.info(
        "terminated %s; billed seconds %s; cost $%.4f",
        billing.instance_ids,
        billing.billed_seconds,
        billing.cost_usd,
    )
    return billing


# ---------------------------------------------------------------------------------------------
# export → benchmark → gate → deploy


def _val_rows(manifest_uri: str, limit: int | None = None) -> list[tuple[str, str, str]]:
    df = read_manifest(manifest_uri)
    df = df[(df["split"] == "val") & df["decode_ok"].astype(bool)].sort_values("path")
    rows = list(zip(df["path"], df["uri"], df["label"].astype(str), strict=True))
    return rows[:limit] if limit else rows


def export(
    run: RunRef, settings: Settings | None = None, *, overrides: dict[str, Any] | None = None
) -> Exported:
    """Export the run's trained weights to ONNX, proven equal to torch on real validation images.

    Everything comes from the run's folder: the job as trained (classes, shards,
    preprocessing, dataset), its metrics and weights, the validated manifest, and the export
    params as the run resolved them (``overrides``: export params to use instead, as the
    command line's ``burstcv export`` gives them).
    """
    from burstcv.export.onnx_export import export_model
    from burstcv.training.job import load_job

    s = settings or get_settings()
    paths = run_layout(run, s)
    params = resolved_run(run, s).params
    if overrides:
        params = RunParams.model_validate({**params.model_dump(), **overrides})
    job = load_job(paths.job_spec)
    images = [
        (path, storage.read_bytes(uri)) for path, uri, _ in _val_rows(paths.manifest, PARITY_IMAGES)
    ]
    metrics = read_artifact(paths.metrics, TrainingMetrics)
    int8_inputs: dict[str, Any] = {}
    if params.int8:
        from burstcv.export.quantize import CALIBRATION_IMAGES
        from burstcv.training.stream import sample_split

        train_x, _ = sample_split(job.train_shards, job.classes, CALIBRATION_IMAGES)
        val_x, val_labels = _val_arrays(job.val_shards, job.classes, s.eval_max_images)
        int8_inputs = {
            "int8": True,
            "calibration_images_u8": train_x,
            "eval_images_u8": val_x,
            "eval_labels": val_labels,
            "max_accuracy_drop": params.int8_max_accuracy_drop,
        }
    card = export_model(
        checkpoint_uri=paths.weights,
        out_uri=paths.model,
        arch=metrics.arch,  # as trained (auto resolved)
        classes=job.classes,
        spec=PreprocessSpec.from_dict(job.preprocess),
        parity_images=images,
        name=s.model_name,
        opset=s.onnx_opset,
        max_abs_diff=s.parity_max_abs_diff,
        metrics={"val_accuracy": metrics.val_accuracy, "val_loss": metrics.val_loss},
        dataset_fingerprint=job.dataset_fingerprint,
        run_id=run.airflow_run_id,
        pretrained=metrics.pretrained,  # as trained: the stem depends on it
        **int8_inputs,
    )
    assert card.parity is not None  # export_model always checks parity
    return Exported(
        model_dir=paths.model,
        sha256=card.sha256,
        parity_max_abs_diff=card.parity.max_abs_diff,
        onnx_file=card.onnx_file,
        quantization=card.quantization,
    )


def _val_arrays(
    val_shards: list[str], classes: list[str], limit: int
) -> tuple[np.ndarray, list[str]]:
    from burstcv.training.stream import sample_split

    images, labels = sample_split(val_shards, classes, limit)
    return images, [classes[i] for i in labels]


class GateInconclusive(RuntimeError):
    """The benchmark could not measure the model: the host stayed busy. Nothing was judged.

    The task fails (and Airflow retries it); the model is neither registered nor rejected.
    """


def busy_limits(s: Settings) -> BusyLimits:
    """Return the interference limits this deployment measures under (``BURSTCV_BENCH_*``)."""
    from burstcv.gate.interference import BusyLimits

    return BusyLimits(
        others_share=s.bench_busy_share,
        slowdown=s.bench_busy_slowdown,
        attempts=s.bench_attempts,
        backoff_s=s.bench_busy_backoff_s,
    )


def benchmark(run: RunRef, settings: Settings | None = None) -> Benchmarked:
    """Measure candidate and production side by side through staging services (latency.json).

    The candidate is the run's exported model; accuracy is scored on the validation shards
    of the job as trained, the requests are validated images of the run's manifest. The
    candidate's CPU fleet is sized too (sizing.json): the rate each CPU size sustains within
    the run's ``latency_slo_ms``, and the cheapest fleet for its ``target_rps``, at the
    serving prices the run resolved. The staging services shed only what queued past the SLO.

    Each measurement records how busy the host was (``burstcv.gate.interference``) and is
    repeated while the host is busy; a host busy through every attempt makes the benchmark
    inconclusive (:class:`GateInconclusive`, latency.json says why), never a rejection.
    """
    from burstcv.gate.accuracy import onnx_accuracy
    from burstcv.gate.interference import (
        HostBusyError,
        Placement,
        QuietFigure,
        measure_quietly,
        running_on,
    )
    from burstcv.gate.latency import (
        bare_onnxruntime_p50,
        drive_paired,
        materialise_model,
        staging_process,
    )
    from burstcv.gate.sizing import (
        GateLoad,
        SizesMemo,
        gate_load,
        host_cpus,
        sizing_placement,
        speed_key,
    )
    from burstcv.registry.registry import PRODUCTION, Registry
    from burstcv.training.job import load_job
    from burstcv_spec.preprocess import eval_view, normalize

    s = settings or get_settings()
    paths = run_layout(run, s)
    resolved = resolved_run(run, s)
    slo_ms = resolved.params.latency_slo_ms
    job = load_job(paths.job_spec)
    request_images = [storage.read_bytes(uri) for _, uri, _ in _val_rows(paths.manifest, 64)]
    val_x, val_labels = _val_arrays(job.val_shards, job.classes, s.eval_max_images)
    registry = Registry(s.registry_uri, s.model_name)
    prod_alias = registry.get_alias(PRODUCTION)
    measured_at, host = lineage.utc_now_iso(), HostInfo.model_validate(lineage.host_description())
    limits, quiet = busy_limits(s), QuietFigure(Path(s.home) / "bench" / "calibration.json")
    results: dict[str, BenchFigures] = {}
    timings: dict[str, float] = {}
    load_at: GateLoad | None = None

    def record(inconclusive: str | None = None) -> str:
        return write_artifact(
            paths.latency,
            LatencyRecord(
                measured_at=measured_at,
                host=host,
                requests=load_at.requests if load_at else 0,
                concurrency=max((f.concurrency for f in results.values()), default=0),
                offered_rps=load_at.rate_rps if load_at else None,
                load_note=load_at.note if load_at else None,
                candidate=results.get("candidate"),
                production=results.get("production"),
                inconclusive=inconclusive,
                bench_s=timings.get("bench_s"),
                sizing_s=timings.get("sizing_s"),
            ),
        )

    def inconclusive(exc: HostBusyError[Any]) -> GateInconclusive:
        reason = str(exc)
        record(reason)
        log.error("gate inconclusive, nothing judged: %s", reason)
        return GateInconclusive(
            f"gate inconclusive: {reason}. The model was not judged; the benchmark is tried "
            "again (BURSTCV_BENCH_ATTEMPTS, BURSTCV_BENCH_BUSY_SHARE set how hard)"
        )

    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        models = {"candidate": materialise_model(paths.model, Path(tmp) / "candidate")}
        if prod_alias is not None:
            models["production"] = materialise_model(
                registry.version_uri(prod_alias.version), Path(tmp) / "production"
            )
        card = read_artifact(str(Path(models["candidate"]) / MODEL_CARD), ModelCard)
        key = speed_key(
            card,
            latency_slo_ms=slo_ms,
            host=host.model_dump(mode="json"),
            max_vcpus=s.sizing_max_vcpus or None,
            duration_s=s.sizing_step_s,
        )
        memo = SizesMemo(Path(s.home) / "bench" / "sizing")
        earlier = None if s.sizing_remeasure else memo.get(key)
        if earlier is not None:
            sizing = _size_fleet(str(models["candidate"]), request_images, resolved, s, earlier)
            log.info(
                "sizing: reused the sizes run %s measured (same speed key %s: architecture, "
                "input, preprocessing, host, SLO); BURSTCV_SIZING_REMEASURE=true measures again",
                earlier.measured_in,
                key,
            )
        else:
            sizing_place = sizing_placement(s.sizing_max_vcpus or None)
            try:
                sizing, sizing_load = measure_quietly(
                    "fleet sizing",
                    lambda: _size_fleet(str(models["candidate"]), request_images, resolved, s),
                    limits=limits,
                    quiet=quiet,
                    cpus=sizing_place.service,
                    isolated=sizing_place.isolated,
                )
            except HostBusyError as exc:
                timings["sizing_s"] = round(time.monotonic() - started, 1)
                # Kept for the report, marked busy: they measured the neighbours.
                write_artifact(
                    paths.sizing, exc.last.model_copy(update={"host_load": exc.loads[-1]})
                )
                raise inconclusive(exc) from None
            sizing = sizing.model_copy(
                update={
                    "host_load": sizing_load,
                    "speed_key": key,
                    "measured_in": run.airflow_run_id,
                }
            )
            memo.put(sizing)
        if resolved.costs.sizing is not None:  # size_on ec2: the candidates on their own boxes
            sizing = size_fleet_on_boxes(run, resolved, s, sizing, request_images)
        timings["sizing_s"] = round(time.monotonic() - started, 1)
        started = time.monotonic()
        # The staging services run on CPUs of their own, the load generator (this process)
        # on another: the window counts whatever else ran on the services' CPUs.
        place = Placement.split(host_cpus())
        # Open-loop, at the load one replica of the sized fleet carries (or the rate set).
        load_at = gate_load(
            sizing,
            len(place.service),
            requests=s.bench_requests,
            max_s=s.bench_max_s,
            rate_rps=s.bench_rate_rps,
        )
        log.info(
            "latency benchmark: %d requests per model at %.1f req/s, open loop: %s",
            load_at.requests,
            load_at.rate_rps,
            load_at.note,
        )
        with contextlib.ExitStack() as services:
            urls, pids = {}, []
            for label, folder in models.items():
                url, proc = services.enter_context(
                    staging_process(str(folder), cpus=place.service, queue_delay_target_ms=slo_ms)
                )
                urls[label] = url
                pids.append(proc.pid)

            def load() -> dict[str, BenchFigures]:
                with running_on(place.generator):
                    return drive_paired(
                        urls,
                        request_images,
                        requests=load_at.requests,
                        rate_rps=load_at.rate_rps,
                        warmup=s.bench_warmup_requests,
                    )

            def passes(paired: dict[str, BenchFigures]) -> bool:
                # The latency checks the gate makes of the candidate (neighbours only slow
                # it down: a pass measured beside them is a pass).
                candidate = paired["candidate"]
                return candidate.p95_ms <= slo_ms and candidate.errors == 0

            what = "latency of the candidate" + (" and production" if len(urls) > 1 else "")
            try:
                paired, host_load = measure_quietly(
                    what,
                    load,
                    limits=limits,
                    quiet=quiet,
                    cpus=place.service,
                    own_pids=pids,
                    isolated=place.isolated,
                    passes=passes,
                )
            except HostBusyError as exc:
                for label, figures in exc.last.items():
                    results[label] = figures.model_copy(update={"host_load": exc.loads[-1]})
                timings["bench_s"] = round(time.monotonic() - started, 1)
                raise inconclusive(exc) from None
        for label, folder in models.items():
            figures = paired[label]
            measured: dict[str, Any] = {"accuracy_note": None, "host_load": host_load}
            try:
                measured["accuracy"] = onnx_accuracy(folder, val_x, val_labels)
            except ValueError as exc:  # production expects another input size: not comparable
                measured["accuracy_note"] = str(exc)
            if label == "production":
                assert prod_alias is not None
                measured["version"] = prod_alias.version
            else:
                spec = PreprocessSpec.from_dict(job.preprocess)
                measured["bare_onnxruntime_p50_ms"] = bare_onnxruntime_p50(
                    str(folder), normalize(eval_view(val_x[:1], spec), spec)
                )
            figures = figures.model_copy(update=measured)
            results[label] = figures
            log.info(
                "%s: p50 %.2f ms p95 %.2f ms p99 %.2f ms, %.1f req/s, errors %d, shed %d, "
                "accuracy %s; others took %.0f%% of the service's CPUs",
                label,
                figures.p50_ms,
                figures.p95_ms,
                figures.p99_ms,
                figures.throughput_rps,
                figures.errors,
                figures.shed,
                figures.accuracy,
                host_load.others_share * 100,
            )
        timings["bench_s"] = round(time.monotonic() - started, 1)
    log.info(
        "the gate's measurements took %.0f s: fleet sizing %.0f s, latency benchmark %.0f s",
        timings["bench_s"] + timings["sizing_s"],
        timings["sizing_s"],
        timings["bench_s"],
    )
    candidate, production = results["candidate"], results.get("production")
    uri = record()
    write_artifact(paths.sizing, sizing)
    return Benchmarked(
        latency_uri=uri,
        host=host,
        candidate=candidate.summary(),
        production=production.summary() if production else None,
        sizing=sizing,
    )


def _capacity_rps(sizing: SizingReport | None, vcpus: int | None) -> float | None:
    """Return the rate the sizing found a ``vcpus``-CPU service sustains; None: none held."""
    from burstcv.gate.sizing import rate_at

    if sizing is None or not vcpus or not any(p.measured for p in sizing.sizes):
        return None
    rate, _ = rate_at(sizing.sizes, vcpus)
    return rate if rate > 0 else None


def size_fleet_on_boxes(
    run: RunRef, resolved: ResolvedRun, s: Settings, host: SizingReport, images: list[bytes]
) -> SizingReport:
    """Measure the cheapest candidate CPU types on boxes of their own (size_on ec2); return
    the fleet chosen from their figures, the host's ``host`` report standing for the rest.

    The candidates are the ``sizing_boxes`` cheapest fleets the host's figures say could
    serve (any allowed family, Graviton included); the boxes' cost goes into billing.json.
    """
    from burstcv.compute.ec2 import Ec2Backend
    from burstcv.compute.sizing_boxes import SizingRequest, size_on_boxes
    from burstcv.gate.sizing import box_candidates, box_speed_key, recommend

    budget, params = resolved.costs.sizing, resolved.params
    assert budget is not None
    types = box_candidates(
        host.sizes,
        count=budget.boxes,
        target_rps=params.target_rps,
        prices=resolved.costs.serving,
        headroom=host.headroom,
        families=params.serving_families,
    )
    if not types:
        log.warning("sizing boxes: no priced CPU type could serve the load; the host's sizes stand")
        return host
    paths = run_layout(run, s)
    card = read_artifact(paths.model_card, ModelCard)
    keys = {
        t: box_speed_key(
            card, instance_type=t, latency_slo_ms=params.latency_slo_ms, duration_s=s.sizing_step_s
        )
        for t in types
    }
    # A type measured before for a model of the same speed key (any run): its figures stand.
    earlier = {} if s.sizing_remeasure else _box_memo(s, keys)
    if earlier:
        log.info(
            "sizing boxes: reused %s (same speed key: architecture, input, preprocessing, SLO; "
            "BURSTCV_SIZING_REMEASURE=true measures again)",
            ", ".join(f"{t} of run {b.measured_in}" for t, b in earlier.items()),
        )
    fresh = [t for t in types if t not in earlier]
    measured: dict[str, BoxSizing] = {}
    if fresh:
        log.info("sizing boxes: measuring %s on boxes of their own", ", ".join(fresh))
        try:
            found = size_on_boxes(
                Ec2Backend(s.ec2),
                SizingRequest(
                    run=run,
                    dag_id=DAG_ID,
                    model_uri=paths.model,
                    instance_types=fresh,
                    latency_slo_ms=params.latency_slo_ms,
                    step_s=s.sizing_step_s,
                    max_s=budget.max_s,
                    parallel=s.sizing_parallel,
                    bound_rate=budget.box_rate,
                ),
                paths,
                images,
                artifact_root=s.artifact_root,
            )
        finally:
            bill_sizing_boxes(run, s)
        for box in found:
            if box.skipped is None:
                box = box.model_copy(
                    update={"speed_key": keys[box.instance_type], "measured_in": run.airflow_run_id}
                )
                write_artifact(paths.box_sizing(box.instance_type), box)
                write_artifact(_box_memo_uri(s, keys[box.instance_type]), box)
            measured[box.instance_type] = box
    boxes = [earlier.get(t) or measured[t] for t in types if t in earlier or t in measured]
    report = recommend(
        host.sizes,
        latency_slo_ms=params.latency_slo_ms,
        target_rps=params.target_rps,
        prices=resolved.costs.serving,
        region=resolved.costs.region,
        unpriced=resolved.costs.serving_unpriced,
        headroom=host.headroom,
        host_cores=host.host_cores,
        families=params.serving_families,
        boxes=boxes,
    )
    log.info("sizing boxes: %s", report.reason)
    return report.model_copy(
        update={
            "host_load": host.host_load,
            "speed_key": host.speed_key,
            "measured_in": host.measured_in,
        }
    )


def _box_memo_uri(s: Settings, key: str) -> str:
    """Return where a sizing box's figures are kept for its speed key (any run reuses them)."""
    return storage.join(s.artifact_root, "sizing", "boxes", f"{key}.json")


def _box_memo(s: Settings, keys: dict[str, str]) -> dict[str, BoxSizing]:
    """Return {type: its figures measured before under the same speed key}."""
    found = {}
    for instance_type, key in keys.items():
        uri = _box_memo_uri(s, key)
        if not storage.exists(uri):
            continue
        try:
            box = read_artifact(uri, BoxSizing)
        except ArtifactError:  # damaged: measured again, and rewritten
            continue
        if box.speed_key == key and box.skipped is None:
            found[instance_type] = box
    return found


def bill_sizing_boxes(run: RunRef, settings: Settings | None = None) -> Billing | None:
    """Add the run's sizing boxes to its bill (billing.json; teardown wrote it before them).

    Their records are priced like training attempts' (``run_bill``, one cost model); a box
    billed before (a benchmark tried again) is replaced by its latest bill, never counted
    twice. None when the run launched no sizing box.
    """
    from burstcv.compute.sizing_boxes import bill_sizing

    s = settings or get_settings()
    paths = run_layout(run, s)
    bills = bill_sizing(paths, lineage.utc_now(), run.airflow_run_id)
    if not bills:
        return None
    sized = [i for b in bills for i in b.instances]
    ids = {i.instance_id for i in sized}
    base = read_artifact(paths.billing, Billing) if storage.exists(paths.billing) else None
    kept = [i for i in base.instances if i.instance_id not in ids] if base else []
    instances = kept + sized
    seconds = {k: v for k, v in (base.billed_seconds if base else {}).items() if k not in ids}
    for b in bills:
        seconds.update(b.billed_seconds)
    billing = Billing(
        instance_ids=[i for i in (base.instance_ids if base else []) if i not in ids]
        + [i.instance_id for i in sized],
        billed_seconds=seconds,
        cost_usd=(base.cost_usd if base else 0.0)
        - sum(i.cost_usd or 0.0 for i in (base.instances if base else []) if i.instance_id in ids)
        + sum(b.cost_usd for b in bills),
        backend=base.backend if base else "ec2",
        instances=instances,
        terminated_at=lineage.utc_now_iso(),
    )
    write_artifact(paths.billing, billing)
    log.info("billing: the sizing boxes cost $%.4f", sum(b.cost_usd for b in bills))
    return billing


def _size_fleet(
    model_dir: str,
    images: list[bytes],
    resolved: ResolvedRun,
    s: Settings,
    earlier: SizingReport | None = None,
) -> SizingReport:
    """Size the candidate's CPU fleet for the run's expected load (burstcv.gate.sizing).

    ``earlier``: sizes measured before under the same speed key: the fleet is chosen from
    them, at this run's load and prices, without measuring.
    """
    from burstcv.gate.sizing import recommend, size_model

    params = resolved.params
    if earlier is not None:
        report = recommend(
            earlier.sizes,
            latency_slo_ms=params.latency_slo_ms,
            target_rps=params.target_rps,
            prices=resolved.costs.serving,
            region=resolved.costs.region,
            unpriced=resolved.costs.serving_unpriced,
            host_cores=earlier.host_cores,
            families=params.serving_families,
        )
        report = report.model_copy(
            update={
                "host_load": earlier.host_load,
                "speed_key": earlier.speed_key,
                "measured_in": earlier.measured_in,
            }
        )
    else:
        report = size_model(
            model_dir,
            images,
            latency_slo_ms=params.latency_slo_ms,
            target_rps=params.target_rps,
            prices=resolved.costs.serving,
            region=resolved.costs.region,
            unpriced=resolved.costs.serving_unpriced,
            max_vcpus=s.sizing_max_vcpus or None,
            duration_s=s.sizing_step_s,
            families=params.serving_families,
        )
    for point in report.sizes:
        log.info(
            "sizing: %d vCPU(s) sustain %.1f req/s within p95 %g ms",
            point.vcpus,
            point.sustainable_rps,
            params.latency_slo_ms,
        )
    log.info("sizing: %s", report.reason)
    return report


def gate(
    run: RunRef, exported: Exported, bench: Benchmarked, settings: Settings | None = None
) -> VerdictRecord:
    """Judge the candidate, register it (promotable or rejected), and return the verdict.

    The registry entry records the run as resolved: its params (the dataset an asset event
    named among them) and, in the lineage, the dataset the model was trained on.
    """
    from burstcv.gate.gate import GateThresholds, ServingContext, check_lines, judge
    from burstcv.registry.registry import Registry

    s = settings or get_settings()
    resolved = resolved_run(run, s)
    params = resolved.params
    card = read_artifact(storage.join(exported.model_dir, MODEL_CARD), ModelCard)
    registry = Registry(s.registry_uri, s.model_name)
    if (earlier := _registered_by(registry, card)) is not None:
        # A retried gate (its worker lost, say, after the version was registered): the
        # verdict stands, and no second version of the same model is registered.
        log.info(
            "version %d of this model was registered by an earlier try of this run; its "
            "verdict stands",
            earlier.version,
        )
        write_artifact(run_layout(run, s).verdict, earlier)
        return earlier
    verdict = judge(
        bench.candidate,
        bench.production,
        GateThresholds(
            latency_slo_ms=params.latency_slo_ms,
            accuracy_floor=params.accuracy_floor,
            max_accuracy_drop=params.max_accuracy_drop,
        ),
        ServingContext(
            # The exported model's: a run's model may have been auto.
            arch=card.arch,
            input_px=card.input.shape[-1],
            int8_tried=bool(exported.quantization and exported.quantization.int8_tried),
            region=resolved.costs.region,
            prices={q.instance_type: q.usd_per_hour for q in resolved.costs.serving},
            target_rps=params.target_rps,
            measured_vcpus=bench.host.cpu_count or None,
            capacity_rps=_capacity_rps(bench.sizing, bench.host.cpu_count),
        ),
        bench.sizing,
    )
    figures = {"candidate": bench.candidate, "production": bench.production}
    version = registry.register(
        exported.model_dir,
        RegistryDecision(
            status="accepted" if verdict.promote else "rejected",
            reason=verdict.summary,
            gate=verdict,
            benchmark={k: f for k, f in figures.items() if f},
            params=params.model_dump(mode="json"),
            fleet=bench.sizing.chosen if bench.sizing else None,
            fleet_measured_in=bench.sizing.measured_in if bench.sizing else None,
        ),
        dataset_uri=params.dataset_uri,
    )
    record = VerdictRecord(version=version, **dict(verdict))
    write_artifact(run_layout(run, s).verdict, record)
    for line in check_lines(verdict):
        log.info("version %d: %s", version, line)
    return record


# How many of the newest versions a retried gate looks through for the one it registered.
RECENT_VERSIONS = 10


def _registered_by(registry: Registry, card: ModelCard) -> VerdictRecord | None:
    """Return the verdict of a version this run already registered from this very model
    file (same run, same sha256), among the newest versions, or None."""
    for version in reversed(registry.versions()[-RECENT_VERSIONS:]):
        entry = registry.entry(version)
        if entry.lineage.run_id == card.run_id and entry.sha256 == card.sha256 and entry.gate:
            return VerdictRecord(version=version, **dict(entry.gate))
    return None


def deploy_skip_reason(verdict: VerdictRecord, *, promote: bool) -> str | None:
    """Return why deploy does not run (the failed checks with their figures), or None.

    ``promote`` is the run's param. The line is logged here, at INFO, so the deploy task's
    own log says why it skipped.
    """
    version = verdict.version
    if not verdict.promote:
        figures = verdict.failed_figures
        reason = f"version {version} not promoted: " + (
            "; ".join(figures) if figures else verdict.summary.removeprefix("not promoted: ")
        )
    elif not promote:
        reason = f"version {version} passed the gate but is not deployed: the run has promote=false"
    else:
        return None
    log.info("%s", reason)
    if not verdict.promote:
        log.info("gate: %s", verdict.summary)
    return reason


def deploy(run: RunRef, verdict: VerdictRecord, settings: Settings | None = None) -> Deployed:
    """Stage the accepted version on the services, then point production at it and switch."""
    from burstcv.registry.deploy import deploy as deploy_version
    from burstcv.registry.registry import Registry

    s = settings or get_settings()
    registry = Registry(s.registry_uri, s.model_name)
    urls = [u.strip().rstrip("/") for u in s.serving_url.split(",") if u.strip()]
    return deploy_version(
        registry,
        verdict.version,
        service_urls=urls,
        token=s.serving_admin_token,
        timeout_s=s.deploy_verify_timeout_s,
        actor=f"run:{run.airflow_run_id}",
    )


def report(run: RunRef, settings: Settings | None = None) -> str:
    """Write runs/<id>/report/index.html: one self-contained page about this run."""
    from burstcv.report.render import build_report

    s = settings or get_settings()
    return build_report(
        run_layout(run, s).root,
        registry_uri=s.registry_uri,
        model_name=s.model_name,
        serving_url=s.serving_url.split(",")[0].strip(),
    )
