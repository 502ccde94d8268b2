"""Benchmark the validate stage (scan + GX suite) against a one-process decode-only floor.

Generates an ImageFolder (10 classes, 80/20 train/val) in a temp dir, of one of two kinds:

* ``--kind photos`` (the default, a dataset of realistic size): ``--images`` (2,000) photo-sized
  files, random crops of scikit-learn's two sample photos (a temple, a flower), 480-1080 px on
  the short side, 4:3 or 3:2 either way up, colour-shifted, lit across at a random angle, with
  sensor noise; three in four saved as JPEG (quality 85-95), one in four as PNG;
* ``--kind small``: distinct smooth 32x32 RGB PNGs (CIFAR-sized).

Then, in the same run:

* one validation (``validate_dataset``: scan + manifest.parquet + GX suite + Data Docs) with
  the peak memory of the whole process tree (this process plus its pool workers: PSS, sampled
  every 50 ms from /proc by a separate process);
* ``--rounds`` (5) rounds of three sides, in an order rotated from round to round (this
  machine drifts more over a minute than within a round): the floor (one process opens and
  fully decodes every file, the least work any validator must do), a validation, and a
  validation without the difference hash (what the near-duplicate check costs). Each figure
  is the median over rounds, in wall and in CPU seconds (this process and its pool workers);
  the ratios to the floor are medians of each round's own ratio. On a machine others share,
  read the CPU figures: the wall times swing by a third from one minute to the next.

Each validation starts as the validate stage does, in a process with no other thread: GX's
progress bars leave tqdm's monitor thread running, and a scan started beside a live thread
spawns its pool's workers instead of forking them, so the bench stops that thread in between.

Fast paths on other libraries' internals (Pillow's decoder and core image API, GX's Jinja
views, tqdm's monitor) were measured with this script against their public fallbacks and
deleted, as none gained 10% of this end-to-end figure (2,000 photos, 2 shared cores: one
validation 19.3 s CPU, 20 s wall): the PNG fast path, core thumbnails and strip hashing
together 1.1 s CPU (6%), each alone within the noise; GX's template cache 0.17 s (1%); the
tqdm patch nothing, as it only spared a later scan in the same process (spawned workers, a
few seconds), which the stage never runs. On 20,000 32x32 PNGs (a 2 s validation) the PNG
fast path saved 0.3-0.45 s. A new fast path on such internals stays only if it gains 10%.

    python bench/validate.py                       # 2,000 photos
    python bench/validate.py --kind small --images 20000
    python bench/validate.py --dir /tmp/photos     # keep the dataset for the next run

``--celery`` measures the stage spread over Airflow's Celery workers instead: images/s with 1
and 2 one-slot workers side by side, a scan task per ``--chunk-files`` files, and the
per-chunk overhead (bench/scaleout.py; bench/pack.py prints the same run's pack figures).

    python bench/validate.py --celery --chunk-files 250
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

CLASSES = 10

# ---------------------------------------------------------------------------------------------
# Datasets


def _place(root: Path, i: int) -> Path:
    """Return the folder of file i: class i % 10; every fifth group of ten goes to val."""
    split = "val" if (i // CLASSES) % 5 == 0 else "train"
    return root / split / f"c{i % CLASSES}"


def _make_folders(root: Path) -> None:
    for split in ("train", "val"):
        for label in range(CLASSES):
            (root / split / f"c{label}").mkdir(parents=True, exist_ok=True)


def generate_small(root: Path, n_images: int, seed: int = 0) -> None:
    """Write n distinct smooth 32x32 RGB PNGs as <root>/<split>/<class>/<i>.png."""
    _make_folders(root)
    rng = np.random.default_rng(seed)
    block = 10_000
    for start in range(0, n_images, block):
        count = min(block, n_images - start)
        pixels = rng.integers(0, 256, size=(count, 8, 8, 3), dtype=np.uint8)
        for offset in range(count):
            i = start + offset
            img = Image.fromarray(pixels[offset], "RGB")
            img = img.resize((32, 32), Image.Resampling.BILINEAR)
            img.save(_place(root, i) / f"{i:07d}.png", compress_level=1)


_SOURCES: list[np.ndarray[Any, Any]] = []


def _load_sources() -> None:
    from sklearn.datasets import load_sample_images

    _SOURCES[:] = [np.asarray(img) for img in load_sample_images().images]


def _write_photo(job: tuple[Path, int, int]) -> None:
    """Write photo i: a crop of a sample photo, resized, colour-shifted, noisy; JPEG or PNG."""
    root, i, seed = job
    rng = np.random.default_rng((seed, i))
    source = _SOURCES[i % len(_SOURCES)]
    height, width = source.shape[:2]
    aspect = (4 / 3, 3 / 2)[int(rng.integers(2))]
    landscape = rng.random() < 0.7
    crop_h = int(rng.uniform(0.45, 0.95) * height)
    crop_w = min(width, int(crop_h * aspect)) if landscape else int(crop_h / aspect)
    top = int(rng.integers(0, height - crop_h + 1))
    left = int(rng.integers(0, width - crop_w + 1))
    crop = Image.fromarray(source[top : top + crop_h, left : left + crop_w])
    short = int(rng.integers(480, 1081))
    scale = short / min(crop.size)
    img = crop.resize(
        (round(crop.width * scale), round(crop.height * scale)), Image.Resampling.BICUBIC
    )
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    pixels = np.asarray(img, dtype=np.float32) * rng.uniform(0.8, 1.2, size=3).astype(np.float32)
    # Light falling across the frame at a random angle: no two crops share a difference hash.
    angle = rng.uniform(0, 2 * np.pi)
    ys, xs = np.mgrid[0 : img.height, 0 : img.width].astype(np.float32)
    ramp = (np.cos(angle) * xs / img.width + np.sin(angle) * ys / img.height) * 80 - 40
    pixels += ramp[:, :, None] + rng.standard_normal(pixels.shape, dtype=np.float32) * 3
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    folder = _place(root, i)
    if i % 4 == 3:  # level 1: a noisy photo takes a third of a second at the default 6
        img.save(folder / f"{i:06d}.png", compress_level=1)
    else:
        img.save(folder / f"{i:06d}.jpg", quality=int(rng.integers(85, 96)))


def generate_photos(root: Path, n_images: int, seed: int = 0) -> None:
    """Write n photo-sized JPEGs and PNGs as <root>/<split>/<class>/<i>.jpg|png, on every core."""
    _make_folders(root)
    jobs = [(root, i, seed) for i in range(n_images)]
    # Its own pool, finished before anything is measured.
    with multiprocessing.get_context("fork").Pool(os.cpu_count(), _load_sources) as pool:
        for _ in pool.imap_unordered(_write_photo, jobs, chunksize=16):
            pass


def dataset_files(root: Path) -> list[Path]:
    """Return every file of the dataset, sorted."""
    return sorted(p for p in root.rglob("*") if p.is_file())


def describe(files: list[Path]) -> str:
    """Return a one-line description: counts per extension, size range, bytes."""
    exts: dict[str, int] = {}
    for path in files:
        exts[path.suffix] = exts.get(path.suffix, 0) + 1
    sample = files[:: max(1, len(files) // 200)]
    sizes = []
    for path in sample:
        with Image.open(path) as img:
            sizes.append(img.width * img.height)
    total = sum(path.stat().st_size for path in files)
    kinds = ", ".join(f"{count} {ext}" for ext, count in sorted(exts.items()))
    return (
        f"{len(files)} files ({kinds}), median {statistics.median(sizes) / 1e6:.2f} Mpixel, "
        f"{total / 2**20:.0f} MiB"
    )


# ---------------------------------------------------------------------------------------------
# Measuring


def decode_floor(files: list[Path]) -> None:
    """Open and fully decode every file in one process."""
    for path in files:
        with Image.open(path) as img:
            img.load()


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Run fn; return its wall seconds and CPU seconds (this process and its finished children)."""
    before = _cpu_seconds()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started, _cpu_seconds() - before


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # pool workers, once joined
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


