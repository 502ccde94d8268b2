"""Measure training throughput: the burstcv job against a plain PyTorch baseline, same device.

The baseline is what most training scripts do: torchvision ImageFolder decoding the PNG files
every epoch through a DataLoader, fp32, default memory format. The job under test is
``burstcv.training.train.main`` on pre-packed uint8 shards with on-device augmentation
(plus bf16 autocast, channels_last and torch.compile on CUDA). Both train the same
architecture on the same images for the same number of steps, in one run, and the ratio of
images/s is printed. On CUDA the achieved fraction of the GPU's bf16 peak is printed too.

    python bench/train.py                     # demo digits, resnet10, 2 epochs each
    python bench/train.py --arch resnet18 --epochs 3 --scale 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

# Dense bf16 tensor-core peaks (TFLOP/s) by device name fragment, from the vendors' data sheets.
BF16_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L4": 121.0,
    "A10G": 70.0,
    "L40S": 362.0,
    "T4": 65.0,
}


def prepare(root: Path, scale: int) -> tuple[Path, dict]:
    """Write the demo digits (``scale`` copies of the train split) and pack them into shards."""
    import shutil

    from burstcv.data.demo import pack_demo, write_demo_dataset

    data = root / "digits"
    write_demo_dataset(data)
    for copy in range(1, scale):
        for path in list((data / "train").rglob("*.png")):
            if "_c" not in path.stem:
                shutil.copy(path, path.with_name(f"{path.stem}_c{copy}.png"))
    packed, spec = pack_demo(data, str(root / "shards"))
    return data, {"packed": packed, "spec": spec}


def run_burstcv(root: Path, prepared: dict, arch: str, epochs: int, batch: int) -> dict:
    """Train with the burstcv job and return its own metrics."""
    from burstcv.training.job import JobSpec
    from burstcv.training.train import main

    packed = prepared["packed"]
    job = JobSpec(
        run_id="bench",
        arch=arch,
        classes=packed.classes,
        train_shards=packed.train_shards,
        val_shards=packed.val_shards,
        preprocess=prepared["spec"].to_dict(),
        output_uri=str(root / "job"),
        epochs=epochs,
        batch_size=batch,
        checkpoint_every_s=1e9,
    )
    t0 = time.perf_counter()
    metrics = main(job)
    wall = time.perf_counter() - t0
    images = metrics["train_images"] * epochs
    return {
        "images_per_s": images / metrics["wall_s"]["compute"]
        if metrics["wall_s"]["compute"]
        else 0,
        "end_to_end_images_per_s": images / wall,
        "wall_s": wall,
        "val_accuracy": metrics["val_accuracy"],
        "epochs": metrics["epochs"],
    }


def run_baseline(
    data: Path, prepared: dict, arch: str, epochs: int, batch: int, device: torch.device
) -> dict:
    """Train the plain way: ImageFolder + DataLoader decoding PNGs every epoch, fp32."""
    from torchvision import datasets, transforms

    from burstcv.training.models import build_model

    spec = prepared["spec"]
    tf = transforms.Compose(
        [
            transforms.RandomCrop(32, padding=2),
            transforms.ToTensor(),
            transforms.Normalize(spec.mean, spec.std),
        ]
    )
    dataset = datasets.ImageFolder(str(data / "train"), transform=tf)
    workers = min(4, os.cpu_count() or 1)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=True,
    )
    model = build_model(arch, len(dataset.classes), 32).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    seen = 0
    t0 = time.perf_counter()
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += len(y)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"images_per_s": seen / wall, "wall_s": wall}


def train_flops_per_image(arch: str, classes: int) -> float:
    """Return forward+backward FLOPs for one 32x32 image (3x the forward count)."""
    from torch.utils.flop_counter import FlopCounterMode

    from burstcv.training.models import build_model

    model = build_model(arch, classes, 32)
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, 3, 32, 32))
    return 3.0 * counter.get_total_flops()


def main() -> None:
    """Run both trainers side by side and print the comparison."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default="resnet10")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--scale", type=int, default=1, help="copies of the train split")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data, prepared = prepare(root, args.scale)
        base = run_baseline(data, prepared, args.arch, args.epochs, args.batch, device)
        ours = run_burstcv(root, prepared, args.arch, args.epochs, args.batch)
    result = {
        "device": torch.cuda.get_device_name()
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "arch": args.arch,
        "epochs": args.epochs,
        "batch": args.batch,
        "train_images": prepared["packed"].counts["train"],
        "baseline_images_per_s": base["images_per_s"],
        "burstcv_images_per_s": ours["end_to_end_images_per_s"],
        "burstcv_compute_images_per_s": ours["images_per_s"],
        "speedup": ours["end_to_end_images_per_s"] / base["images_per_s"],
        "burstcv_val_accuracy": ours["val_accuracy"],
    }
    if device.type == "cuda":
        flops = train_flops_per_image(args.arch, len(prepared["packed"].classes))
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
        achieved = flops * ours["images_per_s"] / 1e12
        result["achieved_tflops"] = achieved
        result["bf16_peak_fraction"] = achieved / peak if peak else None
    print(
        f"device {result['device']}  torch {result['torch']}  {args.arch}  "
        f"{result['train_images']} train images x {args.epochs} epochs, batch {args.batch}"
    )
    print(f"  baseline (ImageFolder+DataLoader, fp32): {base['images_per_s']:10.1f} images/s")
    print(
        f"  burstcv job (shards, device aug):       {ours['end_to_end_images_per_s']:10.1f} img/s "
        f"(compute only {ours['images_per_s']:.1f})"
    )
    print(f"  speedup: {result['speedup']:.2f}x   burstcv val accuracy {ours['val_accuracy']:.4f}")
    if "achieved_tflops" in result:
        frac = result["bf16_peak_fraction"]
        print(
            f"  achieved {result['achieved_tflops']:.2f} TFLOP/s"
            + (f" = {frac:.1%} of bf16 peak" if frac else "")
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
