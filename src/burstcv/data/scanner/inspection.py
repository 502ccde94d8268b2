"""Inspect listed files into manifest rows: read, sha256, decode with the service's rules, hash.

The pixel count is checked from the header before any pixel is decoded (decompression bombs
cost nothing); hostile or odd files become error rows, never exceptions. Runs in the workers.
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import stat
import sys
import warnings
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

from PIL import Image, UnidentifiedImageError

from burstcv.data.scanner.dhash import hash_decoded
from burstcv.data.scanner.formats import EXTENSION_FORMATS, open_formats, open_image
from burstcv.data.scanner.listing import Task
from burstcv_spec import storage
from burstcv_spec.preprocess import ImageDecodeError

# Read size once a local file turns out longer than fstat said (it grew while being read).
_READ_BLOCK = 1024 * 1024


def read_task(task: Task, max_file_bytes: int, s3_client: Any) -> bytes | str:
    """Return the file's bytes, or an error message when it is too large to read."""
    _, uri, size = task
    if size is not None and size > max_file_bytes:
        return f"file is {size} bytes; the limit is {max_file_bytes}"
    if s3_client is not None:
        parsed = urlparse(uri)
        response = s3_client.get_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))
        data: bytes = response["Body"].read()
    else:
        local = read_local(uri, max_file_bytes)
        if isinstance(local, str):
            return local
        data = local
    if len(data) > max_file_bytes:
        return f"file is over {max_file_bytes} bytes, the limit"
    return data


def read_local(path: str, max_file_bytes: int) -> bytes | str:
    """Read a local file to its end with raw system calls (half the cost of ``open().read()``,
    same errors), or return the too-large message once more than ``max_file_bytes`` arrived."""
    fd = os.open(path, os.O_RDONLY)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        size = info.st_size
        if size > max_file_bytes:
            return f"file is {size} bytes; the limit is {max_file_bytes}"
        # One byte more than fstat promised: exactly the promised size back is the whole file;
        # else (a short read, a file that grew) read on to the end, or until past the limit.
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


def inspect_chunk(
    tasks: Sequence[Task], max_pixels: int, max_file_bytes: int, phash: bool = True
) -> list[list[Any]]:
    """Inspect a chunk of files and return its manifest columns (one list per COLUMNS name)."""
    with warnings.catch_warnings():
        # As in open_image: Pillow's bomb warning is an error, so nothing huge is ever decoded.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        # One client per chunk: cheap next to 256 GETs, and never stale across endpoints.
        s3_client = storage.s3_client() if any(storage.is_s3(t[1]) for t in tasks) else None
        rows = [inspect_file(task, max_pixels, max_file_bytes, s3_client, phash) for task in tasks]
    # Columns, not rows: the parent extends its column lists in C instead of looping per row.
    return [list(values) for values in zip(*rows, strict=True)]


def inspect_file(
    task: Task,
    max_pixels: int,
    max_file_bytes: int,
    s3_client: Any,
    with_phash: bool,
) -> tuple[Any, ...]:
    """Return one file's manifest row (in COLUMNS order); a bad file gives an error row."""
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
            data = read_task(task, max_file_bytes, s3_client)
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
                fmt, width, height, mode, channels, img = decode(data, ext, max_pixels)
                if with_phash:
                    try:
                        phash, thumb = hash_decoded(img)
                    except Exception as exc:  # never lose the scan to one odd file
                        raise BadImage(
                            f"decoded, but its grayscale thumbnail failed: {exc}",
                            (fmt, width, height, mode, channels),
                        ) from exc
            except BadImage as exc:
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


class BadImage(ImageDecodeError):
    """Carry what the header revealed about an image that failed a check."""

    def __init__(self, message: str, header: tuple[Any, ...]) -> None:
        super().__init__(message)
        self.header = header


def decode(data: bytes, ext: str, max_pixels: int) -> tuple[str, int, int, str, int, Image.Image]:
    """Decode bytes fully and return (format, width, height, mode, channels, image): the checks,
    order and messages of ``burstcv_spec.preprocess.open_image`` (a test holds them together),
    without its RGB conversion, so that the manifest keeps the original mode."""
    header: tuple[Any, ...] = (None, None, None, None, None)
    if not data:
        raise BadImage("empty file", header)
    allowed = EXTENSION_FORMATS.get(ext)
    formats: tuple[str, ...] = ()
    if allowed is not None:
        formats = open_formats(allowed, data[:16])
    fmt = "unknown"
    try:
        img = open_image(data, formats)
        fmt = img.format or "unknown"
        width, height = img.size
        header = (fmt, width, height, img.mode, len(img.getbands()))
        if allowed is None:
            raise BadImage(
                f"extension {ext or '(none)'!r} is not an image extension; the content is {fmt}",
                header,
            )
        if fmt not in allowed:
            raise BadImage(f"extension {ext!r} lies: the content is {fmt}", header)
        if width <= 0 or height <= 0:
            raise BadImage(f"image declares an empty size {width}x{height}", header)
        if width * height > max_pixels:
            raise BadImage(
                f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}",
                header,
            )
        img.load()
    except BadImage:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise BadImage(f"decompression bomb refused: {exc}", header) from exc
    except UnidentifiedImageError as exc:
        raise BadImage("not an image (no known format signature)", header) from exc
    except Exception as exc:
        # A crafted file can make a Pillow plugin fail with anything (struct.error, IndexError,
        # ...): untrusted bytes never escape as anything but a decode error.
        raise BadImage(f"corrupt or truncated {fmt} data: {exc}", header) from exc
    return (fmt, width, height, header[3], header[4], img)
