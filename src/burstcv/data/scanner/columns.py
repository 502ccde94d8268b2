"""Define the manifest's columns and assemble rows and column lists into its DataFrame."""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

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
INT_COLUMNS = ("width", "height", "channels", "bytes")


def error_row(rel: str, uri: str, error: str, size: int | None = None) -> tuple[Any, ...]:
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


def extend(columns: dict[str, list[Any]], chunk_columns: list[list[Any]]) -> None:
    """Append a chunk's column lists (in COLUMNS order) to the scan's column lists."""
    for name, values in zip(COLUMNS, chunk_columns, strict=True):
        columns[name].extend(values)


def new_columns(rows: Iterable[tuple[Any, ...]] = ()) -> dict[str, list[Any]]:
    """Return a scan's column lists (one per COLUMNS name) holding ``rows`` (in COLUMNS order)."""
    columns: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    for row in rows:
        for name, value in zip(COLUMNS, row, strict=True):
            columns[name].append(value)
    return columns


def to_frame(columns: dict[str, list[Any]]) -> pd.DataFrame:
    """Return the column lists as a DataFrame sorted by path, emptying the lists as it goes."""
    # pandas is imported here, not at module top, so spawned workers start without it.
    import pandas as pd

    data: dict[str, Any] = {}
    for name in COLUMNS:
        values = columns[name]
        if name in INT_COLUMNS:
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
