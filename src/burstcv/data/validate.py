"""Validate an image dataset before any GPU exists: scan, run the GX suite, write the evidence.

Drift is measured against the last dataset of the same name that passed (kept under
``history_uri``): class proportions and image size.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import hashlib
import logging
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import great_expectations as gx
import pandas as pd
import PIL
import tqdm

from burstcv.data.config import ValidationConfig as ValidationConfig
from burstcv.data.manifest import DatasetUnusableError as DatasetUnusableError
from burstcv.data.manifest import scan, write_manifest
from burstcv.data.suite import SuiteOutcome, run_suite, usable_mask
from burstcv_spec import storage
from burstcv_spec.contracts import (
    DatasetCounts,
    DatasetProfile,
    DriftBlock,
    ValidationRecord,
    read_artifact,
    write_artifact,
)
from burstcv_spec.layout import MANIFEST, VALIDATION_RECORD

logger = logging.getLogger(__name__)

# GX makes (disabled) progress bars, for which tqdm starts a monitor thread unless this is 0;
# a thread left running makes a later scan here start its workers by spawn, not fork (slower).
tqdm.tqdm.monitor_interval = 0

_HISTORY_FORMAT = 1
_DRIFT_FIELDS = ("class_proportions", "median_width", "median_height")  # what drift compares
SUMMARY_FILES_PER_CHECK = 5  # offending files named per failed check (all are in the JSON)
SUMMARY_MAX_CLASSES = 20  # per-class counts listed up to this many classes per split


def summary(record: ValidationRecord) -> str:
    """Return one screen of text: verdict, counts per split and class, failed checks."""
    counts = record.counts
    head = "PASSED" if record.success else "FAILED"
    failed = [check for check in record.expectations if not check.success]
    met = len(record.expectations) - len(failed)
    lines = [
        f"dataset {record.dataset_uri}: {head} ({counts.usable} usable of {counts.files} files; "
        f"{met} of {len(record.expectations)} expectations met)"
    ]
    lines.extend(split_count_lines(counts.per_split))
    for check in failed:
        observed = describe_observed(check.observed)
        lines.append(f"- {check.name}: {check.description} (observed: {observed})")
        shown = check.offending_files[:SUMMARY_FILES_PER_CHECK]
        for path in shown:
            reason = check.reasons.get(path)
            lines.append(f"    {path}" + (f": {reason}" if reason else ""))
        unexpected = (
            check.observed.get("unexpected_count") if isinstance(check.observed, dict) else None
        )
        total = unexpected if isinstance(unexpected, int) else len(check.offending_files)
        if total > len(shown):
            more = total - len(shown)
            lines.append(f"    ... and {more} more (see validation.json and the manifest)")
    if record.drift.status == "failed":
        lines.append(f"- drift: {record.drift.message}")
    lines.extend(f"warning: {text}" for text in record.warnings)
    lines.append(f"details: {validation_uri_of(record)}")
    return "\n".join(lines)


def validation_uri_of(record: ValidationRecord) -> str:
    """Return where ``record`` was written: validation.json beside its manifest."""
    manifest = record.manifest_uri
    if storage.is_s3(manifest):
        return f"{manifest.rsplit('/', 1)[0]}/{VALIDATION_RECORD}"
    return str(Path(manifest).with_name(VALIDATION_RECORD))


def validate_dataset(
    dataset_uri: str,
    out_uri: str,
    config: ValidationConfig | None = None,
    *,
    history_uri: str | None = None,
    workers: int | None = None,
) -> ValidationRecord:
    """Scan and validate a dataset; write manifest, validation.json and Data Docs to out_uri.

    Raises DatasetUnusableError (one-line reason) when there is nothing to validate (no path,
    no file, none in the ``<split>/<class>/<file>`` layout); every other problem is a failed
    check in the returned record. After a pass, the dataset's profile is stored under
    ``history_uri`` as the baseline for the next drift comparison.
    """
    config = config or ValidationConfig()
    with _gc_spares_existing_objects():
        scanned = scan(
            dataset_uri,
            workers=workers,
            max_pixels=config.max_pixels,
            max_file_bytes=config.max_file_bytes,
            phash=config.near_duplicate_max_distance is not None,
        )
        return validate_scanned(
            dataset_uri, out_uri, scanned.manifest, scanned.ignored, config, history_uri=history_uri
        )


@contextlib.contextmanager
def _gc_spares_existing_objects() -> Iterator[None]:
    """Keep the objects alive now (modules, an Airflow worker's state) out of GC passes: each
    full collection that validation triggers would walk them all (0.1 s+ with GX and pandas)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@_gc_spares_existing_objects()
def validate_scanned(
    dataset_uri: str,
    out_uri: str,
    manifest: pd.DataFrame,
    ignored: list[dict[str, str]],
    config: ValidationConfig | None = None,
    *,
    history_uri: str | None = None,
) -> ValidationRecord:
    """Validate a dataset already scanned (in chunks, ``burstcv.data.chunks``) as
    ``validate_dataset`` does."""
    config = config or ValidationConfig()
    if not manifest["label"].notna().any():
        raise DatasetUnusableError(
            f"{dataset_uri} is not an ImageFolder: no file at <split>/<class>/<file> "
            f"(e.g. train/cat/1.png); found {len(manifest)} file(s) elsewhere"
        )

    manifest_uri = storage.join(out_uri, MANIFEST)
    outcome = _suite_beside_manifest(manifest, manifest_uri, out_uri, config)
    fingerprint = dataset_fingerprint(manifest)
    profile = _profile(manifest, config, fingerprint, dataset_uri)
    warnings: list[str] = []
    if ignored:
        example = ignored[0]["path"]
        warnings.append(f"{len(ignored)} hidden/system file(s) ignored, e.g. {example}")
    name = f"{dataset_name(dataset_uri)}.json"
    baseline_uri = None if history_uri is None else storage.join(history_uri, name)
    baseline = None
    if baseline_uri is not None and storage.exists(baseline_uri):
        baseline = read_artifact(baseline_uri, DatasetProfile)
    drift = _drift(profile, baseline, config)
    if drift.status == "warning":
        warnings.append(f"drift: {drift.message}")
    record = ValidationRecord(
        success=outcome.success and drift.status != "failed",
        dataset_uri=dataset_uri,
        fingerprint=fingerprint,
        counts=DatasetCounts(
            files=len(manifest),
            usable=int(manifest["decode_ok"].sum()),
            errors=int((~manifest["decode_ok"]).sum()),
            ignored=len(ignored),
            per_split=outcome.class_counts,
        ),
        expectations=outcome.checks,
        ignored=ignored,
        drift=drift,
        warnings=warnings,
        config=config.to_dict(),
        manifest_uri=manifest_uri,
        data_docs_uri=storage.join(out_uri, "data_docs", "index.html"),
        validated_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        versions={"great_expectations": gx.__version__, "pillow": PIL.__version__},
    )
    write_artifact(storage.join(out_uri, VALIDATION_RECORD), record)
    if record.success and baseline_uri is not None:
        write_artifact(baseline_uri, profile)
    # The caller shows summary(record) (the pipeline logs it once, the CLI prints it).
    return record


def _suite_beside_manifest(
    manifest: pd.DataFrame, manifest_uri: str, out_uri: str, config: ValidationConfig
) -> SuiteOutcome:
    """Run the suite (Data Docs under out_uri) while another thread writes the manifest."""
    # The parquet encoding, upload or fsync mostly runs outside the GIL: it overlaps the suite.
    with (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="burstcv-manifest") as writer,
        tempfile.TemporaryDirectory(prefix="burstcv-docs-") as scratch,
    ):
        written = writer.submit(write_manifest, manifest, manifest_uri)
        s3 = storage.is_s3(out_uri)
        docs_dir = (Path(scratch) if s3 else storage.local_path(out_uri)) / "data_docs"
        # A fresh site: pages left by an earlier run here would describe another dataset.
        shutil.rmtree(docs_dir, ignore_errors=True)
        outcome = run_suite(manifest, config, data_docs_dir=docs_dir)
        if s3:
            for path in sorted(p for p in docs_dir.rglob("*") if p.is_file()):
                rel = path.relative_to(docs_dir).as_posix()
                storage.upload_file(path, storage.join(out_uri, "data_docs", rel))
        written.result()  # raises what the write raised
    return outcome


