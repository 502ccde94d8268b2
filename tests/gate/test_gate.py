"""The promotion gate: latency SLO, zero errors, accuracy floor, no regression; priced advice."""

from __future__ import annotations

import math
from typing import Any

import pytest
from burstcv_testkit import bench_figures

from burstcv.gate import gate as gate_module
from burstcv.gate.gate import (
    ARCH_CPU_MS,
    GateThresholds,
    ServingContext,
    advise,
    check_lines,
    describe_check,
    format_figure,
    judge,
)
from burstcv.gate.sizing import recommend
from burstcv.training.names import ARCHITECTURE_NAMES
from burstcv_spec.contracts import (
    BenchFigures,
    GateCheck,
    GateVerdict,
    PriceQuote,
    SizePoint,
    SizingReport,
    Suggestion,
)

LIMITS = GateThresholds(latency_slo_ms=20.0, accuracy_floor=0.9, max_accuracy_drop=0.02)


def cand(p95: float = 5.0, errors: float = 0.0, acc: float = 0.97) -> BenchFigures:
    return bench_figures(p95_ms=p95, error_rate=errors, accuracy=acc)


def prod(**fields: Any) -> BenchFigures:
    return bench_figures(label="production", **fields)


def test_a_fast_accurate_candidate_is_promoted() -> None:
    verdict = judge(cand(), prod(accuracy=0.96, version=3), LIMITS)
    assert verdict.promote and verdict.summary == "promote"
    assert {c.name for c in verdict.checks} == {
        "latency_p95",
        "error_rate",
        "accuracy_floor",
        "no_regression",
    }


def test_a_slow_candidate_is_refused_saying_by_how_much() -> None:
    verdict = judge(cand(p95=30.0), None, LIMITS)
    assert not verdict.promote
    assert verdict.summary.startswith(
        "not promoted: p95 30.00 ms exceeds the SLO 20 ms by 10.00 ms"
    )


def test_errors_below_floor_and_regression_each_refuse() -> None:
    assert "failed" in judge(cand(errors=0.01), None, LIMITS).summary
    assert "below the floor" in judge(cand(acc=0.8), None, LIMITS).summary
    verdict = judge(cand(acc=0.93), prod(accuracy=0.97, version=4), LIMITS)
    assert not verdict.promote and "below production v4" in verdict.summary


def test_every_check_is_logged_as_observed_vs_limit_with_the_verdict() -> None:
    verdict = judge(cand(p95=30.0, acc=0.689), prod(accuracy=0.97, version=4), LIMITS)
    assert check_lines(verdict)[:4] == [
        "gate check latency_p95: p95 30.00 ms > SLO 20 ms: FAILED",
        "gate check error_rate: error rate 0.0% <= allowed 0%: passed",
        "gate check accuracy_floor: accuracy 0.6890 < floor 0.9: FAILED",
        "gate check no_regression: accuracy 0.6890 < production minus allowed drop 0.9500: FAILED",
    ]
    assert check_lines(verdict)[-1] == f"gate verdict: {verdict.summary}"
    assert verdict.failed_figures == [
        "p95 30.00 ms > SLO 20 ms",
        "accuracy 0.6890 < floor 0.9",
        "accuracy 0.6890 < production minus allowed drop 0.9500",
    ]
    passed = judge(cand(), None, LIMITS)
    assert check_lines(passed)[0] == "gate check latency_p95: p95 5.00 ms <= SLO 20 ms: passed"
    assert passed.failed_figures == []


def test_no_production_model_skips_the_regression_check() -> None:
    verdict = judge(cand(), None, LIMITS)
    assert verdict.promote and "no_regression" not in {c.name for c in verdict.checks}


# -- advice when the SLO is missed ---------------------------------------------------------------

SLOW = bench_figures(
    p95_ms=80.0,
    p50_ms=40.0,
    bare_onnxruntime_p50_ms=30.0,  # 10 ms of the median is HTTP + decode
    throughput_rps=100.0,
)
SLO_50 = GateThresholds(latency_slo_ms=50.0, accuracy_floor=0.9, max_accuracy_drop=0.02)

# The on-demand prices a run in us-east-1 resolves (the bundled table's), USD per hour.
PRICES = {
    "c7i.large": 0.08925,
    "c7i.xlarge": 0.1785,
    "c7i.2xlarge": 0.357,
    "m7i.large": 0.1008,
    "g4dn.xlarge": 0.526,
    "g5.xlarge": 1.006,
    "g6.xlarge": 0.8048,
}
TARGET_RPS = 500.0


def ctx(**fields: Any) -> ServingContext:
    """Return the serving context of a run in us-east-1 expecting 500 req/s (overridable)."""
    context: dict[str, Any] = {
        "arch": "resnet18",
        "int8_tried": False,
        "region": "us-east-1",
        "prices": PRICES,
        "target_rps": TARGET_RPS,
    }
    return ServingContext(**{**context, **fields})


