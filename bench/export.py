"""Benchmark the exported model: torch eager vs onnxruntime FP32 vs onnxruntime INT8 on this CPU.

Builds what it needs unless told otherwise: writes the demo digits to a temp dir, packs them
into shards, trains resnet10 for 3 epochs (``burstcv.training.train.run_job``), then exports
with ``export_model(int8=True)`` (parity gate, INT8 quantization and the keep/drop choice).
In one run, with the same thread count for all three engines, it then measures:

* latency at batch 1 and batch 32: warm-up, then engines alternating round by round (so host
  drift hits all alike), p50 and mean of ``model(x)`` / ``session.run`` on a ready float32
  NCHW batch (preprocessing excluded: it is the same numpy code for every engine);
* top-1 accuracy of each engine on the whole demo validation split.

It prints a table with the ratios to torch eager, the INT8 verdict and the host and versions.

    PYTHONPATH=src:serving python bench/export.py                     # train, then measure
    PYTHONPATH=src:serving python bench/export.py --job-dir DIR       # reuse a trained job
    PYTHONPATH=src:serving python bench/export.py --json out.json     # also save the figures
    PYTHONPATH=src:serving python bench/export.py --model resnet50 --image-size 224 --epochs 1

With ``--model`` or ``--image-size`` other than the digits' resnet10 at 32 px, the data is
the photo dataset (``burstcv.data.photos``: crops of the photos scikit-learn ships, 200-800
px JPEGs), packed at that size with ImageNet statistics, and the model is trained for
``--epochs`` on this CPU: the figures that matter there are the latencies (a model this
briefly trained is not accurate, and all three engines are measured on the same one).

``--job-dir`` is a training job's output folder: ``model.pt`` plus ``job.json`` (looked for in
the folder, then beside it), whose shards give the calibration and validation images.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO / "src", REPO / "serving"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from burstcv.export.onnx_export import export_model, load_state_dict  # noqa: E402
from burstcv.export.quantize import FP32_FILE, INT8_FILE, host_cores, serving_session  # noqa: E402
from burstcv.training.job import JobSpec, load_job, write_job  # noqa: E402
from burstcv.training.models import build_model  # noqa: E402
from burstcv.training.train import load_shards  # noqa: E402
from burstcv_spec.preprocess import PreprocessSpec, normalize  # noqa: E402

ENGINES = ("torch eager", "ORT FP32", "ORT INT8")
TARGET_ORT_VS_EAGER_B1 = 3.0  # ORT FP32 must be at least this much faster at batch 1


def build_trained_job(
    work: Path, epochs: int, arch: str = "resnet10", image_size: int = 32
) -> Path:
    """Write the demo data, pack it, train ``arch``; return the job's output folder."""
    from burstcv.data.demo import pack_demo, write_demo_dataset
    from burstcv.training.train import run_job

    if (arch, image_size) == ("resnet10", 32):
        data = work / "digits"
        counts = write_demo_dataset(data)
        print(f"demo digits: {counts}", flush=True)
        packed, spec = pack_demo(data, str(work / "packed"))
    else:
        from burstcv.data.photos import write_photo_dataset

        data = work / "photos"
        print(f"photos: {write_photo_dataset(data).counts}", flush=True)
        packed, spec = pack_demo(
            data, str(work / "packed"), PreprocessSpec(height=image_size, width=image_size)
        )
    out = work / "job"
    job = JobSpec(
        run_id="bench-export",
        arch=arch,
        batch_size=128 if data.name == "digits" else 32,
        # From scratch on 72 photos, the digits' 0.2 makes the larger models diverge.
        learning_rate=0.2 if data.name == "digits" else 0.02,
        classes=packed.classes,
        train_shards=packed.train_shards,
        val_shards=packed.val_shards,
        preprocess=spec.to_dict(),
        output_uri=str(out),
        epochs=epochs,
        dataset_fingerprint="demo",
    )
    job_uri = write_job(job, str(out / "job.json"))
    started = time.perf_counter()
    code = run_job(job_uri)
    if code != 0:
        raise SystemExit(f"training failed with exit code {code}: see {out}")
    print(
        f"trained {arch} at {image_size} px for {epochs} epochs "
        f"in {time.perf_counter() - started:.0f}s"
    )
    return out


