"""Measure a model's latency as users will see it: through a staging copy of the real service.

The service is warmed, then driven open-loop at a fixed rate or closed-loop from fixed clients;
candidate and production run interleaved (:func:`drive_paired`): a noisy machine shifts both.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from burstcv.gate import loadgen
from burstcv.gate.loadgen import Sample, free_port
from burstcv_spec import storage
from burstcv_spec.contracts import BenchFigures, ModelCard, read_artifact
from burstcv_spec.layout import MODEL_CARD

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0


def serving_env(
    model_dir: str, port: int, threads: int | None, queue_delay_target_ms: float | None
) -> dict[str, str]:
    """Return the environment of a staging service that serves one model folder, shedding what
    queued past ``queue_delay_target_ms`` (None: the service's default)."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("BURSTCV_SERVING_")},
        "BURSTCV_SERVING_MODEL_DIR": model_dir,
        "BURSTCV_SERVING_HOST": "127.0.0.1",
        "BURSTCV_SERVING_PORT": str(port),
        "BURSTCV_SERVING_POLL_INTERVAL_S": "0",
        "BURSTCV_SERVING_ENVIRONMENT": "development",
    }
    if threads:
        env["BURSTCV_SERVING_INTRA_OP_THREADS"] = str(threads)
    if queue_delay_target_ms is not None:
        env["BURSTCV_SERVING_QUEUE_DELAY_TARGET_MS"] = f"{queue_delay_target_ms:g}"
    return env


@contextlib.contextmanager
def staging_service(
    model_dir: str, *, threads: int | None = None, queue_delay_target_ms: float | None = None
) -> Iterator[str]:
    """Run the real service on a free port with one model folder; yield its base URL."""
    with staging_process(
        model_dir, threads=threads, queue_delay_target_ms=queue_delay_target_ms
    ) as (url, _):
        yield url


@contextlib.contextmanager
def staging_process(
    model_dir: str,
    *,
    threads: int | None = None,
    cpus: Sequence[int] | None = None,
    queue_delay_target_ms: float | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run the real service with one model folder (on ``cpus`` only, if given); yield its base
    URL and its process. Without ``threads``, it sizes its threads from the CPUs it may use."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = serving_env(model_dir, port, threads, queue_delay_target_ms)
    with tempfile.TemporaryFile() as log_fh:
        cmd = [sys.executable, "-m", "burstcv_serving"]
        proc = loadgen.start_on(cpus, cmd, env=env, stdout=log_fh, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, proc)
            yield url, proc
        except BaseException:
            log_fh.seek(0)
            log.error("staging service output:\n%s", log_fh.read().decode(errors="replace")[-4000:])
            raise
        finally:
            loadgen.stop(proc)


def materialise_model(model_dir_uri: str, dest: Path) -> Path:
    """Return a local folder holding model.json and its ONNX file (downloading from S3)."""
    if not storage.is_s3(model_dir_uri):
        return Path(model_dir_uri)
    card = read_artifact(storage.join(model_dir_uri, MODEL_CARD), ModelCard)
    for name in (MODEL_CARD, card.onnx_file):
        storage.download_file(storage.join(model_dir_uri, name), dest / name)
    return dest


def wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``url``/readyz answers 200; fail early if the process exits."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"service exited with code {proc.returncode} before it was ready"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/readyz").status_code == 200:
                    return
            time.sleep(0.2)
    raise TimeoutError(f"{url} was not ready after {READY_TIMEOUT_S:.0f}s")


def _send(
    url: str,
    images: list[bytes],
    *,
    requests: int,
    concurrency: int,
    content_type: str,
    first: int = 0,
) -> Sample:
    """Send ``requests`` predictions from ``concurrency`` clients, each as soon as the last
    answered (closed loop); image ``first + i`` of the cycle is request ``i``'s."""
    endpoint = f"{url}/v1/predict"
    counter = iter(range(first, first + requests))
    lock = threading.Lock()
    sample = Sample()

    def worker() -> None:
        with httpx.Client(timeout=30.0) as client:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                body = images[i % len(images)]
                t0 = time.perf_counter()
                was_shed = False
                try:
                    response = client.post(
                        endpoint, files={"file": (f"{i}.png", body, content_type)}
                    )
                    code = str(response.status_code)
                    was_shed = response.status_code == 503 and "retry-after" in response.headers
                except httpx.HTTPError as exc:
                    code = type(exc).__name__
                elapsed = (time.perf_counter() - t0) * 1000
                with lock:
                    sample.latencies.append(elapsed)
                    sample.count(code, was_shed)

    sample.peak_in_flight = min(concurrency, requests)
    t_start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(worker)
    sample.wall_s = time.perf_counter() - t_start
    return sample


