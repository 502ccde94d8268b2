"""Read prices: the dated bundled table, and the AWS Price List API's answers.

The table (``prices.json`` beside this module, or ``$BURSTCV_PRICE_TABLE``) holds on-demand and
spot $/hour per region and type, with its source and date; its spot figures are indicative. A
run quotes AWS itself (``burstcv.cost.quotes``) and falls back on this table only offline.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LIFECYCLES: tuple[str, ...] = ("on-demand", "spot", "local")

PACKAGED_TABLE = Path(__file__).with_name("prices.json")
PRICE_TABLE_ENV = "BURSTCV_PRICE_TABLE"

# The Price List API's two endpoints, each with every region's prices (a policy may deny one).
PRICING_API_REGIONS = ("us-east-1", "ap-south-1")
# Refusals of one endpoint (an SCP or a permissions boundary) that the other may not share.
_ENDPOINT_REFUSALS = ("AccessDenied", "UnauthorizedOperation", "UnrecognizedClient")


class PriceListEndpoints:
    """Ask the Price List API at the first of its endpoints that answers (an SCP may deny
    one region); the endpoint that answered is asked first from then on."""

    def __init__(self, client_in: Any, regions: Iterable[str] = PRICING_API_REGIONS) -> None:
        self._client_in = client_in  # region -> boto3 pricing client
        self._clients: dict[str, Any] = {}
        self.regions = list(regions)

    def _client(self, region: str) -> Any:
        if region not in self._clients:
            self._clients[region] = self._client_in(region)
        return self._clients[region]

    def get_products(self, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        last: Exception | None = None
        for region in list(self.regions):
            try:
                answer = self._client(region).get_products(**kwargs)
            except ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                if not code.startswith(_ENDPOINT_REFUSALS):
                    raise
                last = exc
            except BotoCoreError as exc:  # the endpoint cannot be reached from here
                last = exc
            else:
                self.regions.remove(region)
                self.regions.insert(0, region)
                return answer
            log.info("the Price List API in %s refused (%s); trying the next one", region, last)
        if last is None:
            raise ValueError("no Price List API endpoint to ask")
        raise last


class UnknownPriceError(ValueError):
    """Raise when the table has no price for an instance type, region or lifecycle."""


@lru_cache(maxsize=4)
def _load(path: Path) -> dict[str, Any]:
    table: dict[str, Any] = json.loads(path.read_text())
    for key in ("source", "as_of", "regions"):
        if key not in table:
            raise ValueError(f"price table {path} lacks {key!r}")
    return table


def load_price_table(path: Path | None = None) -> dict[str, Any]:
    return _load(path or Path(os.environ.get(PRICE_TABLE_ENV) or PACKAGED_TABLE))


def hourly_price(
    instance_type: str, region: str, lifecycle: str, *, path: Path | None = None
) -> float:
    """Return the $/hour of one instance; the local backend (``lifecycle="local"``) costs 0."""
    if lifecycle == "local":
        return 0.0
    if lifecycle not in LIFECYCLES:
        raise UnknownPriceError(f"unknown lifecycle {lifecycle!r}; choose {', '.join(LIFECYCLES)}")
    regions: dict[str, Any] = load_price_table(path)["regions"]
    if region not in regions:
        raise UnknownPriceError(
            f"no prices for region {region!r}; the table has {', '.join(sorted(regions))}"
        )
    types: dict[str, Any] = regions[region]
    if instance_type not in types:
        raise UnknownPriceError(
            f"no price for {instance_type!r} in {region}; the table has {', '.join(sorted(types))}"
        )
    rates: dict[str, float] = types[instance_type]
    if lifecycle not in rates:
        raise UnknownPriceError(f"no {lifecycle} price for {instance_type!r} in {region}")
    return float(rates[lifecycle])


def instance_shapes(path: Path | None = None) -> dict[str, tuple[int, float]]:
    """Return {instance type: (vCPUs, memory GiB)} of the CPU types the table sizes fleets on."""
    table = load_price_table(path).get("instances", {})
    return {
        name: (int(shape["vcpus"]), float(shape["memory_gib"]))
        for name, shape in table.items()
        if not name.startswith("_")
    }


def instance_arch(instance_type: str, path: Path | None = None) -> str:
    """Return a CPU type's architecture: ``arm64`` (Graviton) or ``x86_64`` (the default)."""
    shape = load_price_table(path).get("instances", {}).get(instance_type, {})
    return str(shape.get("arch", "x86_64"))


