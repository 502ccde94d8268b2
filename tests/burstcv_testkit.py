"""Shared helpers for burstcv tests (importable from any test folder)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from burstcv_spec.contracts import BenchFigures, BoxRate, Launch, Packed, RunRef

if TYPE_CHECKING:
    from PIL import Image

# What a launch of a held box names as its training wheel: held boxes never boot, so never
# read it (the boot path itself runs for real in tests/compute/test_box_boot.py).
HELD_WHEEL: dict[str, str] = {
    "wheel_uri": f"s3://never-read/runtime/{'0' * 64}/burstcv_train-0.1.0-py3-none-any.whl",
    "wheel_sha256": "0" * 64,
}


def make_job(packed: dict[str, Any], out: Path, **overrides: Any) -> Any:
    """Return a JobSpec over the packed demo shards writing into ``out``."""
    from burstcv.training.job import JobSpec
    from burstcv.training.recipe import learning_rate_for

    fields: dict[str, Any] = {
        "run_id": out.name,
        "classes": packed["classes"],
        "train_shards": packed["train_shards"],
        "val_shards": packed["val_shards"],
        "preprocess": packed["spec"].to_dict(),
        "output_uri": str(out),
        "epochs": 3,
        # What the pipeline's recipe gives the digits (short run: AdamW, its rate at batch 128).
        "optimizer": "adamw",
        "learning_rate": learning_rate_for("adamw", 128),
        "dataset_fingerprint": "demo",
    }
    fields.update(overrides)
    return JobSpec(**fields)


def run_ddp_job(job_uri: str, ranks: int = 2) -> subprocess.CompletedProcess[str]:
    """Run ``burstcv train --job`` under torchrun with ``ranks`` CPU (gloo) processes."""
    import os

    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            "-m",
            "burstcv.cli",
            "train",
            "--job",
            job_uri,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )


def demo_val_images(dataset: Path, n: int = 64) -> list[tuple[str, bytes]]:
    """Return ``n`` validation PNGs of the demo dataset, spread over its classes: (name, bytes)."""
    files = sorted((dataset / "val").rglob("*.png"))[:: max(1, 360 // n)][:n]
    return [(str(p.relative_to(dataset)), p.read_bytes()) for p in files]


def export_trained(trained: dict[str, Any], out: Path, **options: Any) -> dict[str, Any]:
    """Export the session's trained demo model (``trained_demo``) into ``out``; return model.json.

    The checkpoint, architecture, classes and preprocessing are the training job's, the name
    is "digits"; ``options`` are export_model's own (parity_images, int8, ...) or override those.
    """
    from burstcv.export.onnx_export import export_model
    from burstcv_spec.preprocess import PreprocessSpec

    job = trained["job"]
    fields: dict[str, Any] = {
        "checkpoint_uri": str(trained["out"] / "model.pt"),
        "out_uri": str(out),
        "arch": job.arch,
        "classes": job.classes,
        "spec": PreprocessSpec.from_dict(job.preprocess),
        "name": "digits",
    }
    fields.update(options)
    return export_model(**fields).model_dump(mode="json")


def model_card(onnx_bytes: bytes, **fields: Any) -> dict[str, Any]:
    """Return a complete model.json (a ModelCard) for an ONNX file of these bytes."""
    from burstcv_spec.contracts import ModelCard

    card: dict[str, Any] = {
        "name": "digits",
        "arch": "resnet10",
        "classes": [str(i) for i in range(10)],
        "onnx_file": "model.onnx",
        "sha256": hashlib.sha256(onnx_bytes).hexdigest(),
        "opset": 18,
        "input": {"name": "input", "shape": [None, 3, 32, 32], "dtype": "float32"},
        "output": {"name": "logits", "kind": "logits"},
        "preprocess": {
            "height": 32,
            "width": 32,
            "mean": [0.5, 0.5, 0.5],
            "std": [0.25, 0.25, 0.25],
            "interpolation": "bilinear",
            "color_mode": "RGB",
            "layout": "NCHW",
            "scale": 1 / 255,
            "formats": ["PNG", "JPEG", "WEBP"],
        },
        "metrics": {"val_accuracy": 0.9},
        "dataset_fingerprint": "fp",
        "source_commit": "abc",
        "run_id": "run",
        "created_at": "2026-01-01T00:00:00+00:00",
    }
    card.update(fields)
    return ModelCard.model_validate(card).model_dump(mode="json")


def write_model_dir(root: Path, onnx_bytes: bytes, **fields: Any) -> Path:
    """Write a model folder (model.onnx + a complete model.json) as the export stage does."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.onnx").write_bytes(onnx_bytes)
    (root / "model.json").write_text(json.dumps(model_card(onnx_bytes, **fields)))
    return root


