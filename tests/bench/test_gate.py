"""The promotion gate: latency SLO, zero errors, accuracy floor, no regression."""

from __future__ import annotations

from burstcv.bench.gate import GateThresholds, judge

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


def test_no_production_model_skips_the_regression_check() -> None:
    verdict = judge(cand(), None, LIMITS)
    assert verdict.promote and "no_regression" not in {c["name"] for c in verdict.checks}
