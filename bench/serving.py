"""Benchmark the prediction service against the bare-onnxruntime floor and a naive torch service.

One run measures, side by side on this machine:

* the floor: onnxruntime in-process, batch 1 latency (p50/p99) and batched throughput;
* the service (``python -m burstcv_serving``, a real process) at concurrency 1 (p50/p99) and
  at concurrency 16 (throughput, p99), over HTTP with a multipart PNG per request;
* the concurrency-1 overhead as the median of paired rounds: one second of bare batch-1
  runs, then two seconds of service requests, five times (the machine drifts more over a
  minute than the overhead being measured);
* a naive baseline: FastAPI + torch eager, one request per forward pass.

``--overload`` instead steps closed-loop connections (16, 64, 256, 400, 800) past saturation
against the service and a plain FastAPI + onnxruntime service (one session.run per request,
no batching, no shedding), both running, the steps alternating between them: goodput (200s
per second), 503s per second and the p99 of the 200s alone, which is why that mode has its
own generator (wrk's latency figures mix every status). A 503 is sent again at once, as a
retry storm would; the goals (800-connection goodput >= 80% of the peak, >= the plain
service at every step, p99 against the queueing-delay target) are printed beside the figures.
``--baseline-serving-dir`` runs another checkout's service (main's, say) in the same steps,
and compares concurrency-1 latency (add 1 to ``--connections``) and concurrency-16 goodput;
``--repeat N`` measures every step N times (medians), for a noisy shared machine.

``--sizing`` instead measures what the fleet recommendation rests on: for 1 CPU up to the
host's, the highest open-loop rate whose p95 stays within ``--slo-ms``, for the service and for
the plain FastAPI + onnxruntime service pinned to the same CPUs, and their ratio per vCPU.

``--protocols`` instead weighs the service's fast HTTP protocol (``burstcv_serving.protocol``,
built on uvicorn's private API) against its public fallback (uvicorn's httptools protocol,
admission in ASGI middleware): the same checkout runs twice, ``FAST_PROTOCOL=true`` and
``false``, both running, the same closed-loop steps alternating between them ``--repeat``
times (medians). Per step: goodput, 503s per second, p50/p99 of the 200s and the server's
CPU time per answer, and the ratios fast/public; then the gain on the figures the fast path
is for (goodput and the p99 of the 200s under overload), against the 10% that keeps it.

Load comes from ``wrk`` when it is installed (Debian: ``apt-get install -y wrk``), else from
an asyncio/httpx generator in this process (which can itself become the bottleneck).

    python bench/serving.py [--model-dir DIR] [--torch-checkpoint model.pt] [--duration-s 5]
    python bench/serving.py --overload [--connections 16,64,256,400,800] [--duration-s 5]
        [--baseline-serving-dir ../main/serving] [--repeat 3]
    python bench/serving.py --protocols [--connections 1,16,64,400,800] [--repeat 5]
    python bench/serving.py --sizing [--slo-ms 50] [--duration-s 3]

Without ``--model-dir`` a synthetic classifier (Conv → ReLU → GlobalAveragePool → Gemm) is
built with onnx.helper, and the torch baseline is the same network as an nn.Module.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
from fastapi import FastAPI, File, UploadFile  # module level: FastAPI resolves the annotations

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "serving"))
sys.path.append(str(REPO_ROOT / "tests"))  # the test-support modules: localserver

from localserver import free_port, prediction_service, server_process  # noqa: E402

from burstcv_serving.settings import Settings  # noqa: E402
from burstcv_spec.preprocess import PreprocessSpec, decode_to_uint8, normalize  # noqa: E402

logger = logging.getLogger("bench.serving")

BOUNDARY = "burstcvbench"
SYNTH_CLASSES = 10
SYNTH_CHANNELS = 32
SYNTH_ARCH = "conv-gap-gemm"  # model.json's "arch" of the synthetic classifier


# --- the model -------------------------------------------------------------------------------


def synthetic_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Return the synthetic network's weights (shared by the ONNX file and the torch module)."""
    rng = np.random.default_rng(seed)
    return {
        "conv_w": (rng.standard_normal((SYNTH_CHANNELS, 3, 3, 3)) * 0.2).astype(np.float32),
        "conv_b": np.zeros(SYNTH_CHANNELS, dtype=np.float32),
        "fc_w": (rng.standard_normal((SYNTH_CLASSES, SYNTH_CHANNELS)) * 0.2).astype(np.float32),
        "fc_b": np.zeros(SYNTH_CLASSES, dtype=np.float32),
    }


