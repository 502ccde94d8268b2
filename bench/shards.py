"""Measure raw uint8 shards against JPEG shards of photos: bytes, pack time, decode rate, ingest.

Pack stores a photo as the margin square of its size (``margin_spec``: 256x256 for 224 px,
196,608 bytes raw), and the training box reads it back with no decoding at all. This script
measures, on the same images in one run, what storing that square as JPEG instead would change:

* bytes stored per image: the raw .npz shard that ``pack_dataset`` writes, against a JPEG shard
  (one .npz of the concatenated JPEG files and their offsets) at quality 90 and 95 (Pillow's
  defaults otherwise: 4:2:0 chroma, baseline);
* pack time per image on one core: ``pack_dataset`` with one worker, against what pack would
  do for JPEG: the same decode of each source file (``decode_to_uint8`` with the margin
  spec), the same channel statistics, a JPEG encode and the same synced write;
* decode rate per core of what a box reads: the raw shard by ``np.load`` (and by
  ``load_shard``, the box's own reader), the JPEGs by Pillow and by torchvision's
  ``decode_jpeg`` on the CPU (one thread), and by nvJPEG (``decode_jpeg`` on CUDA, in batches)
  where a CUDA device is present; skipped, and said so, where none is;
* what JPEG loses: mean absolute error and PSNR of the decoded JPEG against the raw square;
* derived: the images/s a 4- and an 8-vCPU box takes in at 1 and 10 Gbit/s (the lower of the
  download rate and the vCPUs' decode rate; an upper bound, as the training loop needs CPU
  too, and a vCPU is a hyperthread), and whether an ImageNet-sized set (1,281,167 images) fits
  the shard cache of the box's default root volume (``volume_gb`` less the AMI, ~30 GB, and
  the cache's reserve), read back at the gp3 volume's baseline 125 MiB/s in later epochs.

Images: by default ``--n`` (300) generated photo-like JPEGs at camera-ish sizes (375-768 px
on the short side, 4:3 or 3:2, a quarter upright, saved at quality 85-95): occluding shapes
whose sizes follow a power law (as objects in a scene do), each filled with a colour near a
per-image palette, shaded along its own direction and covered in its own texture (smooth,
grainy or fine), then a lens blur and sensor noise. Neither flat noise (which JPEG cannot
compress) nor flat colour (which it compresses absurdly well): their margin squares come to
~19 KB at quality 90 (PSNR ~35.5 dB), as random crops of scikit-learn's two sample photos do
(~19 KB, ~37 dB), which every run measures alongside as a check. Real photos differ: check
yours with ``--images DIR`` (JPEG, PNG or WebP files anywhere under DIR, the first ``--n`` in
name order). Every figure is per image, so it extrapolates linearly to any number of images.

Times are CPU time of this process (one thread works at a time), each the median of
``--rounds`` (3) rounds whose sides run in an order rotated from round to round: on a
machine others share, wall time swings with their load, CPU time much less.

    python bench/shards.py
    python bench/shards.py --images ~/photos --n 2000 --out shards.json
    python bench/shards.py --px 160 --rounds 5
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, features

from burstcv_spec import storage
from burstcv_spec.preprocess import (
    PreprocessSpec,
    decode_to_uint8,
    margin_spec,
    resize_short_for,
)

QUALITIES = (90, 95)
VCPUS = (4, 8)
GBITS = (1, 10)
IMAGENET_IMAGES = 1_281_167  # ILSVRC-2012 training set
AMI_GB = 30  # what the Deep Learning AMI takes of the root volume (docs/aws.md)
GP3_BASELINE_BYTES_S = 125 * 2**20  # a gp3 volume's throughput unless more is provisioned
GPU_BATCH = 128  # images per nvJPEG call
PHOTO_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
MIN_TIMED_S = 0.3  # CPU s a decode side repeats for: the timer's resolution stays negligible

# ---------------------------------------------------------------------------------------------
# Images


def _noise_field(
    rng: np.random.Generator, height: int, width: int, finest: int, falloff: float
) -> np.ndarray:
    """Return a zero-mean, unit-std texture with detail from the whole frame to ``finest`` px.

    A pyramid: from a 2-cell grid, each level doubles the grid (bicubic) and adds fresh noise
    ``falloff`` times weaker than the last, so the cost is about one full-size resize.
    """
    longest = max(height, width)
    cells = 2
    field = rng.standard_normal((2, 2)).astype(np.float32)
    amplitude = 1.0
    while longest / (cells * 2) >= finest:
        cells *= 2
        amplitude *= falloff
        shape = (max(2, round(cells * height / longest)), max(2, round(cells * width / longest)))
        field = np.asarray(
            Image.fromarray(field, "F").resize(shape[::-1], Image.Resampling.BICUBIC)
        ) + amplitude * rng.standard_normal(shape, dtype=np.float32)
    full = Image.fromarray(field, "F").resize((width, height), Image.Resampling.BICUBIC)
    field = np.asarray(full, dtype=np.float32)
    scaled: np.ndarray = (field - field.mean()) / np.float32(field.std() + 1e-6)
    return scaled


def generate_photo(rng: np.random.Generator) -> Image.Image:
    """Return one photo-like RGB image (see the module docstring), varied by ``rng``."""
    short = int(rng.integers(375, 769))
    long = min(1024, round(short * (4 / 3, 3 / 2)[int(rng.integers(2))]))
    width, height = (long, short) if rng.random() < 0.75 else (short, long)
    shapes = int(rng.integers(50, 400))
    # Each shape is drawn with its own label; colour, shading and texture are then looked up
    # per label in whole-image passes, which is ~20 times faster than compositing each shape.
    canvas = Image.new("I", (width, height), 0)  # label 0: the background, sky over ground
    draw = ImageDraw.Draw(canvas)
    for label in range(1, shapes + 1):
        r = min(width, height) * 0.5 * 50.0 ** -rng.uniform(0, 1)  # log-uniform: many small
        cx, cy = rng.uniform(-r, width + r), rng.uniform(-r, height + r)
        kind = int(rng.integers(3))
        if kind == 0:
            draw.ellipse([cx - r, cy - r * rng.uniform(0.4, 1.6), cx + r, cy + r], fill=label)
        elif kind == 1:
            right = cx + r * rng.uniform(0.3, 2)
            draw.rectangle([cx - r, cy - r * rng.uniform(0.3, 2), right, cy + r], fill=label)
        else:
            angles = np.sort(rng.uniform(0, 2 * np.pi, int(rng.integers(3, 9))))
            stretch = rng.uniform(0.5, 1.3, (len(angles), 2))
            corners = [
                (cx + r * np.cos(a) * sx, cy + r * np.sin(a) * sy)
                for a, (sx, sy) in zip(angles, stretch, strict=True)
            ]
            draw.polygon(corners, fill=label)
    labels = np.asarray(canvas, dtype=np.int32)
    palette = rng.uniform(20, 235, (4, 3)).astype(np.float32)
    colour = palette[rng.integers(4, size=shapes + 1)] + rng.normal(0, 30, (shapes + 1, 3))
    slope = rng.normal(0, 40, (shapes + 1, 2)).astype(np.float32)  # light across each surface
    ys = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    xs = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    pixels = colour.astype(np.float32)[labels]
    pixels += (slope[labels, 0] * xs + slope[labels, 1] * ys)[:, :, None]
    ground = 1 / (1 + np.exp(-(ys - rng.uniform(0.25, 0.75)) * rng.uniform(5, 40)))
    background = palette[0] * (1 - ground) + palette[1] * ground  # (height, 3)
    rows = np.nonzero(labels == 0)[0]
    pixels[labels == 0] = background[rows]
    lens = rng.uniform(0.4, 1.5)
    pixels = np.asarray(
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).filter(
            ImageFilter.GaussianBlur(lens)
        ),
        dtype=np.float32,
    )
    textures = [
        _noise_field(rng, height, width, cell, fall) for cell, fall in ((16, 0.7), (4, 0.9), (2, 1))
    ]
    surface = rng.integers(3, size=shapes + 1)[labels]
    strength = rng.uniform(10, 60, shapes + 1).astype(np.float32)[labels]
    texture = np.where(surface == 0, textures[0], np.where(surface == 1, *textures[1:]))
    tint = rng.uniform(0.7, 1.3, 3).astype(np.float32)
    pixels += (texture * strength)[:, :, None] * tint
    pixels += rng.standard_normal(pixels.shape, dtype=np.float32) * rng.uniform(1, 3)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def _write_photo(job: tuple[Path, int, int]) -> None:
    root, i, seed = job
    rng = np.random.default_rng((seed, i))
    quality = int(rng.integers(85, 96))
    generate_photo(rng).save(root / f"{i:06d}.jpg", quality=quality)


def generate_photos(root: Path, n_images: int, seed: int = 0) -> list[Path]:
    """Write n photo-like JPEGs as <root>/NNNNNN.jpg on every core; return their paths."""
    root.mkdir(parents=True, exist_ok=True)
    jobs = [(root, i, seed) for i in range(n_images)]
    # Its own pool, finished before anything is measured.
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
        for _ in pool.imap_unordered(_write_photo, jobs, chunksize=8):
            pass
    return sorted(root.glob("*.jpg"))


def folder_photos(folder: Path, n_images: int) -> list[Path]:
    """Return the first n image files under folder, in name order, or fail naming the folder."""
    files = sorted(
        p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in PHOTO_SUFFIXES
    )[:n_images]
    if not files:
        raise SystemExit(f"no {', '.join(PHOTO_SUFFIXES)} file under {folder}")
    return files


def sample_photo_crops(spec: PreprocessSpec, count: int = 20, seed: int = 0) -> list[np.ndarray]:
    """Return margin squares of random 4:3 crops of scikit-learn's two sample photos."""
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(seed)
    squares = []
    photos = load_sample_images().images
    for i in range(count):
        photo = photos[i % len(photos)]
        height, width = photo.shape[:2]
        crop_h = int(rng.uniform(0.5, 1.0) * height)
        crop_w = min(width, int(crop_h * 4 / 3))
        top = int(rng.integers(0, height - crop_h + 1))
        left = int(rng.integers(0, width - crop_w + 1))
        buf = io.BytesIO()
        Image.fromarray(photo[top : top + crop_h, left : left + crop_w]).save(
            buf, format="JPEG", quality=92
        )
        squares.append(decode_to_uint8(buf.getvalue(), spec))
    return squares