def fleet_per_million(usd_per_hour: float, rps_each: float, target_rps: float) -> float:
    """Price 1M predictions as the serving fleet does: replicas at 70% of their rate."""
    replicas = max(1, math.ceil(target_rps / (rps_each * 0.7)))
    return round(replicas * usd_per_hour / (target_rps * 3600) * 1e6, 4)


def test_a_missed_slo_comes_with_priced_ways_to_close_the_gap() -> None:
    verdict = judge(SLOW, None, SLO_50, ctx(measured_vcpus=2))
    assert not verdict.promote
    by_action = {s.action: s for s in verdict.suggestions}
    assert set(by_action) == {"int8", "smaller_model", "larger_instance", "gpu_serving"}
    for s in verdict.suggestions:
        assert s.gap_ms == 30.0 and s.assumption and s.region == "us-east-1"
        assert s.estimated_throughput_rps is not None
        # Each priced as the fleet of its type serving the run's 500 req/s.
        expected = fleet_per_million(
            PRICES[s.instance_type], s.estimated_throughput_rps, TARGET_RPS
        )
        assert s.cost_per_million_usd == pytest.approx(expected, abs=1e-4)
        assert s.price_note.endswith(
            f"on-demand in us-east-1 at {s.estimated_throughput_rps:.1f} req/s each, "
            "serving 500 req/s"
        )
    smaller = by_action["smaller_model"]
    named = smaller.title.split()[2]
    assert named in ARCHITECTURE_NAMES and ARCH_CPU_MS[named][1] < ARCH_CPU_MS["resnet18"][1]
    assert smaller.meets_slo and smaller.estimated_p95_ms < 50.0
    assert by_action["larger_instance"].instance_type == "c7i.xlarge"
    assert by_action["gpu_serving"].instance_type.startswith("g")
    # The fixed 10 ms (HTTP + decode) stays; the 70 ms compute share halves under INT8.
    assert by_action["int8"].estimated_p95_ms == pytest.approx(45.0)
    # Gap-closers come first, cheapest first; the summary stays one line and names the best.
    costs = [s.cost_per_million_usd for s in verdict.suggestions if s.meets_slo]
    assert costs == sorted(costs)
    assert "\n" not in verdict.summary
    assert verdict.summary.startswith("not promoted: p95 80.00 ms exceeds the SLO 50 ms by 30.00")
    assert f"cheapest fix: {verdict.suggestions[0].title}" in verdict.summary
    assert GateVerdict.model_validate(verdict.model_dump(mode="json")) == verdict


def test_advice_skips_what_was_tried_or_cannot_shrink() -> None:
    suggestions = advise(SLOW, SLO_50, ctx(arch="mobilenet_v3_small", int8_tried=True))
    assert {s.action for s in suggestions} == {"larger_instance", "gpu_serving"}


def test_a_gap_no_cpu_can_close_is_reported_as_not_meeting_the_slo() -> None:
    hopeless = SLOW.model_copy(update={"p95_ms": 900.0})
    suggestions = advise(hopeless, SLO_50, ctx(arch="resnet10"))
    cpu = [s for s in suggestions if s.action != "gpu_serving"]
    assert cpu and not any(s.meets_slo for s in cpu)
    larger = next(s for s in suggestions if s.action == "larger_instance")
    assert larger.instance_type == "c7i.2xlarge"  # the biggest offered, still short


def test_a_region_without_prices_still_advises_and_says_why_it_is_unpriced() -> None:
    suggestions = advise(SLOW, SLO_50, ctx(region="eu-west-9", prices={}))
    # No GPU type has a price there either: GPU serving is advised all the same, unpriced.
    by_action = {s.action: s for s in suggestions}
    assert set(by_action) == {"int8", "smaller_model", "larger_instance", "gpu_serving"}
    gpu = by_action["gpu_serving"]
    assert (gpu.instance_type, gpu.meets_slo, gpu.estimated_p95_ms) == ("g4dn.xlarge", True, 11.0)
    assert all(s.cost_per_million_usd is None for s in suggestions)
    assert [s.price_note for s in suggestions] == [
        f"no price for {s.instance_type} in eu-west-9" for s in suggestions
    ]
    assert all(s.estimated_p95_ms and s.estimated_throughput_rps for s in suggestions)


def test_a_type_without_a_price_is_advised_unpriced_never_an_error() -> None:
    no_xlarge = {t: usd for t, usd in PRICES.items() if t != "c7i.xlarge"}
    by_action = {s.action: s for s in advise(SLOW, SLO_50, ctx(prices=no_xlarge))}
    larger = by_action["larger_instance"]
    assert larger.instance_type == "c7i.xlarge" and larger.meets_slo
    assert larger.cost_per_million_usd is None
    assert larger.price_note == "no price for c7i.xlarge in us-east-1"
    assert larger.estimated_p95_ms == 45.0 and larger.estimated_throughput_rps == 200.0
    # The others keep their prices; the unpriced one comes after them.
    # INT8 and resnet10 both take 5 x c7i.large: a tie, the measured estimate first.
    assert [s.action for s in advise(SLOW, SLO_50, ctx(prices=no_xlarge))] == [
        "smaller_model",
        "int8",
        "gpu_serving",
        "larger_instance",
    ]
    assert by_action["int8"].cost_per_million_usd == 0.2479


