"""What a sizing box runs: size one model on this box's own CPUs, and write the figures.

A sizing box (``size_on`` ec2) is one instance of a candidate serving type; its boot script
runs ``burstcv-size measure``. Nothing here knows about EC2 beyond the identity it passes in.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from burstcv import lineage
from burstcv.gate.latency import materialise_model
from burstcv.gate.sizing import STEP_DURATION_S, measure_sizes
from burstcv_spec import storage
from burstcv_spec.contracts import BoxSizing, HostInfo, write_artifact

log = logging.getLogger("burstcv.sizebox")


def _measure_box(args: argparse.Namespace) -> BoxSizing:
    """Size the model on this machine's CPUs, as ``main``'s arguments say; write its BoxSizing."""
    started = time.monotonic()
    # The request images (bench/sizing/requests/), in name order.
    images = [storage.read_bytes(uri) for uri in sorted(storage.list_files(args.requests))]
    if not images:
        raise ValueError(f"no request images under {args.requests}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = materialise_model(args.model, Path(tmp) / "model")
        points = measure_sizes(
            str(model_dir),
            images,
            latency_slo_ms=args.slo_ms,
            max_vcpus=args.max_vcpus,
            duration_s=args.step_s,
        )
    record = BoxSizing(
        instance_type=args.instance_type,
        instance_id=args.instance_id or None,
        region=args.region,
        zone=args.zone or None,
        host=HostInfo.model_validate(lineage.host_description()),
        sizes=points,
        measured_at=lineage.utc_now_iso(),
        seconds=round(time.monotonic() - started, 1),
    )
    write_artifact(args.out, record)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    """``burstcv-size measure ...``: the sizing box's one command."""
    parser = argparse.ArgumentParser(prog="burstcv-size", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    measure = sub.add_parser("measure", help="size a model on this box's CPUs")
    measure.add_argument("--model", required=True, help="the model folder (model.json, ONNX)")
    measure.add_argument("--requests", required=True, help="the folder of request images")
    measure.add_argument("--out", required=True, help="where the BoxSizing goes")
    measure.add_argument("--slo-ms", type=float, required=True, help="the p95 SLO, ms")
    measure.add_argument("--step-s", type=float, default=STEP_DURATION_S)
    measure.add_argument("--max-vcpus", type=int, default=None)
    measure.add_argument("--instance-type", required=True)
    measure.add_argument("--instance-id", default="")
    measure.add_argument("--region", required=True)
    measure.add_argument("--zone", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        record = _measure_box(args)
    except (OSError, ValueError, RuntimeError) as exc:
        log.error("burstcv-size: %s: %s", type(exc).__name__, exc)
        return 2
    for p in record.sizes:
        log.info("%d vCPU(s): %g req/s, p95 %s ms", p.vcpus, p.sustainable_rps, p.p95_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