# ---------------------------------------------------------------------------------------------
# Packing


def pack_raw(files: list[Path], spec: PreprocessSpec, out: Path) -> list[str]:
    """Pack the files as the pack stage does (one worker: one core); return the train shards."""
    import pandas as pd

    from burstcv.data.pack import pack_dataset

    manifest = pd.DataFrame(
        {
            "path": [p.name for p in files],
            "uri": [str(p) for p in files],
            "split": "train",
            "label": "photo",
            "decode_ok": True,
            "bytes": [p.stat().st_size for p in files],
        }
    )
    packed = pack_dataset(manifest, str(out), spec, workers=1, margin=True)
    shards: list[str] = packed.train_shards
    return shards


def encode_jpeg(square: np.ndarray, quality: int) -> bytes:
    """Return the JPEG file of one stored uint8 HWC square."""
    buf = io.BytesIO()
    Image.fromarray(square).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def pack_jpeg(files: list[Path], spec: PreprocessSpec, quality: int, out: Path) -> list[bytes]:
    """Pack the files as JPEG: decode and count them as pack does, encode, write one .npz."""
    from burstcv.data.pack import ChannelStats

    stored = margin_spec(spec)
    squares = np.stack([decode_to_uint8(p.read_bytes(), stored) for p in files])
    ChannelStats().add(squares)  # the training mean and std: pack gathers them in any format
    blobs = [encode_jpeg(square, quality) for square in squares]
    offsets = np.cumsum([0, *(len(b) for b in blobs)], dtype=np.int64)
    buf = io.BytesIO()
    np.savez(
        buf,
        jpeg=np.frombuffer(b"".join(blobs), dtype=np.uint8),
        offsets=offsets,
        labels=np.zeros(len(blobs), np.int64),
        classes=np.array(["photo"]),
    )
    storage.write_bytes(str(out), buf.getvalue())  # as pack writes: atomically, synced
    return blobs


