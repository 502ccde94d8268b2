"""Scan an ImageFolder dataset (local folder or s3:// prefix) into a one-row-per-file manifest.

The layout is ``<root>/<split>/<class>/<image>``. Every file is read once, hashed (sha256 and
a 64-bit difference hash for near duplicates) and fully decoded with the same rules as the
service's ``burstcv_serving.preprocess.open_image``: the pixel count is checked from the header
before any pixel is decoded (decompression bombs cost nothing), truncated data fails in
``load()``. Hostile or odd files become error rows, never exceptions: a lying extension,
zero bytes, a symlink that leaves the root, a file at the wrong depth. Hidden and system files
(``.DS_Store``, ``Thumbs.db``, dotfiles) are skipped and listed in ``ScanResult.ignored``.
Plain 8-bit PNGs, most of a typical dataset, skip Image.open: their chunks are checked here and
their pixels come from Pillow's own decoder, fed as Pillow feeds it; anything else, and every
error verdict, is Pillow's (tests assert that every row is the same either way).

Files are inspected in chunks by a process pool (fork when the host is single-threaded, spawn
otherwise) that starts as soon as enough files are listed, so the listing of a large dataset
overlaps the inspection. Each chunk's rows are appended straight into column lists, so memory
grows with the number of rows, never with image bytes.
"""

from __future__ import annotations

import errno
import functools
import gc
import hashlib
import io
import logging
import multiprocessing
import operator
import os
import posixpath
import stat
import struct
import sys
import threading
import warnings
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from burstcv_serving.preprocess import ImageDecodeError
from PIL import Image, ImageFile, UnidentifiedImageError

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
# Read size once a local file turns out longer than fstat said (it grew while being read).
_READ_BLOCK = 1024 * 1024

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


# A file to inspect: (path relative to the root, URI, size when an S3 listing gave it). A
# plain tuple: chunks of them are pickled to the workers ten times faster than NamedTuples.
_Task = tuple[str, str, int | None]


# What a listing returns once its files went to the sink: error rows, ignored files + note.
_Listing = tuple[list[tuple[Any, ...]], list[dict[str, str]]]


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
        with _Dispatcher(workers, (max_pixels, max_file_bytes, phash)) as dispatcher:
            # Listing feeds the pool as it goes: on a large dataset the workers start on the
            # first folders while the later ones are still being listed.
            error_rows, ignored = _list_dataset(dataset_uri, dispatcher.add)
            if not dispatcher.listed and not error_rows:
                detail = f" ({len(ignored)} hidden/system files ignored)" if ignored else ""
                raise DatasetUnusableError(f"no files under {dataset_uri}{detail}")
            for row in error_rows:
                _append(columns, row)
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
        manifest=_to_frame(columns),
        ignored=sorted(ignored, key=lambda item: item["path"]),
        workers=dispatcher.workers,
    )