def write_synthetic_model(directory: Path) -> Path:
    """Write model.onnx + model.json for the synthetic classifier; return the directory."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = synthetic_weights()
    nodes = [
        helper.make_node("Conv", ["input", "conv_w", "conv_b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"], axis=1),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "bench_classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 32, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", SYNTH_CLASSES])],
        initializer=[numpy_helper.from_array(v, k) for k, v in w.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    data = model.SerializeToString()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.onnx").write_bytes(data)
    spec = PreprocessSpec(height=32, width=32)
    meta = {
        "format_version": 1,
        "name": "bench-synthetic",
        "arch": SYNTH_ARCH,
        "classes": [str(i) for i in range(SYNTH_CLASSES)],
        "onnx_file": "model.onnx",
        "sha256": hashlib.sha256(data).hexdigest(),
        "opset": 18,
        "input": {"name": "input", "shape": [None, 3, 32, 32], "dtype": "float32"},
        "output": {"name": "logits", "kind": "logits"},
        "preprocess": spec.to_dict(),
        "metrics": {},
        # Lineage, required by the model.json contract (there is none: it was built here).
        "dataset_fingerprint": "0" * 64,
        "source_commit": "unknown",
        "run_id": "bench-synthetic",
        "created_at": "2025-01-01T00:00:00Z",
    }
    (directory / "model.json").write_text(json.dumps(meta, indent=2))
    return directory


def torch_module(checkpoint: str | None, meta: dict[str, Any]) -> Any:
    """Return the torch baseline: a checkpointed torchvision-style model or the synthetic one."""
    import torch
    from torch import nn

    if checkpoint and meta.get("arch") != SYNTH_ARCH:
        # A burstcv training job's model.pt is a state dict: rebuild the architecture that
        # model.json names, so the baseline runs exactly the network the service runs.
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or "arch" not in meta:
            raise SystemExit(f"{checkpoint} is not a burstcv state dict for {meta.get('name')}")
        from burstcv.training.models import build_model

        module = build_model(meta["arch"], len(meta["classes"]), int(meta["input"]["shape"][2]))
        module.load_state_dict(state)
        return module.eval()
    if meta.get("arch") != SYNTH_ARCH:
        raise SystemExit("--model-dir holds a trained model: pass model.pt as --torch-checkpoint")

    class Synthetic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, SYNTH_CHANNELS, 3, padding=1)
            self.fc = nn.Linear(SYNTH_CHANNELS, SYNTH_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.conv(x))
            return self.fc(x.mean(dim=(2, 3)))

    w = synthetic_weights()
    module = Synthetic()
    with torch.no_grad():
        module.conv.weight.copy_(torch.from_numpy(w["conv_w"]))
        module.conv.bias.copy_(torch.from_numpy(w["conv_b"]))
        module.fc.weight.copy_(torch.from_numpy(w["fc_w"]))
        module.fc.bias.copy_(torch.from_numpy(w["fc_b"]))
    return module.eval()


# --- the naive baseline service (run as: bench/serving.py --naive-server) ---------------------


def run_naive_server(model_dir: str, checkpoint: str | None, port: int, threads: int) -> None:
    """Serve FastAPI + torch eager, one forward pass per request (the usual first attempt)."""
    import torch
    import uvicorn

    torch.set_num_threads(threads)  # the same intra-op threads as the service's onnxruntime

    meta = json.loads((Path(model_dir) / "model.json").read_text())
    spec = PreprocessSpec.from_dict(meta["preprocess"])
    classes = meta["classes"]
    module = torch_module(checkpoint, meta)
    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/predict")
    def predict(file: UploadFile = File(...)) -> dict[str, Any]:
        x = torch.from_numpy(normalize(decode_to_uint8(file.file.read(), spec), spec))
        with torch.no_grad():
            probabilities = torch.softmax(module(x), dim=1)[0]
        top = torch.topk(probabilities, k=min(3, len(classes)))
        return {
            "predictions": [
                {"label": classes[i], "index": int(i), "score": float(s)}
                for s, i in zip(top.values.tolist(), top.indices.tolist(), strict=True)
            ]
        }

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def run_plain_server(model_dir: str, port: int, threads: int) -> None:
    """Serve FastAPI + onnxruntime, one session.run per request (no batching, no shedding)."""
    import onnxruntime as ort
    import uvicorn

    meta = json.loads((Path(model_dir) / "model.json").read_text())
    spec = PreprocessSpec.from_dict(meta["preprocess"])
    classes = meta["classes"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads  # the same intra-op threads as the service's
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(
        str(Path(model_dir) / meta["onnx_file"]), options, providers=["CPUExecutionProvider"]
    )
    input_name = meta["input"]["name"]
    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/predict")
    def predict(file: UploadFile = File(...)) -> dict[str, Any]:
        x = normalize(decode_to_uint8(file.file.read(), spec), spec)
        (logits,) = session.run(None, {input_name: x})
        shifted = np.exp(logits[0] - logits[0].max())
        probabilities = shifted / shifted.sum()
        top = np.argsort(-probabilities)[: min(3, len(classes))]
        return {
            "predictions": [
                {"label": classes[i], "index": int(i), "score": float(probabilities[i])}
                for i in top
            ]
        }

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --- measurement helpers ---------------------------------------------------------------------


def _load_average() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def percentile_ms(samples_s: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples_s) * 1000.0, q))


def sample_png() -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def multipart_body(png: bytes) -> bytes:
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="x.png"\r\n'
        "Content-Type: image/png\r\n\r\n"
    ).encode()
    return head + png + f"\r\n--{BOUNDARY}--\r\n".encode()


class BareSession:
    """onnxruntime in this process with the service's options: the floor."""

    def __init__(self, model_dir: Path, threads: int, spinning: bool) -> None:
        import onnxruntime as ort

        meta = json.loads((model_dir / "model.json").read_text())
        spec = PreprocessSpec.from_dict(meta["preprocess"])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.add_session_config_entry("session.intra_op.allow_spinning", str(int(spinning)))
        self.session = ort.InferenceSession(
            str(model_dir / meta["onnx_file"]), options, providers=["CPUExecutionProvider"]
        )
        self.name = meta["input"]["name"]
        self.one = normalize(decode_to_uint8(sample_png(), spec), spec)
        self.batch = np.repeat(self.one, 32, axis=0)
        for _ in range(50):
            self.session.run(None, {self.name: self.one})

    def latencies(self, seconds: float) -> list[float]:
        """Time back-to-back batch-1 runs for ``seconds``."""
        latencies = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            started = time.perf_counter()
            self.session.run(None, {self.name: self.one})
            latencies.append(time.perf_counter() - started)
        return latencies

    def batched_images_per_s(self, seconds: float) -> float:
        """Return images/s of back-to-back batch-32 runs for ``seconds``."""
        images = 0
        started = time.perf_counter()
        end = started + seconds
        while time.perf_counter() < end:
            self.session.run(None, {self.name: self.batch})
            images += len(self.batch)
        return images / (time.perf_counter() - started)