def split_count_lines(per_split: dict[str, dict[str, int]]) -> list[str]:
    """Return one line per split: its usable images, and the count of each class (past
    ``SUMMARY_MAX_CLASSES`` classes only the smallest and largest, to stay one screen)."""
    lines = []
    for split, per_class in per_split.items():
        total = sum(per_class.values())
        head = f"  {split}: {total} images in {len(per_class)} classes"
        if not per_class:
            lines.append(head)
            continue
        ordered = sorted(per_class.items(), key=lambda item: (item[1], item[0]))
        if len(per_class) <= SUMMARY_MAX_CLASSES:
            detail = ", ".join(f"{label} {n}" for label, n in sorted(per_class.items()))
        else:
            (low, low_n), (high, high_n) = ordered[0], ordered[-1]
            detail = f"smallest {low} {low_n}, largest {high} {high_n}"
        lines.append(f"{head} ({detail})")
    return lines


def describe_observed(observed: Any) -> str:
    """Return GX's observed value as a short phrase for the summary."""
    if observed is None:
        return "nothing to measure (no usable images)"
    if isinstance(observed, dict):
        if "exception" in observed:
            return f"GX could not evaluate it: {observed['exception']}"
        if "missing" in observed:
            return "missing " + ", ".join(map(str, observed["missing"]))
        if "unexpected_count" in observed and "element_count" in observed:
            return f"{observed['unexpected_count']} of {observed['element_count']} files"
    if isinstance(observed, float):
        return f"{observed:.3g}"
    return str(observed)