def make_model_dir(root: Path, tag: str) -> Path:
    """Write a model folder (model.onnx bytes + model.json) as the export stage does."""
    return write_model_dir(root, f"onnx-{tag}".encode(), run_id=f"run-{tag}")


def launch_of(
    run_id: str,
    job_uri: str | None = None,
    *,
    dag_id: str = "d",
    time_budget_s: int = 600,
    airflow_run_id: str = "",
    **fields: Any,
) -> Launch:
    """Return the launch of a run keyed ``run_id``: its deadline ``time_budget_s`` from now."""
    from datetime import UTC, datetime, timedelta

    defaults: dict[str, Any] = {
        "instance_types": [],
        "use_spot": None,
        "deadline_at": datetime.now(UTC) + timedelta(seconds=time_budget_s),
        "wheel_uri": "",
        "wheel_sha256": "",
    }
    return Launch(
        run=RunRef(airflow_run_id=airflow_run_id, run_key=run_id),
        dag_id=dag_id,
        job_uri=job_uri or f"s3://never-read/runs/{run_id}/job/job.json",
        time_budget_s=time_budget_s,
        **{**defaults, **fields},
    )


def resolve_validated(run: RunRef, params: Any, settings: Any, packed: Packed) -> Any:
    """Write the run's run.json as its first task and validate would, and return it.

    For a test that provisions a packed dataset made by hand: the run is resolved
    (``resolve.resolve_run``: params, prices, budget), then validate's choices for that data
    are added: the packed size, and the training recipe for its training images
    (``resolve.choose_training``, the rules validate applies).
    """
    from burstcv.stages import resolve
    from burstcv_spec.contracts import ImageSizeChoice, write_artifact

    resolved = resolve.resolve_run(run, params, settings)
    shape = packed.preprocess
    size = ImageSizeChoice(
        px=shape.height, reason="the packed dataset's size", resize_short=shape.resize_short
    )
    training = resolve.choose_training(
        params,
        train_images=packed.counts.get("train", 0),
        photos=shape.resize_short is not None,
        settings=settings,
    )
    validated = resolved.model_copy(update={"image_size": size, "training": training})
    write_artifact(resolve.run_layout(run, settings).record, validated)
    return validated


def g6_box_rate(**fields: Any) -> BoxRate:
    """Return a g6.xlarge's rate on demand in us-east-1, as AWS publishes it: $0.8048/h, a
    100 GB gp3 root volume at $0.08 per GB-month and a public IPv4 address at $0.005/h."""
    published: dict[str, Any] = {
        "instance_type": "g6.xlarge",
        "market": "on-demand",
        "usd_per_hour": 0.8048,
        "price_source": "bundled table, 2024-06-01",
        "volume_gb": 100,
        "ebs_usd_per_gb_month": 0.08,
        "public_ipv4_usd_per_hour": 0.005,
    }
    return BoxRate(**{**published, **fields})


def bench_figures(**fields: Any) -> BenchFigures:
    """Return one model's benchmark figures: a fast, accurate, error-free run unless told."""
    p95 = float(fields.get("p95_ms", 5.0))
    defaults: dict[str, Any] = {
        "label": "candidate",
        "requests": 100,
        "concurrency": 4,
        "errors": 0,
        "p50_ms": p95 / 2,
        "p95_ms": p95,
        "p99_ms": p95 * 1.2,
        "mean_ms": p95 / 2,
        "throughput_rps": 100.0,
        "wall_s": 1.0,
        "status_counts": {"200": 100},
        "error_rate": 0.0,
        "accuracy": 0.97,
    }
    return BenchFigures.model_validate({**defaults, **fields})