def test_advice_is_priced_at_the_runs_expected_load() -> None:
    # INT8 on c7i.large at ~177.8 req/s, at most 70% of it a replica (124.4 req/s).
    def int8(target_rps: float) -> Suggestion:
        by_action = {s.action: s for s in advise(SLOW, SLO_50, ctx(target_rps=target_rps))}
        return by_action["int8"]

    # 500 req/s: 5 replicas at $0.08925/h, $0.44625/h for 1.8M predictions an hour.
    assert int8(500.0).cost_per_million_usd == 0.2479
    assert int8(500.0).price_note == (
        "5 x c7i.large on-demand in us-east-1 at 177.8 req/s each, serving 500 req/s"
    )
    # 50 req/s: one replica, mostly idle: each prediction costs more.
    assert int8(50.0).cost_per_million_usd == 0.4958
    assert int8(50.0).price_note.startswith("1 x c7i.large")
    # 5000 req/s: 41 replicas.
    assert int8(5000.0).cost_per_million_usd == 0.2033
    assert int8(5000.0).price_note.startswith("41 x c7i.large")


def test_a_candidate_within_the_slo_gets_no_suggestions() -> None:
    verdict = judge(cand(), None, LIMITS, ServingContext(arch="resnet34"))
    assert verdict.promote and verdict.suggestions == []


def test_latency_regression_against_production_refuses_when_asked() -> None:
    limits = GateThresholds(20.0, 0.9, 0.02, max_latency_increase=0.2)
    slower = judge(cand(p95=9.0), prod(accuracy=0.97, p95_ms=5.0, version=7), limits)
    assert not slower.promote and "1.8x production v7" in slower.summary
    faster = judge(cand(p95=4.0), prod(accuracy=0.97, p95_ms=5.0, version=7), limits)
    assert faster.promote and "no_latency_regression" in {c.name for c in faster.checks}


# -- limits, exactly at the line -----------------------------------------------------------------


def test_a_p95_exactly_at_the_slo_meets_it() -> None:
    at_slo = judge(cand(p95=20.0), None, LIMITS)
    assert at_slo.promote and at_slo.suggestions == []
    just_over = judge(cand(p95=20.01), None, LIMITS)
    assert not just_over.promote


def test_the_slo_reason_says_how_many_times_too_slow() -> None:
    verdict = judge(cand(p95=30.0), None, LIMITS)
    assert verdict.reasons[0] == "p95 30.00 ms exceeds the SLO 20 ms by 10.00 ms (1.5x)"


def test_accuracy_exactly_at_the_floor_passes() -> None:
    assert judge(cand(acc=0.9), None, LIMITS).promote
    assert not judge(cand(acc=0.8999), None, LIMITS).promote


def test_accuracy_exactly_the_allowed_drop_below_production_passes() -> None:
    limits = GateThresholds(latency_slo_ms=20.0, accuracy_floor=0.25, max_accuracy_drop=0.25)
    production = prod(accuracy=0.75, version=2)
    assert judge(cand(acc=0.5), production, limits).promote
    refused = judge(cand(acc=0.375), production, limits)
    assert refused.reasons == [
        "accuracy 0.3750 drops 0.3750 below production v2 (0.7500); at most 0.2500 allowed"
    ]


def test_p95_exactly_at_the_allowed_increase_over_production_passes() -> None:
    limits = GateThresholds(20.0, 0.9, 0.02, max_latency_increase=0.25)
    production = prod(accuracy=0.97, p95_ms=8.0, version=7)
    at_ceiling = judge(cand(p95=10.0), production, limits)
    assert at_ceiling.promote
    latency = next(c for c in at_ceiling.checks if c.name == "no_latency_regression")
    assert latency.limit == 10.0  # 8 ms + 25%
    over = judge(cand(p95=10.01), production, limits)
    assert not over.promote
    assert over.reasons == ["p95 10.01 ms is 1.3x production v7's 8.00 ms; at most +25% allowed"]
    assert over.failed_figures == ["p95 10.01 ms > production's plus allowed increase 10.00 ms"]


def test_latency_regression_is_not_checked_unless_asked() -> None:
    limits = GateThresholds(20.0, 0.9, 0.02)
    verdict = judge(cand(p95=15.0), prod(accuracy=0.97, p95_ms=5.0, version=7), limits)
    assert verdict.promote
    assert "no_latency_regression" not in {c.name for c in verdict.checks}


# -- how figures read ----------------------------------------------------------------------------


