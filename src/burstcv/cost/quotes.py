"""Quote an instance's hourly price from AWS, cached in the artifact store; the table offline.

On-demand prices come from the AWS Price List API (``pricing:GetProducts``), spot prices from
the EC2 spot price history of the Availability Zone launched (``ec2:DescribeSpotPriceHistory``).
The orchestrator asks, never the box. Each answer is written to
``<artifact root>/prices/<region>/<type>/<market>[-<zone>].json`` with its date and source,
and reused while fresh (on-demand a week, spot an hour). When AWS cannot answer (no route, no
permission, a type it does not price) a stale answer from the store is used, then the bundled
table (``prices.json``), each saying so in its ``source``; when none has a price the quote is
None and the caller decides (the budget takes the highest known price of the candidates).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from burstcv.cost.pricing import (
    UnknownPriceError,
    hourly_price,
    load_price_table,
    on_demand_from_price_list,
)
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


def quote_uri(artifact_root: str, instance_type: str, region: str, market: str, zone: str) -> str:
    """Return where one quote is cached in the artifact store."""
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
    """Return the hourly price of one instance type and market, or None if nobody knows it.

    ``zone`` names the Availability Zone of a spot box; without it the spot quote is the
    highest of the region's zones (a bound, for a box not yet placed).
    """
    now = now or datetime.now(UTC)
    uri = quote_uri(sources.artifact_root, instance_type, region, market, zone)
    cached = _cached(uri)
    if cached is not None and now - datetime.fromisoformat(cached.fetched_at) < FRESH_FOR[market]:
        return cached
    try:
        fetched = _fetch(instance_type, region, market, zone, sources, now)
    except _AWS_ERRORS as exc:
        log.warning(
            "the %s price of %s in %s%s could not be read from AWS: %s",
            market,
            instance_type,
            region,
            f" ({zone})" if zone else "",
            exc,
        )
        fetched = None
    if fetched is not None:
        write_artifact(uri, fetched)
        return fetched
    if cached is not None:
        log.warning("using the %s price of %s fetched %s", market, instance_type, cached.fetched_at)
        return cached
    return bundled_quote(instance_type, region, market, zone, now)


def bundled_quote(
    instance_type: str, region: str, market: str, zone: str, now: datetime
) -> PriceQuote | None:
    """Return the bundled table's price (dated by the table), or None if it has none."""
    try:
        usd = hourly_price(instance_type, region, market)
    except UnknownPriceError:
        return None
    return PriceQuote(
        instance_type=instance_type,
        region=region,
        market=market,
        zone=zone,
        usd_per_hour=usd,
        source=SOURCE_BUNDLED,
        as_of=str(load_price_table()["as_of"]),
        fetched_at=now.isoformat(),
    )


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
    instance_type: str,
    region: str,
    market: str,
    zone: str,
    sources: PriceSources,
    now: datetime,
) -> PriceQuote | None:
    if market == "on-demand" and sources.pricing is not None:
        usd = on_demand_from_price_list(sources.pricing(), instance_type, region)
        source, as_of = SOURCE_PRICE_LIST, now
    elif market == "spot" and sources.ec2 is not None:
        usd, as_of = spot_from_history(sources.ec2(), instance_type, zone, now)
        source = SOURCE_SPOT_HISTORY
    else:
        return None
    where = f"{region} ({zone})" if zone else region
    log.info("%s %s in %s: $%.4f/h (%s)", market, instance_type, where, usd, source)
    return PriceQuote(
        instance_type=instance_type,
        region=region,
        market=market,
        zone=zone,
        usd_per_hour=usd,
        source=source,
        as_of=as_of.astimezone(UTC).isoformat(),
        fetched_at=now.isoformat(),
    )


def _cached(uri: str) -> PriceQuote | None:
    if not storage.exists(uri):
        return None
    try:
        return read_artifact(uri, PriceQuote)
    except ArtifactError as exc:
        log.warning("ignoring an unreadable cached price: %s", exc)
        return None
