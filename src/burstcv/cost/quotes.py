"""Quote an instance's hourly price from AWS, cached in the artifact store; the table offline.

On-demand prices come from the Price List API, spot prices from the spot price history of the
Availability Zone launched; the orchestrator asks, never the box. An answer is reused while
fresh; when AWS cannot answer, a stale answer from the store is used, then the bundled table,
each saying so in its ``source``; when none has a price the quote is None and the caller decides.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from burstcv.cost.pricing import (
    PriceListEndpoints,
    UnknownPriceError,
    hourly_price,
    load_price_table,
    on_demand_from_price_list,
)
from burstcv.settings import Ec2Settings
from burstcv_spec import storage
from burstcv_spec.contracts import ArtifactError, PriceQuote, read_artifact, write_artifact

log = logging.getLogger(__name__)

FRESH_FOR = {
    "on-demand": timedelta(days=7),  # list prices change a few times a year
    "spot": timedelta(hours=1),  # spot prices move by the hour
}
SOURCE_PRICE_LIST = "AWS Price List API (GetProducts: Linux, shared tenancy, no software)"
SOURCE_SPOT_HISTORY = "EC2 DescribeSpotPriceHistory (Linux/UNIX)"
SOURCE_BUNDLED = "bundled table burstcv/cost/prices.json (offline fallback)"
_AWS_ERRORS = (ClientError, BotoCoreError, UnknownPriceError)

ClientFactory = Callable[[], Any]


@dataclass(frozen=True)
class PriceSources:
    """Name the AWS clients a quote may ask (built on first use) and the store that caches."""

    artifact_root: str
    pricing: ClientFactory | None = None  # the Price List API's client (us-east-1)
    ec2: ClientFactory | None = None  # the region's EC2 client


def aws_price_sources(ec2: Ec2Settings, artifact_root: str) -> PriceSources:
    """Return AWS as the price source over the deployment's ``aws_conn_id``, cached in the store."""
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

    @functools.cache
    def client(client_type: str, region: str) -> Any:
        return AwsBaseHook(
            aws_conn_id=ec2.aws_conn_id, client_type=client_type, region_name=region
        ).conn

    pricing = PriceListEndpoints(lambda region: client("pricing", region))
    return PriceSources(
        artifact_root, pricing=lambda: pricing, ec2=lambda: client("ec2", ec2.region)
    )


def quote_uri(artifact_root: str, instance_type: str, region: str, market: str, zone: str) -> str:
    name = f"{market}-{zone}.json" if zone else f"{market}.json"
    return storage.join(artifact_root, "prices", region, instance_type, name)


def quote(
    instance_type: str,
    region: str,
    market: str,
    sources: PriceSources,
    *,
    zone: str = "",
    now: datetime | None = None,
) -> PriceQuote | None:
    """Return the hourly price of one instance type and market, or None if nobody knows it;
    without ``zone``, a spot quote is the region's highest (a bound, for a box not yet placed)."""
    now = now or datetime.now(UTC)
    uri = quote_uri(sources.artifact_root, instance_type, region, market, zone)
    cached = _cached(uri)
    if cached is not None and now - datetime.fromisoformat(cached.fetched_at) < FRESH_FOR[market]:
        return cached
    where = f"{region} ({zone})" if zone else region
    try:
        priced = _fetch(instance_type, region, market, zone, sources, now)
    except _AWS_ERRORS as exc:
        log.warning(
            "the %s price of %s in %s could not be read from AWS: %s",
            market,
            instance_type,
            where,
            exc,
        )
        priced = None
    if priced is None and cached is not None:
        log.warning("using the %s price of %s fetched %s", market, instance_type, cached.fetched_at)
        return cached
    if priced is None:
        try:  # the bundled table's price, dated by the table
            usd = hourly_price(instance_type, region, market)
        except UnknownPriceError:
            return None
        priced = usd, SOURCE_BUNDLED, str(load_price_table()["as_of"])
    else:
        log.info("%s %s in %s: $%.4f/h (%s)", market, instance_type, where, *priced[:2])
    usd, source, as_of = priced
    found = PriceQuote(
        instance_type=instance_type,
        region=region,
        market=market,
        zone=zone,
        usd_per_hour=usd,
        source=source,
        as_of=as_of,
        fetched_at=now.isoformat(),
    )
    if source != SOURCE_BUNDLED:  # a fallback is not cached as if AWS had said it
        write_artifact(uri, found)
    return found


def spot_from_history(
    client: Any, instance_type: str, zone: str, now: datetime
) -> tuple[float, datetime]:
    """Return the current spot $/hour (and its time) in ``zone``, or the region's highest."""
    kwargs: dict[str, Any] = {
        "InstanceTypes": [instance_type],
        "ProductDescriptions": ["Linux/UNIX"],
        "StartTime": now,  # the price in force now, per zone
    }
    if zone:
        kwargs["Filters"] = [{"Name": "availability-zone", "Values": [zone]}]
    latest: dict[str, tuple[datetime, float]] = {}
    for page in client.get_paginator("describe_spot_price_history").paginate(**kwargs):
        for entry in page.get("SpotPriceHistory", []):
            at, where = entry["Timestamp"], entry.get("AvailabilityZone", "")
            if where not in latest or at > latest[where][0]:
                latest[where] = (at, float(entry["SpotPrice"]))
    if not latest:
        where = zone or "any zone"
        raise UnknownPriceError(f"no spot price history for {instance_type} in {where}")
    at, usd = max(latest.values(), key=lambda pair: pair[1])
    return usd, at


def _fetch(
    instance_type: str, region: str, market: str, zone: str, sources: PriceSources, now: datetime
) -> tuple[float, str, str] | None:
    """Return AWS's price: ($/hour, source, as of), or None when no source is given."""
    if market == "on-demand" and sources.pricing is not None:
        usd = on_demand_from_price_list(sources.pricing(), instance_type, region)
        source, as_of = SOURCE_PRICE_LIST, now
    elif market == "spot" and sources.ec2 is not None:
        usd, as_of = spot_from_history(sources.ec2(), instance_type, zone, now)
        source = SOURCE_SPOT_HISTORY
    else:
        return None
    return usd, source, as_of.astimezone(UTC).isoformat()


def _cached(uri: str) -> PriceQuote | None:
    if not storage.exists(uri):
        return None
    try:
        return read_artifact(uri, PriceQuote)
    except ArtifactError as exc:
        log.warning("ignoring an unreadable cached price: %s", exc)
        return None
