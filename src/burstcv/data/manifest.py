"""Scan an ImageFolder dataset (local folder or s3:// prefix) into a one-row-per-file manifest.

The entry point of ``burstcv.data.scanner``, which does the work: a hostile or odd file is an
error row, never an exception; hidden and system files are listed in ``ScanResult.ignored``.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from burstcv.data.config import DEFAULT_MAX_FILE_BYTES as DEFAULT_MAX_FILE_BYTES
from burstcv.data.config import DEFAULT_MAX_PIXELS as DEFAULT_MAX_PIXELS
from burstcv.data.scanner.columns import COLUMNS as COLUMNS
from burstcv.data.scanner.columns import new_columns, to_frame
from burstcv.data.scanner.dispatch import Dispatcher
from burstcv.data.scanner.listing import DatasetUnusableError as DatasetUnusableError
from burstcv.data.scanner.listing import list_dataset
from burstcv_spec import storage

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)


@dataclass
class ScanResult:
    """Hold a scan's manifest (one row per file) and the files that were deliberately skipped."""

    dataset_uri: str
    manifest: pd.DataFrame
    ignored: list[dict[str, str]] = field(default_factory=list)  # {"path": ..., "note": ...}
    workers: int = 1


def scan(
    dataset_uri: str,
    *,
    workers: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    phash: bool = True,
) -> ScanResult:
    """Scan every file of an ImageFolder dataset into a manifest DataFrame, in ``workers``
    processes (default: by the dataset's size). Raise DatasetUnusableError if it holds no file."""
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    with Dispatcher(workers, (max_pixels, max_file_bytes, phash)) as dispatcher:
        # Listing feeds the pool as it goes: workers start before the listing ends.
        error_rows, ignored = list_dataset(dataset_uri, dispatcher.add)
        if not dispatcher.listed and not error_rows:
            detail = f" ({len(ignored)} hidden/system files ignored)" if ignored else ""
            raise DatasetUnusableError(f"no files under {dataset_uri}{detail}")
        columns = new_columns(error_rows)
        dispatcher.finish(columns)
        logger.info(
            "scanned %d files of %s with %d worker(s) (%d ignored, %d layout errors)",
            dispatcher.listed,
            dataset_uri,
            dispatcher.workers,
            len(ignored),
            len(error_rows),
        )
    return ScanResult(
        dataset_uri=dataset_uri,
        manifest=to_frame(columns),
        ignored=sorted(ignored, key=lambda item: item["path"]),
        workers=dispatcher.workers,
    )


def write_manifest(df: pd.DataFrame, uri: str) -> str:
    """Write a manifest DataFrame as parquet to a URI (atomically) and return the URI."""
    import pyarrow as pa

    buffer = io.BytesIO()
    # zstd: half the size of snappy on hex digests and paths, and faster to write.
    df.to_parquet(buffer, index=False, compression="zstd")
    # Arrow keeps freed conversion buffers in its pool; hand them back before the suite runs.
    pa.default_memory_pool().release_unused()
    return storage.write_bytes(uri, buffer.getvalue())


def read_manifest(uri: str) -> pd.DataFrame:
    """Read a manifest written by write_manifest."""
    import pandas as pd

    return pd.read_parquet(io.BytesIO(storage.read_bytes(uri)))
