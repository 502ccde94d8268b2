"""The one cost model: what a box, a run, a budget and a serving fleet cost.

Every expectation is worked out by hand from EC2's billing rules (the instance per second from
``running``, at least 60 s; the root volume and the public IPv4 address from launch, at least
60 s each), with rates chosen so that the dollars come out round.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from burstcv.cost import model
from burstcv.cost.model import (
    HOURS_PER_MONTH,
    LOCAL_RATE,
    BoxCost,
    BudgetTooSmallError,
    FleetCost,
    box_cost,
    box_usd_per_hour,
    fleet_cost,
    replicas_for,
    time_budget,
)
from burstcv_spec.contracts import BoxBill, BoxRate

T0 = datetime(2026, 5, 1, 10, 0, tzinfo=UTC)

# $3.60/h for the instance ($0.001 a second); 73 GB at $0.10 per GB-month is $7.30 a month,
# $0.01/h (730 hours a month); the public IPv4 address $0.005/h: $0.015/h attached.
RATE = BoxRate(
    instance_type="g6.xlarge",
    market="on-demand",
    usd_per_hour=3.6,
    price_source="a test",
    volume_gb=73,
    ebs_usd_per_gb_month=0.1,
    public_ipv4_usd_per_hour=0.005,
)
ATTACHED_USD_PER_S = 0.015 / 3600
# The same box at $3.60/h all parts together: 3.585 + 0.01 + 0.005.
WHOLE_3_60 = RATE.model_copy(update={"usd_per_hour": 3.585})
INSTANCE_ONLY = BoxRate(
    instance_type="g6.xlarge", market="on-demand", usd_per_hour=3.6, price_source="a test"
)


def at(seconds: float) -> str:
    """Return the ISO time ``seconds`` after T0."""
    return (T0 + timedelta(seconds=seconds)).isoformat()


def box(
    launched: float = 0,
    running: float | None = None,
    ended: float | None = None,
    *,
    rate: BoxRate = RATE,
    instance_id: str = "i-1",
) -> BoxBill:
    """Return one box's record: launched, seen running and ended at these seconds after T0."""
    return BoxBill(
        **rate.model_dump(),
        instance_id=instance_id,
        launched_at=at(launched),
        running_at=None if running is None else at(running),
        ended_at=None if ended is None else at(ended),
    )


# -- one box -------------------------------------------------------------------------------------


def test_a_boxs_hourly_rate_counts_the_instance_the_volume_and_the_address() -> None:
    assert box_usd_per_hour(RATE) == pytest.approx(3.615, abs=1e-12)
    assert box_usd_per_hour(WHOLE_3_60) == pytest.approx(3.6, abs=1e-12)
    assert box_usd_per_hour(INSTANCE_ONLY) == 3.6
    assert box_usd_per_hour(LOCAL_RATE) == 0.0


def test_the_models_constants_are_ec2s_and_the_fleets() -> None:
    # Read through the module: what every caller of the model sees.
    assert (model.HOURS_PER_MONTH, model.MINIMUM_BILLED_S) == (HOURS_PER_MONTH, 60) == (730.0, 60)
    # A serving replica runs at most at 70% of its sustainable rate.
    assert model.DEFAULT_HEADROOM == 0.3
    assert model.LOCAL_RATE.market == "local" and box_usd_per_hour(model.LOCAL_RATE) == 0.0


def test_the_instance_bills_from_running_and_the_volume_and_address_from_launch() -> None:
    # 30 s pending (not billed for the instance), then 600 s running.
    cost = box_cost(box(launched=0, running=30, ended=630), T0)
    assert cost.instance_s == 600
    assert cost.usd == pytest.approx(600 * 0.001 + 630 * ATTACHED_USD_PER_S, abs=1e-12)
    assert cost.usd == pytest.approx(0.602625, abs=1e-12)


def test_each_part_is_billed_at_least_a_minute() -> None:
    # Running 30 s of a 40 s life: the instance 60 s, the volume and the address 60 s.
    short = box_cost(box(launched=0, running=10, ended=40), T0)
    assert short == BoxCost(60.0, pytest.approx(0.06 + 60 * ATTACHED_USD_PER_S, abs=1e-12))
    # A long wait for capacity: attached 100 s, running only 20 s; each minimum on its own.
    waited = box_cost(box(launched=0, running=80, ended=100), T0)
    assert waited.instance_s == 60
    assert waited.usd == pytest.approx(0.06 + 100 * ATTACHED_USD_PER_S, abs=1e-12)


