"""Save and choose training checkpoints so that no kill, whenever it comes, stops a resume.

A save stages its file where the job cleans: beside its target as ``.<name>.staged`` (a
rename puts it in place), or for S3 under the temp folder, in one folder per target folder;
the next save of the same file replaces a staged copy a kill left, and an attempt's start
clears them. A resume takes the newest checkpoint that loads; with none, the run starts over,
the unreadable ones kept aside for a person to look at.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from burstcv_spec import storage

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"  # the folder; only rank 0 of the running attempt writes to it
CHECKPOINT = "checkpoints/last.pt"  # the newest
PREVIOUS_CHECKPOINT = "checkpoints/prev.pt"  # a resume's fallback when last.pt does not load
BEST_CHECKPOINT = "checkpoints/best.pt"  # the best epoch: exported, and a resume's last fallback
UNREADABLE = "checkpoints/unreadable"  # where a resume keeps checkpoints none of which loaded
# What a resume reads from a checkpoint (the rest has defaults): one without it is skipped.
RESUME_KEYS = ("model", "optimizer", "scheduler", "rng_cpu", "epoch", "step", "history")
STAGED_SUFFIX = ".staged"


class CheckpointError(RuntimeError):
    """Raise when a checkpoint's file does not load, or lacks what is read from it."""


def staged_path(uri: str) -> Path:
    """Return where a save to ``uri`` writes its file before it is whole."""
    folder, name = uri.rstrip("/").rsplit("/", 1)
    if not storage.is_s3(uri):
        return Path(folder) / f".{name}{STAGED_SUFFIX}"
    digest = hashlib.sha256(folder.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"burstcv-staged-{digest}" / f".{name}{STAGED_SUFFIX}"


def clear_staged(folder_uri: str) -> list[str]:
    """Remove what saves into ``folder_uri`` left staged (a killed writer's); return the paths.
    Only for a folder nothing saves into now."""
    folder = staged_path(storage.join(folder_uri, "_")).parent
    found = sorted(folder.glob(f".*{STAGED_SUFFIX}")) if folder.is_dir() else []
    for path in found:
        path.unlink(missing_ok=True)
    if storage.is_s3(folder_uri):
        shutil.rmtree(folder, ignore_errors=True)
    return [str(p) for p in found]


def save_checkpoint(uri: str, state: dict[str, Any], *, keep_as: str | None = None) -> None:
    """Write a checkpoint whole or not at all; ``keep_as``: first copy the one at ``uri`` there."""
    staged = staged_path(uri)
    staged.parent.mkdir(parents=True, exist_ok=True)
    try:
        with staged.open("wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if keep_as is not None and storage.exists(uri):
            storage.copy(uri, keep_as)
        if storage.is_s3(uri):
            storage.upload_file(staged, uri)
        else:
            os.replace(staged, uri)
    finally:
        staged.unlink(missing_ok=True)


def load_checkpoint(uri: str, required: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """Return the checkpoint at a URI or None; raise if it does not load or lacks a required key."""
    if not storage.exists(uri):
        return None
    data = storage.read_bytes(uri)
    try:
        ckpt = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch, zip and pickle each raise their own on a garbled file
        why = ": ".join([type(exc).__name__, *str(exc).strip().splitlines()[:1]])
        raise CheckpointError(f"{uri} ({len(data)} bytes) does not load: {why}") from exc
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{uri} holds a {type(ckpt).__name__}, not a checkpoint")
    missing = [key for key in required if key not in ckpt]
    if missing:
        raise CheckpointError(f"{uri} lacks {', '.join(missing)}")
    return ckpt


def resume_checkpoint(output_uri: str) -> tuple[str, dict[str, Any]] | None:
    """Return (URI, contents) of the checkpoint to resume from: last.pt when it loads, else the
    further along of prev.pt and best.pt; None when none loads (the run starts over, those
    that do not load copied to checkpoints/unreadable/ first)."""
    last, prev, best = (
        storage.join(output_uri, name)
        for name in (CHECKPOINT, PREVIOUS_CHECKPOINT, BEST_CHECKPOINT)
    )
    loaded: list[tuple[str, dict[str, Any]]] = []
    unreadable: list[str] = []
    for uri in (last, prev, best):
        try:
            ckpt = load_checkpoint(uri, RESUME_KEYS)
        except CheckpointError as exc:
            log.warning("checkpoint skipped: %s", exc)
            unreadable.append(uri)
            continue
        if ckpt is None:
            continue
        if uri == last:  # the newest: the others are not read
            return uri, ckpt
        loaded.append((uri, ckpt))
    if loaded:  # ties (the same epoch end): prev.pt, the first
        return max(loaded, key=lambda found: (int(found[1]["epoch"]), int(found[1]["step"])))
    if last in unreadable or prev in unreadable:
        kept = storage.join(output_uri, UNREADABLE)
        for uri in unreadable:
            storage.copy(uri, storage.join(kept, uri.rsplit("/", 1)[1]))
        log.warning("no checkpoint of the run loads: training starts over (kept in %s)", kept)
    return None


def remove_leftovers(output_uri: str) -> None:
    """Remove what saves a killed attempt cut short left behind (before this attempt saves)."""
    checkpoints = storage.join(output_uri, CHECKPOINTS)
    left = [*storage.remove_partial_writes(checkpoints), *clear_staged(checkpoints)]
    for path in [*left, *clear_staged(output_uri)]:  # model.pt's
        log.warning("removed %s, left by a checkpoint write that was cut short", path)
