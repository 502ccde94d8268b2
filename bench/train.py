"""Measure training throughput: the burstcv data path against torchvision's, same model, same box.

The baseline is what most photo training scripts do: torchvision ImageFolder decoding every
JPEG every epoch through a DataLoader (RandomResizedCrop + flip on the CPU workers). The job
under test is ``burstcv.training.train.main`` on the shards burstcv's pack step writes (uint8,
at the training size with the random-crop margin), streamed or whole as the data memory budget
decides, with the crops and flips done on the device. Both train the same architecture from
scratch on the same images, with the same precision and memory format (bf16 autocast and
channels_last on CUDA; fp32 on a CPU), each in its own child process, and the ratio of
steady-state images/s (the last epoch) is printed, with each side's peak RSS and, on CUDA, its
mean GPU utilisation (nvidia-smi samples over the last epoch) and the fraction of NVIDIA's
published single-GPU ResNet-50 mixed-precision training throughput for that GPU.

Packing runs once before either trainer, on the orchestrator's CPUs, not in paid GPU time, and
is timed apart. ``--vcpus`` (default 4) pins both children to that many CPUs: the vCPUs of
the g4dn/g5/g6.xlarge boxes burstcv rents, where the DataLoader's decode workers compete with
the training loop.

    python bench/train.py --model resnet50 --image-size 224                     # a lent GPU
    python bench/train.py --model resnet18 --image-size 96 --images 1200 --epochs 2   # a CPU
    python bench/train.py --data digits --model resnet10 --scale 4             # the digits

``--measure accuracy`` compares what the two reach instead, after ``--epochs`` epochs each on
real photos (crops of scikit-learn's): the plain torchvision recipe (ResNet-18 from scratch,
AdamW 1e-3, cosine, batch 32, RandomResizedCrop + flip) against the burstcv job with every
training default it derives from the data (burstcv.training.recipe; from scratch too, no
early stop, so both train the same number of epochs):

    python bench/train.py --data photos --measure accuracy --images 300 --image-size 128 --epochs 15
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# NVIDIA's published single-GPU ResNet-50 v1.5 training throughput, mixed precision, PyTorch
# (DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5, NGC 21.03), images/s.
# A GPU not listed gets no fraction unless --reference gives one.
PUBLISHED_RN50_AMP = {
    "A100-SXM4-80GB": 2470.0,
    "A100 80GB": 2470.0,
    "V100-SXM2-16GB": 1200.0,
    "V100-SXM2-32GB": 1156.0,
}
GPU_SAMPLE_S = 0.2
PRECISION = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}


# ---------------------------------------------------------------------------------------------
# Data


def prepare_photos(root: Path, images: int, val: int, px: int) -> dict[str, Any]:
    """Write a JPEG photo folder of ``images`` training files and pack it at ``px``."""
    import dataclasses

    from burstcv.data.manifest import scan
    from burstcv.data.pack import pack_dataset
    from burstcv.data.photos import PHOTO_CLASSES, write_photo_dataset
    from burstcv_spec.preprocess import PreprocessSpec, resize_short_for

    per_class = (-(-images // len(PHOTO_CLASSES)), max(1, val // len(PHOTO_CLASSES)))
    t0 = time.perf_counter()
    write_photo_dataset(root / "photos", per_class=per_class)
    write_s = time.perf_counter() - t0
    manifest = scan(str(root / "photos"), phash=False).manifest
    spec = PreprocessSpec(height=px, width=px, resize_short=resize_short_for(px))
    t1 = time.perf_counter()
    packed = pack_dataset(
        manifest, str(root / "shards"), spec, workers=os.cpu_count() or 1, margin=True
    )
    pack_s = time.perf_counter() - t1
    spec = dataclasses.replace(spec, mean=packed.preprocess.mean, std=packed.preprocess.std)
    return {
        "data": str(root / "photos"),
        "classes": packed.classes,
        "train_shards": packed.train_shards,
        "val_shards": packed.val_shards,
        "counts": packed.counts,
        "preprocess": spec.to_dict(),
        "px": px,
        "photos": True,
        "write_s": write_s,
        "pack_s": pack_s,
        "shard_bytes": sum(Path(p).stat().st_size for p in packed.train_shards),
        "file_bytes": sum(p.stat().st_size for p in (root / "photos" / "train").rglob("*.*")),
    }


def prepare_digits(root: Path, scale: int) -> dict[str, Any]:
    """Write the demo digits (``scale`` copies of the train split) and pack them at 32 px."""
    from burstcv.data.demo import pack_demo, write_demo_dataset

    data = root / "digits"
    write_demo_dataset(data)
    for copy in range(1, scale):
        for path in list((data / "train").rglob("*.png")):
            if "_c" not in path.stem:
                shutil.copy(path, path.with_name(f"{path.stem}_c{copy}.png"))
    t0 = time.perf_counter()
    packed, spec = pack_demo(data, str(root / "shards"))
    return {
        "data": str(data),
        "classes": packed.classes,
        "train_shards": packed.train_shards,
        "val_shards": packed.val_shards,
        "counts": packed.counts,
        "preprocess": spec.to_dict(),
        "px": spec.height,
        "photos": False,
        "write_s": 0.0,
        "pack_s": time.perf_counter() - t0,
        "shard_bytes": sum(Path(p).stat().st_size for p in packed.train_shards),
        "file_bytes": sum(p.stat().st_size for p in (data / "train").rglob("*.png")),
    }


# ---------------------------------------------------------------------------------------------
# Measuring, inside a child


class GpuSampler:
    """Sample nvidia-smi's GPU utilisation every GPU_SAMPLE_S s, with monotonic timestamps."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._index = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"

    def _run(self) -> None:
        while not self._stop.wait(GPU_SAMPLE_S):
            try:
                out = subprocess.run(
                    [
                        "nvidia-smi",
                        "-i",
                        self._index,
                        "--query-gpu=utilization.gpu",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=5,
                    check=True,
                ).stdout
                self.samples.append((time.monotonic(), float(out.strip().splitlines()[0])))
            except (OSError, subprocess.SubprocessError, ValueError, IndexError):
                return

    def __enter__(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def mean(self, start: float, end: float) -> float | None:
        """Return the mean utilisation (%) of the samples taken between start and end."""
        inside = [u for t, u in self.samples if start <= t <= end]
        return sum(inside) / len(inside) if inside else None


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _children_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def child_baseline(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train the torchvision way: ImageFolder + DataLoader, decode and augment on the CPU."""
    import torch
    from torch import nn
    from torchvision import datasets, transforms

    from burstcv.training.models import build_model
    from burstcv.training.train import _amp_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    px, spec = cfg["px"], cfg["preprocess"]
    augment = (
        [transforms.RandomResizedCrop(px, antialias=True), transforms.RandomHorizontalFlip()]
        if cfg["photos"]
        else [transforms.RandomCrop(px, padding=2)]
    )
    tf = transforms.Compose(
        [*augment, transforms.ToTensor(), transforms.Normalize(spec["mean"], spec["std"])]
    )
    dataset = datasets.ImageFolder(str(Path(cfg["data"]) / "train"), transform=tf)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=cfg["batch"],
        shuffle=True,
        drop_last=True,
        num_workers=cfg["workers"],
        pin_memory=device.type == "cuda",
        persistent_workers=cfg["workers"] > 0,
        prefetch_factor=4 if cfg["workers"] > 0 else None,
    )
    model = build_model(cfg["model"], len(dataset.classes), px).to(device)
    # The precision the burstcv job picks on this device (train._amp_dtype): bf16, else fp16.
    amp = _amp_dtype(device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    plain = cfg.get("measure") == "accuracy"
    if plain:  # the plain torchvision recipe: AdamW 1e-3, cosine over the run
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg["epochs"] * len(loader))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    before_kb = _rss_kb("VmRSS")
    epochs: list[dict[str, float]] = []
    with GpuSampler() as gpu:
        for _ in range(cfg["epochs"]):
            seen, start = 0, time.monotonic()
            for x, y in loader:
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                if device.type == "cuda":
                    x = x.contiguous(memory_format=torch.channels_last)
                autocast = (
                    torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()
                )
                with autocast:
                    loss = loss_fn(model(x), y)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                if plain:
                    sched.step()
                seen += len(y)
            if device.type == "cuda":
                torch.cuda.synchronize()
            end = time.monotonic()
            epochs.append({"images_per_s": seen / (end - start), "start": start, "end": end})
    last = epochs[-1]
    result = {
        "images_per_s": last["images_per_s"],
        "epoch_images_per_s": [e["images_per_s"] for e in epochs],
        "gpu_util": gpu.mean(last["start"], last["end"]),
        "rss_growth_mb": (_rss_kb("VmHWM") - before_kb) / 1024,
        "workers_peak_rss_mb": _children_peak_mb(),
        "precision": PRECISION.get(str(amp), "fp32"),
    }
    if plain:
        result["val_accuracy"] = _baseline_accuracy(model, cfg, device)
        result["recipe"] = f"AdamW 1e-3, cosine, batch {cfg['batch']}, {cfg['epochs']} epochs"
    return result


def _baseline_accuracy(model: Any, cfg: dict[str, Any], device: Any) -> float:
    """Return top-1 on the val folder, decoded as serving does (short side, centre crop)."""
    import torch
    from torchvision import datasets, transforms

    spec = cfg["preprocess"]
    tf = transforms.Compose(
        [
            transforms.Resize(spec.get("resize_short") or cfg["px"], antialias=True),
            transforms.CenterCrop(cfg["px"]),
            transforms.ToTensor(),
            transforms.Normalize(spec["mean"], spec["std"]),
        ]
    )
    dataset = datasets.ImageFolder(str(Path(cfg["data"]) / "val"), transform=tf)
    model.eval()
    right = 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(dataset, batch_size=64):
            right += int((model(x.to(device)).argmax(1).cpu() == y).sum())
    return right / max(1, len(dataset))


def child_burstcv(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train with the burstcv job on the packed shards; time its last epoch."""
    import logging

    import torch

    from burstcv.training.job import JobSpec
    from burstcv.training.train import main

    boundaries: list[float] = []
    streamed: list[bool] = []

    class EpochMarks(logging.Handler):
        """Note when each epoch ends, and whether the job chose to stream its shards."""

        def emit(self, record: logging.LogRecord) -> None:
            message = str(record.msg)
            if message.startswith("epoch "):
                boundaries.append(time.monotonic())
            elif message.startswith("data of "):
                streamed.append(True)

    logging.getLogger("burstcv.training.train").addHandler(EpochMarks())
    logging.getLogger("burstcv.training.train").setLevel(logging.INFO)
    job = JobSpec(
        run_id="bench",
        arch=cfg["model"],
        classes=cfg["classes"],
        train_shards=cfg["train_shards"],
        val_shards=cfg["val_shards"],
        preprocess=cfg["preprocess"],
        output_uri=cfg["out"],
        epochs=cfg["epochs"],
        batch_size=cfg["batch"],
        checkpoint_every_s=1e9,
        data_memory_budget_mb=cfg["budget_mb"],
    )
    recipe = None
    if cfg.get("measure") == "accuracy":  # every training default, for --epochs epochs
        from burstcv.training.recipe import RecipeRequest, choose_recipe

        recipe = choose_recipe(
            cfg["counts"]["train"],
            photos=cfg["photos"],
            request=RecipeRequest(epochs=cfg["epochs"], early_stop_patience=cfg["epochs"]),
        )
        job = job.model_copy(
            update={
                "arch": recipe.model,
                "batch_size": recipe.batch_size,
                "learning_rate": recipe.learning_rate,
                "optimizer": recipe.optimizer,
                "warmup_steps": recipe.warmup_steps,
                "early_stop_patience": recipe.early_stop_patience,
            }
        )
    torch.zeros(1).sum()
    before_kb = _rss_kb("VmRSS")
    with GpuSampler() as gpu:
        started = time.monotonic()
        metrics = main(job)
    last = metrics.epochs[-1]
    window = (boundaries[-2] if len(boundaries) > 1 else started, boundaries[-1])
    return {
        "images_per_s": last.images_per_s,
        "epoch_images_per_s": [e.images_per_s for e in metrics.epochs],
        "gpu_util": gpu.mean(*window),
        "rss_growth_mb": (_rss_kb("VmHWM") - before_kb) / 1024,
        "precision": PRECISION.get(metrics.amp_dtype, "fp32"),
        "val_accuracy": metrics.val_accuracy,
        "data_path": "streamed" if streamed else "whole on the device",
        "wall_s": metrics.wall_s.model_dump(),
        "recipe": recipe.reason if recipe else None,
    }


def run_child(
    kind: str, cfg: dict[str, Any], root: Path, vcpus: list[int] | None
) -> dict[str, Any]:
    """Run one trainer in its own process (pinned to ``vcpus``) and return its JSON line."""
    path = root / f"{kind}.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if vcpus:
        env["OMP_NUM_THREADS"] = str(len(vcpus))
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(path)],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=(lambda: os.sched_setaffinity(0, vcpus)) if vcpus else None,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def train_flops_per_image(model_name: str, classes: int, px: int) -> float:
    """Return forward+backward FLOPs for one image (3x the forward count)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from burstcv.training.models import build_model

    model = build_model(model_name, classes, px)
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, 3, px, px))
    return 3.0 * float(counter.get_total_flops())


def _device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return str(torch.cuda.get_device_name())
    return platform.processor() or platform.machine() or "cpu"


def main() -> None:
    """Prepare the data once, run both trainers side by side, print the comparison."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", choices=("photos", "digits"), default="photos")
    parser.add_argument(
        "--measure",
        choices=("throughput", "accuracy"),
        default="throughput",
        help="accuracy: validation top-1 after --epochs, the plain torchvision recipe "
        "(resnet18, batch 32) against burstcv's training defaults",
    )
    parser.add_argument("--model", "--arch", dest="model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224, help="photos only (digits: 32)")
    parser.add_argument("--images", type=int, default=6000, help="photo training images")
    parser.add_argument("--scale", type=int, default=1, help="digits: copies of the train split")
    parser.add_argument("--epochs", type=int, default=2, help="the last one is measured")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vcpus", type=int, default=4, help="CPUs each trainer may use (0: all)")
    parser.add_argument("--workers", type=int, help="DataLoader workers (default: --vcpus)")
    parser.add_argument(
        "--budget-mb", type=int, help="burstcv data memory budget (default: the job's, 2048)"
    )
    parser.add_argument("--reference", type=float, help="published RN50 img/s for this GPU")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, cfg_path = args.child
        cfg = json.loads(Path(cfg_path).read_text())
        measured = child_baseline(cfg) if kind == "baseline" else child_burstcv(cfg)
        print(json.dumps(measured))
        return

    from burstcv.training.job import JobSpec

    cpus = sorted(os.sched_getaffinity(0))
    vcpus = cpus[: args.vcpus] if 0 < args.vcpus < len(cpus) else None
    n_cpu = len(vcpus or cpus)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        accuracy = args.measure == "accuracy"
        if accuracy:  # the plain recipe's model and batch
            args.model, args.batch = "resnet18", 32
        if args.data == "photos":
            val = args.images // 4 if accuracy else max(30, args.images // 20)
            prepared = prepare_photos(root, args.images, val, args.image_size)
        else:
            prepared = prepare_digits(root, args.scale)
        cfg = {
            **prepared,
            "model": args.model,
            "epochs": args.epochs,
            "batch": args.batch,
            "workers": args.workers if args.workers is not None else n_cpu,
            "budget_mb": args.budget_mb or JobSpec.model_fields["data_memory_budget_mb"].default,
            "out": str(root / "job"),
            "measure": args.measure,
        }
        base = run_child("baseline", cfg, root, vcpus)
        ours = run_child("burstcv", cfg, root, vcpus)
    device = _device_name()
    result: dict[str, Any] = {
        "device": device,
        "vcpus": n_cpu,
        "model": args.model,
        "image_size": prepared["px"],
        "data": args.data,
        "train_images": prepared["counts"]["train"],
        "epochs": args.epochs,
        "batch": args.batch,
        "write_s": prepared["write_s"],
        "pack_s": prepared["pack_s"],
        "file_mb": prepared["file_bytes"] / 2**20,
        "shard_mb": prepared["shard_bytes"] / 2**20,
        "baseline": base,
        "burstcv": ours,
        "speedup": ours["images_per_s"] / base["images_per_s"],
        # Kept for bench/gpu_check.sh and earlier readers.
        "baseline_images_per_s": base["images_per_s"],
        "burstcv_images_per_s": ours["images_per_s"],
    }
    reference = args.reference or next(
        (v for k, v in PUBLISHED_RN50_AMP.items() if k in device), None
    )
    if reference and args.model == "resnet50" and prepared["px"] == 224:
        result["published_rn50_amp_images_per_s"] = reference
        result["published_fraction"] = ours["images_per_s"] / reference
    if ours["precision"] != "fp32":  # CUDA: the TFLOP/s the GPU sustained
        flops = train_flops_per_image(args.model, len(prepared["classes"]), prepared["px"])
        result["achieved_tflops"] = flops * ours["images_per_s"] / 1e12
    if accuracy:
        _print_accuracy(result)
    else:
        _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def _print_accuracy(r: dict[str, Any]) -> None:
    base, ours = r["baseline"], r["burstcv"]
    print(
        f"device {r['device']} ({r['vcpus']} vCPUs)  {r['train_images']} {r['data']} train "
        f"images at {r['image_size']} px, validation top-1 after {r['epochs']} epochs each"
    )
    print(f"  torchvision plain recipe (resnet18, {base['recipe']}): {base['val_accuracy']:.4f}")
    print(f"  burstcv defaults ({ours['recipe']}): {ours['val_accuracy']:.4f}")
    print(f"  difference burstcv - torchvision: {ours['val_accuracy'] - base['val_accuracy']:+.4f}")


def _print(r: dict[str, Any]) -> None:
    base, ours = r["baseline"], r["burstcv"]
    print(
        f"device {r['device']} ({r['vcpus']} vCPUs)  {r['model']} at {r['image_size']} px  "
        f"{r['train_images']} {r['data']} train images, batch {r['batch']}, "
        f"last of {r['epochs']} epochs measured"
    )
    print(
        f"  data: {r['file_mb']:.0f} MB of files -> {r['shard_mb']:.0f} MB of shards "
        f"(packed in {r['pack_s']:.1f} s on the orchestrator, before any GPU is rented)"
    )

    def util(side: dict[str, Any]) -> str:
        return f", GPU util {side['gpu_util']:.0f}%" if side.get("gpu_util") is not None else ""

    rows = [
        (f"torchvision ImageFolder+DataLoader ({base['precision']})", base),
        (f"burstcv shards, {ours['data_path']} ({ours['precision']})", ours),
    ]
    width = max(len(label) for label, _ in rows)
    for label, side in rows:
        extra = (
            f" (+ decode workers, up to {side['workers_peak_rss_mb']:.0f} MB each)"
            if "workers_peak_rss_mb" in side
            else ""
        )
        print(
            f"  {label.ljust(width)} {side['images_per_s']:9.1f} img/s{util(side)}, "
            f"peak RSS +{side['rss_growth_mb']:.0f} MB{extra}"
        )
    print(f"  ratio burstcv / torchvision: {r['speedup']:.2f}x")
    if "published_fraction" in r:
        print(
            f"  {r['published_fraction']:.0%} of NVIDIA's published ResNet-50 AMP figure "
            f"for this GPU ({r['published_rn50_amp_images_per_s']:.0f} img/s)"
        )
    if "achieved_tflops" in r:
        print(f"  achieved {r['achieved_tflops']:.1f} TFLOP/s (forward + backward)")


if __name__ == "__main__":
    main()
