"""Right-sized serving: the open-loop load, the sustainable rate per CPU size, the fleet."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Iterator
from http.server import HTTPServer, ThreadingHTTPServer
from pathlib import Path

import pytest

from burstcv.cost.budget import serving_quotes
from burstcv.cost.quotes import PriceSources
from burstcv.gate import sizing
from burstcv.gate.sizing import (
    MIN_GATE_REQUESTS,
    LoadRun,
    _holds,
    box_candidates,
    gate_load,
    open_loop,
    rate_at,
    recommend,
    sustainable_rate,
)
from burstcv_spec.contracts import (
    BoxSizing,
    FleetOption,
    LoadStep,
    PriceQuote,
    SizePoint,
    SizingReport,
)

# The serving tests' model builders (real ONNX graphs, model.json as the contract says).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from burstcv_testkit import predict_handler, served
from servingkit import image_bytes, make_classifier_onnx, model_json

IMAGE = image_bytes("PNG")


def _serve(server: HTTPServer) -> Iterator[str]:
    with served(server) as url:
        yield url


@pytest.fixture
def slow_parallel_server() -> Iterator[str]:
    """Answers every request after 50 ms, many at once."""
    yield from _serve(ThreadingHTTPServer(("127.0.0.1", 0), predict_handler(0.05)))


@pytest.fixture
def one_at_a_time_server() -> Iterator[str]:
    """Answers one request at a time, 20 ms each: at most 50 req/s."""
    server = HTTPServer(("127.0.0.1", 0), predict_handler(0.02))
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


def quotes(
    usd_per_hour: dict[str, float], region: str = "us-east-1", as_of: str = "2026-01-01"
) -> list[PriceQuote]:
    """Return on-demand quotes at these prices, as a run resolves them into run.json."""
    return [
        PriceQuote(
            instance_type=instance_type,
            region=region,
            market="on-demand",
            usd_per_hour=usd,
            source="a test",
            as_of=as_of,
            fetched_at="2026-01-02T00:00:00+00:00",
        )
        for instance_type, usd in usd_per_hour.items()
    ]


# Round prices, so each fleet's cost is worked out by hand below.
PRICES = quotes({"c7i.large": 0.10, "m7i.large": 0.12, "c7i.xlarge": 0.21, "c7i.2xlarge": 0.40})
# 100 req/s on 1 vCPU, 200 on 2: linear, so 400 on 4 and 800 on 8 (extrapolated).
LINEAR = [point(1, 100.0), point(2, 200.0)]


SHAPES = {
    "c7i.large": (2, 4.0),
    "m7i.large": (2, 8.0),
    "c7i.xlarge": (4, 8.0),
    "c7i.2xlarge": (8, 16.0),
}


def fleet(
    instance_type: str,
    replicas: int,
    rps: float,
    per_hour: float | None,
    per_month: float | None,
    per_million: float | None,
    *,
    extrapolated: bool | None = None,
) -> FleetOption:
    """Return the fleet expected of ``instance_type`` (AWS's vCPUs and memory for it)."""
    vcpus, memory_gib = SHAPES[instance_type]
    return FleetOption(
        instance_type=instance_type,
        vcpus=vcpus,
        memory_gib=memory_gib,
        replicas=replicas,
        rps_per_replica=rps,
        # Measured here at 1 and 2 vCPUs unless said otherwise.
        extrapolated=vcpus > 2 if extrapolated is None else extrapolated,
        usd_per_hour=per_hour,
        usd_per_month=per_month,
        usd_per_million=per_million,
    )


def test_sizes_beyond_the_host_follow_the_measured_scaling() -> None:
    points = [point(1, 100.0), point(2, 180.0)]
    assert rate_at(points, 2) == (180.0, False)
    rate4, extrapolated = rate_at(points, 4)
    exponent = math.log(1.8) / math.log(2)
    assert extrapolated and rate4 == pytest.approx(180.0 * 2**exponent)
    # Worse than sqrt scaling is floored there; better than linear is capped.
    assert rate_at([point(1, 100.0), point(2, 100.0)], 8)[0] == pytest.approx(100 * 4**0.5)
    assert rate_at([point(1, 100.0), point(2, 250.0)], 8)[0] == pytest.approx(250 * 4)


def test_one_measured_size_is_extrapolated_linearly() -> None:
    # The pipeline's tests (BURSTCV_SIZING_MAX_VCPUS=1), or a 1-CPU host: no scaling measured,
    # so every larger size scales linearly from the one measured.
    only_one = [point(1, 100.0)]
    assert rate_at(only_one, 1) == (100.0, False)
    assert rate_at(only_one, 2) == (200.0, True)
    assert rate_at(only_one, 8) == (800.0, True)
    # Measured at 2 vCPUs only: nothing to scale from either.
    assert rate_at([point(2, 180.0)], 4) == (360.0, True)
    assert rate_at([point(2, 180.0)], 1) == (0.0, True)  # below the measured: not offered
    report = recommend(
        only_one, latency_slo_ms=50, target_rps=1000, prices=PRICES, region="us-east-1"
    )
    # 1000 req/s at 70% of 200 (2 vCPUs): 8 replicas; of 400 (4): 4; of 800 (8): 2. Every
    # one extrapolated: the same price ranks by the vCPUs, then by name.
    assert report.options == [
        fleet("c7i.2xlarge", 2, 800.0, 0.8, 584.0, 0.2222, extrapolated=True),
        fleet("c7i.large", 8, 200.0, 0.8, 584.0, 0.2222, extrapolated=True),
        fleet("c7i.xlarge", 4, 400.0, 0.84, 613.2, 0.2333, extrapolated=True),
    ]


def test_a_size_that_sustains_nothing_after_a_smaller_held_rests_on_the_smaller() -> None:
    # 2 vCPUs broke the SLO at their lowest load though 1 held (a noisy host, a generator on
    # its CPUs): a measurement error. 2 vCPUs are priced at 1's rate, and larger sizes scale
    # from that as a flat measured scaling does (the slowest scaling allowed), never from 0.
    broken = [point(1, 100.0), point(2, 0.0)]
    assert rate_at(broken, 2) == (100.0, False)
    assert rate_at(broken, 4)[0] == pytest.approx(100 * 2**0.5)
    assert rate_at(broken, 4) == rate_at([point(1, 100.0), point(2, 100.0)], 4)
    # A slow model still scales: 0.8 req/s on 1 vCPU, 1.6 on 2.
    assert rate_at([point(1, 0.8)], 2) == (1.6, True)
    # 0.5 req/s on 1 vCPU, 0.9 on 2: scaled as measured (x1.8 a doubling), not linearly.
    assert rate_at([point(1, 0.5), point(2, 0.9)], 4)[0] == pytest.approx(1.62)
    # Only 2 vCPUs measured, a slow rate: linear, nothing to scale from.
    assert rate_at([point(2, 1.2)], 4) == (2.4, True)
    # A model that slow still gets a fleet: 1 req/s expected, one c7i.large at 1.6.
    slow = recommend(
        [point(1, 0.8)], latency_slo_ms=2000, target_rps=1.0, prices=PRICES, region="us-east-1"
    )
    assert slow.chosen == fleet("c7i.large", 1, 1.6, 0.1, 73.0, 27.7778, extrapolated=True)


def test_the_cheapest_fleet_covers_the_target_with_the_default_headroom() -> None:
    report = recommend(
        LINEAR, latency_slo_ms=50, target_rps=1000, prices=PRICES, region="us-east-1"
    )
    # A replica runs at most at 70% of its sustainable rate: 1000 req/s takes 8 c7i.large at
    # 140 req/s ($0.80/h, $584.00 a month, 1M predictions in 1000 s: $0.2222), 2 c7i.2xlarge
    # at 560 (the same price, extrapolated: after the measured one), 4 c7i.xlarge at 280.
    assert report.headroom == 0.3
    assert report.options == [
        fleet("c7i.large", 8, 200.0, 0.8, 584.0, 0.2222),
        fleet("c7i.2xlarge", 2, 800.0, 0.8, 584.0, 0.2222),
        fleet("c7i.xlarge", 4, 400.0, 0.84, 613.2, 0.2333),
    ]
    assert [o.extrapolated for o in report.options] == [False, True, True]
    assert report.chosen == report.options[0]
    assert report.reason == (
        "8 x c7i.large at 200 req/s each (measured), 30% headroom: $584.00/month"
    )
    assert (report.latency_slo_ms, report.target_rps, report.region) == (50, 1000, "us-east-1")
    assert report.price_source == {"source": "a test", "as_of": "2026-01-01"}
    assert report.unpriced is None
    # Another headroom, another fleet: at 80% of 200 req/s, 7 replicas; at 50%, 10.
    assert recommend(
        LINEAR, latency_slo_ms=50, target_rps=1000, prices=PRICES, region="us-east-1", headroom=0.2
    ).options[0] == fleet("c7i.large", 7, 200.0, 0.7, 511.0, 0.1944)
    assert recommend(
        LINEAR, latency_slo_ms=50, target_rps=1000, prices=PRICES, region="us-east-1", headroom=0.5
    ).options[0] == fleet("c7i.large", 10, 200.0, 1.0, 730.0, 0.2778)
    with pytest.raises(ValueError, match="headroom must be in"):
        recommend(LINEAR, latency_slo_ms=50, target_rps=10, prices=PRICES, region="x", headroom=1)


def test_the_figures_are_rounded_as_published() -> None:
    # The bundled table's us-east-1 prices, dated differently: the oldest date is reported.
    table = quotes({"c7i.large": 0.08925, "c7i.xlarge": 0.1785, "m7i.large": 0.1008})
    table += quotes({"c7i.2xlarge": 0.357}, as_of="2025-06-01")
    report = recommend(
        [point(1, 100.0), point(2, 177.77)],
        latency_slo_ms=50,
        target_rps=1000,
        prices=table,
        region="us-east-1",
    )
    # c7i.large: 9 x $0.08925 = $0.80325/h, $586.3725 a month, $0.223125 per 1M;
    # c7i.xlarge: 177.77 x 1.7777 = 316.0217 req/s, 5 x $0.1785 = $0.8925/h, $651.525 a month.
    assert report.options == [
        fleet("c7i.large", 9, 177.77, 0.8033, 586.37, 0.2231),
        fleet("c7i.xlarge", 5, 316.02, 0.8925, 651.52, 0.2479),
        fleet("m7i.large", 9, 177.77, 0.9072, 662.26, 0.252),
    ]
    assert report.price_source == {"source": "a test", "as_of": "2025-06-01"}


def test_a_type_without_a_price_is_a_fleet_ranked_after_the_priced_ones() -> None:
    sublinear = [point(1, 100.0), point(2, 180.0)]
    unpriced = "no on-demand price for c7i.2xlarge, c7i.large, c7i.xlarge in us-east-1: set it"
    report = recommend(
        sublinear,
        latency_slo_ms=50,
        target_rps=1000,
        prices=quotes({"m7i.large": 0.12}),
        region="us-east-1",
        unpriced=unpriced,
        families=["c7i", "m7i"],
    )
    # The one priced type comes first, though dearer than the others would be; the unpriced
    # ones follow by the vCPUs they take: 8 x 2 (c7i.large at 180 req/s) before 5 x 4
    # (c7i.xlarge at 324) and 3 x 8 (c7i.2xlarge at 583).
    assert report.options == [
        fleet("m7i.large", 8, 180.0, 0.96, 700.8, 0.2667),
        fleet("c7i.large", 8, 180.0, None, None, None),
        fleet("c7i.xlarge", 5, 324.0, None, None, None),
    ]
    assert report.chosen == report.options[0]
    assert report.unpriced == unpriced
    # Nothing priced: still a fleet (the gate passes it), said to be unpriced and why.
    none = recommend(
        sublinear,
        latency_slo_ms=50,
        target_rps=1000,
        prices=[],
        region="eu-west-9",
        unpriced=unpriced,
        families=["c7i", "m7i"],
    )
    assert none.chosen == fleet("c7i.large", 8, 180.0, None, None, None)
    assert [o.instance_type for o in none.options] == ["c7i.large", "m7i.large", "c7i.xlarge"]
    assert none.reason == (
        f"8 x c7i.large at 180 req/s each (measured), 30% headroom: unpriced ({unpriced})"
    )
    assert none.price_source == {"source": "none", "as_of": "?"}
    # Without the resolved reason, the type is named.
    bare = recommend(sublinear, latency_slo_ms=50, target_rps=1000, prices=[], region="x")
    assert bare.reason.endswith("30% headroom: unpriced (no price for c7i.large)")
    assert bare.unpriced is None


def test_the_services_memory_rules_out_the_types_it_would_crowd() -> None:
    def types(rss_mb: float) -> list[str]:
        # The peak of the sizes measured counts (here the 2-vCPU service's).
        points = [point(1, 100.0, rss_mb=10.0), point(2, 200.0, rss_mb=rss_mb)]
        report = recommend(
            points,
            latency_slo_ms=50,
            target_rps=1000,
            prices=PRICES,
            region="us-east-1",
            families=["c7i"],
        )
        return sorted(o.instance_type for o in report.options)

    # A type must have twice the service's memory: c7i.large has 4 GiB, c7i.xlarge 8,
    # c7i.2xlarge 16.
    assert types(2048.0) == ["c7i.2xlarge", "c7i.large", "c7i.xlarge"]
    assert types(2048.5) == ["c7i.2xlarge", "c7i.xlarge"]
    assert types(4096.0) == ["c7i.2xlarge", "c7i.xlarge"]
    assert types(4096.5) == ["c7i.2xlarge"]
    assert types(8192.5) == []
    # Too big for every type, though a size held a (slow) rate: the memory is the reason.
    heavy = recommend(
        [point(1, 0.0, rss_mb=9000.0), point(2, 0.5, rss_mb=9000.0)],
        latency_slo_ms=50,
        target_rps=10,
        prices=PRICES,
        region="us-east-1",
    )
    assert heavy.chosen is None and heavy.options == []
    assert heavy.reason == "no CPU type of the allowed families could hold the model"


def test_a_runs_percentiles_are_numpys_linear_ones() -> None:
    run = LoadRun(
        rate_rps=10.0, sent=100, latencies_ms=[float(ms) for ms in range(1, 101)], wall_s=10.0
    )
    assert (run.percentile(50), run.percentile(95), run.percentile(99)) == (50.5, 95.05, 99.01)
    assert LoadRun(rate_rps=1.0, sent=1).percentile(95) == math.inf  # nothing answered


def test_a_rate_holds_without_errors_within_the_slo_at_the_rate_asked() -> None:
    def run(sent: int = 100, **statuses: int) -> LoadRun:
        return LoadRun(
            rate_rps=10.0,
            sent=sent,
            latencies_ms=[float(ms) for ms in range(1, 101)],  # p95: 95.05 ms
            statuses=statuses or {"200": 100},
            wall_s=10.0,
        )

    assert _holds(run(), 95.05)  # exactly at the SLO
    assert not _holds(run(), 95.04)
    assert not _holds(run(**{"200": 99, "503": 1}), 100.0)
    assert not _holds(run(**{"200": 99, "ReadTimeout": 1}), 100.0)
    # 90% of the rate sent is on time (9 req/s of 10); less is the load generator lagging.
    assert _holds(run(sent=90), 100.0)
    assert not _holds(run(sent=89), 100.0)


SLOW_S = 0.6  # what a slow answer takes, well over the SLO below; the others are immediate
SLO_MS = 300.0


@pytest.fixture
def slow_tail_server() -> Iterator[str]:
    """Answers at once, but takes 600 ms for a request whose file says SLOW."""
    yield from _serve(
        ThreadingHTTPServer(("127.0.0.1", 0), predict_handler(slow_when=(b"SLOW", SLOW_S)))
    )


def tail_images(slow: int) -> list[bytes]:
    """Return 100 bodies, the last ``slow`` of them slow: at 100 req/s for 1 s, each once."""
    return [b"SLOW" if i >= 100 - slow else b"FAST" for i in range(100)]


def test_a_rate_holds_when_its_p95_meets_the_slo_though_its_p99_does_not(
    slow_tail_server: str,
) -> None:
    # 3 slow answers in 100: p95 is fast, p99 is slow.
    tried: list[LoadStep] = []
    best = sustainable_rate(
        slow_tail_server,
        tail_images(3),
        latency_slo_ms=SLO_MS,
        start_rps=100.0,
        duration_s=1.0,
        max_rps=100.0,
        tried=tried,
    )
    assert best is not None and best.percentile(99) >= SLOW_S * 1000  # the tail was there
    assert best.rate_rps == 100.0 and sum(best.statuses.values()) == 100
    # It held at once; the next rate (150) is past max_rps, so nothing else was tried.
    assert [(s.rate_rps, s.held, s.errors) for s in tried] == [(100.0, True, 0)]
    assert tried[0].p95_ms < SLO_MS


def test_a_rate_breaks_when_its_p95_misses_the_slo_though_its_p90_meets_it(
    slow_tail_server: str,
) -> None:
    # 7 slow answers in 100: p90 is fast, p95 is slow. The first rate breaks; a step down
    # (100 / 1.5², 44 requests) sends only fast ones and holds.
    tried: list[LoadStep] = []
    best = sustainable_rate(
        slow_tail_server,
        tail_images(7),
        latency_slo_ms=SLO_MS,
        start_rps=100.0,
        duration_s=1.0,
        max_rps=50.0,
        tried=tried,
    )
    assert [(s.rate_rps, s.held) for s in tried] == [(100.0, False), (44.44, True)]
    assert tried[0].p95_ms >= SLOW_S * 1000  # the p95 recorded is the slow answers'
    assert best is not None and best.rate_rps == pytest.approx(100 / 2.25)


def assert_read_at_their_percentiles(size: SizePoint) -> None:
    """A size's latencies are those of the last rate that held, read at p50, p95 and p99."""
    held = [
        s for s in size.steps if s.held and s.rate_rps == size.sustainable_rps and not s.scouting
    ]
    assert held and held[-1].p95_ms == size.p95_ms  # as the search recorded its p95
    assert size.p50_ms is not None and size.p95_ms is not None and size.p99_ms is not None
    assert size.p50_ms < size.p95_ms < size.p99_ms


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
    prices, unpriced = serving_quotes(
        ["c7i", "m7i"], "us-east-1", PriceSources(artifact_root=str(tmp_path / "store"))
    )
    assert unpriced is None  # the bundled table prices every one
    report = sizing.size_model(
        str(folder),
        [IMAGE],
        latency_slo_ms=100,
        target_rps=2000,
        prices=prices,
        region="us-east-1",
        max_vcpus=2,
        duration_s=1.0,
    )
    one, two = report.sizes
    assert (one.vcpus, two.vcpus) == (1, 2) and one.measured and two.measured
    assert one.sustainable_rps > 0 and one.p95_ms is not None and one.p95_ms <= 100
    for size in (one, two):
        assert_read_at_their_percentiles(size)
    # Monotone in vCPUs, within one search step: on a 2-core host the load generator shares a
    # CPU with the 2-vCPU service (it has one of its own while the service has one).
    assert two.sustainable_rps >= one.sustainable_rps / sizing.STEP_FACTOR
    assert one.cpu_s_per_request and one.rss_mb
    assert report.chosen is not None
    chosen = report.chosen
    assert chosen.replicas * chosen.rps_per_replica * (1 - report.headroom) >= 2000
    assert (chosen.replicas - 1) * chosen.rps_per_replica * (1 - report.headroom) < 2000
    assert chosen.usd_per_hour is not None and chosen.usd_per_million is not None
    assert {o.extrapolated for o in report.options if o.vcpus > 2} <= {True}
    assert report.price_source["source"].startswith("bundled")


def test_an_unattainable_slo_is_rejected_with_the_reason(tmp_path: Path) -> None:
    folder = write_model_dir(tmp_path / "model")
    report = sizing.size_model(
        str(folder),
        [IMAGE],
        latency_slo_ms=0.01,
        target_rps=10,
        prices=PRICES,
        region="us-east-1",
        max_vcpus=1,
        duration_s=0.5,
    )
    assert report.sizes[0].sustainable_rps == 0
    assert report.chosen is None and report.options == []
    assert "no CPU size meets p95 <= 0.01 ms" in report.reason


def test_burstcv_size_measures_a_registered_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    from typer.testing import CliRunner

    from burstcv.cli import app
    from burstcv.registry.registry import Registry
    from burstcv.settings import get_settings
    from burstcv_spec.contracts import RegistryDecision, SizingReport, read_artifact

    registry = Registry(str(tmp_path / "registry"), "digits")
    registry.register(str(write_model_dir(tmp_path / "model")), RegistryDecision(status="accepted"))
    images = tmp_path / "images"
    images.mkdir()
    (images / "a.png").write_bytes(IMAGE)
    monkeypatch.setenv("BURSTCV_REGISTRY_URI", str(tmp_path / "registry"))
    monkeypatch.setenv("BURSTCV_MODEL_NAME", "digits")
    get_settings.cache_clear()  # the command reads these, not what an earlier test cached
    out = tmp_path / "sizing.json"
    args = ["size", "1", "--images", str(images), "--target-rps", "50", "--out", str(out)]
    args += ["--step-s", "0.5"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = read_artifact(str(out), SizingReport)
    assert report.chosen is not None and report.chosen.instance_type in result.output
    assert report.sizes[0].vcpus == 1 and report.sizes[0].sustainable_rps > 0
    assert_read_at_their_percentiles(report.sizes[0])
    assert "/month" in result.output
    missing = CliRunner().invoke(app, ["size", "9", "--images", str(images), "--target-rps", "5"])
    assert missing.exit_code != 0 and "no version 9" in missing.output


def test_only_the_allowed_families_are_priced() -> None:
    points = [point(1, 100.0), point(2, 180.0)]
    report = recommend(
        points,
        latency_slo_ms=50,
        target_rps=300,
        prices=PRICES,
        region="us-east-1",
        families=["m7i"],
    )
    # 300 req/s at 70% of 180: 3 x m7i.large; then the family's larger size.
    assert report.options[0] == fleet("m7i.large", 3, 180.0, 0.36, 262.8, 0.3333)
    assert [o.instance_type for o in report.options] == ["m7i.large", "m7i.xlarge"]
    assert report.families == ["m7i"]
    none = recommend(
        points,
        latency_slo_ms=50,
        target_rps=300,
        prices=PRICES,
        region="us-east-1",
        families=["x9z"],
    )
    assert none.chosen is None and "allowed families" in none.reason


def test_the_search_climbs_to_the_highest_rate_that_holds(one_at_a_time_server: str) -> None:
    """A service that answers 50 req/s at most: the search starts well below and climbs."""
    tried: list[LoadStep] = []
    best = sustainable_rate(
        one_at_a_time_server,
        [IMAGE],
        latency_slo_ms=300,
        start_rps=8.0,
        duration_s=0.5,
        tried=tried,
        max_rps=200.0,
    )
    assert best is not None
    held = [s.rate_rps for s in tried if s.held]
    # The steps record their rates to the cent (a rate between two steps has more digits).
    assert round(best.rate_rps, 2) == max(held) >= 8.0 * sizing.STEP_FACTOR**3  # it climbed
    assert any(not s.held for s in tried)  # it went on until the SLO broke
    assert best.rate_rps < 100.0  # and never past what the service can answer


def test_scouting_steps_bracket_the_limit_and_the_rate_is_a_measuring_steps(
    one_at_a_time_server: str,
) -> None:
    """A 50 req/s service searched from 4 req/s: short steps double the rate until one
    breaks, then full-length steps measure between the last that held and that one."""
    tried: list[LoadStep] = []
    best = sustainable_rate(
        one_at_a_time_server,
        [IMAGE],
        latency_slo_ms=300,
        start_rps=4.0,
        duration_s=1.0,
        tried=tried,
        max_rps=400.0,
        scout_s=0.5,
    )
    scouts = [s for s in tried if s.scouting]
    measuring = [s for s in tried if not s.scouting]
    # The scouting comes first, doubling from the start, and ends at the first that broke.
    assert tried[: len(scouts)] == scouts and len(scouts) >= 3
    assert [s.rate_rps for s in scouts] == [4.0 * 2**i for i in range(len(scouts))]
    assert all(s.held for s in scouts[:-1]) and not scouts[-1].held
    assert {s.seconds for s in scouts} == {0.5} and {s.seconds for s in measuring} == {1.0}
    # Measuring starts at the last scouting rate that held and never reaches the one that broke.
    assert measuring[0].rate_rps == scouts[-2].rate_rps
    assert all(s.rate_rps < scouts[-1].rate_rps for s in measuring)
    # Climbing from 4 req/s at full length would have taken more measuring steps.
    assert len(measuring) <= 3
    assert best is not None and best.rate_rps < 100.0
    assert round(best.rate_rps, 2) == max(s.rate_rps for s in measuring if s.held)
    assert best.sent == round(best.rate_rps * 1.0)  # the full length, not a scout's
    assert sum(s.requests for s in tried) > sum(s.requests for s in measuring)


def test_a_first_scouting_rate_that_breaks_measures_below_it(one_at_a_time_server: str) -> None:
    tried: list[LoadStep] = []
    best = sustainable_rate(
        one_at_a_time_server,
        [IMAGE],
        latency_slo_ms=300,
        start_rps=200.0,
        duration_s=1.0,
        tried=tried,
        max_rps=400.0,
        scout_s=0.5,
    )
    assert [(s.rate_rps, s.scouting, s.held) for s in tried[:1]] == [(200.0, True, False)]
    # Not measured again at full length: the measuring steps start a step and a half below.
    assert tried[1].rate_rps == round(200.0 / sizing.STEP_FACTOR**2, 2) and not tried[1].scouting
    assert all(s.rate_rps < 200.0 for s in tried[1:])
    assert best is not None and best.rate_rps < 100.0


def test_a_size_cap_measures_only_that_many_cpus_and_a_requests_cpu_is_its_share(
    tmp_path: Path,
) -> None:
    if len(sizing.host_cpus()) < 2:
        pytest.skip("needs 2 CPUs: the cap must leave one out")
    folder = write_model_dir(tmp_path / "model")
    (size,) = sizing.measure_sizes(
        str(folder), [IMAGE], latency_slo_ms=100, max_vcpus=1, duration_s=0.3
    )
    assert size.vcpus == 1 and size.sustainable_rps > 0
    # The service's CPU seconds over the search, shared among its requests: a small model
    # costs well under 50 ms of CPU a request, and one CPU spends at most a second a second.
    cpu = size.cpu_s_per_request
    assert cpu is not None and 0 < cpu < 0.05
    assert cpu * size.sustainable_rps < 1.5
    # Beside the size, the generator's own figures: it sent twice the size's rate (or, on a
    # hiccup of this host, 1.25 times) on time to a trivial endpoint on the service's CPU,
    # from the CPU it had alone.
    assert size.generator_processes == 1 and not size.generator_shares_cpus
    assert not size.generator_bound
    assert size.generator_rps is not None
    assert any(
        size.generator_rps == pytest.approx(f * size.sustainable_rps, abs=0.02)
        for f in (sizing.GENERATOR_PROBE, sizing.GENERATOR_MARGIN)
    )
    assert size.send_lag_p95_ms is not None and size.send_lag_p95_ms >= 0
    assert size.anomaly is None


def bound(vcpus: int, rps: float) -> SizePoint:
    return point(vcpus, rps).model_copy(update={"generator_bound": True, "generator_rps": rps})


def test_a_rate_that_falls_as_cpus_are_added_is_a_measurement_error() -> None:
    # The figures: 333 req/s at 1 vCPU, 222 at 2 (the generator shared the 2 CPUs).
    shared = point(2, 222.0).model_copy(update={"generator_shares_cpus": True})
    one, two, four = sizing.flag_falling([point(4, 400.0), shared, point(1, 333.0)])
    assert (one.vcpus, two.vcpus, four.vcpus) == (1, 2, 4)  # ordered by size
    assert one.anomaly is None and four.anomaly is None  # 400 is above 333: no error
    assert two.anomaly is not None
    assert two.anomaly.startswith("measurement error: 222 req/s at 2 vCPUs is below the 333")
    assert "the load generator shared this size's CPUs" in two.anomaly
    # Priced at the smaller size's rate, never at its own.
    assert rate_at([one, two, four], 2) == (333.0, False)
    # Within the noise allowed (a tenth): not an error.
    (_, close) = sizing.flag_falling([point(1, 100.0), point(2, 91.0)])
    assert close.anomaly is None
    (_, below) = sizing.flag_falling([point(1, 100.0), point(2, 89.0)])
    assert below.anomaly is not None and "generator shared" not in below.anomaly


def test_a_generator_bound_size_is_priced_as_a_lower_bound_and_says_so() -> None:
    report = recommend(
        [bound(1, 300.0)],
        latency_slo_ms=50,
        target_rps=1000,
        prices=PRICES,
        region="us-east-1",
        families=["c7i"],
    )
    assert report.options and all(o.generator_bound for o in report.options)
    assert report.chosen is not None
    assert "at least " in report.reason and "the load generator's ceiling" in report.reason
    # A measured size the generator outran is the service's rate, however others fared.
    mixed = [point(1, 100.0), bound(2, 300.0)]
    assert not sizing.generator_bound_at(mixed, 1)
    assert sizing.generator_bound_at(mixed, 2) and sizing.generator_bound_at(mixed, 8)
    fine = recommend(
        [point(1, 100.0)], latency_slo_ms=50, target_rps=100, prices=PRICES, region="us-east-1"
    )
    assert fine.chosen is not None and not fine.chosen.generator_bound
    assert "at least" not in fine.reason


def test_the_reason_says_the_headroom_as_set() -> None:
    report = recommend(
        [point(1, 100.0)],
        latency_slo_ms=50,
        target_rps=100,
        prices=PRICES,
        region="us-east-1",
        headroom=0.6,
        families=["c7i"],
    )
    assert report.headroom == 0.6 and "60% headroom" in report.reason


def sized(points: list[SizePoint], target_rps: float, headroom: float = 0.3) -> SizingReport:
    return recommend(
        points,
        latency_slo_ms=50.0,
        target_rps=target_rps,
        prices=PRICES,
        region="us-east-1",
        headroom=headroom,
    )


def test_the_gate_measures_at_the_most_one_replica_carries() -> None:
    # 100 req/s sustained at 1 vCPU, 30% kept spare: a replica carries at most 70.
    load = gate_load(sized(LINEAR, target_rps=1000.0), 1, requests=200, max_s=30.0)
    assert load.rate_rps == 70.0 and load.requests == 200
    assert "100 req/s sustainable at 1 vCPU(s) (measured) less 30% headroom" in load.note
    assert "capped" not in load.note
    # At 2 vCPUs, 200 sustained; with 10% spare, 180.
    load = gate_load(sized(LINEAR, 1000.0, headroom=0.1), 2, requests=200, max_s=30.0)
    assert load.rate_rps == 180.0
    # Beyond the measured sizes: extrapolated from the scaling, and said so.
    load = gate_load(sized(LINEAR, 1000.0), 4, requests=200, max_s=30.0)
    assert load.rate_rps == 280.0 and "(extrapolated)" in load.note


def test_the_gate_never_measures_above_the_runs_whole_load() -> None:
    load = gate_load(sized(LINEAR, target_rps=20.0), 1, requests=200, max_s=30.0)
    assert load.rate_rps == 20.0
    assert "capped at the run's expected peak load (20 req/s)" in load.note
    # Exactly at the load a replica carries: not capped.
    assert "capped" not in gate_load(sized(LINEAR, 70.0), 1, requests=200, max_s=30.0).note


def test_a_model_no_rate_held_for_is_measured_at_the_lowest_rate() -> None:
    load = gate_load(sized([point(1, 0.0), point(2, 0.0)], 10.0), 1, requests=200, max_s=30.0)
    assert load.rate_rps == sizing.MIN_RATE_RPS
    assert load.note == "the sizing's lowest rate: no rate held the SLO at 1 vCPU(s)"
    load = gate_load(sized([point(1, 0.0)], 10.0), 2, requests=200, max_s=30.0)
    assert load.rate_rps == sizing.MIN_RATE_RPS and "nothing to extrapolate 2 vCPU(s)" in load.note


def test_a_set_rate_overrides_the_sizing() -> None:
    load = gate_load(sized(LINEAR, 1000.0), 1, requests=200, max_s=30.0, rate_rps=12.5)
    assert load.rate_rps == 12.5 and load.note == "the rate set (BURSTCV_BENCH_RATE_RPS=12.5)"


def test_the_gate_load_is_bounded_in_time_but_keeps_enough_requests() -> None:
    report = sized(LINEAR, 1000.0)
    # 70 req/s for at most 2 s: 140 of the 200 asked.
    assert gate_load(report, 1, requests=200, max_s=2.0).requests == 140
    # 2.0 s at 70 req/s is 140; 2.01 s rounds up to 141.
    assert gate_load(report, 1, requests=200, max_s=2.01).requests == 141
    # A slow rate still sends enough for a p95, unless fewer were asked for.
    slow = gate_load(report, 1, requests=200, max_s=10.0, rate_rps=1.0)
    assert slow.requests == MIN_GATE_REQUESTS == 20
    assert gate_load(report, 1, requests=200, max_s=10.0, rate_rps=2.1).requests == 21
    assert gate_load(report, 1, requests=15, max_s=10.0, rate_rps=1.0).requests == 15
    assert gate_load(report, 1, requests=20, max_s=0.1).requests == 20


def box(instance_type: str, *points: SizePoint, skipped: str | None = None) -> BoxSizing:
    """Return a sizing box's record of ``instance_type`` (skipped: no figures, and why)."""
    return BoxSizing(
        instance_type=instance_type, region="us-east-1", sizes=list(points), skipped=skipped
    )


GRAVITON_PRICES = quotes({"c7i.large": 0.10, "c7g.large": 0.08, "m7i.large": 0.12})


def test_the_box_candidates_are_the_cheapest_fleets_the_host_says_could_serve() -> None:
    # 300 req/s at 70% of 200 per c7i.large-sized box: 3 boxes of any type; cheapest first.
    args = {"target_rps": 300, "prices": GRAVITON_PRICES, "families": ["c7i", "c7g", "m7i"]}
    assert box_candidates(LINEAR, count=2, **args) == ["c7g.large", "c7i.large"]
    assert box_candidates(LINEAR, count=5, **args) == ["c7g.large", "c7i.large", "m7i.large"]
    # Only the allowed families, and never more than asked.
    assert box_candidates(LINEAR, count=3, **{**args, "families": ["c7i"]}) == ["c7i.large"]
    assert box_candidates(LINEAR, count=0, **args) == []


def test_a_type_measured_on_its_own_box_rests_on_its_figures_and_is_chosen_over_a_guess() -> None:
    families = ["c7i", "c7g", "m7i"]
    # The host (x86) measured 200 req/s at 2 vCPUs. Without boxes, the Graviton type's figure is
    # the host's, from another architecture: marked extrapolated, never "measured".
    host_only = recommend(
        LINEAR,
        latency_slo_ms=50,
        target_rps=300,
        prices=GRAVITON_PRICES,
        region="us-east-1",
        families=families,
        host_cores=2,
    )
    by_type = {o.instance_type: o for o in host_only.options}
    assert by_type["c7g.large"].extrapolated and by_type["c7g.large"].measured_on is None
    assert not by_type["c7i.large"].extrapolated
    # Boxes: the c7i.large box measured 60 req/s at 2 vCPUs (slower than the host), the c7g
    # box was refused. The fleet rests on the measured box, though the guesses are cheaper.
    measured = recommend(
        LINEAR,
        latency_slo_ms=50,
        target_rps=300,
        prices=GRAVITON_PRICES,
        region="us-east-1",
        families=families,
        host_cores=2,
        boxes=[
            box("c7i.large", point(1, 30.0), point(2, 60.0)),
            box("c7g.large", skipped="not launched: VcpuLimitExceeded"),
        ],
    )
    chosen = measured.chosen
    assert chosen is not None
    assert (chosen.instance_type, chosen.measured_on, chosen.extrapolated) == (
        "c7i.large",
        "c7i.large",
        False,
    )
    assert chosen.rps_per_replica == 60.0 and chosen.replicas == 8  # 300 / (0.7 x 60)
    assert "measured on a c7i.large box" in measured.reason
    rest = [o for o in measured.options if o.instance_type != "c7i.large"]
    assert rest and all(o.extrapolated and o.measured_on is None for o in rest)
    assert [b.instance_type for b in measured.boxes] == ["c7i.large", "c7g.large"]
    # Every box skipped: the host's figures stand, as without boxes.
    skipped = recommend(
        LINEAR,
        latency_slo_ms=50,
        target_rps=300,
        prices=GRAVITON_PRICES,
        region="us-east-1",
        families=families,
        host_cores=2,
        boxes=[box("c7g.large", skipped="not launched")],
    )
    assert skipped.chosen == host_only.chosen