_SAMPLER = r"""
import os, select, sys
root, me, page = int(sys.argv[1]), os.getpid(), os.sysconf("SC_PAGE_SIZE")

def memory(pid):
    try:  # PSS shares fork's copy-on-write pages out fairly; RSS would count them per process
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    with open(f"/proc/{pid}/statm") as fh:
        return int(fh.read().split()[1]) * page

def sample():
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        if pid == me:
            continue
        try:
            total += memory(pid)
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as fh:
                    pending.extend(int(child) for child in fh.read().split())
        except (OSError, ValueError):
            continue  # the process ended while being read
    return total

peak = sample()
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0.05)[0]:
    peak = max(peak, sample())
print(max(peak, sample()), flush=True)
"""


class TreeMemory:
    """Track the peak memory (PSS) of this process and all its descendants.

    The sampler is a separate process, not a thread: a live thread would make the scan's pool
    fall back from fork to spawn and change what is being measured.
    """

    def __init__(self) -> None:
        self.peak_bytes = 0
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> TreeMemory:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        self._proc.stdout.readline()  # "ready": sampling has started
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        out, _ = self._proc.communicate("stop\n", timeout=60)
        self.peak_bytes = int(out.split()[-1])


def stop_tqdm_monitor() -> None:
    """Stop the monitor thread a tqdm bar left running (as GX's progress bars leave one).

    The thread is kept on the class of the bar that started it, a subclass of tqdm's own
    (GX's bars are ``tqdm.auto``'s): every class that holds one forgets it.
    """
    import threading

    from tqdm import std

    for thread in threading.enumerate():
        if isinstance(thread, std.TMonitor):
            thread.exit()
            thread.join(timeout=30)
    classes = [std.tqdm]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if vars(cls).get("monitor") is not None:
            cls.monitor = None