def bare_onnxruntime(bare: BareSession, seconds: float) -> dict[str, float]:
    """Time session.run alone: batch-1 latency and batch-32 throughput (the floor)."""
    latencies = bare.latencies(seconds / 2)
    return {
        "p50_ms": percentile_ms(latencies, 50),
        "p99_ms": percentile_ms(latencies, 99),
        "batched_images_per_s": bare.batched_images_per_s(seconds / 2),
    }


def paired_c1(
    bare: BareSession, url: str, body_path: Path, rounds: int, use_wrk: bool
) -> list[dict[str, float]]:
    """Alternate short windows of bare batch-1 runs and service requests at concurrency 1.

    A shared 2-core machine drifts by tens of percent over a minute, more than the overhead
    being measured; windows a second apart see the same machine, so their difference is the
    service's own cost.
    """
    pairs = []
    for _ in range(rounds):
        bare_p50 = percentile_ms(bare.latencies(1.0), 50)
        service = measure_http(url, body_path, 1, 2.0, use_wrk, warm_up=False)
        pairs.append({"bare_p50_ms": bare_p50, "service_p50_ms": service["p50_ms"]})
    return pairs


_WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "multipart/form-data; boundary={boundary}"
local f = io.open("{body_path}", "rb")
wrk.body = f:read("*all")
f:close()
done = function(summary, latency, requests)
  io.write(string.format("JSON {{\\"requests\\": %d, \\"seconds\\": %f, \\"p50_us\\": %f, "
    .. "\\"p99_us\\": %f, \\"non2xx\\": %d, \\"errors\\": %d}}\\n",
    summary.requests, summary.duration / 1e6, latency:percentile(50), latency:percentile(99),
    summary.errors.status, summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.timeout))
