"""List, scan, validate and pack a run's dataset: the stages that run before anything is rented.

Scanning and packing are cut into chunks (the DAG maps a task over each)."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import numpy as np

from burstcv.data.imagesize import choose_image_size
from burstcv.data.manifest import read_manifest
from burstcv.params import ResolvedRun, RunParams
from burstcv.settings import Settings, get_settings
from burstcv.stages.resolve import (
    StageError,
    ValidationFailed,
    choose_training,
    derived,
    resolve_run,
    resolved_run,
    run_layout,
)
from burstcv_spec import storage
from burstcv_spec.contracts import (
    DataChunk,
    Packed,
    PackedPart,
    PackPlan,
    PreprocessBlock,
    RunRef,
    ScanPlan,
    Validated,
    read_artifact,
    write_artifact,
)

if TYPE_CHECKING:
    from burstcv.data.pack import ShardOrder

log = logging.getLogger(__name__)


def plan_scan(
    run: RunRef, params: RunParams, settings: Settings | None = None, *, trigger: str = "cli"
) -> ScanPlan:
    """Resolve the run, list the dataset and cut it into scan chunks (or ValidationFailed)."""
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
    """Return this Airflow worker's task slots: a CeleryExecutor's worker_concurrency, else 1."""
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

    return settings.task_processes or max(1, usable_cpus() // worker_task_slots())


def scan_chunk(run: RunRef, chunk: DataChunk, settings: Settings | None = None) -> int:
    """Scan one chunk of the run's listing into its manifest part; return its files. Its pool
    takes the CPUs of one task slot, so a worker's slots do not oversubscribe it."""
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
    With ``params`` (the command line), the run is resolved and scanned here first; the image
    size and recipe derived from the data that passed are added to run.json."""
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


def shard_order(resolved: ResolvedRun, validated: Validated) -> ShardOrder:
    """Return the shard layout of the validated images (``burstcv.data.pack.shard_order``)."""
    from burstcv.data.pack import shard_order as order_of

    size, _ = derived(resolved)
    return order_of(
        read_manifest(validated.manifest_uri),
        size.spec(),
        classes=resolved.params.expected_classes or None,
        margin=size.resize_short is not None,
    )


def plan_pack(run: RunRef, validated: Validated, settings: Settings | None = None) -> PackPlan:
    """Cut the validated images' shards into chunks (``chunk_files``, ``chunk_mb``) of whole
    shards: each shard is the one a one-pass pack writes, whichever task writes it."""
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
    from burstcv_spec.preprocess import margin_spec

    paths = run_layout(run, settings)
    plan = read_artifact(paths.pack_plan, PackPlan)
    resolved = resolved_run(run, settings)
    if chunk.listing_uri:  # the chunk's own images, from the plan
        shards = read_shard_rows(storage.read_bytes(chunk.listing_uri))
        size, _ = derived(resolved)  # stored as shard_order stores them: photos with a margin
        spec = margin_spec(size.spec()) if size.resize_short is not None else size.spec()
    else:  # a plan from before them: the whole manifest, ordered again
        order = shard_order(resolved, validated)
        shards, spec = [order.shard(n) for n in range(chunk.start, chunk.stop)], order.spec
    part = pack_shards(
        shards, spec, plan.classes, paths.shards, index=chunk.index, shard_format=plan.shard_format
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
    Photos are stored with the margin training's random crops draw from (the centre is
    the eval transform). ``packed_chunks``: the DAG's mapped tasks packed them already."""
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
    size, training = derived(resolved_run(run, settings))
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


def val_rows(manifest_uri: str, limit: int | None = None) -> list[tuple[str, str, str]]:
    df = read_manifest(manifest_uri)
    df = df[(df["split"] == "val") & df["decode_ok"].astype(bool)].sort_values("path")
    rows = list(zip(df["path"], df["uri"], df["label"].astype(str), strict=True))
    return rows[:limit] if limit else rows


def val_arrays(
    val_shards: list[str], classes: list[str], limit: int
) -> tuple[np.ndarray, list[str]]:
    from burstcv.training.stream import sample_split

    images, labels = sample_split(val_shards, classes, limit)
    return images, [classes[i] for i in labels]