class _Dispatcher:
    """Inspect listed files in chunks: in this process, or in a pool started once it pays.

    ``add`` takes each listed batch; as soon as ``_POOL_MIN_FILES`` files are listed (and more
    than one worker is wanted) the pool starts and full chunks go out while listing goes on.
    ``finish`` sends the rest, splitting the tail finer so both cores stay busy to the end,
    and collects every chunk's columns in order.
    """

    def __init__(self, requested: int | None, options: tuple[int, int, bool]) -> None:
        self.requested = requested
        self.options = options
        self.listed = 0
        self.workers = 1
        self._pending: list[_Task] = []
        self._pool: ProcessPoolExecutor | None = None
        self._futures: deque[Future[list[list[Any]]]] = deque()

    def __enter__(self) -> _Dispatcher:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=exc_type is not None)

    def add(self, tasks: list[_Task]) -> None:
        self.listed += len(tasks)
        self._pending.extend(tasks)
        if self._pool is None and self.listed >= _POOL_MIN_FILES:
            wanted = _worker_count(self.requested, self.listed)
            if wanted > 1:
                self._start(wanted)
        if self._pool is not None and len(self._pending) >= _CHUNK_FILES:
            full = len(self._pending) - len(self._pending) % _CHUNK_FILES
            for start in range(0, full, _CHUNK_FILES):
                self._submit(self._pending[start : start + _CHUNK_FILES])
            del self._pending[:full]

    def finish(self, columns: dict[str, list[Any]]) -> None:
        tasks, self._pending = self._pending, []
        if self._pool is None:
            wanted = _worker_count(self.requested, self.listed)
            if wanted > 1:
                self._start(wanted)
        # Several chunks per worker for what is left keep every core busy to the end.
        size = max(1, min(_CHUNK_FILES, -(-len(tasks) // (self.workers * 4))))
        chunks = [tasks[i : i + size] for i in range(0, len(tasks), size)]
        if self._pool is None:
            for chunk in chunks:
                _extend(columns, _inspect_chunk(chunk, *self.options))
            return
        for chunk in chunks:
            self._submit(chunk)
        while self._futures:  # popped: each chunk's result is freed once its rows are copied
            _extend(columns, self._futures.popleft().result())

    def _start(self, workers: int) -> None:
        self.workers = workers
        self._pool = ProcessPoolExecutor(
            max_workers=workers, mp_context=_pool_context(), initializer=_worker_init
        )

    def _submit(self, chunk: list[_Task]) -> None:
        assert self._pool is not None
        self._futures.append(self._pool.submit(_inspect_chunk, chunk, *self.options))


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


# ---------------------------------------------------------------------------------------------
# Listing


def _list_dataset(dataset_uri: str, sink: Callable[[list[_Task]], None]) -> _Listing:
    """List a dataset: files to inspect go to ``sink`` in batches (one per folder or page).

    Returns the ready-made error rows and the ignored files with a note.
    """
    if storage.is_s3(dataset_uri):
        return _list_s3(dataset_uri, sink)
    return _list_local(Path(dataset_uri), sink)


def _list_local(root: Path, sink: Callable[[list[_Task]], None]) -> _Listing:
    if not root.exists():
        raise DatasetUnusableError(f"dataset path {root} does not exist")
    if not root.is_dir():
        raise DatasetUnusableError(f"dataset path {root} is not a directory")
    real_root = root.resolve()
    errors: list[tuple[Any, ...]] = []
    ignored: list[dict[str, str]] = []
    # Depth first, in name order: the rows mostly arrive sorted, which the final sort likes.
    pending: list[tuple[str, Path]] = [("", root)]
    while pending:
        prefix, folder = pending.pop()
        files: list[os.DirEntry[str]] = []
        subfolders: list[tuple[str, Path]] = []
        with os.scandir(folder) as entries:
            for entry in entries:
                name = entry.name
                if is_system_name(name):
                    kind = "folder (not scanned)" if entry.is_dir() else "file"
                    ignored.append({"path": f"{prefix}{name}", "note": f"hidden or system {kind}"})
                elif entry.is_file(follow_symlinks=False):  # the usual case, from readdir alone
                    files.append(entry)
                elif entry.is_symlink():
                    reason = _symlink_problem(Path(entry.path), real_root)
                    if reason is None:
                        files.append(entry)
                    else:
                        errors.append(_error_row(f"{prefix}{name}", entry.path, reason))
                elif entry.is_dir(follow_symlinks=False):
                    subfolders.append((f"{prefix}{name}/", Path(entry.path)))
                else:
                    errors.append(_error_row(f"{prefix}{name}", entry.path, "not a regular file"))
        pending.extend(sorted(subfolders, reverse=True))
        if not files:
            continue
        files.sort(key=operator.attrgetter("name"))
        layout_error = _layout_problem(f"{prefix}file")  # the same for every file of a folder
        if layout_error is None:
            sink([(f"{prefix}{entry.name}", entry.path, None) for entry in files])
            continue
        for entry in files:
            size = entry.stat(follow_symlinks=False).st_size
            errors.append(_error_row(f"{prefix}{entry.name}", entry.path, layout_error, size=size))
    return errors, ignored


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


def _list_s3(uri: str, sink: Callable[[list[_Task]], None]) -> _Listing:
    parsed = urlparse(uri)
    bucket, prefix = parsed.netloc, parsed.path.strip("/")
    prefix = f"{prefix}/" if prefix else ""
    client = storage.s3_client()
    listed = 0
    errors: list[tuple[Any, ...]] = []
    ignored: list[dict[str, str]] = []
    pages = iter(client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix))
    while True:
        try:
            page = next(pages)
        except StopIteration:
            break
        except client.exceptions.NoSuchBucket as exc:
            raise DatasetUnusableError(f"bucket {bucket} does not exist ({uri})") from exc
        tasks: list[_Task] = []
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
            tasks.append((rel, full, int(obj["Size"])))
        if tasks:
            listed += len(tasks)
            sink(tasks)  # keys come sorted: a page is a batch
    if not listed and not errors and not ignored:
        raise DatasetUnusableError(f"nothing under {uri} (missing prefix or empty)")
    return errors, ignored


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
    if requested is not None:  # scan() refused anything below 1
        return max(1, min(requested, n_files))
    if n_files < _POOL_MIN_FILES:
        return 1
    return max(1, os.cpu_count() or 1)


def _worker_init() -> None:
    """Freeze what a forked worker inherited: its GC then never walks (or copies) those pages.

    The parent may hold hundreds of thousands of objects (pandas, GX, Airflow); without this
    every collection in the worker traverses them all and copy-on-write duplicates the pages.
    """
    gc.freeze()


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
    _, uri, size = task
    if size is not None and size > max_file_bytes:
        return f"file is {size} bytes; the limit is {max_file_bytes}"
    if s3_client is not None:
        parsed = urlparse(uri)
        response = s3_client.get_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))
        data: bytes = response["Body"].read()
    else:
        local = _read_local(uri, max_file_bytes)
        if isinstance(local, str):
            return local
        data = local
    if len(data) > max_file_bytes:
        return f"file is over {max_file_bytes} bytes, the limit"
    return data


