"""Decode validated images once, on CPU, into uint8 shards that a training box loads or streams."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Literal, cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from burstcv_spec import storage
from burstcv_spec.contracts import Packed, PackedPart, PreprocessBlock
from burstcv_spec.preprocess import PreprocessSpec, decode_to_uint8, margin_spec

log = logging.getLogger(__name__)

SHARD_IMAGES = 50_000  # 50k 32x32 RGB images = 150 MB per shard: one GET each, fits any box
# JPEG training shards (burstcv.settings shard_format): the quality, and the side from which
# auto picks JPEG (bench/shards.py: at 224 px q90 is a tenth of the raw bytes, PSNR ~35 dB).
JPEG_QUALITY = 90
JPEG_MIN_SIDE = 128
ShardFormat = Literal["raw", "jpeg"]
# Larger images make fewer per shard, so a shard stays one 150 MB GET (780 at 256x256).
SHARD_BYTES = SHARD_IMAGES * 32 * 32 * 3
# shard_rows' metadata: each shard as "number:split:local", comma-separated, in order.
SHARDS_KEY = "burstcv.shards"


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
    """Return an order of sorted rows in which each ``per_shard`` chunk samples them evenly
    (so a shard of label-sorted rows holds every label in proportion, in order)."""
    left = np.arange(rows)
    chunks = []
    while len(left):
        take = min(per_shard, len(left))
        picks = np.round(np.linspace(0, len(left) - 1, take)).astype(np.int64)
        chunks.append(left[picks])
        left = np.delete(left, picks)
    return np.concatenate(chunks) if chunks else left


@dataclass(frozen=True)
class Shard:
    """One shard: its global number, its split and number there, and its rows in order."""

    number: int
    split: str
    local: int
    uris: list[str]
    labels: np.ndarray


def shard_rows(shards: Sequence[Shard]) -> bytes:
    """Return a run of shards as Parquet (what a pack chunk reads instead of the manifest): one
    row per image (shard, uri, label), each shard's split and number in the metadata."""
    table = pa.table(
        {
            "shard": pa.array([s.number for s in shards for _ in s.uris], pa.int64()),
            "uri": pa.array([u for s in shards for u in s.uris], pa.string()),
            "label": pa.array(
                np.concatenate([s.labels for s in shards]) if shards else [], pa.int64()
            ),
        }
    )
    where = ",".join(f"{s.number}:{s.split}:{s.local}" for s in shards)
    table = table.replace_schema_metadata({SHARDS_KEY: where})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def read_shard_rows(data: bytes) -> list[Shard]:
    """Return the shards :func:`shard_rows` wrote, in order."""
    table = pq.read_table(io.BytesIO(data))
    listed = (table.schema.metadata or {})[SHARDS_KEY.encode()].decode()
    where = [
        (int(number), split, int(local))
        for number, split, local in (entry.split(":") for entry in listed.split(",") if entry)
    ]
    columns = table.to_pydict()
    uris: dict[int, list[str]] = {number: [] for number, _, _ in where}
    labels: dict[int, list[int]] = {number: [] for number, _, _ in where}
    for number, uri, label in zip(columns["shard"], columns["uri"], columns["label"], strict=True):
        uris[number].append(uri)
        labels[number].append(label)
    return [
        Shard(number, split, local, uris[number], np.asarray(labels[number], dtype=np.int64))
        for number, split, local in where
    ]


