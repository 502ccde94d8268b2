"""The sizing's load generator: its own ceiling, and the sizes it measures, side by side.

1. **Ceiling.** On one CPU, the open-loop generator the sizing used before (an httpx async
   client, one coroutine per request) and the one it uses now (``burstcv.gate.loadgen``:
   requests encoded once, written over persistent connections) each drive a trivial endpoint
   (answers at once, computes nothing) on another CPU at rising rates, alternating at each
   rate. A rate holds when every request was answered, the requests left at >= 90% of it and
   p95 (from when each was due) stayed under 10 ms. It prints each rate's figures and both
   ceilings, and their ratio.
2. **Sizes.** The digits-size model (resnet10, 32 px, random weights: its speed does not
   depend on them) is sized at 1 vCPU and at the host's CPUs with the new generator, with its
   generator check and any measurement error beside each size; then the 1-vCPU service is
   driven by the old generator at the rate the new one found sustainable, to show whether the
   old one could have sent it.

    PYTHONPATH=src:serving:spec python bench/loadgen.py [--step-s 2]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import numpy as np
import torch

from burstcv.export.onnx_export import export_model
from burstcv.gate import loadgen
from burstcv.gate.interference import Placement, running_on
from burstcv.gate.latency import staging_process
from burstcv.gate.sizing import describe_generator, host_cpus, measure_sizes
from burstcv.training.models import build_model
from burstcv_spec.preprocess import PreprocessSpec

RATES = [300, 600, 1200, 2400, 4800, 9600, 14400, 19200]
CLASSES = [str(d) for d in range(10)]


async def _httpx_open_loop(url: str, body: bytes, requests: int, rate: float) -> loadgen.Sample:
    """The generator as it was: an httpx AsyncClient, every request a coroutine due at i/rate."""
    sample = loadgen.Sample()
    loop = asyncio.get_running_loop()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        start = loop.time() + 0.05
        last = start

        async def one(i: int) -> None:
            nonlocal last
            due = start + i / rate
            await asyncio.sleep(max(0.0, due - loop.time()))
            last = max(last, loop.time())
            sample.lags.append((loop.time() - due) * 1000)
            try:
                response = await client.post(
                    f"{url}/v1/predict", files={"file": (f"{i}.png", body, "image/png")}
                )
                code = str(response.status_code)
            except httpx.HTTPError as exc:
                code = type(exc).__name__
            sample.latencies.append((loop.time() - due) * 1000)
            sample.count(code, False)

        await asyncio.gather(*(one(i) for i in range(requests)))
    sample.wall_s = max(last - start, (requests - 1) / rate)
    return sample


def httpx_send(url: str, body: bytes, requests: int, rate: float) -> loadgen.Sample:
    return asyncio.run(_httpx_open_loop(url, body, requests, rate))


def new_send(url: str, body: bytes, requests: int, rate: float) -> loadgen.Sample:
    return loadgen.send(url, [body], requests=requests, rate_rps=rate)


def held(sample: loadgen.Sample, rate: float) -> bool:
    achieved = len(sample.latencies) / max(sample.wall_s, 1e-9)
    ok = set(sample.statuses) == {"200"}
    return ok and achieved >= 0.9 * rate and float(np.percentile(sample.latencies, 95)) < 10.0


def png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def ceilings(place: Placement, body: bytes, step_s: float) -> None:
    senders: dict[str, Callable[[str, bytes, int, float], loadgen.Sample]] = {
        "httpx (before)": httpx_send,
        "loadgen (now)": new_send,
    }
    best = dict.fromkeys(senders, 0.0)
    broken: set[str] = set()
    print(f"\n1. generator ceiling on CPU {place.generator}, trivial endpoint on {place.service}")
    print(f"{'rate':>7}  " + "".join(f"{name:>34}" for name in senders))
    with running_on(place.generator), loadgen.trivial_endpoint(place.service) as url:
        for rate in RATES:
            cells = []
            for name, sender in senders.items():
                if name in broken:
                    cells.append(f"{'-':>34}")
                    continue
                sample = sender(url, body, max(1, round(rate * step_s)), rate)
                ok = held(sample, rate)
                achieved = len(sample.latencies) / max(sample.wall_s, 1e-9)
                p95 = float(np.percentile(sample.latencies, 95))
                cells.append(
                    f"{achieved:>9.0f} req/s p95 {p95:>9.1f} ms {'held' if ok else 'BROKE':>5}"
                )
                if ok:
                    best[name] = rate
                else:
                    broken.add(name)
            print(f"{rate:>7}  " + "".join(cells))
            if len(broken) == len(senders):
                break
    before, now = best.values()
    ratio = f"{now / before:.1f}x" if before else "n/a"
    tail = {name: "" if name in broken else " or more" for name in senders}
    print(
        f"ceiling: httpx {before:g} req/s{tail['httpx (before)']}, "
        f"loadgen {now:g} req/s{tail['loadgen (now)']}: {ratio}"
    )


def digits_model(work: Path, body: bytes) -> Path:
    torch.manual_seed(0)
    model = build_model("resnet10", len(CLASSES), 32, pretrained=False)
    torch.save(model.state_dict(), work / "model.pt")
    export_model(
        checkpoint_uri=str(work / "model.pt"),
        out_uri=str(work / "model"),
        arch="resnet10",
        classes=CLASSES,
        spec=PreprocessSpec(height=32, width=32),
        name="digits",
        parity_images=[("0.png", body)],
    )
    return work / "model"


def sizes(place: Placement, body: bytes, step_s: float, slo_ms: float) -> None:
    print(f"\n2. sizes of the digits-size model (resnet10, 32 px), SLO {slo_ms:g} ms")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = digits_model(Path(tmp), body)
        t0 = time.monotonic()
        points = measure_sizes(str(model_dir), [body], latency_slo_ms=slo_ms, duration_s=step_s)
        print(f"measured in {time.monotonic() - t0:.0f} s")
        for p in points:
            print(f"{p.vcpus} vCPU: {p.sustainable_rps:g} req/s, p95 {p.p95_ms} ms; ", end="")
            print(describe_generator(p))
            if p.anomaly:
                print(f"   {p.anomaly}")
        one = points[0]
        if one.sustainable_rps <= 0:
            return
        n = max(1, round(one.sustainable_rps * step_s))
        with (
            running_on(place.generator),
            staging_process(str(model_dir), cpus=place.service[-1:]) as (url, _),
        ):
            old = httpx_send(url, body, n, one.sustainable_rps)
            new = new_send(url, body, n, one.sustainable_rps)
        for name, s in (("httpx (before)", old), ("loadgen (now)", new)):
            achieved = len(s.latencies) / max(s.wall_s, 1e-9)
            print(
                f"1 vCPU at {one.sustainable_rps:g} req/s from {name}: sent at {achieved:.0f} "
                f"req/s, p95 {np.percentile(s.latencies, 95):.1f} ms, "
                f"send lag p95 {np.percentile(s.lags, 95):.1f} ms"
            )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-s", type=float, default=2.0, help="seconds per rate")
    parser.add_argument("--slo-ms", type=float, default=50.0, help="the sizes' latency SLO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cpus = host_cpus()
    if len(cpus) < 2:
        raise SystemExit("needs 2 CPUs: one for the generator, one for the endpoint")
    place = Placement(service=cpus[1:2], generator=cpus[:1])
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    body = png()
    ceilings(place, body, args.step_s)
    sizes(place, body, args.step_s, args.slo_ms)


if __name__ == "__main__":
    main()