def gate_decision(
    accuracy: float, p95_ms: float, reasons: list[str] | tuple[str, ...] = (), **fields: Any
) -> dict[str, Any]:
    """Return the gate's part of a registry entry: a complete verdict and candidate figures."""
    promote = not reasons
    summary = "promote" if promote else "not promoted: " + "; ".join(reasons)
    candidate = bench_figures(p95_ms=p95_ms, accuracy=accuracy).model_dump(mode="json")
    decision: dict[str, Any] = {
        "status": "accepted" if promote else "rejected",
        "reason": summary,
        "gate": {
            "promote": promote,
            "reasons": list(reasons),
            "checks": [],
            "suggestions": [],
            "summary": summary,
            "failed_figures": list(reasons),
        },
        "benchmark": {"candidate": candidate},
    }
    decision.update(fields)
    return decision


def init_airflow_db(env: dict[str, str], *, cwd: Path | None = None) -> None:
    """Migrate the metadata DB that ``env`` names, then run burstcv's Airflow setup (its pool).

    Runs ``airflow db migrate`` then ``burstcv airflow-init`` as subprocesses (Airflow reads
    its configuration once per process); raises RuntimeError with their output on failure.
    """
    steps = {
        "airflow db migrate": ([sys.executable, "-m", "airflow", "db", "migrate"], 600),
        "burstcv airflow-init": ([sys.executable, "-m", "burstcv.cli", "airflow-init"], 300),
    }
    for name, (command, timeout_s) in steps.items():
        done = subprocess.run(
            command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s
        )
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def chromium_screenshot(
    url: str, shot: Path, width: int, height: int, *, wait_ms: int = 0
) -> str | None:
    """Screenshot ``url`` with headless Chromium into ``shot``; None if Chromium is absent.

    Returns Chromium's stderr (for a failure message). ``wait_ms`` lets a page's scripts run
    (virtual time) before the picture is taken.
    """
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return None
    args = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        f"--user-data-dir={shot.parent / 'chromium-profile'}",
        f"--screenshot={shot}",
        f"--window-size={width},{height}",
    ]
    if wait_ms:
        args.append(f"--virtual-time-budget={wait_ms}")
    result = subprocess.run([*args, url], capture_output=True, text=True, timeout=120)
    return result.stderr


