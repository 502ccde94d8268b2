"""Scan an ImageFolder dataset (local folder or s3:// prefix) into a one-row-per-file manifest.

The layout is ``<root>/<split>/<class>/<image>``. Every file is read once, hashed (sha256 and
a 64-bit difference hash for near duplicates) and fully decoded with the same rules as the
service's ``burstcv_serving.preprocess.open_image``: the pixel count is checked from the header
before any pixel is decoded (decompression bombs cost nothing), truncated data fails in
``load()``. Hostile or odd files become error rows, never exceptions: a lying extension,
zero bytes, a symlink that leaves the root, a file at the wrong depth. Hidden and system files
(``.DS_Store``, ``Thumbs.db``, dotfiles) are skipped and listed in ``ScanResult.ignored``.

Files are inspected in chunks by a process pool (fork when the host is single-threaded, spawn
otherwise), and each chunk's rows are appended straight into column lists, so memory
grows with the number of rows, never with image bytes.
"""

from __future__ import annotations

import hashlib
import io
import logging
import multiprocessing
import operator
import os
import posixpath
import sys
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlparse

from burstcv_serving.preprocess import ImageDecodeError
from PIL import Image, UnidentifiedImageError

from burstcv import storage

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)

COLUMNS: tuple[str, ...] = (
    "path",  # relative to the dataset root, posix separators
    "uri",  # full local path or s3:// URI
    "split",
    "label",
    "format",  # Pillow's name for the real content format, or None
    "ext",  # lower-case file extension including the dot, "" when there is none
    "width",
    "height",
    "channels",
    "mode",  # Pillow mode before any conversion (RGB, RGBA, L, P, ...)
    "bytes",
    "sha256",
    "phash",  # 64-bit difference hash, 16 hex digits, for near-duplicate detection
    "thumb",  # the 9x8 grayscale thumbnail the hash came from, hex: confirms near duplicates
    "decode_ok",
    "error",
)
_INT_COLUMNS = ("width", "height", "channels", "bytes")

# Same bound as the service's open_image: a 4096x4096 image is the largest one accepted.
DEFAULT_MAX_PIXELS = 4096 * 4096
# A file larger than this is refused without being read into memory (an image dataset for a
# 32x32 classifier has no business holding a 64 MiB file; raise it for photo datasets).
DEFAULT_MAX_FILE_BYTES = 64 * 1024 * 1024
# Files per task sent to a worker: large enough to amortise pickling, small enough to balance.
_CHUNK_FILES = 256
# Below this many files a process pool costs more to start than it saves.
_POOL_MIN_FILES = 2000

# Lower-cased names that operating systems and tools drop into folders; never images.
_SYSTEM_NAMES = frozenset(
    {
        "thumbs.db",
        "ehthumbs.db",
        "desktop.ini",
        "icon\r",
        "__macosx",
        "@eadir",
        "$recycle.bin",
        "system volume information",
    }
)

# Extension (lower case, with dot) → Pillow format names that may legitimately carry it.
_EXTENSION_FORMATS: dict[str, frozenset[str]] = {}
for _ext, _fmt in Image.registered_extensions().items():
    _EXTENSION_FORMATS[_ext.lower()] = _EXTENSION_FORMATS.get(_ext.lower(), frozenset()) | {_fmt}
# Cameras write multi-picture JPEGs that Pillow names MPO; the bytes are still a JPEG.
for _ext in (".jpg", ".jpeg", ".jpe"):
    _EXTENSION_FORMATS[_ext] = _EXTENSION_FORMATS.get(_ext, frozenset()) | {"JPEG", "MPO"}


class DatasetUnusableError(ValueError):
    """Raise when a dataset URI cannot be validated at all (missing, empty, not an ImageFolder)."""


@dataclass
class ScanResult:
    """Hold a scan's manifest (one row per file) and the files that were deliberately skipped."""

    dataset_uri: str
    manifest: pd.DataFrame
    ignored: list[dict[str, str]] = field(default_factory=list)  # {"path": ..., "note": ...}
    workers: int = 1


