"""Bound a run's time budget by its money budget, at the prices of the types it may rent.

The training box's watchdog is armed from the time budget, so the time budget is what bounds
the bill: provision lowers it until the priciest launch the run allows (on-demand on its
priciest type) costs no more than ``max_cost_usd``.
"""

from __future__ import annotations

import logging

from burstcv.cost.pricing import time_budget_for
from burstcv.params import RunParams
from burstcv.settings import Settings

log = logging.getLogger(__name__)


class UnpricedRunError(RuntimeError):
    """Raise when none of a run's instance types has a price: its budget cannot be bounded."""


def candidate_prices(instance_types: list[str], settings: Settings) -> dict[str, float | None]:
    """Return the on-demand $/hour of each candidate type (None: nobody knows it).

    On-demand is a launch's worst case (spot falls back to it). Quoted from AWS through the
    EC2 backend's connection, cached in the artifact store, the bundled table only offline.
    """
    from burstcv.compute.ec2 import Ec2Backend
    from burstcv.cost.quotes import quote  # botocore: imported when a price is asked

    backend = Ec2Backend(settings.ec2)
    sources = backend.price_sources(settings.artifact_root)
    region = backend.settings.region
    prices: dict[str, float | None] = {}
    for instance_type in instance_types:
        found = quote(instance_type, region, "on-demand", sources)
        prices[instance_type] = None if found is None else found.usd_per_hour
    return prices


def bounded_time_budget(params: RunParams, settings: Settings) -> int:
    """Return the run's time budget, lowered so the most expensive launch stays under max_cost_usd.

    The worst case is on-demand on the priciest allowed type (spot may fall back to it); the
    training box's watchdog is armed from this number, so it is what bounds the bill. A type
    nobody can price is assumed to cost the highest known price of the others; if none of
    them has a price, UnpricedRunError says what to set.
    """
    if params.compute_backend == "local":
        return params.time_budget_s
    region = settings.ec2.region
    prices = candidate_prices(list(params.instance_types), settings)
    known = {t: usd for t, usd in prices.items() if usd is not None}
    if not known:
        raise UnpricedRunError(
            f"no price for any of the run's instance types ({', '.join(prices)}) in {region}: "
            "the AWS Price List API did not answer and the bundled table has none; allow "
            "pricing:GetProducts to the orchestrator (deploy/iam-policy.json) or set "
            "BURSTCV_PRICE_TABLE to a table that prices one of them"
        )
    priciest = max(known, key=lambda t: known[t])
    unpriced = [t for t, usd in prices.items() if usd is None]
    if unpriced:
        log.warning(
            "no price for %s in %s; the budget counts them at the highest known price, "
            "%s's $%.4f/h",
            ", ".join(unpriced),
            region,
            priciest,
            known[priciest],
        )
    return time_budget_for(
        params.max_cost_usd,
        priciest,
        region,
        "on-demand",
        params.time_budget_s,
        usd_per_hour=known[priciest],
    )
