"""Split a dataset's scan into chunks that separate tasks run, and join their parts again.

A large dataset's scan is CPU work in the hundreds of images per second per core: hours on
one machine. ``plan_scan`` lists the dataset once and cuts the listing into chunks of at
most ``max_files`` files and ``max_bytes`` bytes; ``scan_chunk`` inspects one chunk (in this
process, or a local pool for a large one) and writes its manifest rows as a part;
``join_scan`` joins every part into the manifest a one-pass ``scan`` makes of the same data,
row for row. Airflow maps one task per chunk (dags/burstcv_pipeline.py), so a CeleryExecutor
spreads them over its workers, and a chunk that fails is retried alone.

``chunk_ranges`` groups any sized items the same way: pack cuts its shards with it.
"""

from __future__ import annotations

import gc
import io
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from burstcv.data.config import ValidationConfig
from burstcv.data.manifest import write_manifest
from burstcv.data.scanner.columns import COLUMNS, append, to_frame
from burstcv.data.scanner.dispatch import Dispatcher
from burstcv.data.scanner.listing import DatasetUnusableError, Task, list_dataset
from burstcv_spec import storage
from burstcv_spec.contracts import DataChunk, ScanPlan

if TYPE_CHECKING:
    import pandas as pd

LISTING = "listing.parquet"
REFUSED = "refused.parquet"
MB = 1 << 20


def chunk_ranges(
    sizes: Sequence[tuple[int, int]], max_files: int, max_bytes: int
) -> list[tuple[int, int, int, int]]:
    """Group consecutive items of (files, bytes) into runs within both limits.

    Returns (start, stop, files, bytes) per run; an item over a limit by itself is a run of
    its own. No items: one empty run, so that a plan always has a chunk.
    """
    if max_files < 1 or max_bytes < 1:
        raise ValueError(f"chunk limits must be >= 1, got {max_files} files, {max_bytes} bytes")
    runs: list[tuple[int, int, int, int]] = []
    start = files = size = 0
    for number, (item_files, item_bytes) in enumerate(sizes):
        if number > start and (files + item_files > max_files or size + item_bytes > max_bytes):
            runs.append((start, number, files, size))
            start, files, size = number, 0, 0
        files += item_files
        size += item_bytes
    runs.append((start, len(sizes), files, size))
    return runs


def plan_scan(
    dataset_uri: str,
    scan_uri: str,
    part_uri: Callable[[int], str],
    *,
    max_files: int,
    max_bytes: int,
) -> ScanPlan:
    """List a dataset into ``scan_uri`` and cut the listing into chunks.

    Writes the files to inspect (``listing.parquet``) and the manifest rows of the files the
    listing refused unread (``refused.parquet``). ``part_uri(i)`` names where chunk ``i``'s
    rows go. Raises DatasetUnusableError when the URI names nothing or holds no file.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    tasks: list[Task] = []
    refused, ignored = list_dataset(dataset_uri, tasks.extend)
    if not tasks and not refused:
        detail = f" ({len(ignored)} hidden/system files ignored)" if ignored else ""
        raise DatasetUnusableError(f"no files under {dataset_uri}{detail}")
    sizes = [size if size is not None else _local_size(uri) for _, uri, size in tasks]
    listing = pa.table(
        {
            "path": [path for path, _, _ in tasks],
            "uri": [uri for _, uri, _ in tasks],
            "bytes": pa.array(sizes, pa.int64()),
        }
    )
    buffer = io.BytesIO()
    pq.write_table(listing, buffer, compression="zstd")
    listing_uri = storage.write_bytes(storage.join(scan_uri, LISTING), buffer.getvalue())
    columns: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    for row in refused:
        append(columns, row)
    refused_uri = write_manifest(to_frame(columns), storage.join(scan_uri, REFUSED))
    chunks = [
        DataChunk(
            index=index, start=start, stop=stop, files=files, bytes=size, part_uri=part_uri(index)
        )
        for index, (start, stop, files, size) in enumerate(
            chunk_ranges([(1, size) for size in sizes], max_files, max_bytes)
        )
    ]
    return ScanPlan(
        dataset_uri=dataset_uri,
        listing_uri=listing_uri,
        refused_uri=refused_uri,
        ignored=sorted(ignored, key=lambda item: item["path"]),
        files=len(tasks),
        bytes=sum(sizes),
        chunks=chunks,
    )


def _local_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0  # the inspection reports the file's problem in its row


def scan_chunk(
    plan: ScanPlan, chunk: DataChunk, config: ValidationConfig, *, workers: int | None = None
) -> int:
    """Inspect one chunk's files and write their manifest rows to ``chunk.part_uri``.

    Every file becomes a row (an unreadable one an error row), exactly as in ``scan``;
    rewriting the part is harmless, so a retried chunk starts over. Returns the rows written.
    """
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(storage.read_bytes(plan.listing_uri)))
    rows = table.slice(chunk.start, chunk.stop - chunk.start).to_pydict()
    tasks: list[Task] = list(zip(rows["path"], rows["uri"], rows["bytes"], strict=True))
    columns: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    options = (
        config.max_pixels,
        config.max_file_bytes,
        config.near_duplicate_max_distance is not None,
    )
    gc_was_enabled = gc.isenabled()
    gc.disable()  # plain rows, never cycles (see scan)
    try:
        with Dispatcher(workers, options) as dispatcher:
            dispatcher.add(tasks)
            dispatcher.finish(columns)
    finally:
        if gc_was_enabled:
            gc.enable()
    write_manifest(to_frame(columns), chunk.part_uri)
    return len(tasks)


def join_scan(plan: ScanPlan) -> pd.DataFrame:
    """Return the manifest of every chunk's part and the refused rows, sorted by path.

    Raises FileNotFoundError naming the chunk whose part is missing (its task did not run).
    """
    import pyarrow.parquet as pq

    columns: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    sources = [("the listing's refused files", plan.refused_uri)] + [
        (f"scan chunk {chunk.index}", chunk.part_uri) for chunk in plan.chunks
    ]
    for what, uri in sources:
        if not storage.exists(uri):
            raise FileNotFoundError(f"{what}: no manifest part at {uri} (did its task run?)")
        part = pq.read_table(io.BytesIO(storage.read_bytes(uri))).to_pydict()
        for name in COLUMNS:
            columns[name].extend(part[name])
    return to_frame(columns)