def test_figures_read_with_their_units() -> None:
    assert format_figure("latency_p95", 4.851) == "4.85 ms"
    assert format_figure("error_rate", 0.005) == "0.5%"
    assert format_figure("accuracy_floor", 0.91234) == "0.9123"
    assert format_figure("no_latency_regression", 6.0) == "6.00 ms"
    assert format_figure("latency_p95", None) == "—"
    assert format_figure("some_new_check", 1234567.0) == "1.235e+06"


def test_an_allowed_error_rate_reads_as_a_percentage() -> None:
    check = GateCheck(name="error_rate", passed=False, observed=0.02, limit=0.01)
    assert describe_check(check) == "error rate 2.0% > allowed 1%"
    ok = GateCheck(name="error_rate", passed=True, observed=0.0, limit=0.025)
    assert describe_check(ok) == "error rate 0.0% <= allowed 2.5%"


# -- the tables the estimates rest on ------------------------------------------------------------


def test_vcpus_are_awss_published_figures() -> None:
    assert gate_module.VCPUS == {
        "c7i.large": 2,
        "c7i.xlarge": 4,
        "c7i.2xlarge": 8,
        "m7i.large": 2,
        "m7i.xlarge": 4,
        "c7g.large": 2,
        "c7g.xlarge": 4,
        "c7g.2xlarge": 8,
        "m7g.large": 2,
        "m7g.xlarge": 4,
        "c8g.large": 2,
        "c8g.xlarge": 4,
        "g4dn.xlarge": 4,
        "g5.xlarge": 4,
        "g6.xlarge": 4,
    }


def test_cpu_time_per_architecture_is_the_measured_table() -> None:
    # bench/arch_cpu.py's medians (ms per image, one thread): at 32 px, small-input stem;
    # at 224 px, torchvision's stem. Smaller-model advice scales by them.
    assert gate_module.ARCH_CPU_MS == {
        "resnet10": (2.29, 17.6),
        "resnet18": (5.67, 35.0),
        "resnet34": (11.51, 69.6),
        "resnet50": (11.64, 78.3),
        "mobilenet_v3_small": (0.423, 2.23),
        "mobilenet_v3_large": (1.26, 6.78),
        "efficientnet_b0": (2.20, 12.35),
        "convnext_tiny": (13.79, 104.6),
    }
    assert gate_module.arch_cpu_ms("efficientnet_b0", 32) == 2.20
    assert gate_module.arch_cpu_ms("efficientnet_b0", 64) == 2.20  # the small stem's limit
    assert gate_module.arch_cpu_ms("efficientnet_b0", 65) == 12.35
    assert gate_module.arch_cpu_ms("efficientnet_b0", None) == 12.35
    assert gate_module.arch_cpu_ms("vit_b_16", 224) is None


@pytest.mark.parametrize("input_px", [32, 224])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURE_NAMES))
def test_a_latency_miss_is_never_advised_a_slower_architecture(arch: str, input_px: int) -> None:
    for p95 in (55.0, 80.0, 400.0):
        missed = SLOW.model_copy(update={"p95_ms": p95})
        advice = {s.action: s for s in advise(missed, SLO_50, ctx(arch=arch, input_px=input_px))}
        if "smaller_model" not in advice:
            own = gate_module.arch_cpu_ms(arch, input_px) or 0.0
            assert all(
                (gate_module.arch_cpu_ms(a, input_px) or 0.0) > gate_module.MAX_COST_RATIO * own
                for a in ARCHITECTURE_NAMES
            )  # nothing is materially cheaper
            continue
        named = advice["smaller_model"].title.split()[2]
        cost, own = (
            gate_module.arch_cpu_ms(named, input_px),
            gate_module.arch_cpu_ms(arch, input_px),
        )
        assert cost is not None and own is not None
        assert cost <= gate_module.MAX_COST_RATIO * own  # at least 20% cheaper, measured
        assert advice["smaller_model"].estimated_p95_ms < p95


def test_an_architecture_exactly_20_percent_cheaper_is_advised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(gate_module.ARCH_CPU_MS, "resnet18", (5.0, 35.0))
    monkeypatch.setitem(gate_module.ARCH_CPU_MS, "resnet10", (4.0, 17.6))  # 0.8 x 5.0 at 32 px
    for arch in ("mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0"):
        monkeypatch.setitem(gate_module.ARCH_CPU_MS, arch, (4.5, 30.0))  # not cheap enough
    smaller = {s.action: s for s in advise(SLOW, SLO_50, ctx(input_px=32))}["smaller_model"]
    assert smaller.title == "retrain as resnet10 instead of resnet18"


