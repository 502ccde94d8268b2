"""The promotion gate: latency SLO, zero errors, accuracy floor, no regression."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from burstcv_testkit import bench_figures

from burstcv.cost.pricing import PRICE_TABLE_ENV, load_price_table, serving_cost_per_million
from burstcv.gate import gate as gate_module
from burstcv.gate.gate import (
    ARCH_MMACS,
    GateThresholds,
    ServingContext,
    advise,
    check_lines,
    describe_check,
    format_figure,
    judge,
)
from burstcv.training.names import ARCHITECTURE_NAMES
from burstcv_spec.contracts import BenchFigures, GateCheck, GateVerdict, Suggestion

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


def test_a_missed_slo_comes_with_priced_ways_to_close_the_gap() -> None:
    verdict = judge(
        SLOW, None, SLO_50, ServingContext(arch="resnet18", measured_vcpus=2, region="us-east-1")
    )
    assert not verdict.promote
    by_action = {s.action: s for s in verdict.suggestions}
    assert set(by_action) == {"int8", "smaller_model", "larger_instance", "gpu_serving"}
    for s in verdict.suggestions:
        assert s.gap_ms == 30.0 and s.assumption and s.region == "us-east-1"
        expected = serving_cost_per_million(
            s.instance_type, "us-east-1", s.estimated_throughput_rps
        )
        assert s.cost_per_million_usd == pytest.approx(expected, rel=1e-3)
    smaller = by_action["smaller_model"]
    named = smaller.title.split()[2]
    assert named in ARCHITECTURE_NAMES and ARCH_MMACS[named] < ARCH_MMACS["resnet18"]
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
    suggestions = advise(
        SLOW, SLO_50, arch="mobilenet_v3_small", int8_tried=True, region="us-east-1"
    )
    assert {s.action for s in suggestions} == {"larger_instance", "gpu_serving"}


def test_a_gap_no_cpu_can_close_is_reported_as_not_meeting_the_slo() -> None:
    hopeless = SLOW.model_copy(update={"p95_ms": 900.0})
    suggestions = advise(hopeless, SLO_50, arch="resnet10", int8_tried=False, region="us-east-1")
    cpu = [s for s in suggestions if s.action != "gpu_serving"]
    assert cpu and not any(s.meets_slo for s in cpu)
    larger = next(s for s in suggestions if s.action == "larger_instance")
    assert larger.instance_type == "c7i.2xlarge"  # the biggest offered, still short


def test_a_region_without_prices_still_advises_and_says_why_it_is_unpriced() -> None:
    suggestions = advise(SLOW, SLO_50, arch="resnet18", int8_tried=False, region="eu-west-9")
    assert suggestions and all(s.cost_per_million_usd is None for s in suggestions)
    assert all("eu-west-9" in s.price_note for s in suggestions)


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
        "g4dn.xlarge": 4,
        "g5.xlarge": 4,
        "g6.xlarge": 4,
    }


def test_multiply_adds_per_architecture_are_the_measured_figures() -> None:
    # Measured with torch's FlopCounterMode at 32x32; smaller-model advice scales by them.
    assert gate_module.ARCH_MMACS == {
        "resnet10": 63.4,
        "resnet18": 138.9,
        "resnet34": 289.9,
        "resnet50": 324.5,
        "mobilenet_v3_small": 5.5,
        "mobilenet_v3_large": 20.1,
        "efficientnet_b0": 32.0,
        "convnext_tiny": 363.7,
    }


# -- the estimates and figures in each suggestion ------------------------------------------------


def slow_advice(**kwargs: object) -> dict[str, Suggestion]:
    context: dict[str, object] = {"arch": "resnet18", "int8_tried": False, "region": "us-east-1"}
    context.update(kwargs)
    suggestions = advise(SLOW, SLO_50, **context)  # type: ignore[arg-type]
    return {s.action: s for s in suggestions}


def test_each_suggestion_carries_the_figures_a_user_reads() -> None:
    by_action = slow_advice(measured_vcpus=2)
    int8 = by_action["int8"]
    # 10 ms fixed + 70 ms compute at half the time; throughput grows as latency shrinks.
    assert int8.estimated_p95_ms == 45.0
    assert int8.estimated_throughput_rps == 177.78  # 100 req/s x 80/45, to the cent
    assert int8.cost_per_million_usd == 0.1395
    assert "10.00 ms fixed" in str(int8.assumption)
    assert "70.00 ms that scales with compute speed" in str(int8.assumption)
    larger = by_action["larger_instance"]
    assert larger.title == "serve on c7i.xlarge (4 vCPUs) instead of c7i.large"
    assert larger.estimated_p95_ms == 45.0  # the compute share halves on twice the vCPUs
    assert larger.estimated_throughput_rps == 200.0
    assert larger.cost_per_million_usd == 0.2479
    gpu = by_action["gpu_serving"]
    # The cheapest one-GPU type in us-east-1; HTTP + decode stay, compute becomes ~1 ms.
    assert gpu.instance_type == "g4dn.xlarge"
    assert gpu.estimated_p95_ms == 11.0
    assert gpu.estimated_throughput_rps == 200.0  # its 4 vCPUs against the 2 measured
    assert gpu.cost_per_million_usd == 0.7306
    smaller = by_action["smaller_model"]
    assert "63.4M vs 138.9M per image" in str(smaller.assumption)


def test_the_largest_smaller_architecture_that_meets_the_slo_is_suggested() -> None:
    smaller = slow_advice()["smaller_model"]
    # resnet10 (~42 ms) meets the SLO and keeps more accuracy than the mobilenets.
    assert smaller.title == "retrain as resnet10 instead of resnet18"
    assert smaller.meets_slo is True


def test_a_smaller_architecture_exactly_at_the_slo_is_the_one_suggested() -> None:
    # No fixed share measured: all of p95 scales; resnet10 is 63.4/138.9 of resnet18.
    candidate = bench_figures(p95_ms=1389.0)
    limits = GateThresholds(latency_slo_ms=634.0, accuracy_floor=0.9, max_accuracy_drop=0.02)
    suggestions = advise(candidate, limits, arch="resnet18", int8_tried=True, region="us-east-1")
    smaller = next(s for s in suggestions if s.action == "smaller_model")
    assert smaller.title == "retrain as resnet10 instead of resnet18"
    assert smaller.estimated_p95_ms == 634.0 and smaller.meets_slo is True


def test_when_no_architecture_meets_the_slo_the_smallest_is_suggested() -> None:
    hopeless = SLOW.model_copy(update={"p95_ms": 2000.0, "bare_onnxruntime_p50_ms": None})
    suggestions = advise(hopeless, SLO_50, arch="resnet18", int8_tried=True, region="us-east-1")
    smaller = next(s for s in suggestions if s.action == "smaller_model")
    assert smaller.title == "retrain as mobilenet_v3_small instead of resnet18"
    assert smaller.meets_slo is False


def test_an_unknown_architecture_gets_no_smaller_model_advice() -> None:
    assert "smaller_model" not in slow_advice(arch="vit_b_16")
    assert "smaller_model" not in slow_advice(arch=None)


def test_an_instance_upgrade_exactly_at_the_slo_is_the_one_suggested() -> None:
    # c7i.xlarge halves the 70 ms compute share: 10 + 35 = 45 ms, exactly the SLO.
    limits = GateThresholds(latency_slo_ms=45.0, accuracy_floor=0.9, max_accuracy_drop=0.02)
    suggestions = advise(SLOW, limits, arch=None, int8_tried=True, region="us-east-1")
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
def test_gpu_serving_suggests_the_cheapest_gpu_type_sold_in_the_region(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sold: tuple[str, ...], suggested: str
) -> None:
    table = copy.deepcopy(load_price_table())
    prices = table["regions"]["us-east-1"]
    table["regions"] = {
        "xx-test-1": {t: p for t, p in prices.items() if t in sold or t.startswith("c7i")}
    }
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv(PRICE_TABLE_ENV, str(path))
    suggestions = advise(SLOW, SLO_50, arch=None, int8_tried=True, region="xx-test-1")
    gpu = next(s for s in suggestions if s.action == "gpu_serving")
    assert gpu.instance_type == suggested
    # Each of these one-GPU types has 4 vCPUs: throughput as on 4 of the 2 measured.
    assert gpu.estimated_throughput_rps == 200.0
    assert "stay on its 4 vCPUs" in str(gpu.assumption)
    assert gpu.cost_per_million_usd is not None


def test_an_unknown_serving_type_is_assumed_to_have_two_vcpus() -> None:
    larger = slow_advice(arch=None, instance_type="x9.unknown")["larger_instance"]
    # 2 → 4 vCPUs: 10 ms fixed + 70 ms x 2/4.
    assert larger.estimated_p95_ms == 45.0
    assert "2 measured → 4" in str(larger.assumption)


def test_estimates_and_gap_are_rounded_to_the_microsecond() -> None:
    odd = bench_figures(p95_ms=80.0012, throughput_rps=100.0)
    suggestions = advise(odd, SLO_50, arch=None, int8_tried=False, region="us-east-1")
    int8 = next(s for s in suggestions if s.action == "int8")
    assert int8.estimated_p95_ms == 40.001
    assert int8.gap_ms == 30.001


def test_a_p95_that_int8_brings_exactly_to_the_slo_meets_it() -> None:
    exact = bench_figures(p95_ms=100.0)
    suggestions = advise(exact, SLO_50, arch=None, int8_tried=False, region="us-east-1")
    int8 = next(s for s in suggestions if s.action == "int8")
    assert int8.estimated_p95_ms == 50.0 and int8.meets_slo is True


def test_without_a_bare_onnxruntime_figure_all_of_p95_is_assumed_to_scale() -> None:
    for p50 in (10.0, 40.0, 70.0):
        candidate = bench_figures(p95_ms=80.0, p50_ms=p50)
        by_action = {
            s.action: s
            for s in advise(candidate, SLO_50, arch=None, int8_tried=False, region="us-east-1")
        }
        assert by_action["int8"].estimated_p95_ms == 40.0
        assert by_action["gpu_serving"].estimated_p95_ms == 1.0  # no fixed share left
        assert "all of p95 is assumed to scale" in by_action["int8"].assumption


def test_a_bare_onnxruntime_median_above_the_served_one_leaves_no_fixed_share() -> None:
    odd = SLOW.model_copy(update={"p50_ms": 30.0, "bare_onnxruntime_p50_ms": 40.0})
    by_action = {
        s.action: s for s in advise(odd, SLO_50, arch=None, int8_tried=False, region="us-east-1")
    }
    assert by_action["int8"].estimated_p95_ms == 40.0
    assert by_action["gpu_serving"].estimated_p95_ms == 1.0


def test_a_trickle_of_throughput_is_still_priced() -> None:
    trickle = SLOW.model_copy(update={"throughput_rps": 0.5})
    suggestions = advise(trickle, SLO_50, arch=None, int8_tried=False, region="us-east-1")
    int8 = next(s for s in suggestions if s.action == "int8")
    assert int8.estimated_throughput_rps == pytest.approx(0.89, abs=0.01)
    assert int8.cost_per_million_usd is not None and int8.cost_per_million_usd > 0


def test_no_measured_throughput_leaves_the_advice_unpriced_saying_so() -> None:
    unmeasured = SLOW.model_copy(update={"throughput_rps": 0.0})
    suggestions = advise(unmeasured, SLO_50, arch="resnet18", int8_tried=False, region="us-east-1")
    assert len(suggestions) == 4
    assert all(s.cost_per_million_usd is None for s in suggestions)
    assert all(s.price_note == "no measured throughput to price from" for s in suggestions)


# -- the order of advice -------------------------------------------------------------------------


def test_advice_that_meets_the_slo_comes_before_cheaper_advice_that_does_not() -> None:
    hopeless = SLOW.model_copy(update={"p95_ms": 900.0})
    suggestions = advise(hopeless, SLO_50, arch=None, int8_tried=False, region="us-east-1")
    assert [s.action for s in suggestions] == ["gpu_serving", "int8", "larger_instance"]
    assert [s.meets_slo for s in suggestions] == [True, False, False]
    # The CPU options cost less per 1M yet cannot close the gap.
    assert suggestions[1].cost_per_million_usd < suggestions[0].cost_per_million_usd


def test_advice_is_cheapest_first_and_unpriced_advice_comes_last() -> None:
    by_cost = advise(SLOW, SLO_50, arch="resnet18", int8_tried=False, region="us-east-1")
    assert [s.action for s in by_cost] == [
        "smaller_model",
        "int8",
        "larger_instance",
        "gpu_serving",
    ]
    # Serving on a type the price table lacks: the advice that stays on it has no price.
    mixed = advise(
        SLOW, SLO_50, arch="resnet18", int8_tried=False, region="us-east-1", instance_type="x9.big"
    )
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
    verdict = judge(SLOW, None, SLO_50, ServingContext(arch="resnet18", region="eu-west-9"))
    fix = verdict.suggestions[0]
    assert fix.meets_slo and fix.cost_per_million_usd is None
    assert verdict.summary.endswith(
        f"; cheapest fix: {fix.title} (est. p95 {fix.estimated_p95_ms:.1f} ms)"
    )


def test_a_candidate_no_cpu_size_can_serve_within_the_slo_is_refused_with_the_reason() -> None:
    from burstcv.gate.sizing import recommend
    from burstcv_spec.contracts import SizePoint

    def sizes(rps: float) -> list[SizePoint]:
        return [SizePoint(vcpus=v, measured=True, sustainable_rps=rps * v) for v in (1, 2)]

    served = recommend(sizes(100.0), slo_ms=20.0, target_rps=50.0, region="us-east-1")
    verdict = judge(cand(), None, LIMITS, sizing=served)
    assert verdict.promote
    (fleet,) = [c for c in verdict.checks if c.name == "serving_fleet"]
    assert fleet.passed and fleet.observed == 200.0
    unservable = recommend(sizes(0.0), slo_ms=20.0, target_rps=50.0, region="us-east-1")
    verdict = judge(cand(), None, LIMITS, sizing=unservable)
    assert not verdict.promote
    (fleet,) = [c for c in verdict.checks if c.name == "serving_fleet"]
    assert not fleet.passed and fleet.reason == unservable.reason
    assert "no CPU size meets p95 <= 20 ms" in (fleet.reason or "")
    # Without a sizing (outside the pipeline), there is no such check.
    assert "serving_fleet" not in {c.name for c in judge(cand(), None, LIMITS).checks}