def gratings(
    count: int, angles_deg: list[float], *, size_px: int = 32, seed: int = 0
) -> tuple[Any, Any]:
    """Return ``count`` noisy, coloured sine gratings (uint8 NHWC) and their angle-class labels.

    Class ``i`` is a grating at ``angles_deg[i]`` (±4°) with a random frequency, phase and
    colour: a task whose features (oriented edges) carry over to gratings at other angles.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(angles_deg), count)
    yy, xx = np.mgrid[0:size_px, 0:size_px].astype(np.float32) * (32.0 / size_px)
    theta = np.deg2rad(np.asarray(angles_deg, np.float32)[labels] + rng.normal(0, 4, count))
    period_px = rng.uniform(5.0, 12.0, count)
    phase = rng.uniform(0, 2 * np.pi, count)
    along = np.cos(theta)[:, None, None] * xx + np.sin(theta)[:, None, None] * yy
    wave = np.sin(2 * np.pi * along / period_px[:, None, None] + phase[:, None, None])
    colour = rng.uniform(0.3, 1.0, (count, 1, 1, 3))
    noise = rng.normal(0, 0.08, (count, size_px, size_px, 3))
    images = 0.5 + 0.4 * wave[..., None] * colour + noise
    return (images.clip(0, 1) * 255).round().astype(np.uint8), labels.astype(np.int64)


def pretrain_on_gratings(
    path: Path, arch: str, angles_deg: list[float], *, size_px: int = 32, steps: int = 40
) -> Path:
    """Make "pretrained" weights: ``arch`` (torchvision's layout) taught grating orientations.

    512 gratings, normalised as pretrained models are (ImageNet mean/std), ``steps`` SGD
    steps of 32 on CPU with fixed seeds; the state_dict is saved to ``path``.
    """
    import torch
    from torch.nn import functional as F

    from burstcv.training.models import build_model
    from burstcv.training.train import normalize
    from burstcv.training.weights import normalization

    torch.manual_seed(0)
    images, labels = gratings(512, angles_deg, size_px=size_px, seed=1)
    model = build_model(arch, len(angles_deg), size_px, pretrained=True)
    mean, std = (
        torch.tensor(v).view(1, 3, 1, 1) for v in normalization(arch, "w.pt", (0, 0, 0), (1, 1, 1))
    )
    x = normalize(torch.from_numpy(images).permute(0, 3, 1, 2), mean, std, 1 / 255)
    y = torch.from_numpy(labels)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    order = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(y), (32,), generator=order)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save(model.state_dict(), path)
    return path


def write_shard(path: Path, images: Any, labels: Any, classes: list[str]) -> str:
    """Write one training shard (.npz of uint8 NHWC images, labels, classes) as pack does."""
    import io

    import numpy as np

    buf = io.BytesIO()
    np.savez(buf, images=images, labels=labels, classes=np.array(classes))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return str(path)


PHOTO_COLOURS = {"cool": (60, 110, 190), "warm": (190, 110, 60)}


def corrupt_image_member(shard: bytes) -> bytes:
    """Return a .npz shard with bytes zeroed inside its image member: its headers and labels
    still read, its pixels fail their check (a corrupt shard as a box meets it)."""
    data = bytearray(shard)
    at = data.find(b"images.npy")
    assert at > 0, "no image member in the shard"
    middle = at + (len(data) - at) // 4  # inside the member's data, past its local header
    data[middle : middle + 64] = bytes(64)
    return bytes(data)


def photo_jpeg(color: tuple[int, int, int], width: int, height: int, seed: int) -> bytes:
    """Return a JPEG of a noisy coloured picture with a few darker blobs.

    Every fifth seed is stored as a phone stores a portrait photo: pixels turned sideways,
    with an EXIF orientation tag that turns them back.
    """
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = np.array(color, np.float32) + rng.normal(0, 25, (height, width, 3))
    y, x = np.ogrid[:height, :width]
    for _ in range(3):
        cy, cx, r = rng.integers(0, height), rng.integers(0, width), rng.integers(4, 15)
        pixels[(y - cy) ** 2 + (x - cx) ** 2 < r**2] *= 0.5
    img = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
    buf = io.BytesIO()
    if seed % 5 == 0:
        exif = Image.Exif()
        exif[0x0112] = 6  # display rotated 90 degrees clockwise
        img.transpose(Image.Transpose.ROTATE_90).save(buf, "JPEG", quality=90, exif=exif)
    else:
        img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def write_photo_dataset(root: Path, count: int = 96) -> list[dict[str, Any]]:
    """Write a two-class photo set (warm / cool JPEGs of 40-140 px); return manifest rows.

    One image in four is in the val split; rows carry what pack_dataset reads.
    """
    import numpy as np

    rows = []
    rng = np.random.default_rng(0)
    for i in range(count):
        label = sorted(PHOTO_COLOURS)[i % 2]
        width, height = (int(v) for v in rng.integers(40, 140, 2))
        path = root / ("val" if i % 4 == 3 else "train") / label / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(photo_jpeg(PHOTO_COLOURS[label], width, height, i))
        rows.append(
            {
                "path": str(path.relative_to(root)),
                "uri": str(path),
                "split": path.parts[-3],
                "label": label,
                "decode_ok": True,
            }
        )
    return rows


def reclaim_in_emulator(
    instance_id: str, region: str = "us-east-1", ends_after_s: float | None = None
) -> None:
    """Put an emulated instance where a reclaimed spot box stays for minutes: shutting-down.

    moto's TerminateInstances ends an instance at once; EC2 shows ``shutting-down`` first. The
    emulator runs in this process (``localserver.moto_server``), so its instance is set there.
    ``ends_after_s``: the box is terminated that many seconds later, as EC2 ends it (None:
    it stays shutting-down).
    """
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends

    instance = ec2_backends[DEFAULT_ACCOUNT_ID][region].get_instance(instance_id)
    instance._state.name = "shutting-down"
    instance._state.code = 32
    instance._reason = "Server.SpotInstanceTermination: Spot instance termination"
    if ends_after_s is not None:

        def end() -> None:
            instance._state.name = "terminated"
            instance._state.code = 48

        timer = threading.Timer(ends_after_s, end)
        timer.daemon = True
        timer.start()


def power_off_in_emulator(instance_id: str, region: str = "us-east-1") -> None:
    """End an emulated instance as EC2 ends one whose OS halted itself (shutdown -h, with
    InstanceInitiatedShutdownBehavior=terminate): terminated, "Client.InstanceInitiatedShutdown".
    """
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.instances import StateReason

    backend = ec2_backends[DEFAULT_ACCOUNT_ID][region]
    backend.terminate_instances([instance_id])
    instance = backend.get_instance(instance_id)
    instance.state_reason = StateReason(
        "Client.InstanceInitiatedShutdown: Instance initiated shutdown",
        "Client.InstanceInitiatedShutdown",
    )


def forget_in_emulator(instance_ids: list[str], region: str = "us-east-1") -> None:
    """Make the emulator forget instances, as EC2 does about an hour after their termination."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends

    backend = ec2_backends[DEFAULT_ACCOUNT_ID][region]
    for reservation_id, reservation in list(backend.reservations.items()):
        if {i.id for i in reservation.instances} & set(instance_ids):
            del backend.reservations[reservation_id]


# --- small ImageFolder datasets ---------------------------------------------------------

CLASSES = ("cat", "dog", "fox")
SPLITS = ("train", "val")
PER_CLASS = 10  # per split: above the default minimum of 5, so the clean dataset passes


def smooth_image(seed: int, size: int = 32) -> Image.Image:
    """Return a distinct, smooth RGB image: 8x8 random colours, upscaled."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    return Image.fromarray(small, "RGB").resize((size, size), Image.Resampling.BILINEAR)


def write_dataset(
    root: Path,
    *,
    classes: tuple[str, ...] = CLASSES,
    per_class: int | dict[tuple[str, str], int] = PER_CLASS,
    seed: int = 0,
) -> Path:
    """Write <root>/<split>/<class>/<n>.png and return root; every image is distinct."""
    counter = seed * 100_000
    for split in SPLITS:
        for label in classes:
            n = per_class if isinstance(per_class, int) else per_class.get((split, label), 0)
            folder = root / split / label
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                counter += 1
                smooth_image(counter).save(folder / f"{i:03d}.png")
    return root


# A CPU burner: spins on one CPU until its deadline, whatever happens to the test that started it.
_BURNER = (
    "import os, sys, time\n"
    "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
    "end = time.monotonic() + float(sys.argv[2])\n"
    "while time.monotonic() < end:\n"
    "    pass\n"
)


@contextlib.contextmanager
def cpu_burners(
    per_cpu: int = 1, seconds: float = 120.0, cpus: list[int] | None = None
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Keep ``cpus`` (default: every CPU this process may use) busy with ``per_cpu`` spinning
    processes each: other work on the host, as a neighbour's training or tests would be.

    Each burner stops by itself after ``seconds``; all are killed when the block ends.
    """
    targets = cpus if cpus is not None else sorted(os.sched_getaffinity(0))
    procs = [
        subprocess.Popen([sys.executable, "-c", _BURNER, str(cpu), str(seconds)])
        for cpu in targets
        for _ in range(per_cpu)
    ]
    try:
        time.sleep(0.3)  # every burner is spinning before the block measures anything
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def predict_handler(
    delay_s: float = 0.0,
    status: int = 200,
    on_request: Callable[[], None] | None = None,
    slow_when: tuple[bytes, float] | None = None,
) -> type[BaseHTTPRequestHandler]:
    """Return a handler answering POST /v1/predict with ``status`` after ``delay_s``: a stand-in
    for the service where a test proves the load generator, not the service (a 503 carries
    Retry-After, as the service's sheds do). ``on_request`` runs as each request arrives;
    ``slow_when`` (marker, seconds): a request whose body holds the marker takes that long."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if on_request is not None:
                on_request()
            slow = slow_when is not None and slow_when[0] in body
            time.sleep(slow_when[1] if slow_when is not None and slow else delay_s)
            self.send_response(status)
            if status == 503:
                self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@contextlib.contextmanager
def served(server: HTTPServer) -> Iterator[str]:
    """Serve ``server`` (bound to 127.0.0.1) from a thread; yield its URL; stop it after."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def first_trigger_event(trigger: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """Run an Airflow trigger until its first event; return the event's payload."""

    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), timeout=timeout_s))


def s3_gateway_endpoint(ec2: Any, region: str) -> None:
    """Give the default VPC's main route table the free S3 gateway endpoint docs/aws.md asks
    for (the account's route to S3)."""
    (main,) = ec2.describe_route_tables(Filters=[{"Name": "association.main", "Values": ["true"]}])[
        "RouteTables"
    ]
    ec2.create_vpc_endpoint(
        VpcId=main["VpcId"],
        ServiceName=f"com.amazonaws.{region}.s3",
        VpcEndpointType="Gateway",
        RouteTableIds=[main["RouteTableId"]],
    )