def test_the_digits_model_missing_on_a_small_input_is_not_advised_efficientnet() -> None:
    # resnet10 at 32 px, p95 63.66 ms against 50 ms: efficientnet_b0 has half its
    # multiply-adds but costs about as much per image on CPU; the mobilenets are cheaper.
    missed = SLOW.model_copy(update={"p95_ms": 63.66})
    smaller = {s.action: s for s in advise(missed, SLO_50, ctx(arch="resnet10", input_px=32))}[
        "smaller_model"
    ]
    # mobilenet_v3_large (10 + 53.66 x 1.26/2.29 = 39.5 ms) meets, and keeps more accuracy.
    assert smaller.title == "retrain as mobilenet_v3_large instead of resnet10"
    assert smaller.meets_slo and smaller.estimated_p95_ms == pytest.approx(39.525, abs=1e-3)
    assert "(1.26 ms vs 2.29 ms at 32 px, small-input stem, bench/arch_cpu.py)" in str(
        smaller.assumption
    )


# -- the estimates and figures in each suggestion ------------------------------------------------


def slow_advice(**fields: Any) -> dict[str, Suggestion]:
    return {s.action: s for s in advise(SLOW, SLO_50, ctx(**fields))}


def test_each_suggestion_carries_the_figures_a_user_reads() -> None:
    by_action = slow_advice(measured_vcpus=2)
    int8 = by_action["int8"]
    # 10 ms fixed + 70 ms compute at half the time; throughput grows as latency shrinks.
    assert int8.estimated_p95_ms == 45.0
    assert int8.estimated_throughput_rps == 177.78  # 100 req/s x 80/45, to the cent
    # 500 req/s at 70% of 177.78 each: 5 x c7i.large, $0.44625/h for 1.8M predictions.
    assert int8.cost_per_million_usd == 0.2479
    assert int8.price_note.startswith("5 x c7i.large on-demand in us-east-1")
    assert "10.00 ms fixed" in str(int8.assumption)
    assert "70.00 ms that scales with compute speed" in str(int8.assumption)
    larger = by_action["larger_instance"]
    assert larger.title == "serve on c7i.xlarge (4 vCPUs) instead of c7i.large"
    assert larger.estimated_p95_ms == 45.0  # the compute share halves on twice the vCPUs
    assert larger.estimated_throughput_rps == 200.0
    # 500 req/s at 140 each: 4 x c7i.xlarge at $0.1785/h.
    assert larger.cost_per_million_usd == 0.3967
    gpu = by_action["gpu_serving"]
    # The cheapest one-GPU type in us-east-1; HTTP + decode stay, compute becomes ~1 ms.
    assert gpu.instance_type == "g4dn.xlarge"
    assert gpu.estimated_p95_ms == 11.0
    assert gpu.estimated_throughput_rps == 200.0  # its 4 vCPUs against the 2 measured
    assert gpu.cost_per_million_usd == 1.1689  # 4 x g4dn.xlarge at $0.526/h
    smaller = by_action["smaller_model"]
    assert "(17.6 ms vs 35 ms at 224 px, bench/arch_cpu.py)" in str(smaller.assumption)
    # resnet10 at 45.2 ms: ~177.0 req/s, 5 x c7i.large.
    assert smaller.cost_per_million_usd == 0.2479


def test_the_largest_smaller_architecture_that_meets_the_slo_is_suggested() -> None:
    smaller = slow_advice()["smaller_model"]
    # resnet10 (45.2 ms) meets the SLO and keeps more accuracy than the cheaper ones.
    assert smaller.title == "retrain as resnet10 instead of resnet18"
    assert smaller.meets_slo is True


def test_a_smaller_architecture_exactly_at_the_slo_is_the_one_suggested() -> None:
    # No fixed share measured: all of p95 scales; resnet10 takes 17.6/35 of resnet18's time.
    slo = 3500.0 * (ARCH_CPU_MS["resnet10"][1] / ARCH_CPU_MS["resnet18"][1])
    candidate = bench_figures(p95_ms=3500.0)
    limits = GateThresholds(latency_slo_ms=slo, accuracy_floor=0.9, max_accuracy_drop=0.02)
    suggestions = advise(candidate, limits, ctx(int8_tried=True))
    smaller = next(s for s in suggestions if s.action == "smaller_model")
    assert smaller.title == "retrain as resnet10 instead of resnet18"
    assert smaller.estimated_p95_ms == round(slo, 3) and smaller.meets_slo is True


def test_when_no_architecture_meets_the_slo_the_smallest_is_suggested() -> None:
    hopeless = SLOW.model_copy(update={"p95_ms": 2000.0, "bare_onnxruntime_p50_ms": None})
    suggestions = advise(hopeless, SLO_50, ctx(int8_tried=True))
    smaller = next(s for s in suggestions if s.action == "smaller_model")
    assert smaller.title == "retrain as mobilenet_v3_small instead of resnet18"
    assert smaller.meets_slo is False


def test_an_unknown_architecture_gets_no_smaller_model_advice() -> None:
    assert "smaller_model" not in slow_advice(arch="vit_b_16")
    assert "smaller_model" not in slow_advice(arch=None)