def normal_arch(machine: str) -> str:
    name = machine.lower()
    return {"aarch64": "arm64", "amd64": "x86_64"}.get(name, name)


def _table_value(key: str, path: Path | None) -> Any:
    """Return a top-level entry of the table in use, else the packaged table's (an older
    custom table may lack it)."""
    table = load_price_table(path)
    return table[key] if key in table else load_price_table(PACKAGED_TABLE)[key]


def volume_usd_per_gb_month(region: str, *, path: Path | None = None) -> float:
    """Return the gp3 root volume's USD per GB-month in ``region`` (else the table's default)."""
    rates: dict[str, float] = _table_value("storage", path)["gp3_usd_per_gb_month"]
    return float(rates.get(region, rates["default"]))


def public_ipv4_usd_per_hour(*, path: Path | None = None) -> float:
    """Return what a public IPv4 address costs an hour (the same in every commercial region)."""
    return float(_table_value("public_ipv4_usd_per_hour", path))


def _on_demand_usd_per_hour(price_item: dict[str, Any]) -> float | None:
    """Return the hourly on-demand USD rate in one Price List API product document, if any."""
    for offer in price_item.get("terms", {}).get("OnDemand", {}).values():
        for dimension in offer.get("priceDimensions", {}).values():
            if dimension.get("unit") != "Hrs":
                continue
            usd = dimension.get("pricePerUnit", {}).get("USD")
            if usd is not None and float(usd) > 0:
                return float(usd)
    return None


def on_demand_from_price_list(client: Any, instance_type: str, region: str) -> float:
    """Return the Linux on-demand $/hour the Price List API gives, or raise UnknownPriceError."""
    response = client.get_products(
        ServiceCode="AmazonEC2",
        Filters=[
            {"Type": "TERM_MATCH", "Field": "instanceType", "Value": instance_type},
            {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region},
            {"Type": "TERM_MATCH", "Field": "operatingSystem", "Value": "Linux"},
            {"Type": "TERM_MATCH", "Field": "tenancy", "Value": "Shared"},
            {"Type": "TERM_MATCH", "Field": "preInstalledSw", "Value": "NA"},
            {"Type": "TERM_MATCH", "Field": "capacitystatus", "Value": "Used"},
        ],
        MaxResults=10,
    )
    rates = [
        rate
        for item in response.get("PriceList", [])
        if (rate := _on_demand_usd_per_hour(json.loads(item))) is not None
    ]
    if not rates:
        raise UnknownPriceError(
            f"the Price List API has no Linux on-demand price for {instance_type} in {region}"
        )
    return min(rates)


def refresh_from_pricing_api(
    instance_types: Iterable[str],
    regions: Iterable[str],
    *,
    client: Any | None = None,
    output: Path | None = None,
    as_of: str | None = None,
) -> dict[str, Any]:
    """Return the price table with on-demand rates re-read from the AWS Pricing API (spot rates
    kept: it has none), for an offline deployment's fallback; written to ``output`` if given."""
    if client is None:
        import boto3

        client = PriceListEndpoints(lambda region: boto3.client("pricing", region_name=region))
    table = copy.deepcopy(load_price_table())
    for region in regions:
        region_prices = table["regions"].setdefault(region, {})
        for instance_type in instance_types:
            rate = on_demand_from_price_list(client, instance_type, region)
            region_prices.setdefault(instance_type, {})["on-demand"] = rate
            log.info("on-demand %s in %s: $%.4f/h", instance_type, region, rate)
    table["as_of"] = as_of or datetime.now(UTC).date().isoformat()
    table["source"] = (
        "On-demand: AWS Pricing API (get_products, Linux, shared tenancy). "
        "Spot: kept from the previous table (indicative)."
    )
    if output is not None:
        output.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    return table