# ---------------------------------------------------------------------------------------------
# Decoding


def per_second(decode_all: Callable[[], int]) -> float:
    """Return items per CPU second of decode_all (which returns its item count), repeated until
    it has used MIN_TIMED_S of CPU.
    """
    done, started = 0, time.process_time()
    while True:
        done += decode_all()
        elapsed = time.process_time() - started
        if elapsed >= MIN_TIMED_S:
            return done / elapsed


def load_raw(shards: list[str]) -> int:
    """Read every image of the raw shards with np.load; return the image count."""
    count = 0
    for shard in shards:
        with np.load(shard) as npz:
            count += len(npz["images"])
    return count


def load_raw_box(shards: list[str]) -> int:
    """Read every image of the raw shards with the training box's reader; return the count."""
    from burstcv.training.stream import load_shard

    return sum(len(load_shard(shard, ["photo"])[0]) for shard in shards)


def encode_all(squares: np.ndarray, quality: int) -> int:
    """Encode every square as JPEG; return the count."""
    for square in squares:
        encode_jpeg(square, quality)
    return len(squares)


def decode_pil(blobs: list[bytes]) -> int:
    """Decode every JPEG to uint8 HWC with Pillow; return the count."""
    for blob in blobs:
        np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))
    return len(blobs)


def decode_torchvision(tensors: list[Any]) -> int:
    """Decode every JPEG (uint8 tensors of the file bytes) with torchvision on the CPU."""
    from torchvision.io import decode_jpeg

    for data in tensors:
        decode_jpeg(data)
    return len(tensors)