def test_an_instance_upgrade_exactly_at_the_slo_is_the_one_suggested() -> None:
    # c7i.xlarge halves the 70 ms compute share: 10 + 35 = 45 ms, exactly the SLO.
    limits = GateThresholds(latency_slo_ms=45.0, accuracy_floor=0.9, max_accuracy_drop=0.02)
    suggestions = advise(SLOW, limits, ctx(arch=None, int8_tried=True))
    larger = next(s for s in suggestions if s.action == "larger_instance")
    assert larger.instance_type == "c7i.xlarge" and larger.meets_slo is True


def test_no_upgrade_is_offered_from_a_host_as_big_as_the_largest_type() -> None:
    assert "larger_instance" not in slow_advice(measured_vcpus=8)
    only_bigger = slow_advice(measured_vcpus=4)["larger_instance"]
    assert only_bigger.instance_type == "c7i.2xlarge"


def test_serving_on_an_m7i_large_counts_its_two_vcpus() -> None:
    larger = slow_advice(arch=None, instance_type="m7i.large")["larger_instance"]
    assert larger.title == "serve on c7i.xlarge (4 vCPUs) instead of m7i.large"
    assert larger.estimated_p95_ms == 45.0
    assert "2 measured → 4" in str(larger.assumption)


@pytest.mark.parametrize(
    ("sold", "suggested"),
    [
        (("g4dn.xlarge", "g5.xlarge", "g6.xlarge"), "g4dn.xlarge"),
        (("g5.xlarge", "g6.xlarge"), "g6.xlarge"),
        (("g5.xlarge",), "g5.xlarge"),
    ],
)
def test_gpu_serving_suggests_the_cheapest_gpu_type_the_run_has_a_price_for(
    sold: tuple[str, ...], suggested: str
) -> None:
    prices = {t: usd for t, usd in PRICES.items() if t in sold or t.startswith("c7i")}
    suggestions = advise(
        SLOW, SLO_50, ctx(arch=None, int8_tried=True, region="xx-test-1", prices=prices)
    )
    gpu = next(s for s in suggestions if s.action == "gpu_serving")
    assert gpu.instance_type == suggested
    # Each of these one-GPU types has 4 vCPUs: throughput as on 4 of the 2 measured.
    assert gpu.estimated_throughput_rps == 200.0
    assert "stay on its 4 vCPUs" in str(gpu.assumption)
    # 500 req/s at 140 each: 4 of them.
    assert gpu.cost_per_million_usd == fleet_per_million(prices[suggested], 200.0, 500.0)
    assert gpu.price_note.startswith(f"4 x {suggested} on-demand in xx-test-1")


def test_gpu_prices_alone_decide_the_gpu_advised() -> None:
    # A run whose quotes make g5 the cheapest is advised g5, whatever the bundled table says.
    cheap_g5 = {**PRICES, "g5.xlarge": 0.1}
    gpu = slow_advice(prices=cheap_g5)["gpu_serving"]
    assert gpu.instance_type == "g5.xlarge"
    assert gpu.cost_per_million_usd == fleet_per_million(0.1, 200.0, 500.0)


def test_an_unknown_serving_type_is_assumed_to_have_two_vcpus() -> None:
    larger = slow_advice(arch=None, instance_type="x9.unknown")["larger_instance"]
    # 2 → 4 vCPUs: 10 ms fixed + 70 ms x 2/4.
    assert larger.estimated_p95_ms == 45.0
    assert "2 measured → 4" in str(larger.assumption)


def test_estimates_and_gap_are_rounded_to_the_microsecond() -> None:
    odd = bench_figures(p95_ms=80.0012, throughput_rps=100.0)
    suggestions = advise(odd, SLO_50, ctx(arch=None))
    int8 = next(s for s in suggestions if s.action == "int8")
    assert int8.estimated_p95_ms == 40.001
    assert int8.gap_ms == 30.001


def test_a_p95_that_int8_brings_exactly_to_the_slo_meets_it() -> None:
    exact = bench_figures(p95_ms=100.0)
    suggestions = advise(exact, SLO_50, ctx(arch=None))
    int8 = next(s for s in suggestions if s.action == "int8")
    assert int8.estimated_p95_ms == 50.0 and int8.meets_slo is True


def test_without_a_bare_onnxruntime_figure_all_of_p95_is_assumed_to_scale() -> None:
    for p50 in (10.0, 40.0, 70.0):
        candidate = bench_figures(p95_ms=80.0, p50_ms=p50)
        by_action = {s.action: s for s in advise(candidate, SLO_50, ctx(arch=None))}
        assert by_action["int8"].estimated_p95_ms == 40.0
        assert by_action["gpu_serving"].estimated_p95_ms == 1.0  # no fixed share left
        assert "all of p95 is assumed to scale" in by_action["int8"].assumption


