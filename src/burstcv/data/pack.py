"""Decode validated images once, on CPU, into uint8 shards that a training box loads or streams."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pandas as pd

from burstcv_spec import storage
from burstcv_spec.contracts import Packed, PreprocessBlock
from burstcv_spec.preprocess import PreprocessSpec, decode_to_uint8, margin_spec

log = logging.getLogger(__name__)

SHARD_IMAGES = 50_000  # 50k 32x32 RGB images = 150 MB per shard: one GET each, fits any box
# Larger images make fewer per shard, so a shard stays one 150 MB GET (780 at 256x256).
SHARD_BYTES = SHARD_IMAGES * 32 * 32 * 3


class ChannelStats:
    """Accumulate exact per-channel value counts of uint8 RGB images (constant memory)."""

    def __init__(self) -> None:
        self.histogram = np.zeros((3, 256), dtype=np.int64)

    def add(self, images: np.ndarray) -> None:
        """Count the values of a uint8 (N, H, W, 3) batch."""
        for channel in range(3):
            self.histogram[channel] += np.bincount(images[..., channel].ravel(), minlength=256)

    def mean_std(self) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        """Return the mean and std of each channel on a 0..1 scale (std at least 1e-3)."""
        values = np.arange(256, dtype=np.float64) / 255.0
        count = np.maximum(self.histogram.sum(axis=1), 1).astype(np.float64)
        mean = (self.histogram * values).sum(axis=1) / count
        variance = (self.histogram * (values - mean[:, None]) ** 2).sum(axis=1) / count
        std = np.maximum(np.sqrt(variance), 1e-3)  # a constant channel must not divide by 0
        return (
            (float(mean[0]), float(mean[1]), float(mean[2])),
            (float(std[0]), float(std[1]), float(std[2])),
        )


def natural_key(name: str) -> list[object]:
    """Sort '2' before '10' and 'cat' before 'dog'."""
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", name)]


def class_list(labels: Iterable[str]) -> list[str]:
    """Return the class names in the order the model's outputs use."""
    return sorted({str(label) for label in labels}, key=natural_key)


def spread_order(rows: int, per_shard: int) -> np.ndarray:
    """Return an order of sorted rows in which each ``per_shard`` chunk samples them evenly.

    Each shard in turn takes evenly spaced rows of those left, so a shard of label-sorted rows
    holds every label in proportion; one shard's rows keep their order.
    """
    left = np.arange(rows)
    chunks = []
    while len(left):
        take = min(per_shard, len(left))
        picks = np.round(np.linspace(0, len(left) - 1, take)).astype(np.int64)
        chunks.append(left[picks])
        left = np.delete(left, picks)
    return np.concatenate(chunks) if chunks else left


def _decode(uri: str, spec: PreprocessSpec) -> np.ndarray:
    return decode_to_uint8(storage.read_bytes(uri), spec)


def pack_dataset(
    manifest: pd.DataFrame,
    out_uri: str,
    spec: PreprocessSpec,
    *,
    classes: list[str] | None = None,
    workers: int = 4,
    margin: bool = False,
    fingerprint: str = "",
) -> Packed:
    """Write ``<out_uri>/{split}-NNNNN.npz`` from the decodable rows of a manifest.

    Images are stored as ``spec`` makes them, or with ``margin`` (photos; the spec must have
    resize_short) as the resize_short square around that crop: training draws random crops
    from it, and its centre height x width is exactly the eval transform of the image. The
    result's preprocessing is ``spec`` with the training images' per-channel mean and std
    (0..1 scale), gathered while packing so that nothing reads the shards back for them.
    """
    eval_spec = spec
    if margin:
        spec = margin_spec(spec)
    height, width = spec.height, spec.width
    per_shard = min(SHARD_IMAGES, max(1, SHARD_BYTES // (height * width * 3)))
    rows = manifest[manifest["decode_ok"].astype(bool)].sort_values(["split", "label", "path"])
    classes = classes or class_list(rows["label"])
    index = {name: i for i, name in enumerate(classes)}
    unknown = sorted(set(rows["label"].astype(str)) - set(index))
    if unknown:
        raise ValueError(f"labels {unknown} are not among the classes {classes}")
    shards: dict[str, list[str]] = {"train": [], "val": []}
    counts: dict[str, int] = {}
    train_stats = ChannelStats()
    # Decoding is C code that releases the GIL: threads keep both cores busy without pickling.
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for split in ("train", "val"):
            part = rows[rows["split"] == split]
            if split == "train" and len(part) > per_shard:
                # Streamed training holds a few shards at a time: every shard must hold all
                # classes in proportion, not the label-sorted rows' runs of one class.
                part = part.iloc[spread_order(len(part), per_shard)]
            counts[split] = len(part)
            uris = part["uri"].tolist()
            labels = np.array([index[str(lab)] for lab in part["label"]], dtype=np.int64)
            for shard_no, start in enumerate(range(0, max(len(uris), 1), per_shard)):
                chunk = uris[start : start + per_shard]
                images = (
                    np.stack(list(pool.map(lambda u: _decode(u, spec), chunk)))
                    if chunk
                    else (np.zeros((0, height, width, 3), np.uint8))
                )
                if split == "train":
                    train_stats.add(images)
                buf = io.BytesIO()
                np.savez(
                    buf,
                    images=images,
                    labels=labels[start : start + per_shard],
                    classes=np.array(classes),
                )
                uri = storage.join(out_uri, f"{split}-{shard_no:05d}.npz")
                storage.write_bytes(uri, buf.getvalue())
                shards[split].append(uri)
    mean, std = train_stats.mean_std()
    log.info("packed %s into %s", counts, out_uri)
    return Packed(
        classes=classes,
        train_shards=shards["train"],
        val_shards=shards["val"],
        counts=counts,
        preprocess=PreprocessBlock.of(replace(eval_spec, mean=mean, std=std)),
        fingerprint=fingerprint,
    )
