"""List an ImageFolder (local folder or s3:// prefix): files to inspect, refused and ignored files.

Files at another depth than ``<split>/<class>/<image>``, symlinks that leave the root and
non-regular files become error rows; hidden and system files are skipped with a note.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from burstcv.data.scanner.columns import error_row
from burstcv_spec import storage

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

# A file to inspect: (path relative to the root, URI, size when an S3 listing gave it). A
# plain tuple: chunks of them are pickled to the workers ten times faster than NamedTuples.
Task = tuple[str, str, int | None]

# What a listing returns once its files went to the sink: error rows, ignored files + note.
Listing = tuple[list[tuple[Any, ...]], list[dict[str, str]]]


class DatasetUnusableError(ValueError):
    """Raise when a dataset URI cannot be validated at all (missing, empty, not an ImageFolder)."""


def is_system_name(name: str) -> bool:
    """Return True for hidden files/folders and OS droppings that a scan skips."""
    return name.startswith(".") or name.lower() in _SYSTEM_NAMES


def list_dataset(dataset_uri: str, sink: Callable[[list[Task]], None]) -> Listing:
    """List a dataset: files to inspect go to ``sink`` in batches (one per folder or page)."""
    if storage.is_s3(dataset_uri):
        return _list_s3(dataset_uri, sink)
    return _list_local(Path(dataset_uri), sink)


def _list_local(root: Path, sink: Callable[[list[Task]], None]) -> Listing:
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
                        errors.append(error_row(f"{prefix}{name}", entry.path, reason))
                elif entry.is_dir(follow_symlinks=False):
                    subfolders.append((f"{prefix}{name}/", Path(entry.path)))
                else:
                    errors.append(error_row(f"{prefix}{name}", entry.path, "not a regular file"))
        pending.extend(sorted(subfolders, reverse=True))
        if not files:
            continue
        files.sort(key=operator.attrgetter("name"))
        layout_error = layout_problem(f"{prefix}file")  # the same for every file of a folder
        if layout_error is None:
            sink([(f"{prefix}{entry.name}", entry.path, None) for entry in files])
            continue
        for entry in files:
            size = entry.stat(follow_symlinks=False).st_size
            errors.append(error_row(f"{prefix}{entry.name}", entry.path, layout_error, size=size))
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


def _list_s3(uri: str, sink: Callable[[list[Task]], None]) -> Listing:
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
        tasks: list[Task] = []
        for obj in page.get("Contents", []):
            key: str = obj["Key"]
            rel = key[len(prefix) :]
            if not rel or rel.endswith("/"):
                continue  # "folder" marker objects written by consoles
            if any(is_system_name(part) for part in rel.split("/")):
                ignored.append({"path": rel, "note": "hidden or system file"})
                continue
            full = f"s3://{bucket}/{key}"
            layout_error = layout_problem(rel)
            if layout_error is not None:
                errors.append(error_row(rel, full, layout_error, size=int(obj["Size"])))
                continue
            tasks.append((rel, full, int(obj["Size"])))
        if tasks:
            listed += len(tasks)
            sink(tasks)  # keys come sorted: a page is a batch
    if not listed and not errors and not ignored:
        raise DatasetUnusableError(f"nothing under {uri} (missing prefix or empty)")
    return errors, ignored


def layout_problem(rel: str) -> str | None:
    """Return why a file at this relative path breaks the layout, or None at the right depth."""
    depth = rel.count("/") + 1
    if depth == 3:
        return None
    return f"wrong depth: expected <split>/<class>/<file>, found a file {depth} level(s) deep"
