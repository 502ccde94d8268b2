"""Measure onnxruntime's CPU time per image for every architecture burstcv trains.

The gate's smaller-model advice (``burstcv.gate.gate.ARCH_CPU_MS``) scales a missed p95 by
these figures, so it only ever advises an architecture that is measured cheaper on CPU. Each
architecture is built with random weights (the time does not depend on them), exported to
ONNX and run by onnxruntime at batch 1 with one intra-op thread, the architectures alternating
round by round (a block of runs each, as a service runs one model steadily) so that host
drift hits all alike; the median per image is printed, at 32 px
with the small-input stem (trained from scratch, up to 64 px) and at 224 px with
torchvision's stem, beside the table the gate holds and their ratio.

    PYTHONPATH=src:serving:spec python bench/arch_cpu.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from burstcv.gate.gate import ARCH_CPU_MS
from burstcv.training.models import build_model
from burstcv.training.names import ARCHITECTURE_NAMES

SIZES = ((32, False), (224, True))  # (input px, pretrained layout)
BLOCK = 10  # runs of one architecture in a row, per round


def session_of(arch: str, px: int, pretrained: bool) -> ort.InferenceSession:
    model = build_model(arch, 10, px, pretrained=pretrained).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / f"{arch}.onnx")
        x = torch.randn(1, 3, px, px)
        torch.onnx.export(model, (x,), path, opset_version=18, input_names=["x"], dynamo=False)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="blocks per architecture")
    args = parser.parse_args()
    print(f"host: {platform.processor() or platform.machine()}, onnxruntime {ort.__version__}")
    print(f"{'architecture':<20}{'px':>5}{'measured ms':>13}{'table ms':>10}{'ratio':>8}")
    for column, (px, pretrained) in enumerate(SIZES):
        sessions = {a: session_of(a, px, pretrained) for a in ARCHITECTURE_NAMES}
        x = np.random.default_rng(0).standard_normal((1, 3, px, px)).astype(np.float32)
        samples: dict[str, list[float]] = {a: [] for a in sessions}
        for session in sessions.values():  # warm-up
            for _ in range(3):
                session.run(None, {"x": x})
        for _ in range(args.rounds):
            for arch, session in sessions.items():
                # A block of runs, its first two dropped: served steadily, a model's weights
                # stay in cache, which one run between the others' would not see.
                for i in range(BLOCK):
                    t0 = time.perf_counter()
                    session.run(None, {"x": x})
                    if i >= 2:
                        samples[arch].append((time.perf_counter() - t0) * 1000)
        for arch in ARCHITECTURE_NAMES:
            measured = statistics.median(samples[arch])
            table = ARCH_CPU_MS[arch][column]
            print(f"{arch:<20}{px:>5}{measured:>13.3f}{table:>10.3f}{measured / table:>8.2f}")


if __name__ == "__main__":
    main()