def gpu_decode_rate(tensors: list[Any]) -> float | None:
    """Return images/s of nvJPEG (torchvision, batches of GPU_BATCH), or None without CUDA."""
    import torch
    from torchvision.io import decode_jpeg

    if not torch.cuda.is_available():
        return None
    decode_jpeg(tensors[:GPU_BATCH], device="cuda")  # the decoder's handles and buffers
    torch.cuda.synchronize()

    def decode_all() -> int:
        for start in range(0, len(tensors), GPU_BATCH):
            decode_jpeg(tensors[start : start + GPU_BATCH], device="cuda")
        torch.cuda.synchronize()
        return len(tensors)

    return per_second(decode_all)


def fidelity(blobs: list[bytes], squares: np.ndarray) -> tuple[float, float]:
    """Return the mean absolute error and PSNR (dB) of the decoded JPEGs against the squares."""
    abs_sum = sq_sum = 0.0
    for blob, square in zip(blobs, squares, strict=True):
        diff = np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"), np.int32) - square
        abs_sum += float(np.abs(diff).sum())
        sq_sum += float((diff * diff).sum())
    values = squares.size
    mse = sq_sum / values
    psnr = float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)
    return abs_sum / values, float(psnr)


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class FormatFigures:
    """One storage format's measured figures, per image and per core."""

    bytes_per_image: float
    pack_ms_per_image: float
    # What the ingest figures use: the box's reader for raw, the faster CPU decoder for JPEG.
    decode_per_s_core: float
    decoders_per_s_core: dict[str, float]
    encode_ms_per_image: float | None = None  # the JPEG encode alone, part of the pack time
    mean_abs_error: float | None = None  # of the decoded JPEG against the raw square
    psnr_db: float | None = None


def ingest(fig: FormatFigures, vcpus: int, gbit: float) -> tuple[float, str]:
    """Return images/s a box takes in and its bound: 'network' or 'decode'."""
    network = gbit * 1e9 / 8 / fig.bytes_per_image
    decode = vcpus * fig.decode_per_s_core
    return (network, "network") if network <= decode else (decode, "decode")


def default_volume_gb() -> int:
    """Return the root volume a training box gets unless the settings say otherwise."""
    from burstcv.settings import Ec2Settings

    return int(Ec2Settings.model_fields["volume_gb"].default)


def cache_room_gb(volume_gb: int) -> float:
    """Return the GB a root volume leaves the box's shard cache: less the AMI and the reserve."""
    from burstcv.training.stream import CACHE_RESERVE_BYTES

    return float(volume_gb - AMI_GB - CACHE_RESERVE_BYTES / 1e9)


def _median_rounds(rounds: int, sides: Mapping[str, Callable[[], float]]) -> dict[str, float]:
    """Run every side once a round, in an order rotated each round; return each one's median."""
    names = list(sides)
    seen: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seen[name].append(sides[name]())
    return {name: statistics.median(values) for name, values in seen.items()}


def _cpu_ms_per_image(fn: Callable[[], object], count: int) -> Callable[[], float]:
    def run() -> float:
        started = time.process_time()
        fn()
        return (time.process_time() - started) * 1000 / count

    return run