@pytest.mark.parametrize(
    ("running_s", "billed"),
    [(0, 60), (1, 60), (59.2, 60), (60, 60), (60.2, 61), (61, 61), (3600, 3600)],
)
def test_the_instance_bills_per_second_rounded_up(running_s: float, billed: int) -> None:
    cost = box_cost(box(launched=0, running=0, ended=running_s, rate=INSTANCE_ONLY), T0)
    assert cost.instance_s == billed
    assert cost.usd == pytest.approx(billed * 0.001, abs=1e-12)


def test_a_box_never_seen_running_bills_from_its_launch() -> None:
    # An upper bound: the instance may have been pending for part of it.
    cost = box_cost(box(launched=0, running=None, ended=600), T0)
    assert cost.instance_s == 600
    assert cost.usd == pytest.approx(0.6 + 600 * ATTACHED_USD_PER_S, abs=1e-12)


def test_a_box_still_up_is_billed_to_now() -> None:
    up = box(launched=0, running=0, ended=None)
    assert box_cost(up, T0 + timedelta(seconds=1200)).instance_s == 1200
    assert box_cost(up, T0 + timedelta(seconds=1200)).usd == pytest.approx(
        1.2 + 1200 * ATTACHED_USD_PER_S, abs=1e-12
    )
    # A little later, a little more.
    assert box_cost(up, T0 + timedelta(seconds=1800)).usd == pytest.approx(
        1.8 + 1800 * ATTACHED_USD_PER_S, abs=1e-12
    )


def test_an_ended_box_ignores_now() -> None:
    ended = box(launched=0, running=0, ended=600)
    assert box_cost(ended, T0 + timedelta(days=3)) == box_cost(ended, T0 + timedelta(seconds=600))


def test_times_out_of_order_bill_the_minimum_never_a_negative() -> None:
    # Clocks disagree: running "before" launch counts from launch, an end "before" launch
    # bills the minimum of each part.
    early = box_cost(box(launched=100, running=40, ended=700), T0)
    assert early.instance_s == 600
    backwards = box_cost(box(launched=100, running=100, ended=50), T0)
    assert backwards.instance_s == 60
    assert backwards.usd == pytest.approx(0.06 + 60 * ATTACHED_USD_PER_S, abs=1e-12)


def test_a_local_box_costs_nothing_and_counts_its_wall_time() -> None:
    local = box(launched=0, running=None, ended=125.5, rate=LOCAL_RATE)
    assert box_cost(local, T0) == BoxCost(125.5, 0.0)
    # A local box is not billed a minimum either.
    assert box_cost(box(launched=0, ended=5, rate=LOCAL_RATE), T0) == BoxCost(5.0, 0.0)
    assert box_cost(box(launched=0, rate=LOCAL_RATE), T0 + timedelta(seconds=42)).instance_s == 42


def test_a_time_without_a_timezone_is_refused() -> None:
    naive = box().model_copy(update={"launched_at": "2026-05-01T10:00:00"})
    with pytest.raises(ValueError, match="timezone"):
        box_cost(naive, T0)


# -- the time budget -----------------------------------------------------------------------------


def test_a_budget_buys_its_boxes_time_at_their_whole_rate() -> None:
    # $1.80 at $3.60/h, all parts counted: half an hour.
    seconds, reason = time_budget(1.8, 7200, boxes=1, rate=WHOLE_3_60, margin_s=0)
    assert seconds == 1800
    assert reason == (
        "1800 s: what $1.80 buys 1 x g6.xlarge on-demand at $3.6000/h a box, less the "
        "watchdog's 0 s margin (the time budget was 7200 s)"
    )


@pytest.mark.parametrize(("boxes", "seconds"), [(1, 3600), (2, 1800), (3, 1200), (4, 900)])
def test_n_boxes_divide_the_affordable_time_by_n(boxes: int, seconds: int) -> None:
    assert time_budget(3.6, 7200, boxes=boxes, rate=INSTANCE_ONLY, margin_s=0)[0] == seconds
    # What the boxes may spend till the deadline stays within the budget.
    assert boxes * 3.6 * seconds / 3600 <= 3.6