@dataclass(frozen=True)
class ShardOrder:
    """Fix which rows go to which shard, so that any run of shards can be packed alone
    (numbered over the whole dataset, the training split's first)."""

    spec: PreprocessSpec  # what each stored image is (the margin square for photos)
    classes: list[str]
    per_shard: int
    uris: dict[str, list[str]]  # per split, in shard order
    labels: dict[str, np.ndarray]
    source_bytes: dict[str, np.ndarray]

    def shards(self, split: str) -> int:
        """Return the split's shard count (an empty split still writes one, empty, shard)."""
        return max(1, -(-len(self.uris[split]) // self.per_shard))

    @property
    def total(self) -> int:
        """Return the number of shards over both splits."""
        return sum(self.shards(split) for split in SPLITS)

    def locate(self, number: int) -> tuple[str, int]:
        """Return the split of global shard ``number`` and its number within the split."""
        for split in SPLITS:
            if number < self.shards(split):
                return split, number
            number -= self.shards(split)
        raise IndexError(f"shard {number} is past the last one")

    def rows(self, number: int) -> slice:
        """Return the rows of global shard ``number`` within its split."""
        _, local = self.locate(number)
        return slice(local * self.per_shard, (local + 1) * self.per_shard)

    def shard(self, number: int) -> Shard:
        """Return global shard ``number``: where it goes and the rows it holds."""
        split, local = self.locate(number)
        rows = self.rows(number)
        return Shard(number, split, local, self.uris[split][rows], self.labels[split][rows])

    def sizes(self) -> list[tuple[int, int]]:
        """Return each shard's (source files, source bytes), in global order."""
        out = []
        for number in range(self.total):
            split, _ = self.locate(number)
            rows = self.rows(number)
            out.append((len(self.uris[split][rows]), int(self.source_bytes[split][rows].sum())))
        return out


SPLITS = ("train", "val")


def shard_order(
    manifest: pd.DataFrame,
    spec: PreprocessSpec,
    *,
    classes: list[str] | None = None,
    margin: bool = False,
) -> ShardOrder:
    """Return the shard layout of a manifest's decodable rows (see ``pack_dataset``)."""
    if margin:
        spec = margin_spec(spec)
    per_shard = min(SHARD_IMAGES, max(1, SHARD_BYTES // (spec.height * spec.width * 3)))
    rows = manifest[manifest["decode_ok"].astype(bool)].sort_values(["split", "label", "path"])
    classes = classes or class_list(rows["label"])
    index = {name: i for i, name in enumerate(classes)}
    unknown = sorted(set(rows["label"].astype(str)) - set(index))
    if unknown:
        raise ValueError(f"labels {unknown} are not among the classes {classes}")
    uris, labels, sizes = {}, {}, {}
    for split in SPLITS:
        part = rows[rows["split"] == split]
        if split == "train" and len(part) > per_shard:
            # Streamed training holds a few shards at a time: each must hold every class.
            part = part.iloc[spread_order(len(part), per_shard)]
        uris[split] = part["uri"].tolist()
        labels[split] = np.array([index[str(lab)] for lab in part["label"]], dtype=np.int64)
        sizes[split] = (
            part["bytes"].fillna(0).to_numpy(dtype=np.int64)
            if "bytes" in part
            else np.zeros(len(part), np.int64)
        )
    return ShardOrder(spec, classes, per_shard, uris, labels, sizes)


def choose_format(setting: str, spec: PreprocessSpec) -> ShardFormat:
    """Return the training shards' format: the setting's, or for auto, JPEG for photo sizes."""
    if setting in ("raw", "jpeg"):
        return cast(ShardFormat, setting)
    if setting != "auto":
        raise ValueError(f"shard format {setting!r} is not auto, raw or jpeg")
    return "jpeg" if min(spec.height, spec.width) >= JPEG_MIN_SIDE else "raw"


def encode_jpeg(image: np.ndarray) -> bytes:
    """Return one uint8 HxWx3 image as a JPEG (quality JPEG_QUALITY, 4:2:0, baseline)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image, "RGB").save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


def _shard_bytes(
    images: np.ndarray,
    labels: np.ndarray,
    classes: list[str],
    jpeg: bool,
    pool: ThreadPoolExecutor,
) -> bytes:
    """Return a shard's .npz: raw ``images``, or ``jpeg`` (the files end to end), ``offsets``
    (N+1 byte offsets into it) and ``shape`` (H, W, 3 of each decoded image).
    """
    buf = io.BytesIO()
    if not jpeg:
        np.savez(buf, images=images, labels=labels, classes=np.array(classes))
        return buf.getvalue()
    files = list(pool.map(encode_jpeg, images))  # Pillow's encoder releases the GIL too
    offsets = np.zeros(len(files) + 1, np.int64)
    offsets[1:] = np.cumsum([len(f) for f in files])
    np.savez(
        buf,
        jpeg=np.frombuffer(b"".join(files), np.uint8),
        offsets=offsets,
        shape=np.array(images.shape[1:], np.int64),
        labels=labels,
        classes=np.array(classes),
    )
    return buf.getvalue()


def pack_shards(
    run: Sequence[Shard],
    spec: PreprocessSpec,
    classes: list[str],
    out_uri: str,
    *,
    index: int = 0,
    workers: int = 4,
    shard_format: ShardFormat = "raw",
) -> PackedPart:
    """Decode and write a run of shards (``ShardOrder.shard``) under ``out_uri``, each image
    as ``spec`` stores it; ``shard_format`` jpeg stores the training shards' images as JPEG
    (the channel statistics are those of the pixels before encoding)."""
    shards: dict[str, list[str]] = {split: [] for split in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)
    train_stats = ChannelStats()
    # Decoding is C code that releases the GIL: threads keep both cores busy without pickling.
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for shard in run:
            split, chunk = shard.split, shard.uris
            images = (
                np.stack(
                    list(pool.map(lambda u: decode_to_uint8(storage.read_bytes(u), spec), chunk))
                )
                if chunk
                else np.zeros((0, spec.height, spec.width, 3), np.uint8)
            )
            if split == "train":
                train_stats.add(images)
            jpeg = shard_format == "jpeg" and split == "train"
            data = _shard_bytes(images, shard.labels, classes, jpeg, pool)
            uri = storage.join(out_uri, f"{split}-{shard.local:05d}.npz")
            storage.write_bytes(uri, data)
            shards[split].append(uri)
            counts[split] += len(chunk)
    return PackedPart(
        index=index,
        train_shards=shards["train"],
        val_shards=shards["val"],
        counts=counts,
        train_histogram=train_stats.histogram.tolist(),
    )


def join_parts(
    parts: Iterable[PackedPart],
    eval_spec: PreprocessSpec,
    classes: list[str],
    fingerprint: str,
    shard_format: ShardFormat = "raw",
) -> Packed:
    """Return the pack of a dataset from its parts, in chunk order: shards listed in order,
    counts summed, and the training images' mean and std from the summed histograms."""
    shards: dict[str, list[str]] = {split: [] for split in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)
    train_stats = ChannelStats()
    for part in sorted(parts, key=lambda p: p.index):
        shards["train"] += part.train_shards
        shards["val"] += part.val_shards
        for split in SPLITS:
            counts[split] += part.counts.get(split, 0)
        train_stats.histogram += np.asarray(part.train_histogram, dtype=np.int64)
    mean, std = train_stats.mean_std()
    return Packed(
        classes=classes,
        train_shards=shards["train"],
        val_shards=shards["val"],
        counts=counts,
        preprocess=PreprocessBlock.of(replace(eval_spec, mean=mean, std=std)),
        fingerprint=fingerprint,
        shard_format=shard_format,
    )


def pack_dataset(
    manifest: pd.DataFrame,
    out_uri: str,
    spec: PreprocessSpec,
    *,
    classes: list[str] | None = None,
    workers: int = 4,
    margin: bool = False,
    fingerprint: str = "",
    shard_format: ShardFormat = "raw",
) -> Packed:
    """Write ``<out_uri>/{split}-NNNNN.npz`` from the decodable rows of a manifest, in one pass.

    Images are stored as ``spec`` makes them, or with ``margin`` (photos) as the resize_short
    square whose centre is the eval transform: training draws random crops from it.
    """
    order = shard_order(manifest, spec, classes=classes, margin=margin)
    part = pack_shards(
        [order.shard(n) for n in range(order.total)],
        order.spec,
        order.classes,
        out_uri,
        workers=workers,
        shard_format=shard_format,
    )
    log.info("packed %s into %s", part.counts, out_uri)
    return join_parts([part], spec, order.classes, fingerprint, shard_format)
