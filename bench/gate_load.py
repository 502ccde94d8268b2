"""The gate's latency load for a photo-size model: a fixed concurrency vs the load it will serve.

Builds a 224 px ResNet-18 (5 classes, random weights: its latency does not depend on them;
pretrained weights cannot be fetched here), exports it as a run does (parity-checked ONNX and
model.json), and serves it from a staging copy of the real service pinned to CPUs of its own,
the load generator on another, as the benchmark stage does. The fleet sizing then finds the
rate the service sustains within the SLO, and the gate's load follows from it
(``burstcv.gate.sizing.gate_load``: the most one replica carries, 30% headroom). Rounds then
alternate:

- closed: 4 clients in flight (the gate's load before this change, ``bench_concurrency`` 4);
- open: the open-loop rate the gate now drives (latency counted from when each was due).

It prints, side by side, each load's p50/p95, shed 503s and the verdict the gate would give on
the latency check (p95 within the SLO, nothing failed). The SLO defaults to 2.5 x the model's
p50 one request at a time: a model that meets its SLO when asked to serve what a replica will
get.

    PYTHONPATH=src:serving:spec python bench/gate_load.py [--rounds 3] [--slo-ms 150]
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import platform
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from burstcv.export.onnx_export import export_model
from burstcv.gate.interference import Placement, running_on
from burstcv.gate.latency import drive, staging_process
from burstcv.gate.sizing import gate_load, host_cpus, measure_sizes, recommend
from burstcv.training.models import build_model
from burstcv_spec.preprocess import PreprocessSpec

CLASSES = ["a", "b", "c", "d", "e"]


def photos(count: int, seed: int = 0) -> list[bytes]:
    """Return ``count`` JPEG photos of mixed sizes (200-800 px), as a photo dataset holds."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        w, h = (int(v) for v in rng.integers(200, 801, size=2))
        pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def photo_model(work: Path, images: list[bytes]) -> Path:
    """Export a 224 px ResNet-18 with random weights as a run's model folder."""
    torch.manual_seed(0)
    model = build_model("resnet18", len(CLASSES), 224, pretrained=True)
    checkpoint = work / "model.pt"
    torch.save(model.state_dict(), checkpoint)
    export_model(
        checkpoint_uri=str(checkpoint),
        out_uri=str(work / "model"),
        arch="resnet18",
        classes=CLASSES,
        spec=PreprocessSpec(height=224, width=224, resize_short=256),
        name="photos",
        parity_images=[(f"{i}.jpg", body) for i, body in enumerate(images[:8])],
        pretrained="DEFAULT",  # the layout of a pretrained model: torchvision's stem
    )
    return work / "model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="closed/open pairs")
    parser.add_argument("--requests", type=int, default=120, help="per load, per round")
    parser.add_argument("--concurrency", type=int, default=4, help="the closed loop's clients")
    parser.add_argument("--slo-ms", type=float, help="default: 2.5 x p50 one at a time")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    images = photos(32)
    place = Placement.split(host_cpus())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = photo_model(Path(tmp), images)
        if args.slo_ms is None:
            with (
                running_on(place.generator),
                staging_process(str(model_dir), cpus=place.service) as (url, _),
            ):
                alone = drive(url, images, requests=30, concurrency=1, warmup=5, label="alone")
            slo_ms = round(2.5 * alone.p50_ms)
        else:
            slo_ms = args.slo_ms
        points = measure_sizes(
            str(model_dir), images, latency_slo_ms=slo_ms, max_vcpus=len(place.service)
        )
        sizing = recommend(
            points, latency_slo_ms=slo_ms, target_rps=1000.0, prices=[], region="us-east-1"
        )
        load = gate_load(sizing, len(place.service), requests=args.requests, max_s=30.0)
        results: dict[str, list[tuple[float, float, int, int]]] = {"closed": [], "open": []}
        with (
            running_on(place.generator),
            staging_process(str(model_dir), cpus=place.service, queue_delay_target_ms=slo_ms) as (
                url,
                _,
            ),
        ):
            for _ in range(args.rounds):
                for name in results:
                    figures = drive(
                        url,
                        images,
                        requests=load.requests if name == "open" else args.requests,
                        warmup=5,
                        label=name,
                        concurrency=args.concurrency if name == "closed" else None,
                        rate_rps=load.rate_rps if name == "open" else None,
                    )
                    results[name].append(
                        (figures.p50_ms, figures.p95_ms, figures.shed, figures.errors)
                    )
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(
        f"resnet18 at 224 px, JPEG photos 200-800 px; service on CPU(s) {place.service}, "
        f"generator on {place.generator}; SLO {slo_ms:g} ms"
    )
    print(f"sizing: {', '.join(f'{p.vcpus} vCPU {p.sustainable_rps:g} req/s' for p in points)}")
    print(
        f"gate load now: {load.rate_rps:g} req/s open loop, {load.requests} requests: {load.note}"
    )
    print(f"{'load':<28}{'p50 ms':>9}{'p95 ms':>9}{'shed':>6}{'errors':>8}  latency check")
    labels = {
        "closed": f"closed, {args.concurrency} in flight (before)",
        "open": f"open, {load.rate_rps:g} req/s (now)",
    }
    for name, rows in results.items():
        for p50, p95, shed, errors in rows:
            verdict = "passed" if p95 <= slo_ms and errors == 0 else "REJECTED"
            print(f"{labels[name]:<28}{p50:9.1f}{p95:9.1f}{shed:6d}{errors:8d}  {verdict}")
    closed = statistics.median(p95 for _, p95, _, _ in results["closed"])
    opened = statistics.median(p95 for _, p95, _, _ in results["open"])
    print(
        f"median p95: closed {closed:.1f} ms, open {opened:.1f} ms "
        f"({closed / opened:.2f}x); SLO {slo_ms:g} ms"
    )


if __name__ == "__main__":
    main()