class _Task(NamedTuple):
    rel: str
    uri: str
    size: int | None  # known from an S3 listing; read from the file otherwise


# What a listing yields: files to inspect, ready-made error rows, ignored files with a note.
_Listing = tuple[list[_Task], list[tuple[Any, ...]], list[dict[str, str]]]


def is_system_name(name: str) -> bool:
    """Return True for hidden files/folders and OS droppings that a scan skips."""
    return name.startswith(".") or name.lower() in _SYSTEM_NAMES


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
    small ones). ``phash=False`` skips the difference hash (a third of the per-image cost on
    small images) and leaves the column null, for when near duplicates are not checked.
    Raises DatasetUnusableError when the URI names nothing or holds no file.
    """
    tasks, error_rows, ignored = _list_dataset(dataset_uri)
    if not tasks and not error_rows:
        detail = f" ({len(ignored)} hidden/system files ignored)" if ignored else ""
        raise DatasetUnusableError(f"no files under {dataset_uri}{detail}")

    columns: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    for row in error_rows:
        _append(columns, row)
    n_workers = _worker_count(workers, len(tasks))
    # Several chunks per worker keep both cores busy to the end; _CHUNK_FILES caps pickling.
    chunk_size = max(1, min(_CHUNK_FILES, -(-len(tasks) // (n_workers * 4))))
    chunks = [tasks[i : i + chunk_size] for i in range(0, len(tasks), chunk_size)]
    logger.info(
        "scanning %d files of %s with %d worker(s) (%d ignored, %d layout errors)",
        len(tasks),
        dataset_uri,
        n_workers,
        len(ignored),
        len(error_rows),
    )
    if n_workers == 1:
        for chunk in chunks:
            _extend(columns, _inspect_chunk(chunk, max_pixels, max_file_bytes, phash))
    else:
        with ProcessPoolExecutor(max_workers=n_workers, mp_context=_pool_context()) as pool:
            results = pool.map(
                _inspect_chunk, chunks, repeat(max_pixels), repeat(max_file_bytes), repeat(phash)
            )
            for chunk_columns in results:
                _extend(columns, chunk_columns)
    return ScanResult(
        dataset_uri=dataset_uri,
        manifest=_to_frame(columns),
        ignored=sorted(ignored, key=lambda item: item["path"]),
        workers=n_workers,
    )


def write_manifest(df: pd.DataFrame, uri: str) -> str:
    """Write a manifest DataFrame as parquet to a URI (atomically) and return the URI."""
    import pyarrow as pa

    buffer = io.BytesIO()
    df.to_parquet(buffer, index=False)
    # Arrow keeps freed conversion buffers in its pool; hand them back before the suite runs.
    pa.default_memory_pool().release_unused()
    return storage.write_bytes(uri, buffer.getvalue())


def read_manifest(uri: str) -> pd.DataFrame:
    """Read a manifest written by write_manifest."""
    import pandas as pd

    return pd.read_parquet(io.BytesIO(storage.read_bytes(uri)))


# ---------------------------------------------------------------------------------------------
# Listing


def _list_dataset(dataset_uri: str) -> _Listing:
    if storage.is_s3(dataset_uri):
        return _list_s3(dataset_uri)
    return _list_local(Path(dataset_uri))


def _list_local(root: Path) -> _Listing:
    if not root.exists():
        raise DatasetUnusableError(f"dataset path {root} does not exist")
    if not root.is_dir():
        raise DatasetUnusableError(f"dataset path {root} is not a directory")
    real_root = root.resolve()
    tasks: list[_Task] = []
    errors: list[tuple[Any, ...]] = []
    ignored: list[dict[str, str]] = []
    pending: list[tuple[str, Path]] = [("", root)]
    while pending:
        prefix, folder = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                rel = f"{prefix}{entry.name}"
                if is_system_name(entry.name):
                    kind = "folder (not scanned)" if entry.is_dir() else "file"
                    ignored.append({"path": rel, "note": f"hidden or system {kind}"})
                    continue
                if entry.is_symlink():
                    reason = _symlink_problem(Path(entry.path), real_root)
                    if reason is not None:
                        errors.append(_error_row(rel, entry.path, reason))
                        continue
                elif entry.is_dir(follow_symlinks=False):
                    pending.append((f"{rel}/", Path(entry.path)))
                    continue
                elif not entry.is_file(follow_symlinks=False):
                    errors.append(_error_row(rel, entry.path, "not a regular file"))
                    continue
                layout_error = _layout_problem(rel)
                if layout_error is not None:
                    size = entry.stat(follow_symlinks=False).st_size
                    errors.append(_error_row(rel, entry.path, layout_error, size=size))
                    continue
                tasks.append(_Task(rel=rel, uri=entry.path, size=None))
    tasks.sort(key=lambda task: task.rel)
    return tasks, errors, ignored


def _symlink_problem(link: Path, real_root: Path) -> str | None:
    """Return why a symlink is refused, or None for a link to a file inside the root."""
    target = Path(os.path.realpath(link))
    if not target.is_relative_to(real_root):
        return f"symlink points outside the dataset root (to {target}); not followed"
    if target.is_dir():
        return "symlinked directory inside the dataset; not followed (it would count twice)"
    if not target.is_file():
        return f"dangling symlink (to {target})"
    return None


def _list_s3(uri: str) -> _Listing:
    parsed = urlparse(uri)
    bucket, prefix = parsed.netloc, parsed.path.strip("/")
    prefix = f"{prefix}/" if prefix else ""
    client = storage.s3_client()
    tasks: list[_Task] = []
    errors: list[tuple[Any, ...]] = []
    ignored: list[dict[str, str]] = []
    try:
        pages = list(client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix))
    except client.exceptions.NoSuchBucket as exc:
        raise DatasetUnusableError(f"bucket {bucket} does not exist ({uri})") from exc
    for page in pages:
        for obj in page.get("Contents", []):
            key: str = obj["Key"]
            rel = key[len(prefix) :]
            if not rel or rel.endswith("/"):
                continue  # "folder" marker objects written by consoles
            if any(is_system_name(part) for part in rel.split("/")):
                ignored.append({"path": rel, "note": "hidden or system file"})
                continue
            full = f"s3://{bucket}/{key}"
            layout_error = _layout_problem(rel)
            if layout_error is not None:
                errors.append(_error_row(rel, full, layout_error, size=int(obj["Size"])))
                continue
            tasks.append(_Task(rel=rel, uri=full, size=int(obj["Size"])))
    if not tasks and not errors and not ignored:
        raise DatasetUnusableError(f"nothing under {uri} (missing prefix or empty)")
    tasks.sort(key=lambda task: task.rel)
    return tasks, errors, ignored


def _layout_problem(rel: str) -> str | None:
    depth = rel.count("/") + 1
    if depth == 3:
        return None
    return f"wrong depth: expected <split>/<class>/<file>, found a file {depth} level(s) deep"


def _error_row(rel: str, uri: str, error: str, size: int | None = None) -> tuple[Any, ...]:
    """Return a manifest row for a file that is refused without being read."""
    parts = rel.split("/")
    split, label = (parts[0], parts[1]) if len(parts) == 3 else (None, None)
    values = {
        "path": rel,
        "uri": uri,
        "split": split,
        "label": label,
        "bytes": size,
        "ext": posixpath.splitext(rel)[1].lower(),
        "decode_ok": False,
        "error": error,
    }
    return tuple(values.get(name) for name in COLUMNS)


def _worker_count(requested: int | None, n_files: int) -> int:
    if requested is not None:
        if requested < 1:
            raise ValueError(f"workers must be >= 1, got {requested}")
        return max(1, min(requested, n_files))
    if n_files < _POOL_MIN_FILES:
        return 1
    return max(1, os.cpu_count() or 1)


def _pool_context() -> multiprocessing.context.BaseContext:
    """Return fork where it is safe (Linux, no other thread alive), else spawn.

    fork starts workers in milliseconds and needs no importable ``__main__``; it is unsafe
    only when another thread might hold a lock at fork time (an Airflow worker's heartbeat, a
    test's emulator server), and on macOS, so those get spawn.
    """
    if sys.platform.startswith("linux") and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


# ---------------------------------------------------------------------------------------------
# Inspection (runs in worker processes)


def _read(task: _Task, max_file_bytes: int, s3_client: Any) -> bytes | str:
    """Return the file's bytes, or an error message when it is too large to read."""
    if task.size is not None and task.size > max_file_bytes:
        return f"file is {task.size} bytes; the limit is {max_file_bytes}"
    if s3_client is not None:
        parsed = urlparse(task.uri)
        response = s3_client.get_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))
        data: bytes = response["Body"].read()
    else:
        with open(task.uri, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > max_file_bytes:
                return f"file is {size} bytes; the limit is {max_file_bytes}"
            # Not read(max_file_bytes + 1): that allocates the whole limit for every file.
            data = fh.read()
    if len(data) > max_file_bytes:
        return f"file is over {max_file_bytes} bytes, the limit"
    return data


def _inspect_chunk(
    tasks: Sequence[_Task], max_pixels: int, max_file_bytes: int, phash: bool = True
) -> list[list[Any]]:
    """Inspect a chunk of files and return its manifest columns (one list per COLUMNS name)."""
    with warnings.catch_warnings():
        # As in open_image: Pillow's bomb warning is an error, so nothing huge is ever decoded.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        # One client per chunk: cheap next to 256 GETs, and never stale across endpoints.
        s3_client = storage.s3_client() if any(storage.is_s3(t.uri) for t in tasks) else None
        rows = [_inspect(task, max_pixels, max_file_bytes, s3_client, phash) for task in tasks]
    # Columns, not rows: the parent extends its column lists in C instead of looping per row.
    return [list(values) for values in zip(*rows, strict=True)]


def _inspect(
    task: _Task, max_pixels: int, max_file_bytes: int, s3_client: Any, with_phash: bool
) -> tuple[Any, ...]:
    parts = task.rel.split("/")
    # Interned: 200,000 rows then share a handful of split/label/ext/mode/format objects
    # (pickle sends each once per chunk), which keeps the parent's columns small.
    split, label = sys.intern(parts[0]), sys.intern(parts[1])
    ext = sys.intern(posixpath.splitext(task.rel)[1].lower())
    fmt = mode = sha = phash = thumb = None
    width = height = channels = None
    size = task.size
    if size == 0:
        error: str | None = "empty file (0 bytes)"
    else:
        try:
            data = _read(task, max_file_bytes, s3_client)
        except OSError as exc:
            data = f"unreadable: {exc}"
        if isinstance(data, str):
            error = data
        elif not data:
            size, error = 0, "empty file (0 bytes)"
        else:
            size = len(data)
            sha = hashlib.sha256(data).hexdigest()
            error = None
            try:
                fmt, width, height, mode, channels, img = _decode(data, ext, max_pixels)
                if with_phash:
                    phash, thumb = _dhash(img)
            except _BadImage as exc:
                error = str(exc)
                fmt, width, height, mode, channels = exc.header
            fmt = sys.intern(fmt) if fmt else fmt
            mode = sys.intern(mode) if mode else mode
    return (
        task.rel,
        task.uri,
        split,
        label,
        fmt,
        ext,
        width,
        height,
        channels,
        mode,
        size,
        sha,
        phash,
        thumb,
        error is None,
        error,
    )


class _BadImage(ImageDecodeError):
    """Carry what the header revealed about an image that failed a check."""

    def __init__(self, message: str, header: tuple[Any, ...]) -> None:
        super().__init__(message)
        self.header = header


def _decode(data: bytes, ext: str, max_pixels: int) -> tuple[str, int, int, str, int, Image.Image]:
    """Decode bytes fully and return (format, width, height, mode, channels, image).

    Mirrors ``burstcv_serving.preprocess.open_image`` (same checks, same order, same messages)
    without its RGB conversion, so the manifest keeps the original mode; a test asserts that
    the two agree on every fault kind.
    """
    header: tuple[Any, ...] = (None, None, None, None, None)
    if not data:
        raise _BadImage("empty file", header)
    fmt = "unknown"
    try:
        img = Image.open(io.BytesIO(data))
        fmt = img.format or "unknown"
        width, height = img.size
        header = (fmt, width, height, img.mode, len(img.getbands()))
        allowed = _EXTENSION_FORMATS.get(ext)
        if allowed is None:
            raise _BadImage(
                f"extension {ext or '(none)'!r} is not an image extension; the content is {fmt}",
                header,
            )
        if fmt not in allowed:
            raise _BadImage(f"extension {ext!r} lies: the content is {fmt}", header)
        if width <= 0 or height <= 0:
            raise _BadImage(f"image declares an empty size {width}x{height}", header)
        if width * height > max_pixels:
            raise _BadImage(
                f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}",
                header,
            )
        img.load()
    except _BadImage:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _BadImage(f"decompression bomb refused: {exc}", header) from exc
    except UnidentifiedImageError as exc:
        raise _BadImage("not an image (no known format signature)", header) from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        # Pillow reports truncated or corrupt streams as OSError/SyntaxError/EOFError.
        raise _BadImage(f"corrupt or truncated {fmt} data: {exc}", header) from exc
    return (fmt, width, height, header[3], header[4], img)