def measure(files: list[Path], spec: PreprocessSpec, root: Path, rounds: int) -> dict[str, Any]:
    """Pack the files raw and as JPEG, decode each, and return every figure."""
    import torch

    torch.set_num_threads(1)  # per-core figures: torchvision's decoder on one thread
    stored = margin_spec(spec)
    count = len(files)

    pack_sides = {"raw": _cpu_ms_per_image(partial(pack_raw, files, spec, root / "raw"), count)}
    for q in QUALITIES:
        pack_q = partial(pack_jpeg, files, spec, q, root / f"q{q}.npz")
        pack_sides[f"JPEG q{q}"] = _cpu_ms_per_image(pack_q, count)
    # Imports and first-call set-up (pandas, the pack module) are no side's cost.
    pack_raw(files[:2], spec, root / "warm-up")
    pack_jpeg(files[:2], spec, QUALITIES[0], root / "warm-up.npz")
    pack_ms = _median_rounds(rounds, pack_sides)

    shards = pack_raw(files, spec, root / "raw")
    squares = np.concatenate([np.load(s)["images"] for s in shards])
    first = decode_to_uint8(files[0].read_bytes(), stored)
    if not np.array_equal(squares[0], first) or squares.shape[1:3] != stored.stored_size:
        raise AssertionError("the packed squares are not decode_to_uint8 with the margin spec")
    raw_bytes = sum(Path(s).stat().st_size for s in shards) / count

    blobs = {q: [encode_jpeg(square, q) for square in squares] for q in QUALITIES}
    tensors = {
        q: [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs[q]] for q in QUALITIES
    }
    decode_sides = {
        "raw np.load": partial(per_second, partial(load_raw, shards)),
        "raw load_shard": partial(per_second, partial(load_raw_box, shards)),
    }
    for q in QUALITIES:
        decode_sides[f"q{q} encode"] = partial(per_second, partial(encode_all, squares, q))
        decode_sides[f"q{q} Pillow"] = partial(per_second, partial(decode_pil, blobs[q]))
        decode_sides[f"q{q} torchvision"] = partial(
            per_second, partial(decode_torchvision, tensors[q])
        )
    # torchvision loads its image library on the first decode: no side's cost either.
    load_raw_box(shards[:1])
    decode_torchvision(tensors[QUALITIES[0]][:2])
    rates = _median_rounds(rounds, decode_sides)

    raw_decoders = {"np.load": rates["raw np.load"], "load_shard": rates["raw load_shard"]}
    # The box reads raw shards with load_shard: its rate is the one a box takes in at.
    formats = {
        "raw": FormatFigures(raw_bytes, pack_ms["raw"], rates["raw load_shard"], raw_decoders)
    }
    gpu: dict[str, float | None] = {}
    for q in QUALITIES:
        decoders = {"Pillow": rates[f"q{q} Pillow"], "torchvision": rates[f"q{q} torchvision"]}
        mae, psnr = fidelity(blobs[q], squares)
        formats[f"JPEG q{q}"] = FormatFigures(
            bytes_per_image=(root / f"q{q}.npz").stat().st_size / count,
            pack_ms_per_image=pack_ms[f"JPEG q{q}"],
            decode_per_s_core=max(decoders.values()),
            decoders_per_s_core=decoders,
            encode_ms_per_image=1000 / rates[f"q{q} encode"],
            mean_abs_error=mae,
            psnr_db=psnr,
        )
        gpu[f"JPEG q{q}"] = gpu_decode_rate(tensors[q])

    real = np.stack(sample_photo_crops(stored))
    real_blobs = [encode_jpeg(square, 90) for square in real]
    return {
        "formats": formats,
        "gpu_decode_per_s": gpu,
        "content_check_q90": {
            "these images": {
                "bytes_per_image": float(np.mean([len(b) for b in blobs[90]])),
                "psnr_db": fidelity(blobs[90], squares)[1],
            },
            "scikit-learn sample photo crops": {
                "bytes_per_image": float(np.mean([len(b) for b in real_blobs])),
                "psnr_db": fidelity(real_blobs, real)[1],
            },
        },
    }