def dataset_fingerprint(manifest_df: pd.DataFrame) -> str:
    """Return sha256 over the sorted (path, sha256) rows: same files, same bytes, same print."""
    digest = hashlib.sha256()
    # tolist(): iterating pandas' Arrow-backed strings element by element is several times slower.
    paths = [str(path) for path in manifest_df["path"].tolist()]
    shas = [sha if isinstance(sha, str) else "" for sha in manifest_df["sha256"].tolist()]
    rows: Iterable[tuple[str, str]] = zip(paths, shas, strict=True)
    column = manifest_df["path"]
    if not (column.is_monotonic_increasing and column.is_unique):  # a scan's rows already are
        rows = sorted(rows)
    # Hashed a block of rows at a time: the same bytes as one update per row, fewer calls.
    block: list[str] = []
    for path, sha in rows:
        block.append(f"{path}\t{sha}\n")
        if len(block) == 10_000:
            digest.update("".join(block).encode())
            block.clear()
    digest.update("".join(block).encode())
    return digest.hexdigest()


def dataset_name(dataset_uri: str) -> str:
    """Return the path-safe name of a dataset: its last path segment."""
    last = dataset_uri.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1] or "dataset"
    return re.sub(r"[^A-Za-z0-9._-]", "_", last)


def _profile(
    manifest: pd.DataFrame, config: ValidationConfig, fingerprint: str, dataset_uri: str
) -> DatasetProfile:
    usable = manifest.loc[usable_mask(manifest, config.splits), ["label", "width", "height"]]
    total = max(len(usable), 1)
    proportions = {str(label): n / total for label, n in usable.groupby("label").size().items()}
    return DatasetProfile(
        format_version=_HISTORY_FORMAT,
        dataset_uri=dataset_uri,
        fingerprint=fingerprint,
        validated_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        images=len(usable),
        class_proportions=proportions,
        median_width=float(usable["width"].median()) if len(usable) else None,
        median_height=float(usable["height"].median()) if len(usable) else None,
    )


def _drift(
    profile: DatasetProfile, baseline: DatasetProfile | None, config: ValidationConfig
) -> DriftBlock:
    """Compare a profile with the baseline: class-proportion TVD and median size change."""
    if baseline is None:
        return DriftBlock(status="no_baseline", message="no earlier validated dataset of this name")
    old_p, new_p = baseline.class_proportions, profile.class_proportions
    labels = set(old_p) | set(new_p)
    # Total variation distance: the share of images that would have to change class.
    class_tvd = 0.5 * sum(abs(new_p.get(k, 0.0) - old_p.get(k, 0.0)) for k in labels)
    size_changes = [
        abs(new - old) / old
        for new, old in (
            (profile.median_width, baseline.median_width),
            (profile.median_height, baseline.median_height),
        )
        if new and old
    ]
    size_change = max(size_changes, default=0.0)
    score = max(class_tvd, size_change)
    message = (
        f"class proportions moved by {class_tvd:.1%} (total variation) and median image size "
        f"by {size_change:.1%} since {baseline.validated_at} "
        f"(fingerprint {baseline.fingerprint[:12]})"
    )
    status: Literal["ok", "warning", "failed"] = "ok"
    if config.drift_max is not None and score > config.drift_max:
        status = "failed"
        message += f"; above drift_max {config.drift_max:.1%}"
    elif score > config.drift_warn:
        status = "warning"
    return DriftBlock(
        status=status,
        score=score,
        class_proportion_tvd=class_tvd,
        median_size_change=size_change,
        drift_warn=config.drift_warn,
        drift_max=config.drift_max,
        baseline=baseline.model_dump(
            include={"fingerprint", "validated_at", "dataset_uri", *_DRIFT_FIELDS}
        ),
        current=profile.model_dump(include=set(_DRIFT_FIELDS)),
        message=message,
    )
