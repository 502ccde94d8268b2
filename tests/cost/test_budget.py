"""What a run's budget still allows: another attempt of its boxes, and a deadline past their boot.

Every expectation is worked out by hand with rates chosen so that the dollars come out round.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from burstcv.cost.boot import BOOT_FLOOR_S, UNKNOWN_FAMILY_BOOT_S, boot_estimate, record_boots
from burstcv.cost.budget import relaunch_refusal
from burstcv.cost.model import attempt_minimum_usd
from burstcv_spec.contracts import BoxRate, RunCosts

# $3.60/h for the instance; 73 GB at $0.10 per GB-month ($0.01/h) and a public IPv4 ($0.005/h).
RATE = BoxRate(
    instance_type="g6.12xlarge",
    market="on-demand",
    usd_per_hour=3.6,
    price_source="a test",
    volume_gb=73,
    ebs_usd_per_gb_month=0.1,
    public_ipv4_usd_per_hour=0.005,
)
# Two boxes, each its 60 s minimum and the watchdog's 360 s: 2 x $3.615/h x 420 s = $0.8435.
ANOTHER_ATTEMPT_USD = 0.8435


def costs(max_cost_usd: float) -> RunCosts:
    return RunCosts(
        region="us-east-1",
        boxes=2,
        max_cost_usd=max_cost_usd,
        box_rate=RATE,
        time_budget_s=600,
        margin_s=360,
        budget_reason="a test",
        serving=[],
    )


def test_another_attempt_needs_each_box_its_minimum_and_the_margin() -> None:
    assert attempt_minimum_usd(RATE, 2, 360) == pytest.approx(ANOTHER_ATTEMPT_USD)


def test_a_relaunch_is_allowed_while_the_budget_left_covers_another_attempt_exactly() -> None:
    assert relaunch_refusal(costs(2.0), spent_usd=2.0 - ANOTHER_ATTEMPT_USD) is None
    assert relaunch_refusal(costs(2.0), spent_usd=0.0) is None


def test_a_relaunch_the_budget_left_cannot_cover_is_refused_with_the_numbers() -> None:
    refused = relaunch_refusal(costs(2.0), spent_usd=1.2)
    assert refused == (
        "the run's boxes have cost $1.2000 of its $2.0000 training budget, $0.8000 left; "
        "another attempt of 2 x g6.12xlarge needs $0.8435 (at $3.6150/h a box, its 60 s "
        "minimum and the watchdog's 360 s margin): over the budget; no relaunch"
    )
    # Spent past the budget (a box's last minutes): nothing is left, never a negative.
    assert "$0.0000 left" in str(relaunch_refusal(costs(2.0), spent_usd=2.5))


def test_a_boot_is_the_slowest_measured_else_the_familys_assumed_floor(tmp_path: Path) -> None:
    root = str(tmp_path)
    floor = boot_estimate(root, "p4d.24xlarge")
    assert (floor.seconds, floor.source) == (600, "assumed: the p4d family's floor")
    assert boot_estimate(root, "g5.12xlarge").seconds == BOOT_FLOOR_S["g5"] == 480
    unknown = boot_estimate(root, "x9.huge")
    assert (unknown.seconds, unknown.source) == (
        UNKNOWN_FAMILY_BOOT_S,
        "assumed: no floor for the x9 family",
    )
    record_boots(root, "p4d.24xlarge", [301.04, 255.0])
    measured = boot_estimate(root, "p4d.24xlarge")
    assert (measured.seconds, measured.source) == (301.0, "measured: the slowest of its last 2")
    assert boot_estimate(root, "p4de.24xlarge").seconds == 600  # measured per type
