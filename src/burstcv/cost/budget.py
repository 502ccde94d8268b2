"""Resolve a run's costs once, at its first task: the prices where it runs and its budget.

The training boxes' watchdog is armed from the run's deadline, so the time budget is what
bounds the bill: it is lowered until ``num_nodes`` boxes of the priciest kind a launch may get
(on-demand on the priciest allowed type, its root volume and public IPv4 included), living
until the deadline plus the watchdog's margin, cost no more than ``max_cost_usd``
(``burstcv.cost.model.time_budget``). The serving fleet's CPU types are priced here too, from
the same sources: a price nobody has is known before anything is rented, and the fleet is
then reported unpriced rather than the model rejected.
"""

from __future__ import annotations

import logging

from burstcv.compute.userdata import outlives_deadline_s
from burstcv.cost.model import LOCAL_RATE, time_budget
from burstcv.cost.pricing import (
    instance_shapes,
    public_ipv4_usd_per_hour,
    volume_usd_per_gb_month,
)
from burstcv.cost.quotes import PriceSources, quote
from burstcv.params import RunParams
from burstcv.settings import Settings
from burstcv_spec.contracts import BoxRate, PriceQuote, RunCosts

log = logging.getLogger(__name__)


class UnpricedRunError(RuntimeError):
    """Raise when none of a run's instance types has a price: its budget cannot be bounded."""


def price_sources(params: RunParams, settings: Settings) -> PriceSources:
    """Return where the run's prices come from: AWS (cached in the artifact store) when this
    deployment reaches AWS or the run trains on EC2; else the store's cache and the bundled
    table alone (a local run never waits on AWS)."""
    if params.compute_backend != "ec2" and not settings.aws_configured():
        return PriceSources(artifact_root=settings.artifact_root)
    from burstcv.compute.ec2 import Ec2Backend

    return Ec2Backend(settings.ec2).price_sources(settings.artifact_root)


def candidate_quotes(
    instance_types: list[str], region: str, sources: PriceSources
) -> dict[str, PriceQuote | None]:
    """Return each candidate type's on-demand quote (None: nobody prices it).

    On-demand is a launch's worst case: spot falls back to it.
    """
    return {t: quote(t, region, "on-demand", sources) for t in instance_types}


def worst_box_rate(params: RunParams, settings: Settings, sources: PriceSources) -> BoxRate:
    """Return the priciest box the run may rent, every part priced.

    A type nobody can price is assumed to cost the highest known price of the others; if
    none of them has a price, UnpricedRunError says what to set.
    """
    if params.compute_backend == "local":
        return LOCAL_RATE
    region = settings.ec2.region
    quotes = candidate_quotes(list(params.instance_types), region, sources)
    known = {t: q for t, q in quotes.items() if q is not None}
    if not known:
        raise UnpricedRunError(
            f"no price for any of the run's instance types ({', '.join(quotes)}) in {region}: "
            "the AWS Price List API did not answer and the bundled table has none; allow "
            "pricing:GetProducts to the orchestrator (deploy/iam-policy.json) or set "
            "BURSTCV_PRICE_TABLE to a table that prices one of them"
        )
    priciest = max(known.values(), key=lambda q: q.usd_per_hour)
    unpriced = [t for t, q in quotes.items() if q is None]
    if unpriced:
        log.warning(
            "no price for %s in %s; the budget counts them at the highest known price, "
            "%s's $%.4f/h",
            ", ".join(unpriced),
            region,
            priciest.instance_type,
            priciest.usd_per_hour,
        )
    return BoxRate(
        instance_type=priciest.instance_type,
        market="on-demand",
        usd_per_hour=priciest.usd_per_hour,
        price_source=f"{priciest.source}, {priciest.as_of}",
        volume_gb=settings.ec2.volume_gb,
        ebs_usd_per_gb_month=volume_usd_per_gb_month(region),
        # A box in a subnet that assigns public addresses (the default subnets do) pays one.
        public_ipv4_usd_per_hour=public_ipv4_usd_per_hour(),
    )


def serving_quotes(
    families: list[str], region: str, sources: PriceSources
) -> tuple[list[PriceQuote], str | None]:
    """Return the on-demand quotes of the CPU types of ``families``, and what is unpriced.

    The second value is None when every type has a price, else one line naming the types
    without one and what to set.
    """
    types = [t for t in sorted(instance_shapes()) if t.split(".")[0] in families]
    if not types:
        return [], (
            f"no CPU type of the families {', '.join(families)} is known to burstcv "
            "(serving_families: choose among "
            f"{', '.join(sorted({t.split('.')[0] for t in instance_shapes()}))})"
        )
    quotes = {t: quote(t, region, "on-demand", sources) for t in types}
    missing = [t for t, q in quotes.items() if q is None]
    unpriced = None
    if missing:
        unpriced = (
            f"no on-demand price for {', '.join(missing)} in {region}: the AWS Price List API "
            "did not answer and the bundled table has none; allow pricing:GetProducts to the "
            "orchestrator (deploy/iam-policy.json) or set BURSTCV_PRICE_TABLE to a table that "
            f"prices them in {region}"
        )
        log.warning("serving fleet: %s", unpriced)
    return [q for q in quotes.values() if q is not None], unpriced


def resolve_costs(params: RunParams, settings: Settings) -> RunCosts:
    """Return the run's prices and budget: what every later stage reads from run.json."""
    sources = price_sources(params, settings)
    region = settings.ec2.region
    rate = worst_box_rate(params, settings, sources)
    # An EC2 box outlives the deadline by at most the watchdog's margin (its expiry).
    margin_s = (
        outlives_deadline_s(settings.ec2.watchdog_margin_min)
        if params.compute_backend == "ec2"
        else 0
    )
    budget_s, reason = time_budget(
        params.max_cost_usd,
        params.time_budget_s,
        boxes=params.num_nodes,
        rate=rate,
        margin_s=margin_s,
    )
    serving, unpriced = serving_quotes(list(params.serving_families), region, sources)
    # The one-GPU types the gate may advise serving on, priced alike (unpriced: advised so).
    from burstcv.gate.gate import GPU_SERVING_TYPES

    gpus = [q for t in GPU_SERVING_TYPES if (q := quote(t, region, "on-demand", sources))]
    return RunCosts(
        region=region,
        boxes=params.num_nodes,
        max_cost_usd=params.max_cost_usd,
        box_rate=rate,
        time_budget_s=budget_s,
        margin_s=margin_s,
        budget_reason=reason,
        serving=serving + gpus,
        serving_unpriced=unpriced,
    )
