"""Split a dataset's scan into chunks that separate tasks run, and join their parts again.

``plan_scan`` lists the dataset once and cuts the listing into chunks; ``scan_chunk`` writes
one chunk's manifest rows as a part; ``join_scan`` joins the parts into the manifest a
one-pass ``scan`` makes, row for row. Airflow maps one task per chunk, so a chunk that fails
is retried alone. ``chunk_ranges`` groups any sized items (pack's shards too) the same way.
"""

from __future__ import annotations

import io
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from burstcv.data.config import ValidationConfig
from burstcv.data.manifest import write_manifest
from burstcv.data.scanner.columns import COLUMNS, new_columns, to_frame
from burstcv.data.scanner.dispatch import Dispatcher
from burstcv.data.scanner.listing import DatasetUnusableError, Task, list_dataset
from burstcv_spec import storage
from burstcv_spec.contracts import DataChunk, ScanPlan

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

LISTING = "listing.parquet"
LISTING_SLICES = "listing"  # listing/<chunk>.parquet: each chunk's rows of the listing
REFUSED = "refused.parquet"
MB = 1 << 20


def chunk_ranges(
    sizes: Sequence[tuple[int, int]], max_files: int, max_bytes: int
) -> list[tuple[int, int, int, int]]:
    """Group consecutive items of (files, bytes) into runs within both limits: (start, stop,
    files, bytes) each (an item over a limit is a run alone; no items, one empty run)."""
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


# The share of Airflow's map limit a plan may take: a margin for a limit lowered later.
MAP_LIMIT_SHARE = 0.9
GROWTH = 1.25  # each try at fitting the map limit grows both chunk limits this much


def ranges_within(
    sizes: Sequence[tuple[int, int]], max_files: int, max_bytes: int, max_chunks: int | None
) -> tuple[list[tuple[int, int, int, int]], int, int]:
    """Return ``chunk_ranges`` of ``sizes`` in at most ``max_chunks`` chunks (None: no cap),
    and the limits that made them: grown by ``GROWTH`` while there would be more chunks than
    Airflow may map (a mapped task over its ``max_map_length`` fails the run)."""
    runs = chunk_ranges(sizes, max_files, max_bytes)
    if max_chunks is not None and max_chunks < 1:
        raise ValueError(f"a plan needs room for at least one chunk, not {max_chunks}")
    while max_chunks is not None and len(runs) > max_chunks:
        max_files = math.ceil(max_files * GROWTH)
        max_bytes = math.ceil(max_bytes * GROWTH)
        runs = chunk_ranges(sizes, max_files, max_bytes)
    return runs, max_files, max_bytes


def data_chunks(
    runs: Sequence[tuple[int, int, int, int]],
    part_uri: Callable[[int], str],
    listing_uri: Callable[[int, int, int], str] | None = None,
) -> list[DataChunk]:
    """Return one chunk per run of :func:`ranges_within`: its range, size and part, and its
    slice of the listing where ``listing_uri(index, start, stop)`` writes one (a scan's)."""
    return [
        DataChunk(
            index=index,
            start=start,
            stop=stop,
            files=files,
            bytes=size,
            part_uri=part_uri(index),
            listing_uri=None if listing_uri is None else listing_uri(index, start, stop),
        )
        for index, (start, stop, files, size) in enumerate(runs)
    ]


def chunk_cap(map_limit: int) -> int:
    """Return the most chunks a plan makes under Airflow's map limit (with its margin)."""
    return max(1, math.floor(map_limit * MAP_LIMIT_SHARE))


def plan_scan(
    dataset_uri: str,
    scan_uri: str,
    part_uri: Callable[[int], str],
    *,
    max_files: int,
    max_bytes: int,
    max_chunks: int | None = None,
) -> ScanPlan:
    """List a dataset into ``scan_uri`` (the listing, each chunk's slice of it, the files
    refused unread) and cut it into chunks, chunk ``i``'s rows going to ``part_uri(i)``."""
    import pyarrow as pa

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
    listing_uri = storage.write_bytes(storage.join(scan_uri, LISTING), _parquet(listing))
    refused_uri = write_manifest(to_frame(new_columns(refused)), storage.join(scan_uri, REFUSED))
    runs = _file_runs(sizes, max_files, max_bytes, max_chunks)

    def write_slice(index: int, start: int, stop: int) -> str:
        slice_uri = storage.join(scan_uri, LISTING_SLICES, f"{index:05d}.parquet")
        return storage.write_bytes(slice_uri, _parquet(listing.slice(start, stop - start)))

    chunks = data_chunks(runs, part_uri, write_slice)
    return ScanPlan(
        dataset_uri=dataset_uri,
        listing_uri=listing_uri,
        refused_uri=refused_uri,
        ignored=sorted(ignored, key=lambda item: item["path"]),
        files=len(tasks),
        bytes=sum(sizes),
        chunks=chunks,
    )


def _file_runs(
    sizes: list[int], max_files: int, max_bytes: int, max_chunks: int | None
) -> list[tuple[int, int, int, int]]:
    """Return ``ranges_within`` of the listed files, saying so when the map limit grew them."""
    runs, files_cap, bytes_cap = ranges_within(
        [(1, size) for size in sizes], max_files, max_bytes, max_chunks
    )
    if (files_cap, bytes_cap) != (max_files, max_bytes):
        log.warning(
            "%d files at %d files and %d MB a chunk would be more chunks than the %d mapped "
            "tasks allowed: chunks of up to %d files and %d MB instead",
            len(sizes),
            max_files,
            max_bytes // MB,
            max_chunks,
            files_cap,
            bytes_cap // MB,
        )
    return runs


def _parquet(table: Any) -> bytes:
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    return buffer.getvalue()


def _local_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0  # the inspection reports the file's problem in its row


def scan_chunk(
    plan: ScanPlan,
    chunk: DataChunk,
    config: ValidationConfig,
    *,
    workers: int | None = None,
    max_workers: int | None = None,
) -> int:
    """Inspect one chunk's files (as ``scan`` does) into ``chunk.part_uri``; return the rows.
    ``workers`` processes, else as many as its size is worth, at most ``max_workers``."""
    import pyarrow.parquet as pq

    if chunk.listing_uri:  # the chunk's own rows
        rows = pq.read_table(io.BytesIO(storage.read_bytes(chunk.listing_uri))).to_pydict()
    else:  # a plan made before chunks had their own slice
        table = pq.read_table(io.BytesIO(storage.read_bytes(plan.listing_uri)))
        rows = table.slice(chunk.start, chunk.stop - chunk.start).to_pydict()
    tasks: list[Task] = list(zip(rows["path"], rows["uri"], rows["bytes"], strict=True))
    columns = new_columns()
    options = (
        config.max_pixels,
        config.max_file_bytes,
        config.near_duplicate_max_distance is not None,
    )
    with Dispatcher(workers, options, max_workers) as dispatcher:
        dispatcher.add(tasks)
        dispatcher.finish(columns)
    write_manifest(to_frame(columns), chunk.part_uri)
    return len(tasks)


def join_scan(plan: ScanPlan) -> pd.DataFrame:
    """Return the manifest of every chunk's part and the refused rows, sorted by path; raise
    FileNotFoundError naming a chunk whose part is missing."""
    import pyarrow.parquet as pq

    columns = new_columns()
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
