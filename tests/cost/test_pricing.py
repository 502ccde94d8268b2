"""Check prices, EC2's billing rule, serving cost and the budget that bounds the watchdog."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber

from burstcv.cost.pricing import (
    BudgetTooSmallError,
    UnknownPriceError,
    billed_seconds,
    hourly_price,
    load_price_table,
    on_demand_from_price_list,
    price_source,
    refresh_from_pricing_api,
    run_cost,
    serving_cost_per_million,
    time_budget_for,
)

T0 = datetime(2024, 5, 1, 10, 0, tzinfo=UTC)
GPU_TYPES = ("g6.xlarge", "g5.xlarge", "g4dn.xlarge", "g6.12xlarge", "p4d.24xlarge")
CPU_TYPES = ("c7i.large", "c7i.xlarge", "c7i.2xlarge", "m7i.large")


def test_table_is_dated_sourced_and_complete() -> None:
    table = load_price_table()
    assert table["source"] and table["as_of"]
    assert datetime.fromisoformat(price_source()["as_of"]).year >= 2024
    assert {"us-east-1", "us-west-2"} <= set(table["regions"])
    for region in ("us-east-1", "us-west-2"):
        for instance_type in GPU_TYPES + CPU_TYPES:
            on_demand = hourly_price(instance_type, region, "on-demand")
            spot = hourly_price(instance_type, region, "spot")
            assert 0 < spot < on_demand, (instance_type, region)


def test_local_costs_nothing() -> None:
    assert hourly_price("anything", "nowhere", "local") == 0.0
    assert run_cost("cpu", "local", "local", launched=T0, stopped=T0 + timedelta(hours=5)) == 0.0


def test_unknown_prices_name_the_options() -> None:
    with pytest.raises(UnknownPriceError, match=r"g6\.xlarge"):
        hourly_price("x9.huge", "us-east-1", "on-demand")
    with pytest.raises(UnknownPriceError, match="us-east-1"):
        hourly_price("g6.xlarge", "mars-1", "on-demand")
    with pytest.raises(UnknownPriceError, match="on-demand, spot, local"):
        hourly_price("g6.xlarge", "us-east-1", "reserved")


@pytest.mark.parametrize(
    ("elapsed_s", "billed"),
    [(0, 60), (1, 60), (59.2, 60), (60, 60), (60.2, 61), (61, 61), (3600, 3600)],
)
def test_billing_is_per_second_with_a_one_minute_minimum(elapsed_s: float, billed: int) -> None:
    assert billed_seconds(T0, T0 + timedelta(seconds=elapsed_s)) == billed


def test_billing_refuses_naive_or_backwards_times() -> None:
    with pytest.raises(ValueError, match="timezone"):
        billed_seconds(datetime(2024, 1, 1), datetime(2024, 1, 2))
    naive = datetime(2024, 5, 1, 10, 0)
    with pytest.raises(ValueError, match="timezone"):
        billed_seconds(naive, T0 + timedelta(hours=1))
    with pytest.raises(ValueError, match="timezone"):
        billed_seconds(T0, naive + timedelta(hours=1))
    with pytest.raises(ValueError, match="before"):
        billed_seconds(T0, T0 - timedelta(seconds=1))


def test_run_cost_applies_the_rule() -> None:
    per_hour = hourly_price("g5.xlarge", "us-east-1", "on-demand")
    half_hour = run_cost(
        "g5.xlarge", "us-east-1", "on-demand", launched=T0, stopped=T0 + timedelta(minutes=30)
    )
    assert half_hour == pytest.approx(per_hour / 2)
    ten_s = run_cost(
        "g5.xlarge", "us-east-1", "spot", launched=T0, stopped=T0 + timedelta(seconds=10)
    )
    assert ten_s == pytest.approx(hourly_price("g5.xlarge", "us-east-1", "spot") / 60)


def write_table(tmp_path: Path, on_demand: float) -> Path:
    """Write a price table with one type, x1.test in us-east-1, at ``on_demand`` $/hour."""
    path = tmp_path / "prices.json"
    regions = {"us-east-1": {"x1.test": {"on-demand": on_demand, "spot": on_demand / 3}}}
    path.write_text(json.dumps({"source": "a test", "as_of": "2026-01-01", "regions": regions}))
    return path


def test_serving_cost_per_million_predictions_in_dollars(tmp_path: Path) -> None:
    table = write_table(tmp_path, on_demand=3.6)
    # $3.60/h at 100 predictions/s: 360,000 predictions cost $3.60, so 1M cost $10.
    assert serving_cost_per_million("x1.test", "us-east-1", 100.0, path=table) == pytest.approx(
        10.0, rel=1e-9
    )
    # A slow model (one prediction every 2 s) is still priced: 1M take 2M s, 555.6 h.
    assert serving_cost_per_million("x1.test", "us-east-1", 0.5, path=table) == pytest.approx(
        2000.0, rel=1e-9
    )
    for rps in (0, -1.0):
        with pytest.raises(ValueError, match="throughput_rps must be positive"):
            serving_cost_per_million("x1.test", "us-east-1", rps, path=table)


def test_serving_cost_per_million_predictions() -> None:
    per_hour = hourly_price("c7i.large", "us-east-1", "on-demand")
    # 100 predictions/s = 360,000/h, so 1M predictions take 1e6 / 360,000 hours.
    expected = per_hour * 1_000_000 / 360_000
    assert serving_cost_per_million("c7i.large", "us-east-1", 100.0) == pytest.approx(expected)
    assert serving_cost_per_million("c7i.large", "us-east-1", 200.0) == pytest.approx(expected / 2)
    with pytest.raises(ValueError):
        serving_cost_per_million("c7i.large", "us-east-1", 0)


def test_budget_lowers_the_time_budget_and_the_cap_still_holds() -> None:
    per_hour = hourly_price("g6.xlarge", "us-east-1", "on-demand")
    assert time_budget_for(None, "g6.xlarge", "us-east-1", "on-demand", 3600) == 3600
    assert time_budget_for(100.0, "g6.xlarge", "us-east-1", "on-demand", 3600) == 3600
    half = time_budget_for(per_hour / 2, "g6.xlarge", "us-east-1", "on-demand", 3600)
    assert half == 1800
    assert time_budget_for(0.0, "cpu", "local", "local", 900) == 900  # free is never capped
    with pytest.raises(BudgetTooSmallError, match="60 s minimum"):
        time_budget_for(0.001, "g6.xlarge", "us-east-1", "on-demand", 3600)


def test_a_budget_that_buys_exactly_the_minute_minimum_is_enough() -> None:
    # $3.60/h is $0.06 a minute: exactly EC2's minimum charge.
    assert time_budget_for(0.06, "x1.test", "us-east-1", "on-demand", 3600, usd_per_hour=3.6) == 60
    with pytest.raises(BudgetTooSmallError) as too_small:
        time_budget_for(0.0599, "x1.test", "us-east-1", "on-demand", 3600, usd_per_hour=3.6)
    # The error says what the minimum would cost, so the user knows what to raise it to.
    message = str(too_small.value)
    assert "$0.0599 does not cover the 60 s minimum" in message
    assert "x1.test on-demand in us-east-1 ($0.0600)" in message


def test_a_budget_exactly_at_the_limit_buys_the_time_it_pays_for() -> None:
    # $1.80 at $3.60/h is half an hour; a cap below that still holds.
    budget_s = time_budget_for(1.8, "x1.test", "us-east-1", "on-demand", 7200, usd_per_hour=3.6)
    assert budget_s == 1800
    assert 3.6 * budget_s / 3600 <= 1.8
    assert time_budget_for(1.8, "x1.test", "us-east-1", "on-demand", 1799, usd_per_hour=3.6) == 1799
    # A quoted price wins over the table's.
    assert time_budget_for(1.8, "g6.xlarge", "us-east-1", "on-demand", 7200, usd_per_hour=3.6) == (
        1800
    )


def test_a_time_budget_needs_a_positive_cap() -> None:
    assert time_budget_for(None, "g6.xlarge", "us-east-1", "on-demand", 1) == 1
    for cap_s in (0, -60):
        with pytest.raises(ValueError, match="cap_s must be positive"):
            time_budget_for(None, "g6.xlarge", "us-east-1", "on-demand", cap_s)


def pricing_product(instance_type: str, usd: str) -> str:
    """Return one Pricing API product document as the API sends it (a JSON string)."""
    return json.dumps(
        {
            "product": {"attributes": {"instanceType": instance_type, "regionCode": "us-east-1"}},
            "terms": {
                "OnDemand": {
                    "SKU.JRTCKXETXF": {
                        "priceDimensions": {
                            "SKU.JRTCKXETXF.6YS6EN2CT7": {
                                "unit": "Hrs",
                                "pricePerUnit": {"USD": usd},
                            }
                        }
                    }
                }
            },
        }
    )


def test_refresh_from_pricing_api_updates_on_demand_keeps_spot(tmp_path: Path) -> None:
    # moto does not emulate the Pricing API; botocore's Stubber checks the request shape
    # against the real service model and returns a recorded-format answer.
    client = boto3.client(
        "pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    with Stubber(client) as stub:
        stub.add_response(
            "get_products",
            {
                "PriceList": [pricing_product("g6.xlarge", "0.9000000000")],
                "FormatVersion": "aws_v1",
            },
        )
        output = tmp_path / "prices.json"
        table = refresh_from_pricing_api(
            ["g6.xlarge"], ["us-east-1"], client=client, output=output, as_of="2030-01-01"
        )
        stub.assert_no_pending_responses()
    assert table["regions"]["us-east-1"]["g6.xlarge"]["on-demand"] == 0.9
    assert table["regions"]["us-east-1"]["g6.xlarge"]["spot"] == hourly_price(
        "g6.xlarge", "us-east-1", "spot"
    )
    assert table["as_of"] == "2030-01-01" and "Pricing API" in table["source"]
    assert hourly_price("g6.xlarge", "us-east-1", "on-demand", path=output) == 0.9


def price_list_item(dimensions: list[dict[str, object]]) -> str:
    """Return one Pricing API product document with these price dimensions."""
    return json.dumps(
        {
            "product": {"attributes": {"instanceType": "g6.xlarge", "regionCode": "us-east-1"}},
            "terms": {
                "OnDemand": {
                    "SKU.TERM": {
                        "priceDimensions": {f"SKU.TERM.{i}": d for i, d in enumerate(dimensions)}
                    }
                }
            },
        }
    )


def answer_price_list(items: list[str]) -> float:
    """Return the on-demand rate read from a Pricing API that answers with these products."""
    client = boto3.client(
        "pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    with Stubber(client) as stub:
        stub.add_response("get_products", {"PriceList": items, "FormatVersion": "aws_v1"})
        return on_demand_from_price_list(client, "g6.xlarge", "us-east-1")


def test_a_zero_or_missing_dollar_rate_is_not_a_price() -> None:
    items = [
        price_list_item([{"unit": "Hrs", "pricePerUnit": {"USD": "0.0000000000"}}]),
        price_list_item([{"unit": "Hrs", "pricePerUnit": {"CNY": "6.0000000000"}}]),
        price_list_item([{"unit": "Quantity", "pricePerUnit": {"USD": "0.0100000000"}}]),
        price_list_item([{"unit": "Hrs", "pricePerUnit": {"USD": "0.8048000000"}}]),
    ]
    assert answer_price_list(items) == 0.8048
    with pytest.raises(UnknownPriceError, match=r"g6\.xlarge in us-east-1"):
        answer_price_list(items[:3])


def test_of_several_matching_products_the_plain_rate_is_taken() -> None:
    # Variants that add a charge (a licence, say) list higher rates than the plain instance.
    items = [
        price_list_item([{"unit": "Hrs", "pricePerUnit": {"USD": "1.2000000000"}}]),
        price_list_item([{"unit": "Hrs", "pricePerUnit": {"USD": "0.8048000000"}}]),
        price_list_item([{"unit": "Hrs", "pricePerUnit": {"USD": "0.9500000000"}}]),
    ]
    assert answer_price_list(items) == 0.8048
