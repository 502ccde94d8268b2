"""The gate's latency measurement of the demo model: quiet, busy, and busy with isolation.

Trains (or reuses, ``--model-dir``) the demo digits model, then measures it as the benchmark
stage does (a staging copy of the real service pinned to CPUs of its own, the load generator
on another, the closed-loop request mix, in an interference watch of the service's CPUs) in
rounds that alternate three conditions:

- quiet;
- busy: CPU burners (``--burners`` per CPU) on every CPU, the service's included;
- busy, isolated: as many burners, all kept on the load generator's CPU (as a dedicated
  worker's cpuset keeps the neighbours off the benchmark's CPUs).

It prints, side by side, the p95 of each, its ratio to quiet, how busy the watch found the
service's CPUs, and what the gate does with it: before ``burstcv.gate.interference`` a busy
p95 was judged (and a miss rejected the model); now a busy window is inconclusive and the
model is not judged on it unless it passes even so (neighbours only slow a measurement down:
a pass is kept, marked busy). Needs two CPUs or more for the isolated condition.

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

from burstcv.gate.interference import (
    BusyLimits,
    HostBusyError,
    Placement,
    measure_quietly,
    running_on,
)
from burstcv.gate.latency import drive, staging_process

_BURNER = (
    "import os, sys, time\n"
    "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
    "end = time.monotonic() + 600\n"
    "while time.monotonic() < end:\n"
    "    pass\n"
)


@contextlib.contextmanager
def burners(count: int, cpus: list[int]) -> Iterator[None]:
    """Start ``count`` spinning processes, spread over ``cpus``."""
    procs = [
        subprocess.Popen([sys.executable, "-c", _BURNER, str(cpus[i % len(cpus)])])
        for i in range(count)
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
        cpus = sorted(os.sched_getaffinity(0))
        place = Placement.split(cpus)
        total = args.burners * len(cpus)
        conditions = {
            "quiet": None,
            "busy": cpus,
            "isolated": place.generator if place.isolated else None,
        }
        if not place.isolated:
            del conditions["isolated"]
        figures: dict[str, list[tuple[float, float, str]]] = {c: [] for c in conditions}
        with staging_process(
            str(model_dir), cpus=place.service, queue_delay_target_ms=args.slo_ms
        ) as (url, proc):

            def load(condition: str = "quiet") -> Any:
                with running_on(place.generator):
                    return drive(
                        url,
                        images,
                        requests=args.requests,
                        concurrency=args.concurrency,
                        warmup=10,
                        label=condition,
                    )

            for _ in range(args.rounds):
                for condition, on in conditions.items():
                    held = burners(total, on) if on else contextlib.nullcontext()
                    with held:
                        try:
                            result, host = measure_quietly(
                                condition,
                                functools.partial(load, condition),
                                limits=limits,
                                cpus=place.service,
                                own_pids=[proc.pid],
                                isolated=place.isolated,
                                # As the benchmark stage: a busy pass is kept.
                                passes=lambda r: r.p95_ms <= args.slo_ms and r.errors == 0,
                            )
                            verdict = "kept, busy" if host.busy else "judged"
                        except HostBusyError as exc:
                            result, host, verdict = exc.last, exc.loads[-1], "inconclusive"
                    figures[condition].append((result.p95_ms, host.others_share, verdict))
    quiet_p95 = statistics.median(p for p, _, _ in figures["quiet"])
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(
        f"demo model, {args.requests} requests at concurrency {args.concurrency}, "
        f"SLO {args.slo_ms:g} ms; service on CPU(s) {place.service}, generator on "
        f"{place.generator}; busy = {total} burner(s) on every CPU; isolated = {total} "
        f"burner(s) on the generator's CPU(s) only"
    )
    print(f"{'condition':<10}{'p95 ms':>9}{'x quiet':>9}{'others':>9}  gate then / gate now")
    for condition in conditions:
        for p95, others, verdict in figures[condition]:
            then = "promote" if p95 <= args.slo_ms else "REJECT"
            now = "inconclusive" if verdict == "inconclusive" else then
            if verdict == "kept, busy":
                now += " (busy, kept)"
            print(
                f"{condition:<10}{p95:>9.2f}{p95 / quiet_p95:>9.2f}{others:>8.0%}  {then} / {now}"
            )


if __name__ == "__main__":
    main()
