"""Right-sized serving: the open-loop load, the sustainable rate per CPU size, the fleet."""

from __future__ import annotations

import hashlib
import json
import math
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from pathlib import Path

import pytest

from burstcv.gate import sizing
from burstcv.gate.sizing import open_loop, rate_at, recommend
from burstcv_spec.contracts import SizePoint

# The serving tests' model builders (real ONNX graphs, model.json as the contract says).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from servingkit import image_bytes, make_classifier_onnx, model_json

IMAGE = image_bytes("PNG")


def _handler(delay_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            time.sleep(delay_s)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def _serve(server: HTTPServer) -> Iterator[str]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def slow_parallel_server() -> Iterator[str]:
    """Answers every request after 50 ms, many at once."""
    yield from _serve(ThreadingHTTPServer(("127.0.0.1", 0), _handler(0.05)))


@pytest.fixture
def one_at_a_time_server() -> Iterator[str]:
    """Answers one request at a time, 20 ms each: at most 50 req/s."""
    server = HTTPServer(("127.0.0.1", 0), _handler(0.02))
    server.request_queue_size = 256
    yield from _serve(server)


def test_the_open_loop_holds_its_rate_whatever_the_answers_take(
    slow_parallel_server: str,
) -> None:
    # A closed-loop client waiting for each 50 ms answer would send 20 req/s; this sends 80.
    run = open_loop(slow_parallel_server, [IMAGE], rate_rps=80, duration_s=2.0)
    assert run.sent == 160 and run.errors == 0, run.statuses
    assert 72 <= run.achieved_rps <= 88
    assert 50 <= run.percentile(50) < 200


def test_latency_counts_from_when_the_request_was_due(one_at_a_time_server: str) -> None:
    # Twice what the server can answer: the queue grows, and the latencies say so.
    run = open_loop(one_at_a_time_server, [IMAGE], rate_rps=100, duration_s=1.5)
    assert run.statuses.get("200", 0) >= 100, run.statuses  # a toy server drops a few
    assert run.percentile(95) > 300  # the last requests waited behind ~half the others


def test_a_rate_must_be_positive_and_there_must_be_images(slow_parallel_server: str) -> None:
    with pytest.raises(ValueError, match="rate_rps"):
        open_loop(slow_parallel_server, [IMAGE], rate_rps=0)
    with pytest.raises(ValueError, match="images"):
        open_loop(slow_parallel_server, [], rate_rps=1)


def point(vcpus: int, rps: float, rss_mb: float = 100.0) -> SizePoint:
    return SizePoint(vcpus=vcpus, measured=True, sustainable_rps=rps, p95_ms=10.0, rss_mb=rss_mb)


def test_sizes_beyond_the_host_follow_the_measured_scaling() -> None:
    points = [point(1, 100.0), point(2, 180.0)]
    assert rate_at(points, 2) == (180.0, False)
    rate4, extrapolated = rate_at(points, 4)
    exponent = math.log(1.8) / math.log(2)
    assert extrapolated and rate4 == pytest.approx(180.0 * 2**exponent)
    # Worse than sqrt scaling is floored there; better than linear is capped.
    assert rate_at([point(1, 100.0), point(2, 100.0)], 8)[0] == pytest.approx(100 * 4**0.5)
    assert rate_at([point(1, 100.0), point(2, 250.0)], 8)[0] == pytest.approx(250 * 4)


def test_the_cheapest_fleet_covers_the_target_with_headroom() -> None:
    points = [point(1, 100.0), point(2, 180.0)]
    report = recommend(points, slo_ms=50, target_rps=1000, region="us-east-1", headroom=0.3)
    assert report.chosen is not None and report.chosen == report.options[0]
    assert [o.usd_per_hour for o in report.options] == sorted(
        o.usd_per_hour for o in report.options
    )
    for option in report.options:
        assert option.replicas * option.rps_per_replica * 0.7 >= 1000
        assert (option.replicas - 1) * option.rps_per_replica * 0.7 < 1000
        assert option.usd_per_month == pytest.approx(option.usd_per_hour * 730, rel=1e-3)
        assert option.usd_per_million == pytest.approx(
            option.usd_per_hour / (1000 * 3600) * 1e6, rel=1e-2
        )
    assert report.chosen.instance_type in report.reason
    # A model whose service needs more memory than a type has rules the type out.
    heavy = recommend(
        [point(1, 100.0, rss_mb=3000), point(2, 180.0, rss_mb=3000)],
        slo_ms=50,
        target_rps=1000,
        region="us-east-1",
    )
    assert "c7i.large" not in {o.instance_type for o in heavy.options}


def write_model_dir(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    onnx_bytes = make_classifier_onnx(1)
    (folder / "model.onnx").write_bytes(onnx_bytes)
    meta = model_json(None, hashlib.sha256(onnx_bytes).hexdigest())
    (folder / "model.json").write_text(json.dumps(meta))
    return folder


def test_sizing_the_real_service_at_1_and_2_vcpus(tmp_path: Path) -> None:
    if len(sizing.host_cpus()) < 2:
        pytest.skip("needs 2 CPUs")
    folder = write_model_dir(tmp_path / "model")
    report = sizing.size_model(
        str(folder),
        [IMAGE],
        slo_ms=100,
        target_rps=2000,
        region="us-east-1",
        max_vcpus=2,
        duration_s=1.0,
    )
    one, two = report.sizes
    assert (one.vcpus, two.vcpus) == (1, 2) and one.measured and two.measured
    assert one.sustainable_rps > 0 and one.p95_ms is not None and one.p95_ms <= 100
    # Monotone in vCPUs, within one search step: on a 2-core host the load generator shares a
    # CPU with the 2-vCPU service (it has one of its own while the service has one).
    assert two.sustainable_rps >= one.sustainable_rps / sizing.STEP_FACTOR
    assert one.cpu_s_per_request and one.rss_mb
    assert report.chosen is not None
    chosen = report.chosen
    assert chosen.replicas * chosen.rps_per_replica * (1 - report.headroom) >= 2000
    assert {o.extrapolated for o in report.options if o.vcpus > 2} <= {True}


def test_an_unattainable_slo_is_rejected_with_the_reason(tmp_path: Path) -> None:
    folder = write_model_dir(tmp_path / "model")
    report = sizing.size_model(
        str(folder),
        [IMAGE],
        slo_ms=0.01,
        target_rps=10,
        region="us-east-1",
        max_vcpus=1,
        duration_s=0.5,
    )
    assert report.sizes[0].sustainable_rps == 0
    assert report.chosen is None and report.options == []
    assert "no CPU size meets p95 <= 0.01 ms" in report.reason


def test_burstcv_size_measures_a_registered_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from burstcv.cli import app
    from burstcv.registry.registry import Registry
    from burstcv_spec.contracts import RegistryDecision, SizingReport, read_artifact

    registry = Registry(str(tmp_path / "registry"), "digits")
    registry.register(str(write_model_dir(tmp_path / "model")), RegistryDecision(status="accepted"))
    images = tmp_path / "images"
    images.mkdir()
    (images / "a.png").write_bytes(IMAGE)
    monkeypatch.setenv("BURSTCV_REGISTRY_URI", str(tmp_path / "registry"))
    monkeypatch.setenv("BURSTCV_MODEL_NAME", "digits")
    out = tmp_path / "sizing.json"
    args = ["size", "1", "--images", str(images), "--target-rps", "50", "--out", str(out)]
    args += ["--step-s", "0.5"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = read_artifact(str(out), SizingReport)
    assert report.chosen is not None and report.chosen.instance_type in result.output
    assert "/month" in result.output
    missing = CliRunner().invoke(app, ["size", "9", "--images", str(images), "--target-rps", "5"])
    assert missing.exit_code != 0 and "no version 9" in missing.output


def test_only_the_allowed_families_are_priced() -> None:
    points = [point(1, 100.0), point(2, 180.0)]
    report = recommend(points, slo_ms=50, target_rps=300, region="us-east-1", families=["m7i"])
    assert {o.instance_type.split(".")[0] for o in report.options} == {"m7i"}
    assert report.families == ["m7i"]
    none = recommend(points, slo_ms=50, target_rps=300, region="us-east-1", families=["x9z"])
    assert none.chosen is None and "allowed families" in none.reason