def test_a_bare_onnxruntime_median_above_the_served_one_leaves_no_fixed_share() -> None:
    odd = SLOW.model_copy(update={"p50_ms": 30.0, "bare_onnxruntime_p50_ms": 40.0})
    by_action = {s.action: s for s in advise(odd, SLO_50, ctx(arch=None))}
    assert by_action["int8"].estimated_p95_ms == 40.0
    assert by_action["gpu_serving"].estimated_p95_ms == 1.0


def test_a_trickle_of_throughput_is_still_priced() -> None:
    trickle = SLOW.model_copy(update={"throughput_rps": 0.5})
    suggestions = advise(trickle, SLO_50, ctx(arch=None, target_rps=1.0))
    int8 = next(s for s in suggestions if s.action == "int8")
    assert int8.estimated_throughput_rps == pytest.approx(0.89, abs=0.01)
    # 1 req/s at 70% of 0.889 each: 2 replicas, $0.1785/h for 3,600 predictions an hour.
    assert int8.cost_per_million_usd == 49.5833


def test_no_measured_throughput_leaves_the_advice_unpriced_saying_so() -> None:
    unmeasured = SLOW.model_copy(update={"throughput_rps": 0.0})
    suggestions = advise(unmeasured, SLO_50, ctx())
    assert len(suggestions) == 4
    assert all(s.cost_per_million_usd is None for s in suggestions)
    assert all(s.price_note == "no measured throughput to price from" for s in suggestions)


# -- the order of advice -------------------------------------------------------------------------


def test_advice_that_meets_the_slo_comes_before_cheaper_advice_that_does_not() -> None:
    hopeless = SLOW.model_copy(update={"p95_ms": 900.0})
    suggestions = advise(hopeless, SLO_50, ctx(arch=None))
    assert [s.action for s in suggestions] == ["gpu_serving", "int8", "larger_instance"]
    assert [s.meets_slo for s in suggestions] == [True, False, False]
    # The CPU options cost less per 1M yet cannot close the gap.
    assert suggestions[1].cost_per_million_usd < suggestions[0].cost_per_million_usd


def test_advice_is_cheapest_first_and_unpriced_advice_comes_last() -> None:
    by_cost = advise(SLOW, SLO_50, ctx())
    assert [s.action for s in by_cost] == [
        "smaller_model",  # the same 5 x c7i.large as INT8, measured: first
        "int8",
        "larger_instance",
        "gpu_serving",
    ]
    # Only the architecture's estimate rests on its own measured CPU cost.
    assert [s.measured for s in by_cost] == [True, False, False, False]
    # A dear c7i.xlarge: serving on it now costs more than on a GPU, and comes after it.
    dear = advise(SLOW, SLO_50, ctx(prices={**PRICES, "c7i.xlarge": 5.0}))
    assert [s.action for s in dear][2:] == ["gpu_serving", "larger_instance"]
    # Serving on a type the price table lacks: the advice that stays on it has no price.
    mixed = advise(SLOW, SLO_50, ctx(instance_type="x9.big"))
    assert [s.cost_per_million_usd is None for s in mixed] == [False, False, True, True]
    assert all(s.meets_slo for s in mixed)


def test_a_candidate_whose_accuracy_was_not_measured_fails_the_floor_saying_why() -> None:
    unmeasured = bench_figures(accuracy=None, accuracy_note="the classes differ from the data")
    verdict = judge(unmeasured, None, LIMITS)
    assert not verdict.promote
    assert verdict.reasons == ["accuracy was not measured (the classes differ from the data)"]
    floor = next(c for c in verdict.checks if c.name == "accuracy_floor")
    assert (floor.passed, floor.observed) == (False, 0.0)  # nothing measured counts as 0


def test_an_unpriced_fix_is_named_in_the_summary_without_a_price() -> None:
    verdict = judge(SLOW, None, SLO_50, ctx(region="eu-west-9", prices={}))
    fix = verdict.suggestions[0]
    assert fix.meets_slo and fix.cost_per_million_usd is None
    assert verdict.summary.endswith(
        f"; cheapest fix: {fix.title} (est. p95 {fix.estimated_p95_ms:.1f} ms)"
    )


def sizes(rps: float) -> list[SizePoint]:
    """Return a sizing's points: ``rps`` per vCPU at 1 and 2 vCPUs."""
    return [SizePoint(vcpus=v, measured=True, sustainable_rps=rps * v) for v in (1, 2)]


def quotes(prices: dict[str, float], region: str = "us-east-1") -> list[PriceQuote]:
    """Return the run's resolved on-demand quotes at these prices."""
    return [
        PriceQuote(
            instance_type=t,
            region=region,
            market="on-demand",
            usd_per_hour=usd,
            source="a test",
            as_of="2026-01-01",
            fetched_at="2026-01-01T00:00:00+00:00",
        )
        for t, usd in prices.items()
    ]