def test_the_watchdogs_margin_is_paid_for_out_of_the_budget() -> None:
    # $3.60 buys 2 boxes at $3.60/h 1800 s; 360 s of it go to the margin a box may outlive
    # the deadline by.
    seconds, reason = time_budget(3.6, 7200, boxes=2, rate=INSTANCE_ONLY, margin_s=360)
    assert seconds == 1440
    assert 2 * 3.6 * (seconds + 360) / 3600 == pytest.approx(3.6)
    assert "less the watchdog's 360 s margin (the time budget was 7200 s)" in reason
    assert "2 x g6.xlarge on-demand at $3.6000/h a box" in reason


def test_a_budget_that_buys_exactly_the_minimum_is_enough() -> None:
    # $3.60/h is $0.06 a minute: exactly EC2's minimum charge.
    assert time_budget(0.06, 3600, boxes=1, rate=INSTANCE_ONLY, margin_s=0)[0] == 60
    # Two boxes, each its minute and the watchdog's 360 s: 2 x $3.60/h x 420 s = $0.84.
    assert time_budget(0.84, 3600, boxes=2, rate=INSTANCE_ONLY, margin_s=360)[0] == 60


def test_a_budget_too_small_says_what_the_boxes_need() -> None:
    with pytest.raises(BudgetTooSmallError) as too_small:
        time_budget(0.0599, 3600, boxes=1, rate=INSTANCE_ONLY, margin_s=0)
    assert str(too_small.value) == (
        "$0.0599 does not cover 1 x g6.xlarge on-demand at $3.6000/h a box for the 60 s "
        "minimum and the watchdog's 0 s margin ($0.0600); raise max_cost_usd"
    )
    # With more boxes and a margin, the error names them and what they need together.
    with pytest.raises(BudgetTooSmallError) as too_small:
        time_budget(0.8, 3600, boxes=2, rate=INSTANCE_ONLY, margin_s=360)
    assert str(too_small.value) == (
        "$0.8000 does not cover 2 x g6.xlarge on-demand at $3.6000/h a box for the 60 s "
        "minimum and the watchdog's 360 s margin ($0.8400); raise max_cost_usd"
    )
    # What buys one box its minute does not buy two.
    time_budget(0.06, 3600, boxes=1, rate=INSTANCE_ONLY, margin_s=0)
    with pytest.raises(BudgetTooSmallError, match=r"2 x g6\.xlarge"):
        time_budget(0.06, 3600, boxes=2, rate=INSTANCE_ONLY, margin_s=0)


def test_a_budget_that_buys_more_than_the_cap_keeps_the_cap() -> None:
    # $100 buys 100 hours; the run was given 1000 s.
    assert time_budget(100.0, 1000, boxes=2, rate=INSTANCE_ONLY, margin_s=360) == (
        1000,
        "1000 s: the run's time budget (2 x g6.xlarge on-demand at $3.6000/h a box costs "
        "less than its budget)",
    )
    # Exactly what the budget buys: the cap it is, and one second under it.
    assert time_budget(1.8, 1800, boxes=1, rate=INSTANCE_ONLY, margin_s=0) == (
        1800,
        "1800 s: the run's time budget (1 x g6.xlarge on-demand at $3.6000/h a box costs "
        "less than its budget)",
    )
    assert time_budget(1.8, 1799, boxes=1, rate=INSTANCE_ONLY, margin_s=0)[0] == 1799
    assert time_budget(1.8, 1801, boxes=1, rate=INSTANCE_ONLY, margin_s=0)[0] == 1800


def test_a_box_under_a_dollar_an_hour_is_bounded_too() -> None:
    # $0.36/h is $0.0001 a second: $0.09 buys 900 s.
    cheap = INSTANCE_ONLY.model_copy(update={"instance_type": "g4dn.xlarge", "usd_per_hour": 0.36})
    assert time_budget(0.09, 3600, boxes=1, rate=cheap, margin_s=0)[0] == 900
    assert time_budget(0.09, 3600, boxes=2, rate=cheap, margin_s=0)[0] == 450


def test_compute_that_costs_nothing_keeps_the_cap_whatever_the_budget() -> None:
    assert time_budget(0.01, 900, boxes=1, rate=model.LOCAL_RATE, margin_s=0) == (
        900,
        "900 s: the run's time budget (its compute costs nothing)",
    )
    free = INSTANCE_ONLY.model_copy(update={"usd_per_hour": 0.0})
    assert time_budget(0.01, 900, boxes=4, rate=free, margin_s=360)[0] == 900