def _dhash(img: Image.Image) -> tuple[str, str]:
    """Return a 64-bit difference hash and the 9x8 grayscale thumbnail it was computed from.

    Bit = is a pixel brighter than its right neighbour. The hash finds candidate pairs fast;
    the thumbnail (72 bytes) then tells a re-encoded or retouched copy (a few grey levels
    apart) from a different image that merely has the same coarse shape, such as two
    handwritten zeros.
    """
    small = img.convert("L").resize((9, 8), Image.Resampling.BILINEAR).tobytes()
    # Compare neighbours in C (map over bytes), drop the comparisons that wrap across rows,
    # and read the 64 resulting 0/1 bytes as a binary number: ~2x faster than a Python loop.
    brighter = bytes(map(operator.gt, small[:-1], small[1:]))
    bits = b"".join([brighter[start : start + 8] for start in range(0, 72, 9)])
    return f"{int(bits.translate(_BITS_AS_DIGITS), 2):016x}", small.hex()


_BITS_AS_DIGITS = bytes.maketrans(b"\x00\x01", b"01")


# ---------------------------------------------------------------------------------------------
# Assembly


def _extend(columns: dict[str, list[Any]], chunk_columns: list[list[Any]]) -> None:
    for name, values in zip(COLUMNS, chunk_columns, strict=True):
        columns[name].extend(values)


def _append(columns: dict[str, list[Any]], row: tuple[Any, ...]) -> None:
    for name, value in zip(COLUMNS, row, strict=True):
        columns[name].append(value)


def _to_frame(columns: dict[str, list[Any]]) -> pd.DataFrame:
    # pandas is imported here, not at module top, so spawned workers start without it.
    import pandas as pd

    data: dict[str, Any] = {}
    for name in COLUMNS:
        values = columns[name]
        if name in _INT_COLUMNS:
            data[name] = pd.array(values, dtype="Int64")
        elif name == "decode_ok":
            data[name] = pd.array(values, dtype="bool")
        else:
            data[name] = pd.Series(values, dtype="object")
        columns[name] = []  # release the list as soon as its column exists
    return pd.DataFrame(data).sort_values("path", kind="stable").reset_index(drop=True)
