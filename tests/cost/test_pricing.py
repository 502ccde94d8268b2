"""Read prices: the bundled table, its storage and address rows, and the AWS Price List API.

What a box, a run, a budget or a fleet costs is burstcv.cost.model's (tests/cost/test_model.py).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber

from burstcv.cost.pricing import (
    PACKAGED_TABLE,
    PRICE_TABLE_ENV,
    UnknownPriceError,
    hourly_price,
    instance_arch,
    instance_shapes,
    load_price_table,
    normal_arch,
    on_demand_from_price_list,
    public_ipv4_usd_per_hour,
    refresh_from_pricing_api,
    volume_usd_per_gb_month,
)

GPU_TYPES = ("g6.xlarge", "g5.xlarge", "g4dn.xlarge", "g6.12xlarge", "p4d.24xlarge")
CPU_TYPES = ("c7i.large", "c7i.xlarge", "c7i.2xlarge", "m7i.large")


def test_table_is_dated_sourced_and_complete() -> None:
    table = load_price_table()
    assert table["source"] and table["as_of"]
    assert datetime.fromisoformat(table["as_of"]).year >= 2024
    assert {"us-east-1", "us-west-2"} <= set(table["regions"])
    for region in ("us-east-1", "us-west-2"):
        for instance_type in GPU_TYPES + CPU_TYPES:
            on_demand = hourly_price(instance_type, region, "on-demand")
            spot = hourly_price(instance_type, region, "spot")
            assert 0 < spot < on_demand, (instance_type, region)


def test_local_costs_nothing() -> None:
    assert hourly_price("anything", "nowhere", "local") == 0.0


def test_unknown_prices_name_the_options() -> None:
    with pytest.raises(UnknownPriceError, match=r"g6\.xlarge"):
        hourly_price("x9.huge", "us-east-1", "on-demand")
    with pytest.raises(UnknownPriceError, match="us-east-1"):
        hourly_price("g6.xlarge", "mars-1", "on-demand")
    with pytest.raises(UnknownPriceError, match="on-demand, spot, local"):
        hourly_price("g6.xlarge", "us-east-1", "reserved")


def write_table(tmp_path: Path, on_demand: float) -> Path:
    """Write a price table with one type, x1.test in us-east-1, at ``on_demand`` $/hour."""
    path = tmp_path / "prices.json"
    regions = {"us-east-1": {"x1.test": {"on-demand": on_demand, "spot": on_demand / 3}}}
    path.write_text(json.dumps({"source": "a test", "as_of": "2026-01-01", "regions": regions}))
    return path


def test_a_custom_table_replaces_the_packaged_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = write_table(tmp_path, on_demand=3.6)
    assert hourly_price("x1.test", "us-east-1", "on-demand", path=table) == 3.6
    assert hourly_price("x1.test", "us-east-1", "spot", path=table) == pytest.approx(1.2)
    monkeypatch.setenv(PRICE_TABLE_ENV, str(table))
    assert load_price_table()["source"] == "a test"
    assert hourly_price("x1.test", "us-east-1", "on-demand") == 3.6
    with pytest.raises(UnknownPriceError, match=r"the table has x1\.test"):
        hourly_price("g6.xlarge", "us-east-1", "on-demand")
    monkeypatch.delenv(PRICE_TABLE_ENV)
    assert load_price_table() is load_price_table(PACKAGED_TABLE)


def test_a_table_without_its_source_or_date_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "undated.json"
    path.write_text(json.dumps({"source": "a test", "regions": {}}))
    with pytest.raises(ValueError, match=re.escape(f"price table {path} lacks 'as_of'")):
        load_price_table(path)


def test_the_serving_types_shapes_are_awss_published_figures() -> None:
    assert instance_shapes() == {
        "c7i.large": (2, 4.0),
        "c7i.xlarge": (4, 8.0),
        "c7i.2xlarge": (8, 16.0),
        "m7i.large": (2, 8.0),
        "m7i.xlarge": (4, 16.0),
        "c7g.large": (2, 4.0),
        "c7g.xlarge": (4, 8.0),
        "c7g.2xlarge": (8, 16.0),
        "m7g.large": (2, 8.0),
        "m7g.xlarge": (4, 16.0),
        "c8g.large": (2, 4.0),
        "c8g.xlarge": (4, 8.0),
    }


def test_graviton_types_are_arm64_and_the_rest_x86_64() -> None:
    arm = {t for t in instance_shapes() if instance_arch(t) == "arm64"}
    assert arm == {t for t in instance_shapes() if t.split(".")[0] in ("c7g", "m7g", "c8g")}
    assert instance_arch("c7i.large") == "x86_64"
    assert instance_arch("z9.unknown") == "x86_64"  # a type the table does not list
    assert [normal_arch(m) for m in ("aarch64", "x86_64", "AMD64", "arm64")] == [
        "arm64",
        "x86_64",
        "x86_64",
        "arm64",
    ]


@pytest.mark.parametrize(
    ("region", "usd_per_gb_month"),
    [
        ("us-east-1", 0.08),
        ("us-west-2", 0.08),
        ("eu-west-1", 0.088),
        ("eu-central-1", 0.0952),
        ("ap-northeast-1", 0.096),
        ("xx-nowhere-9", 0.08),  # a region the table does not list: its default row
    ],
)
def test_a_root_volume_is_priced_per_gb_month_by_region(
    region: str, usd_per_gb_month: float
) -> None:
    assert volume_usd_per_gb_month(region) == usd_per_gb_month


def test_a_public_ipv4_address_costs_the_same_everywhere() -> None:
    assert public_ipv4_usd_per_hour() == 0.005


def test_a_custom_table_without_storage_or_address_rows_falls_back_to_the_packaged_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An older table (made before boxes were priced part by part) names neither.
    old = write_table(tmp_path, on_demand=3.6)
    assert "storage" not in json.loads(old.read_text())
    assert volume_usd_per_gb_month("eu-west-1", path=old) == 0.088
    assert volume_usd_per_gb_month("xx-nowhere-9", path=old) == 0.08
    assert public_ipv4_usd_per_hour(path=old) == 0.005
    monkeypatch.setenv(PRICE_TABLE_ENV, str(old))
    assert volume_usd_per_gb_month("eu-central-1") == 0.0952
    assert public_ipv4_usd_per_hour() == 0.005
    # A table that has them is read for them.
    own = tmp_path / "own.json"
    doc = json.loads(old.read_text())
    doc["storage"] = {"gp3_usd_per_gb_month": {"default": 0.5, "eu-west-1": 0.25}}
    doc["public_ipv4_usd_per_hour"] = 0.0075
    own.write_text(json.dumps(doc))
    monkeypatch.setenv(PRICE_TABLE_ENV, str(own))
    assert volume_usd_per_gb_month("eu-west-1") == 0.25
    assert volume_usd_per_gb_month("us-east-1") == 0.5  # its default row, not the packaged
    assert public_ipv4_usd_per_hour() == 0.0075


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