def test_a_time_budget_needs_a_positive_cap_and_a_box() -> None:
    assert time_budget(5.0, 1, boxes=1, rate=INSTANCE_ONLY, margin_s=0)[0] == 1
    for cap_s in (0, -60):
        with pytest.raises(ValueError, match="cap_s must be positive"):
            time_budget(5.0, cap_s, boxes=1, rate=INSTANCE_ONLY, margin_s=0)
    with pytest.raises(ValueError, match="boxes must be at least 1, got 0"):
        time_budget(5.0, 60, boxes=0, rate=INSTANCE_ONLY, margin_s=0)


# -- a serving fleet -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target_rps", "rate_rps", "headroom", "replicas"),
    [
        (1000.0, 100.0, 0.3, 15),  # 1000 / 70 = 14.3
        (700.0, 100.0, 0.3, 10),  # exactly 10 replicas at 70 req/s each
        (701.0, 100.0, 0.3, 11),
        (1000.0, 100.0, 0.0, 10),  # no headroom: each at its sustainable rate
        (1000.0, 100.0, 0.5, 20),
        (1.0, 1000.0, 0.3, 1),  # a trickle still takes one replica
        (0.5, 0.5, 0.3, 2),  # a slow model: 0.35 req/s each
    ],
)
def test_replicas_cover_the_target_with_headroom(
    target_rps: float, rate_rps: float, headroom: float, replicas: int
) -> None:
    assert replicas_for(target_rps, rate_rps, headroom) == replicas


@pytest.mark.parametrize(
    ("target_rps", "rate_rps", "headroom", "message"),
    [
        (100.0, 10.0, 1.0, r"headroom must be in \[0, 1\), got 1.0"),
        (100.0, 10.0, -0.1, r"headroom must be in \[0, 1\), got -0.1"),
        (100.0, 0.0, 0.3, "rates must be positive, got 0.0 and 100.0"),
        (100.0, -5.0, 0.3, "rates must be positive"),
        (0.0, 10.0, 0.3, "rates must be positive, got 10.0 and 0.0"),
    ],
)
def test_replicas_for_refuses_what_has_no_answer(
    target_rps: float, rate_rps: float, headroom: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        replicas_for(target_rps, rate_rps, headroom)


def test_a_fleet_costs_per_hour_per_month_and_per_million_predictions() -> None:
    # One $3.60/h replica at 100 predictions/s: 360,000 predictions cost $3.60, 1M cost $10.
    one = fleet_cost(3.6, 1, 100.0)
    assert one.usd_per_hour == 3.6
    assert one.usd_per_month == pytest.approx(3.6 * 730, abs=1e-9)
    assert one.usd_per_million == pytest.approx(10.0, abs=1e-12)
    # Three replicas serving the same load: three times the money for the same predictions.
    three = fleet_cost(3.6, 3, 100.0)
    assert three == FleetCost(
        usd_per_hour=pytest.approx(10.8, abs=1e-12),
        usd_per_month=pytest.approx(7884.0, abs=1e-9),
        usd_per_million=pytest.approx(30.0, abs=1e-12),
    )
    # A slow trickle (one prediction every 2 s) is still priced: 1M take 555.6 hours.
    assert fleet_cost(3.6, 1, 0.5).usd_per_million == pytest.approx(2000.0, abs=1e-9)
    assert fleet_cost(0.0, 4, 10.0) == FleetCost(0.0, 0.0, 0.0)


def test_a_fleet_needs_a_positive_load() -> None:
    for target_rps in (0.0, -1.0):
        with pytest.raises(ValueError, match="target_rps must be positive"):
            fleet_cost(3.6, 1, target_rps)


def test_the_fleet_at_the_replicas_it_needs_is_what_a_user_pays() -> None:
    # c7i.large at $0.08925/h sustaining 200 req/s, 1000 req/s expected: 8 replicas.
    replicas = replicas_for(1000.0, 200.0, 0.3)
    assert replicas == math.ceil(1000 / 140) == 8
    cost = fleet_cost(0.08925, replicas, 1000.0)
    assert cost.usd_per_hour == pytest.approx(0.714, abs=1e-12)
    assert cost.usd_per_month == pytest.approx(521.22, abs=1e-9)
    assert cost.usd_per_million == pytest.approx(0.714 / 3.6, abs=1e-12)