def describe(files: list[Path]) -> dict[str, Any]:
    """Return the source images' count, pixel sizes and file bytes."""
    pixels, shorts = [], []
    for path in files:
        with Image.open(path) as img:
            pixels.append(img.width * img.height)
            shorts.append(min(img.size))
    return {
        "count": len(files),
        "short_side_px": [min(shorts), max(shorts)],
        "median_mpixel": statistics.median(pixels) / 1e6,
        "mean_file_bytes": float(np.mean([p.stat().st_size for p in files])),
    }


def _host() -> dict[str, Any]:
    import torch
    import torchvision

    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pillow": Image.__version__,
        "libjpeg_turbo": features.version("libjpeg_turbo"),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the tables, ratios, ingest rates and cache fits of a run's result."""
    host, images, spec = result["host"], result["images"], result["stored"]
    formats: dict[str, FormatFigures] = result["figures"]["formats"]
    gpu = result["figures"]["gpu_decode_per_s"]
    print(
        f"host: {host['cpu']}, {host['cores']} cores; python {host['python']}, numpy "
        f"{host['numpy']}, pillow {host['pillow']} (libjpeg-turbo {host['libjpeg_turbo']}), "
        f"torch {host['torch']}, torchvision {host['torchvision']}"
    )
    print(
        f"images: {images['count']} {images['source']}, short side {images['short_side_px'][0]}"
        f"-{images['short_side_px'][1]} px, median {images['median_mpixel']:.2f} Mpixel, "
        f"{images['mean_file_bytes'] / 1e3:.0f} KB per file; stored as {spec['height']}x"
        f"{spec['width']} margin squares for {args.px} px ({spec['raw_bytes']:,} bytes raw); "
        f"CPU time, the median of {args.rounds} round{'s' if args.rounds != 1 else ''}"
    )
    check = result["figures"]["content_check_q90"]
    print(
        "content check, JPEG q90 of the margin square: "
        + ", ".join(
            f"{name} {c['bytes_per_image'] / 1e3:.1f} KB, {c['psnr_db']:.1f} dB"
            for name, c in check.items()
        )
        + "\n"
    )

    raw = formats["raw"]
    print(
        f"{'format':<10}{'bytes/img':>11}{'x smaller':>10}{'pack CPU ms':>13}{'x raw':>7}"
        f"{'decode/s/core':>15}  {'(per decoder)':<30}{'MAE':>6}{'PSNR dB':>9}"
    )
    for name, fig in formats.items():
        decoders = ", ".join(f"{k} {v:,.0f}" for k, v in fig.decoders_per_s_core.items())
        error = ""
        if fig.mean_abs_error is not None and fig.psnr_db is not None:
            error = f"{fig.mean_abs_error:>6.2f}{fig.psnr_db:>9.1f}"
        smaller = raw.bytes_per_image / fig.bytes_per_image
        print(
            f"{name:<10}{fig.bytes_per_image:>11,.0f}{smaller:>10.1f}"
            f"{fig.pack_ms_per_image:>13.2f}{fig.pack_ms_per_image / raw.pack_ms_per_image:>7.2f}"
            f"{fig.decode_per_s_core:>15,.0f}  {decoders:<30}{error}"
        )
    for name, fig in formats.items():
        if name == "raw":
            continue
        encode = fig.encode_ms_per_image or 0.0
        written = fig.pack_ms_per_image - raw.pack_ms_per_image - encode
        print(
            f"{name} vs raw: {raw.bytes_per_image / fig.bytes_per_image:.1f}x fewer bytes; pack "
            f"{fig.pack_ms_per_image / raw.pack_ms_per_image:.2f}x the time "
            f"({fig.pack_ms_per_image - raw.pack_ms_per_image:+.2f} ms/image: the encode "
            f"+{encode:.2f}, the rest {written:+.2f}); decode per core "
            f"{raw.decode_per_s_core / fig.decode_per_s_core:.1f}x slower than load_shard, "
            f"{raw.decoders_per_s_core['np.load'] / fig.decode_per_s_core:.1f}x than np.load"
        )
    for name, rate in gpu.items():
        if rate is None:
            print(f"{name} on the GPU (nvJPEG): skipped, no CUDA device")
        else:
            print(f"{name} on the GPU (nvJPEG, {host['gpu']}): {rate:,.0f} images/s")

    print("\nimages/s a box takes in: the lower of the download rate and its vCPUs' decode rate")
    columns = [(v, g) for v in VCPUS for g in GBITS]
    print(f"{'format':<10}" + "".join(f"{f'{v} vCPU {g} Gbit/s':>20}" for v, g in columns))
    for name, fig in formats.items():
        cells = []
        for v, g in columns:
            rate, bound = ingest(fig, v, g)
            cells.append(f"{f'{rate:,.0f} ({bound})':>20}")
        print(f"{name:<10}" + "".join(cells))

    for name, fig in formats.items():
        if name == "raw":
            continue
        crossings = [
            f"{v} vCPU past {v * fig.decode_per_s_core * raw.bytes_per_image * 8 / 1e9:.0f} Gbit/s"
            for v in VCPUS
        ]
        print(
            f"raw takes in as many images/s as {name} only on a link faster than the JPEG "
            f"decode: {', '.join(crossings)}"
        )

    room = result["cache_room_gb"]
    print(
        f"\nImageNet-sized set ({IMAGENET_IMAGES:,} images) against the shard cache of the "
        f"default root volume ({room:.0f} GB: {result['volume_gb']} GB less ~{AMI_GB} GB of AMI "
        "and the cache's reserve)"
    )
    print(f"{'format':<10}{'GB':>8}{'fits':>6}{'cached epoch img/s (gp3 125 MiB/s)':>38}")
    for name, fig in formats.items():
        gb = fig.bytes_per_image * IMAGENET_IMAGES / 1e9
        disk = min(GP3_BASELINE_BYTES_S / fig.bytes_per_image, VCPUS[0] * fig.decode_per_s_core)
        cached = f"{disk:,.0f} on {VCPUS[0]} vCPU" if gb <= room else "- (re-downloaded)"
        print(f"{name:<10}{gb:>8.0f}{'yes' if gb <= room else 'no':>6}{cached:>38}")


