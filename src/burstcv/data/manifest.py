"""Scan an ImageFolder dataset (local folder or s3:// prefix) into a one-row-per-file manifest.

The layout is ``<root>/<split>/<class>/<image>``. Every file is read once, hashed (sha256 and
a 64-bit difference hash for near duplicates) and fully decoded with the same rules as the
service's ``burstcv_spec.preprocess.open_image``. Hostile or odd files become error rows,
never exceptions: a lying extension, zero bytes, a symlink that leaves the root, a file at
the wrong depth. Hidden and system files (``.DS_Store``, ``Thumbs.db``, dotfiles) are skipped
and listed in ``ScanResult.ignored``.

This module is the entry point; the work is done in ``burstcv.data.scanner``: ``listing``
finds the files, ``dispatch`` spreads them over a process pool while the listing goes on,
``inspection`` turns each file into a row with Pillow's public decode (``dhash`` hashes it),
and ``columns`` assembles the DataFrame.
"""

from __future__ import annotations

import gc
import io
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from burstcv.data.config import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_PIXELS
from burstcv.data.scanner.columns import COLUMNS, append, to_frame
from burstcv.data.scanner.dispatch import Dispatcher
from burstcv.data.scanner.listing import DatasetUnusableError, is_system_name, list_dataset
from burstcv_spec import storage

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "COLUMNS",
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_MAX_PIXELS",
    "DatasetUnusableError",
    "ScanResult",
    "is_system_name",
    "read_manifest",
    "scan",
    "write_manifest",
]

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
    """Scan every file of an ImageFolder dataset into a manifest DataFrame.

    ``workers`` is the number of processes (default: every core for large datasets, one for
    small ones). ``phash=False`` skips the difference hash and leaves the column null, for
    when near duplicates are not checked.
    Raises DatasetUnusableError when the URI names nothing or holds no file.
    """
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    columns: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    # The rows are plain values, never cycles: a cyclic GC pass while they pile up would only
    # walk the whole process heap (large in an Airflow worker) again and again for nothing.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with Dispatcher(workers, (max_pixels, max_file_bytes, phash)) as dispatcher:
            # Listing feeds the pool as it goes: on a large dataset the workers start on the
            # first folders while the later ones are still being listed.
            error_rows, ignored = list_dataset(dataset_uri, dispatcher.add)
            if not dispatcher.listed and not error_rows:
                detail = f" ({len(ignored)} hidden/system files ignored)" if ignored else ""
                raise DatasetUnusableError(f"no files under {dataset_uri}{detail}")
            for row in error_rows:
                append(columns, row)
            dispatcher.finish(columns)
            logger.info(
                "scanned %d files of %s with %d worker(s) (%d ignored, %d layout errors)",
                dispatcher.listed,
                dataset_uri,
                dispatcher.workers,
                len(ignored),
                len(error_rows),
            )
    finally:
        if gc_was_enabled:
            gc.enable()
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
    # zstd: half the size of the default snappy on hex digests and paths, and faster to write.
    df.to_parquet(buffer, index=False, compression="zstd")
    # Arrow keeps freed conversion buffers in its pool; hand them back before the suite runs.
    pa.default_memory_pool().release_unused()
    return storage.write_bytes(uri, buffer.getvalue())


def read_manifest(uri: str) -> pd.DataFrame:
    """Read a manifest written by write_manifest."""
    import pandas as pd

    return pd.read_parquet(io.BytesIO(storage.read_bytes(uri)))