end
"""


def load_wrk(url: str, body_path: Path, concurrency: int, seconds: float) -> dict[str, float]:
    script = body_path.with_suffix(".lua")
    script.write_text(_WRK_LUA.format(boundary=BOUNDARY, body_path=body_path))
    threads = min(concurrency, 2)
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{seconds:.0f}s", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    match = re.search(r"^JSON (\{.*\})$", out, re.MULTILINE)
    if not match:
        raise SystemExit(f"cannot parse wrk output:\n{out}")
    stats = json.loads(match.group(1))
    return {
        "requests": stats["requests"],
        "throughput_rps": stats["requests"] / stats["seconds"],
        "p50_ms": stats["p50_us"] / 1000.0,
        "p99_ms": stats["p99_us"] / 1000.0,
        "failed": stats["non2xx"] + stats["errors"],
    }


def load_python(url: str, body: bytes, concurrency: int, seconds: float) -> dict[str, float]:
    import httpx

    latencies: list[float] = []
    failed = 0

    async def worker(client: httpx.AsyncClient, end: float) -> None:
        nonlocal failed
        headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
        while time.perf_counter() < end:
            started = time.perf_counter()
            response = await client.post(url, content=body, headers=headers)
            latencies.append(time.perf_counter() - started)
            failed += response.status_code != 200

    async def main() -> float:
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:
            started = time.perf_counter()
            end = started + seconds
            await asyncio.gather(*(worker(client, end) for _ in range(concurrency)))
            return time.perf_counter() - started

    elapsed = asyncio.run(main())
    return {
        "requests": len(latencies),
        "throughput_rps": len(latencies) / elapsed,
        "p50_ms": percentile_ms(latencies, 50),
        "p99_ms": percentile_ms(latencies, 99),
        "failed": failed,
    }


class _ClosedLoopConnection(asyncio.Protocol):
    """One closed-loop client: send the request, read the whole answer, send again at once.

    Each answer's status and latency (write to last byte) is recorded while the window is
    open. A connection the server closes is opened again, as a browser or SDK would.
    """

    def __init__(self, run: _ClosedLoopRun) -> None:
        self.run = run
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.needed = 0  # bytes of the current answer, once its head has arrived
        self.status = 0
        self.closing = False
        self.sent_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.send()

    def send(self) -> None:
        assert self.transport is not None
        self.sent_at = time.perf_counter()
        self.transport.write(self.run.request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            if not self.needed:
                head_end = self.buffer.find(b"\r\n\r\n")
                if head_end < 0:
                    return
                head = bytes(self.buffer[:head_end])
                self.status = int(head[9:12])
                length = _CONTENT_LENGTH.search(head)
                self.needed = head_end + 4 + (int(length.group(1)) if length else 0)
                self.closing = _CONNECTION_CLOSE.search(head) is not None
            if len(self.buffer) < self.needed:
                return
            del self.buffer[: self.needed]
            self.needed = 0
            self.run.record(self.status, time.perf_counter() - self.sent_at)
            assert self.transport is not None
            if self.closing or not self.run.open:
                self.transport.close()
                return
            self.send()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.needed or self.buffer or exc is not None:
            self.run.errors += 1
        if self.run.open:
            self.run.reconnect()


_CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length:\s*(\d+)")
_CONNECTION_CLOSE = re.compile(rb"(?i)\r\nconnection:\s*close")


class _ClosedLoopRun:
    """Hold the clients of one measurement and what they saw inside its window."""

    def __init__(self, host: str, port: int, request: bytes) -> None:
        self.host, self.port, self.request = host, port, request
        self.open = True
        self.counting = False
        self.ok_latencies: list[float] = []
        self.statuses: dict[int, int] = {}
        self.errors = 0
        self.pending: set[asyncio.Task[Any]] = set()

    def record(self, status: int, latency_s: float) -> None:
        if not self.counting:
            return
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if status == 200:
            self.ok_latencies.append(latency_s)

    def reconnect(self) -> None:
        task = asyncio.get_running_loop().create_task(self.connect())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(lambda: _ClosedLoopConnection(self), self.host, self.port)
        except OSError:
            self.errors += 1
            if self.open:
                await asyncio.sleep(0.01)
                self.reconnect()


def load_closed_loop(
    url: str, body: bytes, concurrency: int, seconds: float, warm_up_s: float = 1.0
) -> dict[str, float]:
    """Run ``concurrency`` closed-loop clients; count answers by status, time the 200s.

    wrk's latency figures mix every status, and the overload steps need the p99 of the 200s
    alone (a 503 answered in 0.1 ms would hide a 200 that took a second), so this generator
    keeps them apart. It is a bare asyncio Protocol on uvloop: a few microseconds a request.
    """
    import urllib.parse

    import uvloop

    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    request = (
        f"POST {parsed.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    run = _ClosedLoopRun(host, port, request)

    async def main() -> float:
        await asyncio.gather(*(run.connect() for _ in range(concurrency)))
        await asyncio.sleep(warm_up_s)
        run.counting = True
        started = time.perf_counter()
        await asyncio.sleep(seconds)
        run.counting = False
        elapsed = time.perf_counter() - started
        run.open = False
        await asyncio.sleep(0.5)  # let answers in flight arrive (not counted) before closing
        return elapsed

    elapsed = uvloop.run(main())
    ok = run.statuses.get(200, 0)
    shed = run.statuses.get(503, 0)
    other = sum(n for status, n in run.statuses.items() if status not in (200, 503))
    return {
        "connections": concurrency,
        "ok_per_s": ok / elapsed,
        "shed_per_s": shed / elapsed,
        "other": other,
        "errors": run.errors,
        "ok_p50_ms": percentile_ms(run.ok_latencies, 50) if ok else float("nan"),
        "ok_p99_ms": percentile_ms(run.ok_latencies, 99) if ok else float("nan"),
    }


def measure_http(
    url: str,
    body_path: Path,
    concurrency: int,
    seconds: float,
    use_wrk: bool,
    warm_up: bool = True,
) -> dict[str, float]:
    # Warm-up (connections, caches), not counted.
    if use_wrk:
        if warm_up:
            load_wrk(url, body_path, concurrency, 1)
        return load_wrk(url, body_path, concurrency, seconds)
    if warm_up:
        load_python(url, body_path.read_bytes(), concurrency, 1)
    return load_python(url, body_path.read_bytes(), concurrency, seconds)


def bench_service_settings(model_dir: Path, threads: int) -> dict[str, object]:
    """Return the BURSTCV_SERVING_* settings of the service serving ``model_dir``."""
    return {"MODEL_DIR": model_dir, "POLL_INTERVAL_S": 0, "INTRA_OP_THREADS": threads}


def shed_counters(metrics_text: str) -> dict[str, float]:
    """Return the admitted and shed counters (by reason) from a /metrics answer."""
    counters: dict[str, float] = {}
    for line in metrics_text.splitlines():
        match = re.match(
            r'burstcv_serving_(admitted_requests|shed_requests)_total(?:\{reason="(\w+)"\})? (\S+)',
            line,
        )
        if match:
            name = "admitted" if match.group(1) == "admitted_requests" else f"shed_{match.group(2)}"
            counters[name] = float(match.group(3))
    return counters


def overload(args: argparse.Namespace, model_dir: Path, body: bytes, work: Path) -> None:
    """Step closed-loop connections up past saturation against the service and the plain one.

    Every service runs for the whole measurement and the steps alternate between them, so a
    shift in the machine's load hits every side of each comparison alike. With
    ``--baseline-serving-dir`` another checkout's service (main's, say) runs beside them.
    """
    import httpx

    steps = [int(c) for c in args.connections.split(",")]
    target_ms = Settings(model_dir=str(model_dir)).queue_delay_target_ms
    checkouts = {"service": args.serving_dir}
    if args.baseline_serving_dir:
        checkouts["baseline"] = args.baseline_serving_dir
    plain_port = free_port()
    plain_cmd = [sys.executable, __file__, "--plain-server", "--model-dir", str(model_dir)]
    plain_cmd += ["--port", str(plain_port), "--threads", str(args.threads)]
    load_start = _load_average()
    with contextlib.ExitStack() as running:
        urls = {
            name: running.enter_context(
                prediction_service(
                    bench_service_settings(model_dir, args.threads),
                    log_path=work / f"{name}.log",
                    serving_dir=serving_dir,
                )
            ).url
            for name, serving_dir in checkouts.items()
        }
        urls["plain"] = running.enter_context(
            server_process(
                plain_cmd, port=plain_port, log_path=work / "plain.log", ready_path="/healthz"
            )
        ).url
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
        for connections in steps:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
            for repeat in range(args.repeat):
                # Alternate the order, so that neither side always follows the other.
                for name in list(urls)[:: 1 if repeat % 2 == 0 else -1]:
                    url = f"{urls[name]}/v1/predict"
                    runs[name].append(load_closed_loop(url, body, connections, args.duration_s))
                    logger.info("%s at %d connections: %s", name, connections, runs[name][-1])
            for name, measured in runs.items():
                rows[name].append(_median_row(measured))
        counters = {
            name: shed_counters(httpx.get(f"{urls[name]}/metrics").text) for name in checkouts
        }
    results = {
        "machine": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform()},
        "load_average": {"start": load_start, "end": _load_average()},
        "queue_delay_target_ms": target_ms,
        "repeat": args.repeat,
        "serving_dirs": checkouts,
        "steps": rows,
        "counters": counters,
    }
    report_overload(results, args.duration_s)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


# The fast path stays only if it gains at least this much on the figure it serves.
FAST_PATH_MIN_GAIN = 0.10
# Steps at or past this many connections are overload: the service refuses most requests
# (with the bench's model on 2 cores it sheds from a few hundred connections on).
OVERLOAD_CONNECTIONS = 256


def protocols(args: argparse.Namespace, model_dir: Path, body: bytes, work: Path) -> None:
    """Step closed-loop connections against the fast protocol and the public fallback.

    Both services run for the whole measurement, from the same checkout, and the steps
    alternate between them (the order flipping each repeat), so a shift in the machine's load
    hits both sides alike. Each log is checked for which protocol actually ran.
    """
    import httpx
    import psutil

    steps = [int(c) for c in args.connections.split(",")]
    target_ms = Settings(model_dir=str(model_dir)).queue_delay_target_ms
    load_start = _load_average()
    with contextlib.ExitStack() as running:
        servers = {
            name: running.enter_context(
                prediction_service(
                    {
                        **bench_service_settings(model_dir, args.threads),
                        "FAST_PROTOCOL": str(fast).lower(),
                        "LOG_LEVEL": "info",  # the line saying the fast path is off
                    },
                    log_path=work / f"{name}.log",
                    serving_dir=args.serving_dir,
                )
            )
            for name, fast in (("fast", True), ("public", False))
        }
        for name, server in servers.items():
            off = "fast HTTP protocol off" in server.log_path.read_text()
            if off != (name == "public"):
                raise SystemExit(
                    f"the {name} service did not run the {name} protocol:\n{server.log_tail()}"
                )
        cpu = {name: psutil.Process(server.process.pid) for name, server in servers.items()}
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
        for connections in steps:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
            for repeat in range(args.repeat):
                for name in list(servers)[:: 1 if repeat % 2 == 0 else -1]:
                    url = f"{servers[name].url}/v1/predict"
                    before = sum(cpu[name].cpu_times()[:2])
                    row = load_closed_loop(url, body, connections, args.duration_s)
                    # CPU over the warm-up, the window and the drain, per answer over the
                    # warm-up and the window (answered at the window's rate; the drain
                    # answers a request per connection at most).
                    spent_s = sum(cpu[name].cpu_times()[:2]) - before
                    answers = (row["ok_per_s"] + row["shed_per_s"]) * (args.duration_s + 1.0)
                    row["cpu_ms_per_answer"] = 1000.0 * spent_s / max(answers, 1.0)
                    runs[name].append(row)
                    logger.info("%s at %d connections: %s", name, connections, row)
            for name, measured in runs.items():
                rows[name].append(_median_row(measured))
        counters = {
            name: shed_counters(httpx.get(f"{server.url}/metrics").text)
            for name, server in servers.items()
        }
    results = {
        "machine": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform()},
        "load_average": {"start": load_start, "end": _load_average()},
        "queue_delay_target_ms": target_ms,
        "repeat": args.repeat,
        "steps": rows,
        "counters": counters,
    }
    report_protocols(results, args.duration_s)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def sizing(args: argparse.Namespace, model_dir: Path, work: Path) -> None:
    """Measure the sustainable rate per vCPU of the service and of the plain service, side by side.

    The fleet recommendation (burstcv.gate.sizing) rests on how much load one CPU sustains
    within the SLO under an open-loop load. For each size from 1 CPU to the host's, both
    services run pinned to the same CPUs with as many threads, one after the other, and the
    same stepped search finds each one's highest rate with p95 within ``--slo-ms``.
    """
    from burstcv.gate.sizing import host_cpus, pinned_service, sustainable_rate

    image = sample_png()
    cpus = host_cpus()
    rows = []
    for vcpus in range(1, len(cpus) + 1):
        pinned = ",".join(map(str, cpus[:vcpus]))
        measured: dict[str, float] = {}
        for name in ("burstcv", "plain"):
            if name == "burstcv":
                context: Any = pinned_service(str(model_dir), cpus[:vcpus])
            else:
                port = free_port()
                command = ["taskset", "-c", pinned, sys.executable, __file__, "--plain-server"]
                command += ["--model-dir", str(model_dir), "--port", str(port)]
                command += ["--threads", str(vcpus)]
                context = server_process(
                    command, port=port, log_path=work / f"plain-{vcpus}.log", ready_path="/healthz"
                )
            with context as running:
                url = running[0] if name == "burstcv" else running.url
                best = sustainable_rate(
                    url, [image], latency_slo_ms=args.slo_ms, duration_s=args.duration_s
                )
            measured[name] = best.rate_rps if best else 0.0
            logger.info(
                "%s at %d vCPU: %.1f req/s within p95 %g ms",
                name,
                vcpus,
                measured[name],
                args.slo_ms,
            )
        rows.append({"vcpus": vcpus, **measured})
    print(f"\nsustainable rate within p95 {args.slo_ms:g} ms, open loop, one image per request")
    print(
        f"{'vCPUs':>5} {'burstcv req/s':>14} {'plain req/s':>12} {'burstcv/plain':>14}"
        f" {'burstcv per vCPU':>17}"
    )
    for row in rows:
        ratio = row["burstcv"] / row["plain"] if row["plain"] else float("inf")
        print(
            f"{row['vcpus']:>5} {row['burstcv']:>14.1f} {row['plain']:>12.1f} {ratio:>13.2f}x"
            f" {row['burstcv'] / row['vcpus']:>17.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"slo_ms": args.slo_ms, "rows": rows}, indent=2))


def report_protocols(results: dict[str, Any], seconds: float) -> None:
    """Print both protocols per step, the ratios, and the gain against FAST_PATH_MIN_GAIN."""
    fast, public = results["steps"]["fast"], results["steps"]["public"]
    header = f"{'connections':>11}" + "".join(
        f" | {name + ' 200/s':>12}{'503/s':>7}{'p50 ms':>8}{'p99 ms':>8}{'cpu ms':>7}{'other':>6}"
        for name in ("fast", "public")
    )
    header += f" | {'200/s f/p':>9}{'p50 p/f':>8}{'p99 p/f':>8}{'cpu p/f':>8}"
    lines = [
        f"machine: {results['machine']}",
        f"load average (1, 5, 15 min): {results['load_average']['start']} at start, "
        f"{results['load_average']['end']} at end",
        f"closed-loop clients, {seconds:.0f} s per step after 1 s of warm-up, median of "
        f"{results['repeat']} (the two services alternating); a 503 is sent again at once "
        "(Retry-After ignored); p50/p99 of the 200s alone; 'cpu ms' = the server's CPU time "
        "per answer (200 or 503); ratios above 1 favour the fast protocol",
        f"queue-delay target {results['queue_delay_target_ms']:.0f} ms",
        "",
        header,
        "-" * len(header),
    ]
    overload: dict[str, list[float]] = {"goodput": [], "p99": []}
    for ours, theirs in zip(fast, public, strict=True):
        line = f"{ours['connections']:>11}"
        for row in (ours, theirs):
            line += (
                f" | {row['ok_per_s']:>12.0f}{row['shed_per_s']:>7.0f}{row['ok_p50_ms']:>8.1f}"
                f"{row['ok_p99_ms']:>8.1f}{row['cpu_ms_per_answer']:>7.2f}"
                f"{row['other'] + row['errors']:>6.0f}"
            )
        goodput = _ratio(ours["ok_per_s"], theirs["ok_per_s"])
        p99 = _ratio(theirs["ok_p99_ms"], ours["ok_p99_ms"])
        line += (
            f" | {goodput:>8.2f}x{_ratio(theirs['ok_p50_ms'], ours['ok_p50_ms']):>7.2f}x"
            f"{p99:>7.2f}x{_ratio(theirs['cpu_ms_per_answer'], ours['cpu_ms_per_answer']):>7.2f}x"
        )
        lines.append(line)
        if ours["connections"] >= OVERLOAD_CONNECTIONS:
            overload["goodput"].append(goodput)
            overload["p99"].append(p99)
    if overload["goodput"]:
        gain = max(
            statistics.median(overload["goodput"]) - 1, statistics.median(overload["p99"]) - 1
        )
        verdict = "keep it" if gain >= FAST_PATH_MIN_GAIN else "delete it"
        lines += [
            "",
            f"at {OVERLOAD_CONNECTIONS}+ connections, median over the steps: goodput fast/public "
            f"{statistics.median(overload['goodput']):.3f}x, p99 of the 200s public/fast "
            f"{statistics.median(overload['p99']):.3f}x",
            f"fast path's gain: {gain:+.1%} (rule: keep at >= {FAST_PATH_MIN_GAIN:.0%}): {verdict}",
        ]
    lines += [f"{name} counters: {values}" for name, values in results["counters"].items()]
    sys.stdout.write("\n".join(lines) + "\n")


def _median_row(measured: list[dict[str, float]]) -> dict[str, float]:
    """Return the median of each figure over repeated measurements of one step."""
    medians = {key: statistics.median(row[key] for row in measured) for key in measured[0]}
    return {**medians, "connections": measured[0]["connections"]}


def _ratio(a: float, b: float) -> float:
    return a / max(b, 1e-9)


def report_overload(results: dict[str, Any], seconds: float) -> None:
    """Print goodput, 503s and the p50/p99 of the 200s per step, side by side, and the goals."""
    steps: dict[str, list[dict[str, float]]] = results["steps"]
    service, plain = steps["service"], steps["plain"]
    baseline = steps.get("baseline")
    target_ms = results["queue_delay_target_ms"]
    names = list(steps)
    header = f"{'connections':>11}" + "".join(
        f" | {name + ' 200/s':>14}{'503/s':>7}{'p50 ms':>8}{'p99 ms':>8}{'other':>6}"
        for name in names
    )
    header += f" | {'service/plain':>13}"
    if baseline:
        header += f" {'/baseline':>9}"
    lines = [
        f"machine: {results['machine']}",
        f"load average (1, 5, 15 min): {results['load_average']['start']} at start, "
        f"{results['load_average']['end']} at end",
        f"closed-loop clients, {seconds:.0f} s per step after 1 s of warm-up, median of "
        f"{results['repeat']} (the services alternating); a 503 is sent again at once "
        "(Retry-After ignored); p50/p99 of the 200s alone; 'other' = other statuses + "
        "connection errors",
        *(f"{name}: {path}" for name, path in results["serving_dirs"].items()),
        f"queue-delay target {target_ms:.0f} ms",
        "",
        header,
        "-" * len(header),
    ]
    for i, ours in enumerate(service):
        line = f"{ours['connections']:>11}"
        for name in names:
            row = steps[name][i]
            line += (
                f" | {row['ok_per_s']:>14.0f}{row['shed_per_s']:>7.0f}{row['ok_p50_ms']:>8.1f}"
                f"{row['ok_p99_ms']:>8.1f}{row['other'] + row['errors']:>6.0f}"
            )
        line += f" | {_ratio(ours['ok_per_s'], plain[i]['ok_per_s']):>12.2f}x"
        if baseline:
            line += f" {_ratio(ours['ok_per_s'], baseline[i]['ok_per_s']):>8.2f}x"
        lines.append(line)
    peak = max(max(row["ok_per_s"] for row in service), 1e-9)
    last = service[-1]
    worst_ratio = min(
        _ratio(ours["ok_per_s"], theirs["ok_per_s"])
        for ours, theirs in zip(service, plain, strict=True)
    )
    worst_p99 = max(row["ok_p99_ms"] for row in service)
    lines += [
        "",
        f"goodput at {last['connections']} / peak goodput:  "
        f"{last['ok_per_s'] / peak:.2f}   (target >= 0.80)",
        f"service / plain goodput, worst step: {worst_ratio:.2f}x   (target >= 1.00)",
        f"p99 of the 200s, worst step:        {worst_p99:.1f} ms   (target <= {target_ms:.0f} ms)",
    ]
    if baseline:
        # Below saturation nothing may get slower than the checkout compared against.
        for i, ours in enumerate(service):
            theirs = baseline[i]
            if ours["connections"] == 1:
                lines.append(
                    f"1 connection, p50 of the 200s / baseline's: "
                    f"{_ratio(ours['ok_p50_ms'], theirs['ok_p50_ms']):.3f}   (target <= 1.05)"
                )
            elif ours["connections"] == 16:
                lines.append(
                    f"16 connections, goodput / baseline's:     "
                    f"{_ratio(ours['ok_per_s'], theirs['ok_per_s']):.3f}   (target >= 0.95)"
                )
    lines += [f"{name} counters: {values}" for name, values in results["counters"].items()]
    sys.stdout.write("\n".join(lines) + "\n")


# --- main ------------------------------------------------------------------------------------


def main() -> None:
    """Run every measurement and print the figures and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="directory with model.onnx + model.json")
    parser.add_argument(
        "--torch-checkpoint", help="the training job's model.pt (state dict) for the naive baseline"
    )
    parser.add_argument("--duration-s", type=float, default=5.0, help="per HTTP measurement")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--rounds", type=int, default=5, help="paired bare/service windows at concurrency 1"
    )
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--no-wrk", action="store_true", help="use the Python load generator")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--overload",
        action="store_true",
        help="step closed-loop connections past saturation: goodput, 503s/s and the p99 of "
        "the 200s, beside a plain FastAPI + onnxruntime service",
    )
    parser.add_argument(
        "--protocols",
        action="store_true",
        help="step closed-loop connections against the fast HTTP protocol and its public "
        "fallback (FAST_PROTOCOL=false), side by side",
    )
    parser.add_argument(
        "--connections",
        help="--overload/--protocols steps, comma-separated (default 16,64,256,400,800; "
        "1,16,64,400,800 for --protocols)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="--overload/--protocols: measure each step this many times per service and "
        "report medians",
    )
    parser.add_argument(
        "--baseline-serving-dir",
        help="--overload: also run this folder's burstcv_serving (another checkout's, e.g. "
        "main's) in the same steps, and compare below saturation (add 1 to --connections "
        "for the single-connection latency)",
    )
    parser.add_argument(
        "--serving-dir",
        default=str(REPO_ROOT / "serving"),
        help="folder holding the burstcv_serving package to run (another checkout's, to "
        "compare versions on the same machine)",
    )
    parser.add_argument(
        "--sizing",
        action="store_true",
        help="the sustainable rate per vCPU (open loop, within --slo-ms) of the service and "
        "of a plain FastAPI + onnxruntime service, side by side",
    )
    parser.add_argument("--slo-ms", type=float, default=50.0, help="p95 limit for --sizing")
    parser.add_argument("--naive-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plain-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.naive_server:
        run_naive_server(args.model_dir, args.torch_checkpoint, args.port, args.threads)
        return
    if args.plain_server:
        run_plain_server(args.model_dir, args.port, args.threads)
        return

    work = Path(tempfile.mkdtemp(prefix="burstcv-bench-"))
    model_dir = Path(args.model_dir) if args.model_dir else write_synthetic_model(work / "model")
    if not args.model_dir and args.torch_checkpoint:
        raise SystemExit("--torch-checkpoint needs the --model-dir it was exported to")
    body_path = work / "body.bin"
    body_path.write_bytes(multipart_body(sample_png()))
    if args.sizing:
        sizing(args, model_dir, work)
        return
    if args.protocols:
        args.connections = args.connections or "1,16,64,400,800"
        protocols(args, model_dir, body_path.read_bytes(), work)
        return
    if args.overload:
        args.connections = args.connections or "16,64,256,400,800"
        overload(args, model_dir, body_path.read_bytes(), work)
        return
    use_wrk = shutil.which("wrk") is not None and not args.no_wrk
    generator = "wrk" if use_wrk else "python asyncio+httpx"

    results: dict[str, Any] = {
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        # Other work on a shared machine skews every figure: note how busy it was.
        "load_average": {"start": _load_average()},
        "load_generator": generator,
        "model_dir": str(model_dir),
    }
    # The same thread options as the service will use (its settings, from this environment).
    service_settings = Settings(model_dir=str(model_dir))
    bare = BareSession(model_dir, args.threads, service_settings.intra_op_spinning)
    results["bare"] = bare_onnxruntime(bare, seconds=4.0)

    with prediction_service(
        bench_service_settings(model_dir, args.threads),
        log_path=work / "service.log",
        serving_dir=args.serving_dir,
    ) as service:
        url = f"{service.url}/v1/predict"
        results["service_c1"] = measure_http(url, body_path, 1, args.duration_s, use_wrk)
        results[f"service_c{args.concurrency}"] = measure_http(
            url, body_path, args.concurrency, args.duration_s, use_wrk
        )
        results["paired_c1"] = paired_c1(bare, url, body_path, args.rounds, use_wrk)

    naive_port = free_port()
    naive_cmd = [sys.executable, __file__, "--naive-server", "--model-dir", str(model_dir)]
    naive_cmd += ["--port", str(naive_port), "--threads", str(args.threads)]
    if args.torch_checkpoint:
        naive_cmd += ["--torch-checkpoint", args.torch_checkpoint]
    with server_process(
        naive_cmd, port=naive_port, log_path=work / "naive.log", ready_path="/healthz"
    ) as naive:
        results[f"naive_c{args.concurrency}"] = measure_http(
            f"{naive.url}/v1/predict", body_path, args.concurrency, args.duration_s, use_wrk
        )

    bare_figures = results["bare"]
    cn = results[f"service_c{args.concurrency}"]
    naive_cn = results[f"naive_c{args.concurrency}"]
    results["load_average"]["end"] = _load_average()
    results["ratios"] = {
        # Median over the paired windows: each difference is taken a second apart.
        "service_p50_minus_bare_p50_ms": statistics.median(
            pair["service_p50_ms"] - pair["bare_p50_ms"] for pair in results["paired_c1"]
        ),
        "service_cN_throughput_over_bare_batched": cn["throughput_rps"]
        / bare_figures["batched_images_per_s"],
        "service_cN_throughput_over_naive": cn["throughput_rps"] / naive_cn["throughput_rps"],
    }
    report(results, args.concurrency)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def report(results: dict[str, Any], n: int) -> None:
    """Print the figures side by side with the targets."""
    bare, c1 = results["bare"], results["service_c1"]
    cn, naive = results[f"service_c{n}"], results[f"naive_c{n}"]
    ratios = results["ratios"]
    lines = [
        f"machine: {results['machine']}; load generator: {results['load_generator']}",
        f"model: {results['model_dir']}",
        f"load average (1, 5, 15 min): {results['load_average']['start']} at start, "
        f"{results['load_average']['end']} at end",
        "",
        f"{'measurement':<42}{'p50 ms':>10}{'p99 ms':>10}{'per s':>12}{'failed':>8}",
        f"{'bare onnxruntime, batch 1':<42}{bare['p50_ms']:>10.3f}{bare['p99_ms']:>10.3f}"
        f"{'':>12}{'':>8}",
        f"{'bare onnxruntime, batch 32 (images)':<42}{'':>10}{'':>10}"
        f"{bare['batched_images_per_s']:>12.0f}{'':>8}",
        f"{'service, concurrency 1':<42}{c1['p50_ms']:>10.3f}{c1['p99_ms']:>10.3f}"
        f"{c1['throughput_rps']:>12.0f}{c1['failed']:>8}",
        f"{f'service, concurrency {n}':<42}{cn['p50_ms']:>10.3f}{cn['p99_ms']:>10.3f}"
        f"{cn['throughput_rps']:>12.0f}{cn['failed']:>8}",
        f"{f'naive FastAPI + torch, concurrency {n}':<42}{naive['p50_ms']:>10.3f}"
        f"{naive['p99_ms']:>10.3f}{naive['throughput_rps']:>12.0f}{naive['failed']:>8}",
        "",
        "paired windows at concurrency 1 (bare 1 s, then service 2 s), p50 ms:",
        *(
            f"  round {i}: bare {pair['bare_p50_ms']:.3f}  service {pair['service_p50_ms']:.3f}"
            f"  difference {pair['service_p50_ms'] - pair['bare_p50_ms']:.3f}"
            for i, pair in enumerate(results["paired_c1"], 1)
        ),
        "",
        f"service p50 - bare p50:           {ratios['service_p50_minus_bare_p50_ms']:.3f} ms"
        "   (median of the paired rounds; target <= 1.0 ms)",
        f"c{n} throughput / bare batched:    "
        f"{ratios['service_cN_throughput_over_bare_batched']:.3f}   (target >= 0.4)",
        f"c{n} throughput / naive baseline:  "
        f"{ratios['service_cN_throughput_over_naive']:.2f}x   (target >= 4x)",
    ]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
