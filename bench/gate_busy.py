"""The gate's latency measurement of the demo model on a quiet host and on a busy one.

Trains (or reuses, ``--model-dir``) the demo digits model, then measures it as the benchmark
stage does (a staging copy of the real service, the closed-loop request mix, in an
interference watch) in rounds that alternate: quiet, busy (CPU burners, ``--burners`` per CPU,
on the same CPUs), quiet, busy, ... It prints, side by side, the p95 of each condition, its
ratio to quiet, how busy the watch found the host, and what the gate does with it: before
``burstcv.gate.interference`` a busy p95 was judged (and a miss rejected the model); now a
busy window is inconclusive and the model is not judged on it.

    PYTHONPATH=src:serving:spec python bench/gate_busy.py [--burners 3] [--rounds 3]
    PYTHONPATH=src:serving:spec python bench/gate_busy.py --model-dir DIR --images PNGS

``--model-dir``: an exported model folder (model.json + its ONNX file), e.g. a run's model/.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from burstcv.gate.interference import BusyLimits, HostBusyError, measure_quietly
from burstcv.gate.latency import drive, staging_process

_BURNER = (
    "import os, sys, time\n"
    "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
    "end = time.monotonic() + 600\n"
    "while time.monotonic() < end:\n"
    "    pass\n"
)


@contextlib.contextmanager
def burners(per_cpu: int) -> Iterator[None]:
    procs = [
        subprocess.Popen([sys.executable, "-c", _BURNER, str(cpu)])
        for cpu in sorted(os.sched_getaffinity(0))
        for _ in range(per_cpu)
    ]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def demo_model(work: Path) -> tuple[Path, list[bytes]]:
    """Train resnet10 on the demo digits for 3 epochs (bench/export.py's job), export it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from export import build_trained_job  # bench/export.py

    from burstcv.export.onnx_export import export_model
    from burstcv.training.job import load_job
    from burstcv_spec.preprocess import PreprocessSpec

    out = build_trained_job(work, epochs=3)
    job = load_job(str(out / "job.json"))
    files = sorted((work / "digits" / "val").rglob("*.png"))[:64]
    export_model(
        checkpoint_uri=str(out / "model.pt"),
        out_uri=str(work / "model"),
        arch=job.arch,
        classes=job.classes,
        spec=PreprocessSpec.from_dict(job.preprocess),
        name="digits",
        parity_images=[(p.name, p.read_bytes()) for p in files[:32]],
    )
    return work / "model", [p.read_bytes() for p in files]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="an exported model (default: train one)")
    parser.add_argument("--images", type=Path, default=Path("."), help="PNGs to send")
    parser.add_argument("--burners", type=int, default=3, help="spinning processes per CPU")
    parser.add_argument("--rounds", type=int, default=3, help="quiet/busy pairs")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--slo-ms", type=float, default=50.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir is None:
            model_dir, images = demo_model(Path(tmp))
        else:
            model_dir = args.model_dir
            images = [p.read_bytes() for p in sorted(args.images.rglob("*.png"))[:64]]
            if not images:
                raise SystemExit("--model-dir needs --images, a folder of PNGs to send")
        limits = BusyLimits(attempts=1)
        figures: dict[str, list[tuple[float, float, bool]]] = {"quiet": [], "busy": []}
        with staging_process(str(model_dir), queue_delay_target_ms=args.slo_ms) as (url, proc):

            def load(condition: str = "quiet") -> Any:
                return drive(
                    url,
                    images,
                    requests=args.requests,
                    concurrency=args.concurrency,
                    warmup=10,
                    label=condition,
                )

            for _ in range(args.rounds):
                for condition in ("quiet", "busy"):
                    held = burners(args.burners) if condition == "busy" else None
                    with held or contextlib.nullcontext():
                        try:
                            result, host = measure_quietly(
                                condition,
                                functools.partial(load, condition),
                                limits=limits,
                                own_pids=[proc.pid],
                            )
                            busy = False
                        except HostBusyError as exc:
                            result, host, busy = exc.last, exc.loads[-1], True
                    figures[condition].append((result.p95_ms, host.others_share, busy))
    quiet_p95 = statistics.median(p for p, _, _ in figures["quiet"])
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(
        f"demo model, {args.requests} requests at concurrency {args.concurrency}, "
        f"SLO {args.slo_ms:g} ms, busy = {args.burners} burner(s) per CPU"
    )
    print(f"{'condition':<10}{'p95 ms':>9}{'x quiet':>9}{'others':>9}  gate then / gate now")
    for condition in ("quiet", "busy"):
        for p95, others, busy in figures[condition]:
            then = "promote" if p95 <= args.slo_ms else "REJECT"
            now = "inconclusive" if busy else then
            print(
                f"{condition:<10}{p95:>9.2f}{p95 / quiet_p95:>9.2f}{others:>8.0%}  {then} / {now}"
            )


if __name__ == "__main__":
    main()