def main() -> None:
    """Prepare the images, measure both formats, print the comparison, write --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="images (generated, or the first N)")
    parser.add_argument("--images", type=Path, help="a folder of real photos to use instead")
    parser.add_argument("--px", type=int, default=224, help="the training size (square)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side; medians")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()

    spec = PreprocessSpec(height=args.px, width=args.px, resize_short=resize_short_for(args.px))
    stored = margin_spec(spec)
    with tempfile.TemporaryDirectory(prefix="burstcv-bench-shards-") as tmp:
        root = Path(tmp)
        if args.images:
            files = folder_photos(args.images, args.n)
            source = f"files under {args.images}"
        else:
            started = time.perf_counter()
            files = generate_photos(root / "photos", args.n, args.seed)
            source = f"generated photo-like JPEGs ({time.perf_counter() - started:.0f} s)"
        images = {"source": source, **describe(files)}
        figures = measure(files, spec, root, args.rounds)
    volume_gb = default_volume_gb()
    result = {
        "measured": (
            "raw uint8 vs JPEG shards of the pack margin square: bytes, pack ms and decode "
            "images/s per core (medians of rounds), JPEG error, derived ingest and cache fit"
        ),
        "host": _host(),
        "images": images,
        "stored": {
            "height": stored.height,
            "width": stored.width,
            "raw_bytes": stored.height * stored.width * 3,
        },
        "figures": figures,
        "volume_gb": volume_gb,
        "cache_room_gb": cache_room_gb(volume_gb),
    }
    report(result, args)
    if args.out:
        args.out.write_text(json.dumps(_jsonable(result), indent=2) + "\n")
        print(f"\nwrote {args.out}")


def _jsonable(result: dict[str, Any]) -> dict[str, Any]:
    """Return the result with its dataclasses as dicts and derived figures added."""
    formats: dict[str, FormatFigures] = result["figures"]["formats"]
    out = {**result, "figures": {**result["figures"]}}
    out["figures"]["formats"] = {name: asdict(fig) for name, fig in formats.items()}
    out["ingest_images_per_s"] = {
        name: {f"{v} vCPU {g} Gbit/s": ingest(fig, v, g)[0] for v in VCPUS for g in GBITS}
        for name, fig in formats.items()
    }
    out["imagenet"] = {
        name: {
            "images": IMAGENET_IMAGES,
            "gb": fig.bytes_per_image * IMAGENET_IMAGES / 1e9,
            "fits_cache": fig.bytes_per_image * IMAGENET_IMAGES / 1e9 <= result["cache_room_gb"],
        }
        for name, fig in formats.items()
    }
    return out


if __name__ == "__main__":
    main()
