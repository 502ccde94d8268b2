"""The promotion gate: latency SLO, zero errors, accuracy floor, no regression."""

from __future__ import annotations

import pytest

from burstcv.cost.pricing import serving_cost_per_million
from burstcv.gate.gate import ARCH_MMACS, GateThresholds, ServingContext, advise, judge
from burstcv.training.names import ARCHITECTURE_NAMES

LIMITS = GateThresholds(latency_slo_ms=20.0, accuracy_floor=0.9, max_accuracy_drop=0.02)


def cand(p95: float = 5.0, errors: float = 0.0, acc: float = 0.97) -> dict[str, float]:
    return {"p95_ms": p95, "error_rate": errors, "accuracy": acc}


def test_a_fast_accurate_candidate_is_promoted() -> None:
    verdict = judge(cand(), {"accuracy": 0.96, "version": 3}, LIMITS)
    assert verdict.promote and verdict.summary == "promote"
    assert {c["name"] for c in verdict.checks} == {
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
    verdict = judge(cand(acc=0.93), {"accuracy": 0.97, "version": 4}, LIMITS)
    assert not verdict.promote and "below production v4" in verdict.summary


def test_every_check_is_logged_as_observed_vs_limit_with_the_verdict() -> None:
    verdict = judge(cand(p95=30.0, acc=0.689), {"accuracy": 0.97, "version": 4}, LIMITS)
    assert verdict.check_lines()[:4] == [
        "gate check latency_p95: p95 30.00 ms > SLO 20 ms: FAILED",
        "gate check error_rate: error rate 0.0% <= allowed 0%: passed",
        "gate check accuracy_floor: accuracy 0.6890 < floor 0.9: FAILED",
        "gate check no_regression: accuracy 0.6890 < production minus allowed drop 0.9500: FAILED",
    ]
    assert verdict.check_lines()[-1] == f"gate verdict: {verdict.summary}"
    assert verdict.to_dict()["failed_figures"] == [
        "p95 30.00 ms > SLO 20 ms",
        "accuracy 0.6890 < floor 0.9",
        "accuracy 0.6890 < production minus allowed drop 0.9500",
    ]
    passed = judge(cand(), None, LIMITS)
    assert passed.check_lines()[0] == "gate check latency_p95: p95 5.00 ms <= SLO 20 ms: passed"
    assert passed.failed_figures == []


def test_no_production_model_skips_the_regression_check() -> None:
    verdict = judge(cand(), None, LIMITS)
    assert verdict.promote and "no_regression" not in {c["name"] for c in verdict.checks}


# -- advice when the SLO is missed ---------------------------------------------------------------

SLOW = {
    "p95_ms": 80.0,
    "p50_ms": 40.0,
    "bare_onnxruntime_p50_ms": 30.0,  # 10 ms of the median is HTTP + decode
    "error_rate": 0.0,
    "accuracy": 0.97,
    "throughput_rps": 100.0,
}
SLO_50 = GateThresholds(latency_slo_ms=50.0, accuracy_floor=0.9, max_accuracy_drop=0.02)


def test_a_missed_slo_comes_with_priced_ways_to_close_the_gap() -> None:
    verdict = judge(
        SLOW, None, SLO_50, ServingContext(arch="resnet18", measured_vcpus=2, region="us-east-1")
    )
    assert not verdict.promote
    by_action = {s["action"]: s for s in verdict.suggestions}
    assert set(by_action) == {"int8", "smaller_model", "larger_instance", "gpu_serving"}
    for s in verdict.suggestions:
        assert s["gap_ms"] == 30.0 and s["assumption"] and s["region"] == "us-east-1"
        expected = serving_cost_per_million(
            s["instance_type"], "us-east-1", s["estimated_throughput_rps"]
        )
        assert s["cost_per_million_usd"] == pytest.approx(expected, rel=1e-3)
    smaller = by_action["smaller_model"]
    named = smaller["title"].split()[2]
    assert named in ARCHITECTURE_NAMES and ARCH_MMACS[named] < ARCH_MMACS["resnet18"]
    assert smaller["meets_slo"] and smaller["estimated_p95_ms"] < 50.0
    assert by_action["larger_instance"]["instance_type"] == "c7i.xlarge"
    assert by_action["gpu_serving"]["instance_type"].startswith("g")
    # The fixed 10 ms (HTTP + decode) stays; the 70 ms compute share halves under INT8.
    assert by_action["int8"]["estimated_p95_ms"] == pytest.approx(45.0)
    # Gap-closers come first, cheapest first; the summary stays one line and names the best.
    costs = [s["cost_per_million_usd"] for s in verdict.suggestions if s["meets_slo"]]
    assert costs == sorted(costs)
    assert "\n" not in verdict.summary
    assert verdict.summary.startswith("not promoted: p95 80.00 ms exceeds the SLO 50 ms by 30.00")
    assert f"cheapest fix: {verdict.suggestions[0]['title']}" in verdict.summary
    assert verdict.to_dict()["suggestions"] == verdict.suggestions


def test_advice_skips_what_was_tried_or_cannot_shrink() -> None:
    suggestions = advise(
        SLOW, SLO_50, arch="mobilenet_v3_small", int8_tried=True, region="us-east-1"
    )
    assert {s["action"] for s in suggestions} == {"larger_instance", "gpu_serving"}


def test_a_gap_no_cpu_can_close_is_reported_as_not_meeting_the_slo() -> None:
    hopeless = {**SLOW, "p95_ms": 900.0}
    suggestions = advise(hopeless, SLO_50, arch="resnet10", int8_tried=False, region="us-east-1")
    cpu = [s for s in suggestions if s["action"] != "gpu_serving"]
    assert cpu and not any(s["meets_slo"] for s in cpu)
    larger = next(s for s in suggestions if s["action"] == "larger_instance")
    assert larger["instance_type"] == "c7i.2xlarge"  # the biggest offered, still short


def test_a_region_without_prices_still_advises_and_says_why_it_is_unpriced() -> None:
    suggestions = advise(SLOW, SLO_50, arch="resnet18", int8_tried=False, region="eu-west-9")
    assert suggestions and all(s["cost_per_million_usd"] is None for s in suggestions)
    assert all("eu-west-9" in s["price_note"] for s in suggestions)


def test_a_candidate_within_the_slo_gets_no_suggestions() -> None:
    verdict = judge(cand(), None, LIMITS, ServingContext(arch="resnet34"))
    assert verdict.promote and verdict.suggestions == []
    assert verdict.to_dict()["suggestions"] == []


def test_latency_regression_against_production_refuses_when_asked() -> None:
    limits = GateThresholds(20.0, 0.9, 0.02, max_latency_increase=0.2)
    slower = judge(cand(p95=9.0), {"accuracy": 0.97, "p95_ms": 5.0, "version": 7}, limits)
    assert not slower.promote and "1.8x production v7" in slower.summary
    faster = judge(cand(p95=4.0), {"accuracy": 0.97, "p95_ms": 5.0, "version": 7}, limits)
    assert faster.promote and "no_latency_regression" in {c["name"] for c in faster.checks}