def require_fork() -> None:
    """Stop the benchmark if this process's next scan would spawn its workers, not fork them."""
    import threading

    from burstcv.data.scanner.dispatch import pool_context

    if pool_context().get_start_method() != "fork":
        names = [thread.name for thread in threading.enumerate()]
        raise SystemExit(f"a scan here would spawn its workers (threads alive: {names})")


def main() -> None:
    """Run the benchmark and print one line per measurement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("photos", "small"), default="photos")
    parser.add_argument("--images", type=int, default=None, help="default: 2000 (small: 20000)")
    parser.add_argument("--workers", type=int, default=None, help="default: as validate picks")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every side")
    parser.add_argument("--dir", type=Path, default=None, help="reuse/keep a dataset here")
    parser.add_argument("--celery", action="store_true", help="1 vs 2 Celery workers")
    parser.add_argument("--chunk-files", type=int, default=250, help="--celery: per scan task")
    args = parser.parse_args()
    n_images = args.images or (2000 if args.kind == "photos" else 20_000)

    scratch = Path(tempfile.mkdtemp(prefix="burstcv-bench-"))
    root = args.dir or scratch / "dataset"
    try:
        if not (root / "train").is_dir():
            started = time.perf_counter()
            (generate_photos if args.kind == "photos" else generate_small)(root, n_images)
            print(f"generated {n_images} {args.kind} in {time.perf_counter() - started:.1f} s")
        if args.celery:
            import scaleout

            images = len(dataset_files(root))
            result = scaleout.compare(root, images, args.chunk_files, image_size=224)
            print(scaleout.report(result, "validate"))
        else:
            run(root, scratch, args.workers, args.rounds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(root: Path, scratch: Path, workers: int | None, rounds: int) -> None:
    """Measure one validation with its peak memory, then the rounds of sides."""
    # Imported here so that the import time of GX/pandas is charged to no side.
    from burstcv.data.validate import ValidationConfig, summary, validate_dataset

    files = dataset_files(root)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"python {platform.python_version()}; pillow {Image.__version__}; workers: "
        f"{workers or 'default'}\ndataset: {describe(files)}",
        flush=True,
    )
    outs = iter(range(100_000))

    def validation(distance: int | None) -> Callable[[], None]:
        config = ValidationConfig(
            min_total_images=min(20, len(files)),
            min_images_per_class=1,
            near_duplicate_max_distance=distance,
        )

        def validate() -> None:
            stop_tqdm_monitor()  # the last validation's: the stage's process has no thread
            require_fork()
            out = str(scratch / f"out{next(outs)}")
            report = validate_dataset(str(root), out, config, workers=workers)
            if not report.success:
                raise SystemExit(f"benchmark dataset failed validation:\n{summary(report)}")

        return validate

    sides: dict[str, Callable[[], None]] = {
        "floor (1 process, open+load)": lambda: decode_floor(files),
        "validate (scan+parquet+GX+Data Docs)": validation(0),
        "validate (same, near-duplicate check off)": validation(None),
    }
    decode_floor(files)  # warm the page cache so every side reads from memory
    with TreeMemory() as memory:
        wall, cpu = timed(sides["validate (scan+parquet+GX+Data Docs)"])
    print(
        f"one validation: {wall:.2f} s wall, {cpu:.2f} s CPU, "
        f"peak tree PSS {memory.peak_bytes / 2**20:.0f} MiB",
        flush=True,
    )
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    names = list(sides)
    for round_no in range(rounds):
        shift = round_no % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed(sides[name]))
    floor = times[names[0]]
    n = len(files)
    head = f"medians of {rounds} rounds"
    print(f"\n  {head:42s} {'wall s':>7s} {'CPU s':>7s} {'images/s':>9s}  floor/side (wall, CPU)")
    for name, runs in times.items():
        wall = statistics.median(t[0] for t in runs)
        cpu = statistics.median(t[1] for t in runs)
        ratios = [
            statistics.median(f[kind] / t[kind] for f, t in zip(floor, runs, strict=True))
            for kind in (0, 1)
        ]
        print(
            f"  {name:42s} {wall:7.2f} {cpu:7.2f} {n / wall:9.0f}  "
            f"{ratios[0]:5.2f}x {ratios[1]:5.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