def find_job(job_dir: Path) -> JobSpec:
    """Load job.json from the job folder, or from beside it (the test fixtures' layout)."""
    for candidate in (job_dir / "job.json", job_dir.parent / "job.json"):
        if candidate.exists():
            return load_job(str(candidate))
    raise SystemExit(f"no job.json in {job_dir} or {job_dir.parent}")


def png_bytes(image_u8: np.ndarray) -> bytes:
    """Encode one uint8 HWC image losslessly, as the parity check wants real image bytes."""
    buf = io.BytesIO()
    Image.fromarray(image_u8, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def time_engines(
    engines: dict[str, Callable[[], object]], *, warmup: int, rounds: int, runs_per_round: int
) -> dict[str, dict[str, float]]:
    """Time each zero-argument call, engines alternating round by round; return p50/mean ms."""
    for fn in engines.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, fn in engines.items():
            for _ in range(runs_per_round):
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) * 1000.0)
    return {
        name: {
            "p50_ms": float(np.percentile(v, 50)),
            "mean_ms": float(np.mean(v)),
            "p95_ms": float(np.percentile(v, 95)),
            "runs": len(v),
        }
        for name, v in samples.items()
    }


def main() -> None:
    """Build or load a trained job, export + quantize it, measure the three engines, print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job-dir", type=Path, help="trained job folder (skips training)")
    parser.add_argument("--work-dir", type=Path, help="keep data, job and model here")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--model", default="resnet10", help="architecture to train and export")
    parser.add_argument("--image-size", type=int, default=32, help="training/serving size, px")
    parser.add_argument("--threads", type=int, default=host_cores())
    parser.add_argument("--runs-b1", type=int, default=600, help="timed batch-1 runs per engine")
    parser.add_argument("--runs-b32", type=int, default=120, help="timed batch-32 runs per engine")
    parser.add_argument("--rounds", type=int, default=6, help="engine alternations")
    parser.add_argument("--max-accuracy-drop", type=float, default=0.01)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        job_dir = args.job_dir or build_trained_job(work, args.epochs, args.model, args.image_size)
        job = find_job(job_dir)
        spec = PreprocessSpec.from_dict(job.preprocess)
        train_x, _ = load_shards(job.train_shards, job.classes)
        val_x, val_y = load_shards(job.val_shards, job.classes)
        val_labels = [job.classes[i] for i in val_y]

        model_dir = work / "model"
        started = time.perf_counter()
        model_json = export_model(
            checkpoint_uri=str(job_dir / "model.pt"),
            out_uri=str(model_dir),
            arch=job.arch,
            classes=job.classes,
            spec=spec,
            parity_images=[(f"val/{i}", png_bytes(val_x[i])) for i in range(min(256, len(val_x)))],
            name="digits",
            dataset_fingerprint=job.dataset_fingerprint,
            run_id=job.run_id,
            int8=True,
            calibration_images_u8=train_x,
            eval_images_u8=val_x,
            eval_labels=val_labels,
            max_accuracy_drop=args.max_accuracy_drop,
        ).model_dump(mode="json")
        export_s = time.perf_counter() - started
        quant = model_json["quantization"]

        # The INT8 file is only copied out when kept; rebuild it for measuring if it was not.
        int8_path = model_dir / INT8_FILE
        if not int8_path.exists():
            from burstcv.export.quantize import evenly_spaced, quantize_int8

            quantize_int8(
                model_dir / FP32_FILE,
                int8_path,
                evenly_spaced(train_x, quant["calibration_images"]),
                spec,
                model_json["input"]["name"],
            )

        model = build_model(job.arch, len(job.classes), spec.height)
        model.load_state_dict(load_state_dict((job_dir / "model.pt").read_bytes()))
        model.eval()
        sessions = {
            "ORT FP32": serving_session(model_dir / FP32_FILE, threads=args.threads),
            "ORT INT8": serving_session(int8_path, threads=args.threads),
        }

        def engine_calls(x: np.ndarray) -> dict[str, Callable[[], object]]:
            xt = torch.from_numpy(x)

            def eager() -> object:
                with torch.inference_mode():
                    return model(xt)

            calls: dict[str, Callable[[], object]] = {"torch eager": eager}
            for name, session in sessions.items():
                calls[name] = partial(session.run, None, {session.get_inputs()[0].name: x})
            return calls

        latency: dict[int, dict[str, dict[str, float]]] = {}
        for batch, runs in ((1, args.runs_b1), (32, args.runs_b32)):
            x = normalize(val_x[:batch], spec)
            latency[batch] = time_engines(
                engine_calls(x),
                warmup=max(10, runs // 10),
                rounds=args.rounds,
                runs_per_round=max(1, runs // args.rounds),
            )

        accuracy: dict[str, float] = {}
        predictions: dict[str, np.ndarray] = {}
        for name, fn_for in (
            ("torch eager", None),
            ("ORT FP32", sessions["ORT FP32"]),
            ("ORT INT8", sessions["ORT INT8"]),
        ):
            preds = []
            for start in range(0, len(val_x), 256):
                x = normalize(val_x[start : start + 256], spec)
                if fn_for is None:
                    with torch.inference_mode():
                        logits = model(torch.from_numpy(x)).numpy()
                else:
                    logits = fn_for.run(None, {fn_for.get_inputs()[0].name: x})[0]
                preds.append(logits.argmax(1))
            predictions[name] = np.concatenate(preds)
            accuracy[name] = float(np.mean(predictions[name] == val_y))

        results: dict[str, Any] = {
            "measured": "latency of model(x) / session.run(x) on a ready float32 NCHW batch",
            "host": {
                "machine": platform.machine(),
                "processor": _cpu_name(),
                "cpu_count": os.cpu_count(),
                "usable_cores": host_cores(),
                "platform": platform.platform(terse=True),
                "python": platform.python_version(),
            },
            "versions": {
                "torch": torch.__version__,
                "onnx": onnx.__version__,
                "onnxruntime": ort.__version__,
                "numpy": np.__version__,
            },
            "threads": args.threads,
            "arch": job.arch,
            "val_images": len(val_x),
            "export_s": export_s,
            "latency_ms": {str(b): v for b, v in latency.items()},
            "accuracy": accuracy,
            "int8_fp32_top1_agreement": float(
                np.mean(predictions["ORT INT8"] == predictions["ORT FP32"])
            ),
            "quantization": quant,
        }
        print_table(results)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
            print(f"\nwrote {args.json}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def print_table(results: dict[str, Any]) -> None:
    """Print latency (p50/mean, ratio to torch eager) and accuracy per engine, then the verdict."""
    host, versions = results["host"], results["versions"]
    print(
        f"\nhost: {host['processor']} ({host['machine']}), {host['usable_cores']} usable of "
        f"{host['cpu_count']} cores, {host['platform']}, Python {host['python']}"
    )
    print(
        "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + f"; threads per "
        f"engine {results['threads']}; {results['arch']}, {results['val_images']} val images"
    )
    print(f"measured: {results['measured']}\n")
    header = f"{'engine':12s} {'batch':>5s} {'p50 ms':>9s} {'mean ms':>9s} {'vs eager':>9s}"
    print(header + f" {'img/s':>9s} {'accuracy':>9s}")
    print("-" * (len(header) + 20))
    for batch, figures in results["latency_ms"].items():
        eager_p50 = figures["torch eager"]["p50_ms"]
        for name in ENGINES:
            f = figures[name]
            print(
                f"{name:12s} {batch:>5s} {f['p50_ms']:9.3f} {f['mean_ms']:9.3f} "
                f"{eager_p50 / f['p50_ms']:8.2f}x {int(batch) / f['p50_ms'] * 1000:9.0f} "
                f"{results['accuracy'][name]:9.4f}"
            )
    b1 = results["latency_ms"]["1"]
    ratio = b1["torch eager"]["p50_ms"] / b1["ORT FP32"]["p50_ms"]
    verdict = "meets" if ratio >= TARGET_ORT_VS_EAGER_B1 else "MISSES"
    print(
        f"\nORT FP32 vs torch eager at batch 1: {ratio:.2f}x ({verdict} the "
        f"{TARGET_ORT_VS_EAGER_B1:.0f}x target)"
    )
    print(
        f"INT8 vs FP32 at batch 1: {b1['ORT FP32']['p50_ms'] / b1['ORT INT8']['p50_ms']:.2f}x; "
        f"top-1 agreement {results['int8_fp32_top1_agreement']:.4f}"
    )
    print(f"export choice: serves {results['quantization']['serving_file']}")
    print(f"  {results['quantization']['reason']}")


if __name__ == "__main__":
    main()