def _figures(label: str, sample: Sample, rate_rps: float | None) -> BenchFigures:
    arr = np.asarray(sample.latencies)
    errors = sum(n for code, n in sample.statuses.items() if code != "200") - sample.shed
    return BenchFigures(
        label=label,
        requests=len(sample.latencies),
        concurrency=sample.peak_in_flight,
        offered_rps=None if rate_rps is None else round(rate_rps, 3),
        errors=errors,
        shed=sample.shed,
        error_rate=errors / max(1, len(sample.latencies)),
        p50_ms=float(np.percentile(arr, 50)),
        p95_ms=float(np.percentile(arr, 95)),
        p99_ms=float(np.percentile(arr, 99)),
        mean_ms=float(arr.mean()),
        throughput_rps=len(sample.latencies) / max(sample.wall_s, 1e-9),
        wall_s=sample.wall_s,
        latencies_ms=[round(x, 4) for x in sample.latencies],
        status_counts=sample.statuses,
        accuracy=None,
        accuracy_note="not measured: latency only",
    )


def drive(
    url: str,
    images: list[bytes],
    *,
    requests: int,
    warmup: int,
    label: str,
    concurrency: int | None = None,
    rate_rps: float | None = None,
    content_type: str = "image/png",
) -> BenchFigures:
    """Send ``requests`` predictions, open-loop at ``rate_rps`` or from ``concurrency`` clients;
    a 503 with Retry-After (queued past its target) is ``shed`` (latency counted), not an error."""
    return drive_paired(
        {label: url},
        images,
        requests=requests,
        warmup=warmup,
        concurrency=concurrency,
        rate_rps=rate_rps,
        rounds=1,
        content_type=content_type,
    )[label]


def drive_paired(
    urls: dict[str, str],
    images: list[bytes],
    *,
    requests: int,
    warmup: int,
    concurrency: int | None = None,
    rate_rps: float | None = None,
    rounds: int = 4,
    content_type: str = "image/png",
) -> dict[str, BenchFigures]:
    """Measure several services in the same window, interleaved: like with like (``rounds``
    stretches each, in an order reversed every other round: A B B A ...)."""
    if not images:
        raise ValueError("no images to send")
    if not urls:
        return {}
    for url in urls.values():
        with httpx.Client(timeout=30.0) as client:
            for i in range(warmup):
                warm = ("w.png", images[i % len(images)], content_type)
                client.post(f"{url}/v1/predict", files={"file": warm})
    if rate_rps is not None:
        stretch = functools.partial(loadgen.send, rate_rps=rate_rps, content_type=content_type)
    elif concurrency is not None and concurrency >= 1:
        stretch = functools.partial(_send, concurrency=concurrency, content_type=content_type)
    else:
        raise ValueError("give a rate (open loop) or a concurrency of at least 1 (closed loop)")
    rounds = max(1, min(rounds, requests))
    samples = {label: Sample() for label in urls}
    labels, sent = list(urls), 0
    for r in range(rounds):
        chunk = requests * (r + 1) // rounds - sent
        for label in labels if r % 2 == 0 else reversed(labels):
            samples[label].add(stretch(urls[label], images, requests=chunk, first=sent))
        sent += chunk
    return {label: _figures(label, samples[label], rate_rps) for label in labels}


def bare_onnxruntime_p50(
    model_dir: str, batch: np.ndarray, *, threads: int | None = None, runs: int = 200
) -> float:
    """Return the in-process onnxruntime p50 latency (ms) at batch 1: the floor under HTTP."""
    import onnxruntime as ort

    card = read_artifact(str(Path(model_dir) / MODEL_CARD), ModelCard)
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(
        str(Path(model_dir) / card.onnx_file), options, providers=["CPUExecutionProvider"]
    )
    name = session.get_inputs()[0].name
    x = batch[:1]
    for _ in range(20):
        session.run(None, {name: x})
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run(None, {name: x})
        samples.append((time.perf_counter() - t0) * 1000)
    return float(np.percentile(samples, 50))
