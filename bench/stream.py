"""Measure streamed training data against the whole-in-memory path, and raw against JPEG shards.

Images: random crops of scikit-learn's two sample photos (427x640 JPEGs of a temple and a
flower), 400 distinct files resized to the training size by pack_dataset, 10 classes, 20,000
training images (each file used 50 times) in shards of ``--shard-images``.

1. Feed rate and peak memory, each path in its own child process: every training batch of one
   epoch is produced as the training loop gets it (uint8 NCHW on the device, here the CPU)
   and touched; peak RSS is the child's, less its RSS before the data is opened.
2. Shard formats: bytes per image and decode rate (one core) of raw uint8 .npz against JPEG
   at quality 90 and 95, and what that means for a box that downloads at 1 and 10 Gbit/s
   and decodes on 4 vCPUs.

    python bench/stream.py
    python bench/stream.py --images 20000 --px 64 --shard-images 2000 --budget-mb 64
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CLASSES = 10
DISTINCT_FILES = 400


def prepare(root: Path, images: int, val: int, px: int, shard_images: int) -> dict[str, Any]:
    """Write photo crops as PNGs and pack ``images`` + ``val`` rows of them into shards."""
    import pandas as pd
    from PIL import Image
    from sklearn.datasets import load_sample_images

    from burstcv.data import pack
    from burstcv_spec.preprocess import PreprocessSpec

    photos = load_sample_images().images
    rng = np.random.default_rng(0)
    (root / "files").mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(DISTINCT_FILES):
        photo = photos[i % len(photos)]
        size = int(rng.integers(px, 3 * px))
        top = int(rng.integers(0, photo.shape[0] - size))
        left = int(rng.integers(0, photo.shape[1] - size))
        path = root / "files" / f"{i}.png"
        Image.fromarray(photo[top : top + size, left : left + size]).save(path)
        files.append(str(path))
    rows = [
        {
            "path": f"{split}/{n}.png",
            "uri": files[n % DISTINCT_FILES],
            "split": split,
            "label": str(n % CLASSES),
            "decode_ok": True,
        }
        for split, count in (("train", images), ("val", val))
        for n in range(count)
    ]
    spec = PreprocessSpec(height=px, width=px)
    pack.SHARD_IMAGES = shard_images
    result = pack.pack_dataset(pd.DataFrame(rows), str(root / "shards"), spec, workers=2)
    return {
        "run_id": "bench",
        "classes": result.classes,
        "train_shards": result.train_shards,
        "val_shards": result.val_shards,
        "preprocess": spec.to_dict(),
        "output_uri": str(root / "job"),
        "batch_size": 256,
    }


def _vm_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(job_json: str) -> None:
    """Feed one epoch of training batches; print images/s and memory as one JSON line."""
    import torch

    from burstcv.training.job import JobSpec
    from burstcv.training.train import _train_batches, open_splits

    job = JobSpec.model_validate_json(Path(job_json).read_text())
    torch.zeros(1).sum()  # torch's own start-up memory belongs to the baseline
    before_kb = _vm_kb("VmRSS")
    t0 = time.perf_counter()
    train, _, share = open_splits(job, torch.device("cpu"))
    open_s = time.perf_counter() - t0
    seen = 0
    t1 = time.perf_counter()
    batches = _train_batches(train, job.seed, 0, 0, share)
    for x, _y in batches:
        x.float().mean()  # what normalize() does first: every byte is read
        seen += x.shape[0]
    feed_s = time.perf_counter() - t1
    print(
        json.dumps(
            {
                "path": type(train).__name__,
                "images": seen,
                "open_s": open_s,
                "images_per_s": seen / feed_s,
                "rss_growth_mb": (_vm_kb("VmHWM") - before_kb) / 1024,
            }
        )
    )


def run_child(job: dict[str, Any], budget_mb: int, root: Path) -> dict[str, Any]:
    """Run ``child`` for a job under a data memory budget; return its JSON line."""
    path = root / f"job-{budget_mb}.json"
    path.write_text(json.dumps({**job, "data_memory_budget_mb": budget_mb}))
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(path)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ},
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def formats(shard_uri: str, limit: int) -> dict[str, dict[str, float]]:
    """Return bytes/image and one-core decode images/s of raw .npz and JPEG q90/q95."""
    from PIL import Image

    with np.load(shard_uri) as npz:
        images = npz["images"][:limit]
    raw_bytes = Path(shard_uri).stat().st_size / len(np.load(shard_uri)["labels"])
    blob = Path(shard_uri).read_bytes()
    t0 = time.perf_counter()
    repeats = 5
    for _ in range(repeats):
        with np.load(io.BytesIO(blob)) as npz:
            decoded = npz["images"]
    raw_rate = repeats * len(decoded) / (time.perf_counter() - t0)
    result = {"raw npz": {"bytes_per_image": raw_bytes, "decode_per_s_core": raw_rate}}
    for quality in (90, 95):
        encoded = []
        for img in images:
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=quality)
            encoded.append(buf.getvalue())
        t0 = time.perf_counter()
        for data in encoded:
            np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        rate = len(encoded) / (time.perf_counter() - t0)
        result[f"JPEG q{quality}"] = {
            "bytes_per_image": float(np.mean([len(e) for e in encoded])),
            "decode_per_s_core": rate,
        }
    return result


def main() -> None:
    """Prepare the shards, run both paths, measure the formats, print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--val", type=int, default=2_000)
    parser.add_argument("--px", type=int, default=64)
    parser.add_argument("--shard-images", type=int, default=2_000)
    parser.add_argument("--budget-mb", type=int, default=64, help="for the streamed run")
    parser.add_argument("--vcpus", type=int, default=4, help="the box's decode cores")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return

    import torch

    with tempfile.TemporaryDirectory(prefix="burstcv-bench-stream-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        job = prepare(root, args.images, args.val, args.px, args.shard_images)
        data_mb = sum(Path(u).stat().st_size for u in job["train_shards"]) / 2**20
        print(
            f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
            f"torch {torch.__version__}, numpy {np.__version__}"
        )
        print(
            f"data: {args.images} train images of {args.px} px = {data_mb:.0f} MB in "
            f"{len(job['train_shards'])} shards (packed in {time.perf_counter() - t0:.0f} s)\n"
        )
        runs = {
            "streamed": run_child(job, args.budget_mb, root),
            "whole": run_child(job, 1_000_000, root),
        }
        print(f"{'path':<10}{'budget MB':>10}{'images/s':>11}{'open s':>8}{'RSS +MB':>9}")
        for name, run in runs.items():
            budget = args.budget_mb if name == "streamed" else "-"
            print(
                f"{name:<10}{budget:>10}{run['images_per_s']:>11.0f}{run['open_s']:>8.2f}"
                f"{run['rss_growth_mb']:>9.0f}"
            )
        ratio = runs["streamed"]["images_per_s"] / runs["whole"]["images_per_s"]
        print(f"streamed / whole feed rate: {ratio:.2f}\n")

        figures = formats(job["train_shards"][0], limit=args.shard_images)
        print(f"{'format':<10}{'bytes/img':>10}{'decode/s/core':>15}", end="")
        gbits = (1, 10)
        for g in gbits:
            print(f"{f'{g} Gbit/s img/s':>17}", end="")
        print()
        rates: dict[str, dict[int, float]] = {}
        for name, fig in figures.items():
            decode = fig["decode_per_s_core"] * args.vcpus
            rates[name] = {g: min(g * 1e9 / 8 / fig["bytes_per_image"], decode) for g in gbits}
            print(
                f"{name:<10}{fig['bytes_per_image']:>10.0f}{fig['decode_per_s_core']:>15.0f}",
                end="",
            )
            for g in gbits:
                print(f"{rates[name][g]:>17.0f}", end="")
            print()
        print(
            f"(images/s a box can take in: the lower of the download rate and {args.vcpus} "
            "vCPUs' decode rate)"
        )
        best_jpeg = max((n for n in rates if n.startswith("JPEG")), key=lambda n: rates[n][1])
        gain = {g: rates[best_jpeg][g] / rates["raw npz"][g] for g in gbits}
        smaller = figures["raw npz"]["bytes_per_image"] / figures[best_jpeg]["bytes_per_image"]
        print(
            f"{best_jpeg} vs raw: x{gain[1]:.1f} at 1 Gbit/s, x{gain[10]:.1f} at 10 Gbit/s; "
            f"{smaller:.1f}x smaller"
        )
        if gain[1] >= 1.5 and gain[10] >= 1.0:
            print("recommendation: JPEG shards (the download is the bottleneck)")
        else:
            print(
                "recommendation: raw uint8 shards: JPEG wins only where the link is slow, and "
                "then spends the GPU box's paid CPU on decoding, lossy"
            )


if __name__ == "__main__":
    main()