def _read_local(path: str, max_file_bytes: int) -> bytes | str:
    """Read a local file to its end with raw system calls, or return the too-large message.

    Half the cost of ``open(path, "rb").read()`` (no file objects, usually a single read), with
    the same errors: a directory fails as open() fails, with the path in the message. Reading
    stops once more than ``max_file_bytes`` arrived (a file that grows while it is read).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        size = info.st_size
        if size > max_file_bytes:
            return f"file is {size} bytes; the limit is {max_file_bytes}"
        # Ask for one byte more than fstat promised: getting exactly the promised size back is
        # the whole file in one call. Anything else (a short read, a file that grew since
        # fstat) reads on until the end, as file.read() does, or until past the limit.
        block = os.read(fd, size + 1)
        if len(block) == size:
            return block
        parts = [block]
        total = len(block)
        while block and total <= max_file_bytes:
            block = os.read(fd, size + 1 - total if total < size else _READ_BLOCK)
            parts.append(block)
            total += len(block)
        return b"".join(parts)
    finally:
        os.close(fd)


def _inspect_chunk(
    tasks: Sequence[_Task], max_pixels: int, max_file_bytes: int, phash: bool = True
) -> list[list[Any]]:
    """Inspect a chunk of files and return its manifest columns (one list per COLUMNS name)."""
    with warnings.catch_warnings():
        # As in open_image: Pillow's bomb warning is an error, so nothing huge is ever decoded.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        # One client per chunk: cheap next to 256 GETs, and never stale across endpoints.
        s3_client = storage.s3_client() if any(storage.is_s3(t[1]) for t in tasks) else None
        strips = _Strips(hashing=phash) if _STRIPS else None
        rows = [
            _inspect(task, max_pixels, max_file_bytes, s3_client, phash, strips, index)
            for index, task in enumerate(tasks)
        ]
        hashes = strips.finish() if strips is not None else {}
    # Columns, not rows: the parent extends its column lists in C instead of looping per row.
    columns = [list(values) for values in zip(*rows, strict=True)]
    for index, hashed in hashes.items():
        if isinstance(hashed, str):  # the thumbnail failed; the row says so
            columns[_ERROR][index], columns[_DECODE_OK][index] = hashed, False
        else:
            columns[_PHASH][index], columns[_THUMB][index] = hashed
    return columns


def _inspect(
    task: _Task,
    max_pixels: int,
    max_file_bytes: int,
    s3_client: Any,
    with_phash: bool,
    strips: _Strips | None = None,
    index: int = 0,
) -> tuple[Any, ...]:
    rel, uri, size = task
    parts = rel.split("/")
    # Interned: 200,000 rows then share a handful of split/label/ext/mode/format objects
    # (pickle sends each once per chunk), which keeps the parent's columns small.
    split, label = sys.intern(parts[0]), sys.intern(parts[1])
    ext = sys.intern(posixpath.splitext(rel)[1].lower())
    fmt = mode = sha = phash = thumb = None
    width = height = channels = None
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
                fmt, width, height, mode, channels, img = _decode(
                    data, ext, max_pixels, strips=strips
                )
                if img is None:  # decoded into a strip: hashed with the rest of the chunk
                    if with_phash and strips is not None:
                        strips.keep(index)
                elif with_phash:
                    try:
                        phash, thumb = _hash_decoded(img)
                    except Exception as exc:  # never lose the scan to one odd file
                        raise _BadImage(
                            f"decoded, but its grayscale thumbnail failed: {exc}",
                            (fmt, width, height, mode, channels),
                        ) from exc
            except _BadImage as exc:
                error = str(exc)
                fmt, width, height, mode, channels = exc.header
            fmt = sys.intern(fmt) if fmt else fmt
            mode = sys.intern(mode) if mode else mode
    return (
        rel,
        uri,
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


def _decode(
    data: bytes, ext: str, max_pixels: int, *, strips: _Strips | None = None
) -> tuple[str, int, int, str, int, Image.Image | None]:
    """Decode bytes fully and return (format, width, height, mode, channels, image).

    The image is None when the fast path decoded the pixels into one of ``strips`` instead.

    Mirrors ``burstcv_serving.preprocess.open_image`` (same checks, same order, same messages)
    without its RGB conversion, so the manifest keeps the original mode; a test asserts that
    the two agree on every fault kind. Plain PNGs take a fast path that can only say "ok";
    every other file, and every error verdict, comes from Pillow's own open and load.
    """
    header: tuple[Any, ...] = (None, None, None, None, None)
    if not data:
        raise _BadImage("empty file", header)
    allowed = _EXTENSION_FORMATS.get(ext)
    formats: tuple[str, ...] = ()
    if allowed is not None:
        formats = _open_formats(allowed, data[:16])
        if _PNG_FAST_PATH and formats and formats[0] == "PNG" and "PNG" in allowed:
            decoded = _try_png_fast_path(data, max_pixels, strips)
            if decoded is not None:
                return decoded
    fmt = "unknown"
    try:
        img = _open_image(data, formats)
        fmt = img.format or "unknown"
        width, height = img.size
        header = (fmt, width, height, img.mode, len(img.getbands()))
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
    except Exception as exc:
        # Pillow reports truncated or corrupt streams as OSError/SyntaxError/EOFError, and a
        # crafted file can make a plugin fail with anything (struct.error, IndexError, ...):
        # untrusted bytes never escape as anything but a decode error.
        raise _BadImage(f"corrupt or truncated {fmt} data: {exc}", header) from exc
    return (fmt, width, height, header[3], header[4], img)


def _open_image(data: bytes, formats: tuple[str, ...]) -> Image.Image:
    """Open bytes as ``Image.open`` would, trying only ``formats`` first when there are any.

    ``formats`` (from _open_formats) holds every format Image.open would try before reaching
    the extension's own, so a file it opens is the one the full search opens, for a fifth of
    the cost on PNGs. When none of them takes the file (a lying extension, not an image), the
    full search runs and names the real format, or raises the usual errors.
    """
    if formats:
        try:
            return Image.open(io.BytesIO(data), formats=formats)
        except UnidentifiedImageError:
            pass
    return Image.open(io.BytesIO(data))


def _open_formats(allowed: frozenset[str], prefix: bytes) -> tuple[str, ...]:
    """Return the formats, in Image.open's order, that it may try on a file before ``allowed``.

    Image.open tries the registered formats in order and keeps the first one that accepts the
    16-byte prefix and opens the file. This list keeps the extension's formats and every
    earlier format whose accept test does not refuse the prefix (tests that raise, warn or are
    missing included), so Image.open with it finds the same format, raises the same errors and
    emits the same warnings as the full search whenever the file is one of ``allowed``; the
    skipped formats would have been skipped anyway. Empty means "run the full search". Cached
    per (allowed, prefix): the accept tests only ever see the prefix.
    """
    global _formats_registry_size
    if Image.WARN_POSSIBLE_FORMATS:
        return ()  # the full search would add a warning per refused format
    if len(Image.ID) != _formats_registry_size or len(_formats_cache) >= _FORMATS_CACHE_SIZE:
        _formats_cache.clear()  # a plugin registered since, or too many distinct prefixes
        _formats_registry_size = len(Image.ID)
    key = (allowed, prefix)
    formats = _formats_cache.get(key)
    if formats is None:
        formats = _plan_formats(allowed, prefix)
        _formats_cache[key] = formats
    return formats


def _plan_formats(allowed: frozenset[str], prefix: bytes) -> tuple[str, ...]:
    registered = list(Image.ID)
    last = max((i for i, name in enumerate(registered) if name in allowed), default=-1)
    planned: list[str] = []
    for name in registered[: last + 1]:
        if name not in allowed:
            try:
                accept = Image.OPEN[name][1]
                result = True if accept is None else accept(prefix)
            except Exception:  # Image.open will meet the same error itself
                result = True
            if not result and not isinstance(result, str):
                continue
        planned.append(name)
    return tuple(planned)


_FORMATS_CACHE_SIZE = 256
_formats_cache: dict[tuple[frozenset[str], bytes], tuple[str, ...]] = {}
_formats_registry_size = 0


# ---------------------------------------------------------------------------------------------
# PNG fast path: most datasets are small 8-bit PNGs, and Image.open + load spends more time in
# Python (plugin search, chunk handlers, file-object reads) than in decoding. This path checks
# the whole chunk stream itself and runs Pillow's own zip decoder exactly as ImageFile.load
# does, so the pixels are Pillow's. It only ever answers "ok" (a file Pillow decodes the same
# way); anything unusual or broken returns None and goes through Pillow, which gives the
# verdict and the message.

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_CHUNK_HEAD = struct.Struct(">I4s")
_PNG_IHDR = struct.Struct(">IIBBBBB")
_PNG_CRC = struct.Struct(">I")
# Colour type at bit depth 8 → (mode, rawmode, channels), as PngImagePlugin._MODES has them.
_PNG_COLOR_TYPES = {0: ("L", "L", 1), 2: ("RGB", "RGB", 3), 6: ("RGBA", "RGBA", 4)}
# Ancillary chunks that change no pixel, with the body lengths the PNG spec gives them (Pillow
# raises on a short gAMA, cHRM, sRGB or pHYs).
_PNG_ANCILLARY = {
    b"gAMA": (4, 4),
    b"sRGB": (1, 1),
    b"pHYs": (9, 9),
    b"cHRM": (32, 32),
    b"sBIT": (1, 4),
    b"tIME": (7, 7),
}
_PNG_TEXT_LIMIT = 64 * 1024  # all tEXt bodies together
# tEXt keywords that Pillow copies into Image.info under a name its own code reads
# ("transparency" changes convert()): such files take the normal path.
_PNG_TEXT_RESERVED = frozenset({b"transparency", b"exif", b"icc_profile"})
# Off when Pillow lacks what the fast path uses (checked here and on first use); tests toggle it.
_PNG_FAST_PATH = all(
    hasattr(owner, name)
    for owner, name in (
        (Image, "_getdecoder"),
        (Image, "new"),
        (Image.core, "zip_decoder"),
        (ImageFile, "MAXBLOCK"),
        (ImageFile, "LOAD_TRUNCATED_IMAGES"),
    )
)
if not _PNG_FAST_PATH:
    logger.debug("PNG fast path off: this Pillow lacks a decoder internal it uses")


def _try_png_fast_path(
    data: bytes, max_pixels: int, strips: _Strips | None = None
) -> tuple[str, int, int, str, int, Image.Image | None] | None:
    """Run _decode_png; on any exception return None, and turn the path off if Pillow changed."""
    global _PNG_FAST_PATH
    try:
        return _decode_png(data, max_pixels, strips)
    except (AttributeError, TypeError, NameError, ImportError) as exc:
        _PNG_FAST_PATH = False
        logger.debug("PNG fast path off: Pillow's decoder internals changed (%r)", exc)
    except Exception:
        pass  # Pillow decodes the file again and says what is wrong with it
    return None


def _decode_png(
    data: bytes, max_pixels: int, strips: _Strips | None = None
) -> tuple[str, int, int, str, int, Image.Image | None] | None:
    """Decode a plain 8-bit L/RGB/RGBA PNG as Pillow would, or return None to ask Pillow.

    Accepted: IHDR first (8-bit grey, RGB or RGBA; not interlaced; a size within both
    ``max_pixels`` and Pillow's bomb limit), one run of IDAT chunks, IEND last with nothing
    after it, every CRC right, and only gAMA/sRGB/pHYs/cHRM/sBIT/tIME/tEXt besides. The IDAT
    data goes to the zip decoder in the pieces ImageFile.load feeds it (one call per IDAT chunk
    and MAXBLOCK), and only the decoder's own "finished, no error" counts. A small image goes
    into a slot of ``strips`` when given (the returned image is then None).
    """
    end = len(data)
    if end < 57 or not data.startswith(_PNG_SIGNATURE) or ImageFile.LOAD_TRUNCATED_IMAGES:
        return None  # 57 bytes: signature, IHDR, one IDAT and IEND, each with no spare byte
    length, kind = _PNG_CHUNK_HEAD.unpack_from(data, 8)
    if length != 13 or kind != b"IHDR":
        return None
    width, height, depth, color, compression, filtering, interlace = _PNG_IHDR.unpack_from(data, 16)
    spec = _PNG_COLOR_TYPES.get(color)
    if spec is None or depth != 8 or compression or filtering or interlace:
        return None
    pixels = width * height
    bomb = Image.MAX_IMAGE_PIXELS
    if not 0 < pixels <= max_pixels or (bomb is not None and pixels > bomb):
        return None
    view = memoryview(data)
    idat: list[memoryview] = []
    text = 0
    stage = 0  # 0: before the IDAT run, 1: in it, 2: after it
    pos = 8
    while True:
        if pos + 12 > end:
            return None
        length, kind = _PNG_CHUNK_HEAD.unpack_from(data, pos)
        body = pos + 8
        stop = body + length
        if (
            stop + 4 > end
            or zlib.crc32(view[pos + 4 : stop]) != _PNG_CRC.unpack_from(data, stop)[0]
        ):
            return None
        pos = stop + 4
        if kind == b"IDAT":
            if stage == 2:
                return None
            stage = 1
            if length:
                idat.append(view[body:stop])
            continue
        if stage == 1:
            stage = 2
        if kind == b"IEND":
            if stage != 2 or length or pos != end:
                return None
            break
        if kind == b"tEXt":
            text += length
            nul = data.find(b"\0", body, stop)
            if (
                text > _PNG_TEXT_LIMIT
                or data[body : stop if nul < 0 else nul] in _PNG_TEXT_RESERVED
            ):
                return None
        elif kind == b"IHDR":
            if body != 16:
                return None
        else:
            bounds = _PNG_ANCILLARY.get(kind)
            if bounds is None or not bounds[0] <= length <= bounds[1]:
                return None
    if not idat:
        return None
    mode, rawmode, channels = spec
    slot = strips.slot(mode, width, height) if strips is not None else None
    img: Image.Image | None = None
    if slot is None:
        img = Image.new(mode, (width, height), None)  # core.new, as ImageFile.load_prepare does
        core, top = img.im, 0
    else:
        core, top = slot
    decoder = Image._getdecoder(mode, "zip", rawmode)
    try:
        if decoder.pulls_fd:
            return None
        decoder.setimage(core, (0, top, width, top + height))
        if not _feed_decoder(decoder, idat):
            return None
    finally:
        decoder.cleanup()
    return "PNG", width, height, mode, channels, img


def _feed_decoder(decoder: Any, chunks: list[memoryview]) -> bool:
    """Feed IDAT bodies as ImageFile.load does; return True when the decoder finished cleanly."""
    block = ImageFile.MAXBLOCK
    pending = b""
    for chunk in chunks:
        step = block if block > 0 else len(chunk)
        for start in range(0, len(chunk), step):
            piece = chunk[start : start + step]
            buffer = pending + piece if pending else piece
            consumed, status = decoder.decode(buffer)
            if consumed < 0:
                return bool(status >= 0)  # what ImageFile.load raises on is status < 0
            pending = bytes(buffer[consumed:])
    return False  # out of data before the last row: Pillow says "image file is truncated"


# ---------------------------------------------------------------------------------------------
# Difference hash

_THUMB_SIZE = (9, 8)
# The comparisons run on all 72 thumbnail bytes at once as 8-bit lanes of one integer.
_LANES_ALL = (1 << 576) - 1
_LANES_HIGH = int.from_bytes(b"\x80" * 72, "big")
_LANES_LOW = _LANES_HIGH ^ _LANES_ALL
# Lane i compares byte i with byte i + 1; the last lane of each 9-pixel row wraps to the next
# row: those get 0x01 (deleted before the digits are read), the others keep their 0x80 bit.
_LANES_WRAP = int.from_bytes(bytes(1 if i % 9 == 8 else 0 for i in range(72)), "big")
_LANES_KEEP = int.from_bytes(bytes(0 if i % 9 == 8 else 0x80 for i in range(72)), "big")
_LANES_AS_DIGITS = bytes.maketrans(b"\x00\x80", b"01")


def _dhash(img: Image.Image) -> tuple[str, str]:
    """Return a 64-bit difference hash and the 9x8 grayscale thumbnail it was computed from.

    Bit = is a pixel brighter than its right neighbour. The hash finds candidate pairs fast;
    the thumbnail (72 bytes) then tells a re-encoded or retouched copy (a few grey levels
    apart) from a different image that merely has the same coarse shape, such as two
    handwritten zeros.
    """
    mode = img.mode
    if _CORE_THUMBNAILS and (
        mode == "L" or (mode in ("RGB", "RGBA") and "transparency" not in img.info)
    ):
        small = _core_thumbnail(img)
    else:
        small = img.convert("L").resize(_THUMB_SIZE, Image.Resampling.BILINEAR).tobytes()
    return f"{_brighter_bits(small):016x}", small.hex()


def _hash_decoded(img: Image.Image) -> tuple[str, str]:
    """Return _dhash of a decoded image, even when its metadata breaks convert().

    A text chunk may plant a bogus ``transparency`` entry in ``img.info``; convert("L")
    then fails while converting that colour, although the pixels are fine (and the grey
    levels never depend on it). The hash is then taken without the entry.
    """
    try:
        return _dhash(img)
    except Exception:
        if "transparency" not in img.info:
            raise
        img.info.pop("transparency")
        return _dhash(img)


def _core_thumbnail(img: Image.Image) -> bytes:
    """Return ``img.convert("L").resize((9, 8), BILINEAR).tobytes()`` for L/RGB/RGBA images.

    The same core calls those methods make for these modes (convert("L") of an L image is a
    copy; of RGB/RGBA without "transparency" it is core convert with Floyd-Steinberg, which
    only matters for "1"/"P"), without the Image objects in between: a third of the cost.
    """
    core = img.im
    if img.mode != "L":
        core = core.convert("L", Image.Dither.FLOYDSTEINBERG)
    if core.size != _THUMB_SIZE:
        core = core.resize(_THUMB_SIZE, Image.Resampling.BILINEAR, (0, 0, *core.size))
    return bytes(core)


def _brighter_bits(small: bytes) -> int:
    """Return the 64 bits "pixel > right neighbour" of a 9x8 thumbnail, row by row, MSB first."""
    left = int.from_bytes(small, "big")
    right = (left << 8) & _LANES_ALL  # lane i now holds byte i + 1
    # Per-lane unsigned left > right without borrows between lanes: compare the high bits,
    # and the low 7 bits (0x80 | right_low) - left_low, whose 0x80 bit says right_low >= left_low.
    right_low_ge = ((right & _LANES_LOW) | _LANES_HIGH) - (left & _LANES_LOW)
    greater = (left & ~right) | (~(left ^ right) & ~right_low_ge)
    lanes = (greater & _LANES_KEEP) | _LANES_WRAP
    return int(lanes.to_bytes(72, "big").translate(_LANES_AS_DIGITS, b"\x01"), 2)


def _core_thumbnails_match() -> bool:
    """Return True when _core_thumbnail gives Pillow's thumbnail bytes on sample images."""
    try:
        gradient = Image.linear_gradient("L").resize((37, 23))
        samples = [
            Image.merge(
                "RGB",
                (
                    gradient,
                    gradient.rotate(90),
                    gradient.transpose(Image.Transpose.FLIP_LEFT_RIGHT),
                ),
            ),
            gradient,
            Image.new("RGBA", (1, 1), (10, 200, 30, 7)),
            gradient.crop((0, 0, 9, 8)),
        ]
        return all(
            _core_thumbnail(img)
            == img.convert("L").resize(_THUMB_SIZE, Image.Resampling.BILINEAR).tobytes()
            for img in samples
        )
    except Exception:
        logger.debug("core thumbnails off: Pillow's core image API differs", exc_info=True)
        return False


_CORE_THUMBNAILS = _core_thumbnails_match()


# ---------------------------------------------------------------------------------------------
# Chunk-wide difference hashes: the fast path decodes small images into slots of one tall
# image per (mode, size), a strip, and each strip is hashed in a handful of whole-strip calls
# instead of a dozen calls per image (on 32x32 images the hash cost as much as the decode).

_STRIP_MAX_PIXELS = 64 * 64  # larger images are hashed one by one: their decode dominates
_STRIP_SLOTS = 64  # images per strip (1 MiB for 64x64 RGBA)
_STRIPS_OPEN = 4  # distinct (mode, size) strips a chunk holds at once; the oldest is hashed
_COLUMN = {name: position for position, name in enumerate(COLUMNS)}
_PHASH, _THUMB = _COLUMN["phash"], _COLUMN["thumb"]
_DECODE_OK, _ERROR = _COLUMN["decode_ok"], _COLUMN["error"]


class _Strip:
    """One tall image whose slots hold same-sized images, one under the other."""

    def __init__(self, mode: str, width: int, height: int, slots: int) -> None:
        self.mode, self.width, self.height, self.slots = mode, width, height, slots
        self.core = Image.new(mode, (width, height * slots), None).im
        self.rows: list[int] = []  # chunk row of each filled slot, top to bottom

    def free_top(self) -> int:
        return len(self.rows) * self.height


class _Strips:
    """Give the fast path slots to decode into, and hash each full strip in one go.

    ``slot`` offers the next free slot of the image's strip (None for a large image, which
    gets an image of its own); ``keep`` fills it with the chunk row just decoded there (a
    failed decode leaves it free for the next image). Without hashing, one slot per strip is
    reused as scratch space. ``finish`` returns row -> (phash, thumb), or the error message
    for a row whose thumbnail failed.
    """

    def __init__(self, hashing: bool) -> None:
        self.hashing = hashing
        self._strips: dict[tuple[str, int, int], _Strip] = {}
        self._last: _Strip | None = None
        self._hashes: dict[int, tuple[str, str] | str] = {}

    def slot(self, mode: str, width: int, height: int) -> tuple[Any, int] | None:
        if width * height > _STRIP_MAX_PIXELS or (self.hashing and not _pass_order(width, height)):
            return None
        key = (mode, width, height)
        strip = self._strips.get(key)
        if strip is None:
            if len(self._strips) >= _STRIPS_OPEN:
                self._flush(self._strips.pop(next(iter(self._strips))))
            slots = _STRIP_SLOTS if self.hashing else 1
            strip = self._strips[key] = _Strip(mode, width, height, slots)
        self._last = strip
        top = strip.free_top()
        if self.hashing:
            # Blank, as a new image is: a stream that ends early is a clean finish for Pillow,
            # and the rows it never wrote must not keep an earlier image's pixels.
            strip.core.paste(0, (0, top, width, top + height))
        return strip.core, top

    def keep(self, row: int) -> None:
        strip = self._last
        assert strip is not None and self.hashing
        strip.rows.append(row)
        if len(strip.rows) == strip.slots:
            self._flush(strip)

    def finish(self) -> dict[int, tuple[str, str] | str]:
        for strip in self._strips.values():
            self._flush(strip)
        self._strips.clear()
        return self._hashes

    def _flush(self, strip: _Strip) -> None:
        if not strip.rows:
            return
        try:
            hashes: list[tuple[str, str] | str] = list(_strip_hashes(strip, len(strip.rows)))
        except Exception:  # never lose the scan: hash each slot the usual way
            logger.debug("strip hashing failed; hashing one by one", exc_info=True)
            hashes = [_slot_hash(strip, slot) for slot in range(len(strip.rows))]
        self._hashes.update(zip(strip.rows, hashes, strict=True))
        strip.rows = []


def _core_bytes(core: Any) -> bytes:
    """Return a core image's pixel bytes (what Image.tobytes gives for its Image)."""
    return Image.Image()._new(core).tobytes()


def _strip_hashes(strip: _Strip, count: int) -> list[tuple[str, str]]:
    """Return _dhash of the first ``count`` slots, computed over the whole strip at once.

    Pillow's bilinear resize is separable: one pass over rows, one over columns, rounding to
    8 bits in between, in an order it picks from the sizes (``_pass_order``). Stacked, each
    row of the strip is a row of one image; side by side, each column is a column of one
    image: both passes run once for the whole strip. Same calls, same rounding, same bytes.
    """
    import numpy as np

    width, height = strip.width, strip.height
    core = strip.core if count == strip.slots else strip.core.crop((0, 0, width, height * count))
    if strip.mode != "L":
        core = core.convert("L", Image.Dither.FLOYDSTEINBERG)
    pixels = np.frombuffer(_core_bytes(core), np.uint8)
    images = pixels.reshape(count, height, width)
    if _pass_order(width, height) == "rows":
        thumbs = _column_pass(_row_pass(images))
    else:
        thumbs = _row_pass(_column_pass(images))
    brighter = thumbs[:, :, :-1] > thumbs[:, :, 1:]  # (count, 8, 8): brighter than the right
    hashes = np.packbits(brighter.reshape(count, 64), axis=1).view(">u8").ravel().tolist()
    digits = np.ascontiguousarray(thumbs).tobytes().hex()
    step = 2 * _THUMB_SIZE[0] * _THUMB_SIZE[1]
    return [(f"{value:016x}", digits[i * step : (i + 1) * step]) for i, value in enumerate(hashes)]


def _row_pass(images: Any) -> Any:
    """Resize (count, height, width) grey images to the thumbnail width, rows only."""
    import numpy as np

    count, height, width = images.shape
    target = _THUMB_SIZE[0]
    if width == target:  # Pillow's own test: no row pass
        return images
    tall = count * height
    stacked = Image.frombytes("L", (width, tall), images.tobytes()).im
    resized = stacked.resize((target, tall), Image.Resampling.BILINEAR, (0, 0, width, tall))
    data = np.frombuffer(_core_bytes(resized), np.uint8)
    return data.reshape(count, height, target)


def _column_pass(images: Any) -> Any:
    """Resize (count, height, width) grey images to the thumbnail height, columns only."""
    import numpy as np

    count, height, width = images.shape
    target = _THUMB_SIZE[1]
    if height == target:
        return images
    wide = count * width
    side = np.ascontiguousarray(images.transpose(1, 0, 2)).reshape(height, wide)
    core = Image.frombytes("L", (wide, height), side.tobytes()).im
    resized = core.resize((wide, target), Image.Resampling.BILINEAR, (0, 0, wide, height))
    data = np.frombuffer(_core_bytes(resized), np.uint8)
    return data.reshape(target, count, width).transpose(1, 0, 2)


@functools.lru_cache(maxsize=_STRIP_MAX_PIXELS)
def _pass_order(width: int, height: int) -> str | None:
    """Return which pass Pillow runs first resizing this size to the thumbnail, or None.

    Pillow picks the order from the sizes alone; two noise images tell which order gives its
    bytes ("rows" when either does, as when one pass is a no-op). None: neither does, and
    images of this size are hashed one by one.
    """
    import numpy as np

    rng = np.random.default_rng(width * 65536 + height)
    orders = {"rows", "columns"}
    for _ in range(2):
        images = rng.integers(0, 256, (1, height, width), dtype=np.uint8)
        grey = Image.frombytes("L", (width, height), images.tobytes()).im
        resized = grey.resize(_THUMB_SIZE, Image.Resampling.BILINEAR, (0, 0, width, height))
        expected = _core_bytes(resized)
        if _column_pass(_row_pass(images)).tobytes() != expected:
            orders.discard("rows")
        if _row_pass(_column_pass(images)).tobytes() != expected:
            orders.discard("columns")
    return "rows" if "rows" in orders else next(iter(orders), None)


def _slot_hash(strip: _Strip, slot: int) -> tuple[str, str] | str:
    """Return _dhash of one slot's image, or the error message the row gets if it fails."""
    top = slot * strip.height
    try:
        img = Image.Image()._new(strip.core.crop((0, top, strip.width, top + strip.height)))
        return _dhash(img)
    except Exception as exc:
        return f"decoded, but its grayscale thumbnail failed: {exc}"


def _strips_match() -> bool:
    """Return True when strip hashing gives _dhash's values on sample images."""
    try:
        gradient = Image.linear_gradient("L")
        samples = []
        for size in ((32, 32), (9, 8), (1, 1), (64, 64), (37, 23), (8, 9), (9, 30)):
            grey = gradient.resize(size).rotate(17)
            rgb = Image.merge("RGB", (grey, grey.transpose(Image.Transpose.FLIP_LEFT_RIGHT), grey))
            samples += [grey, rgb, rgb.convert("RGBA")]
        strips = _Strips(hashing=True)
        for row, img in enumerate(samples):
            slot = strips.slot(img.mode, *img.size)
            assert slot is not None
            core, top = slot
            core.paste(img.im, (0, top, img.width, top + img.height))
            strips.keep(row)
        hashes = strips.finish()
        return all(hashes[row] == _dhash(img) for row, img in enumerate(samples))
    except Exception:
        logger.debug("strip hashing off: Pillow's core image API differs", exc_info=True)
        return False


_STRIPS = _PNG_FAST_PATH and _strips_match()


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
    frame = pd.DataFrame(data)
    if frame["path"].is_monotonic_increasing:  # the usual case: folders are listed in order
        return frame
    return frame.sort_values("path", kind="stable").reset_index(drop=True)
