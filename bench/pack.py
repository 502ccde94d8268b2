"""Benchmark pack spread over Airflow's Celery workers: images/s with 1 and 2 workers.

Generates photo-sized files (bench/validate.py's generator: crops of two sample photos,
480-1080 px on the short side, JPEG and PNG; ``--images``, default 2,000) and runs the
pipeline's own data stages on them, side by side on a Celery stack of 1 and of 2 one-slot
workers (bench/scaleout.py says how each figure is measured). Pack decodes each image once
into the 224 px training size (photos: the 256 px margin square), a chunk of shards per task.

    python bench/pack.py                           # 2,000 photos, 250 files a chunk
    python bench/pack.py --images 4000 --chunk-files 500 --dir /tmp/photos --out pack.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import scaleout
from validate import generate_photos


def main() -> None:
    """Generate (or reuse) the photos, run both sides, print the pack and validate tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--chunk-files", type=int, default=250)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--dir", type=Path, default=None, help="reuse/keep the photos here")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="burstcv-bench-pack-"))
    root = args.dir or scratch / "dataset"
    try:
        if not (root / "train").is_dir():
            started = time.perf_counter()
            generate_photos(root, args.images)
            print(f"generated {args.images} photos in {time.perf_counter() - started:.1f} s")
        images = sum(1 for p in root.rglob("*") if p.is_file())
        result = scaleout.compare(root, images, args.chunk_files, args.image_size)
        print(scaleout.report(result, "pack"))
        print(scaleout.report(result, "validate"))
        if args.out:
            args.out.write_text(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