def sizing(rps: float, prices: dict[str, float], region: str = "us-east-1") -> SizingReport:
    return recommend(
        sizes(rps),
        latency_slo_ms=20.0,
        target_rps=50.0,
        prices=quotes(prices, region),
        region=region,
        unpriced=None if prices else f"no on-demand price for c7i.large in {region}: set one",
    )


def test_a_candidate_no_cpu_size_can_serve_within_the_slo_is_refused_with_the_reason() -> None:
    served = sizing(100.0, PRICES)
    verdict = judge(cand(), None, LIMITS, sizing=served)
    assert verdict.promote
    (fleet,) = [c for c in verdict.checks if c.name == "serving_fleet"]
    assert fleet.passed and fleet.observed == 200.0
    unservable = sizing(0.0, PRICES)
    verdict = judge(cand(), None, LIMITS, sizing=unservable)
    assert not verdict.promote
    (fleet,) = [c for c in verdict.checks if c.name == "serving_fleet"]
    assert not fleet.passed and fleet.reason == unservable.reason
    assert "no CPU size meets p95 <= 20 ms" in (fleet.reason or "")
    # A sizing that measured no size at all: its best rate is none.
    nothing = unservable.model_copy(update={"sizes": []})
    (fleet,) = [
        c for c in judge(cand(), None, LIMITS, sizing=nothing).checks if c.name == "serving_fleet"
    ]
    assert (fleet.passed, fleet.observed, fleet.limit) == (False, 0.0, 1.0)
    # Without a sizing (outside the pipeline), there is no such check.
    assert "serving_fleet" not in {c.name for c in judge(cand(), None, LIMITS).checks}


def test_an_unpriced_fleet_is_still_a_fleet_the_gate_passes() -> None:
    unpriced = sizing(100.0, {}, region="eu-west-9")
    assert unpriced.chosen is not None and unpriced.chosen.usd_per_hour is None
    verdict = judge(cand(), None, LIMITS, ctx(region="eu-west-9", prices={}), sizing=unpriced)
    assert verdict.promote and verdict.summary == "promote"
    (fleet,) = [c for c in verdict.checks if c.name == "serving_fleet"]
    assert (fleet.passed, fleet.observed, fleet.limit, fleet.reason) == (True, 200.0, 1.0, None)


@pytest.mark.parametrize("p95_ms", [5.0, 80.0])
def test_the_verdict_is_the_same_whatever_the_region_and_prices(p95_ms: float) -> None:
    candidate = SLOW.model_copy(update={"p95_ms": p95_ms, "accuracy": 0.97})
    production = prod(accuracy=0.96, version=3)
    twice = {t: 2 * usd for t, usd in PRICES.items()}
    verdicts = [
        judge(candidate, production, SLO_50, ctx(), sizing=sizing(100.0, PRICES)),
        judge(candidate, production, SLO_50, ctx(prices=twice), sizing=sizing(100.0, twice)),
        judge(
            candidate,
            production,
            SLO_50,
            ctx(region="eu-west-9", prices={}),
            sizing=sizing(100.0, {}, region="eu-west-9"),
        ),
    ]
    first = verdicts[0]
    assert first.promote is (p95_ms == 5.0)
    for verdict in verdicts[1:]:
        assert (verdict.promote, verdict.reasons, verdict.checks, verdict.failed_figures) == (
            first.promote,
            first.reasons,
            first.checks,
            first.failed_figures,
        )
    # Only the advice's prices differ: the same ways to close the gap, the same estimates.
    priced, dearer, unpriced = ([s.action for s in v.suggestions] for v in verdicts)
    assert priced == dearer and set(unpriced) == set(priced)
    if p95_ms == 80.0:
        cost = {s.action: s.cost_per_million_usd for s in verdicts[0].suggestions}
        cost_twice = {s.action: s.cost_per_million_usd for s in verdicts[1].suggestions}
        assert cost_twice == {a: pytest.approx(2 * c, abs=2e-4) for a, c in cost.items()}
        assert all(s.cost_per_million_usd is None for s in verdicts[2].suggestions)


def test_a_replica_is_priced_at_what_the_sizing_found_it_sustains() -> None:
    # The sizing found 50 req/s at the measured vCPUs: that, not the benchmark's rate, is a
    # replica's capacity; INT8 at 45 of 80 ms gives 88.89.
    int8 = next(s for s in advise(SLOW, SLO_50, ctx(capacity_rps=50.0)) if s.action == "int8")
    assert int8.estimated_throughput_rps == 88.89
    # An open-loop benchmark's throughput is the rate it sent at, never a capacity.
    open_loop = SLOW.model_copy(update={"offered_rps": 100.0})
    suggestions = advise(open_loop, SLO_50, ctx())
    assert all(s.price_note == "no measured throughput to price from" for s in suggestions)
    int8 = next(s for s in advise(open_loop, SLO_50, ctx(capacity_rps=50.0)) if s.action == "int8")
    assert int8.estimated_throughput_rps == 88.89 and int8.cost_per_million_usd is not None
