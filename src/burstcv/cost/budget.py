"""Resolve a run's costs once, at its first task: the prices where it runs and its budget.

The watchdog is armed from the run's deadline, so the time budget bounds the bill. Serving CPU
types are priced here too, so a missing price is known before anything is rented (the fleet is
reported unpriced, the model not rejected). EC2 sizing boxes' worst cost is set aside first.
"""

from __future__ import annotations

import logging

from burstcv.cost.boot import boot_estimate
from burstcv.cost.model import (
    GPU_SERVING_TYPES,
    LOCAL_RATE,
    MINIMUM_BILLED_S,
    BudgetTooSmallError,
    attempt_minimum_usd,
    box_usd_per_hour,
    outlives_deadline_s,
    time_budget,
)
from burstcv.cost.pricing import instance_shapes, public_ipv4_usd_per_hour, volume_usd_per_gb_month
from burstcv.cost.quotes import PriceSources, aws_price_sources, quote
from burstcv.params import RunParams
from burstcv.settings import Settings
from burstcv_spec import storage
from burstcv_spec.contracts import BoxRate, PriceQuote, RunCosts, SizingBudget

log = logging.getLogger(__name__)

AUTO_SIZING_SHARE = 0.25  # of a run's budget its sizing boxes may take when size_on is auto
# What to do about a type no source prices (the rest of the sentence names the types).
_NO_PRICE_FIX = (
    "the AWS Price List API did not answer and the bundled table has none; allow "
    "pricing:GetProducts to the orchestrator (deploy/iam-policy.json) or set "
    "BURSTCV_PRICE_TABLE to a table that prices"
)


class UnpricedRunError(RuntimeError):
    """Raise when none of a run's instance types has a price: its budget cannot be bounded."""


def price_sources(params: RunParams, settings: Settings) -> PriceSources:
    """Return where the run's prices come from: AWS, cached in the store, when this deployment
    reaches AWS or trains on EC2; else the cache and the bundled table (a local run never waits)."""
    if params.compute_backend != "ec2" and not settings.aws_configured():
        return PriceSources(artifact_root=settings.artifact_root)
    return aws_price_sources(settings.ec2, settings.artifact_root)


def candidate_quotes(
    instance_types: list[str], region: str, sources: PriceSources
) -> dict[str, PriceQuote | None]:
    """Return each type's on-demand quote (None: nobody prices it); on-demand is a launch's
    worst case: spot falls back to it."""
    return {t: quote(t, region, "on-demand", sources) for t in instance_types}


def _on_demand_rate(price: PriceQuote, region: str, volume_gb: int) -> BoxRate:
    """Return a box on-demand at ``price``, with its root volume and a public IPv4 (a subnet
    that assigns public addresses, as the default subnets do, gives it one)."""
    return BoxRate(
        instance_type=price.instance_type,
        market="on-demand",
        usd_per_hour=price.usd_per_hour,
        price_source=f"{price.source}, {price.as_of}",
        volume_gb=volume_gb,
        ebs_usd_per_gb_month=volume_usd_per_gb_month(region),
        public_ipv4_usd_per_hour=public_ipv4_usd_per_hour(),
    )


def worst_box_rate(params: RunParams, settings: Settings, sources: PriceSources) -> BoxRate:
    """Return the priciest box the run may rent, every part priced: a type nobody prices
    counts at the highest known price; none priced raises UnpricedRunError."""
    if params.compute_backend == "local":
        return LOCAL_RATE
    region = settings.ec2.region
    quotes = candidate_quotes(list(params.instance_types), region, sources)
    known = {t: q for t, q in quotes.items() if q is not None}
    if not known:
        raise UnpricedRunError(
            f"no price for any of the run's instance types ({', '.join(quotes)}) in {region}: "
            f"{_NO_PRICE_FIX} one of them"
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
    return _on_demand_rate(priciest, region, settings.ec2.volume_gb)


def refuse_a_deadline_before_boot(
    params: RunParams,
    artifact_root: str,
    training_usd: float,
    budget_s: int,
    rate: BoxRate,
    margin_s: int,
) -> None:
    """Raise BudgetTooSmallError when the run's deadline comes before the slowest boot among
    its instance types (measured here, else its family's floor): its boxes would never train."""
    boot = max(
        (boot_estimate(artifact_root, t) for t in params.instance_types), key=lambda b: b.seconds
    )
    if budget_s > boot.seconds:
        return
    boxes = params.num_nodes
    if budget_s == params.time_budget_s:
        bought, fix = f"time_budget_s leaves {budget_s} s", "raise time_budget_s"
    else:
        bought = f"{boxes} x {rate.instance_type} at ${training_usd:.2f} buys {budget_s} s"
        # The boot, a minute of training and the margin, for every box; the sizing's reserve.
        needed = attempt_minimum_usd(rate, boxes, round(boot.seconds) + margin_s)
        needed += params.max_cost_usd - training_usd
        fix = f"raise max_cost_usd to ${needed:.2f} or more for a minute of training"
    raise BudgetTooSmallError(
        f"{bought} to the deadline; a {boot.instance_type} box's boot takes about "
        f"{boot.seconds:.0f} s ({boot.source}): its boxes would be paid and never train; {fix}, "
        "or choose instance types that boot sooner"
    )


def serving_quotes(
    families: list[str], region: str, sources: PriceSources
) -> tuple[list[PriceQuote], str | None]:
    """Return the on-demand quotes of ``families``' CPU types, and a line naming the unpriced."""
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
            f"no on-demand price for {', '.join(missing)} in {region}: {_NO_PRICE_FIX} them "
            f"in {region}"
        )
        log.warning("serving fleet: %s", unpriced)
    return [q for q in quotes.values() if q is not None], unpriced


def resolve_costs(params: RunParams, settings: Settings) -> RunCosts:
    """Return the run's prices and budget: what every later stage reads from run.json."""
    sources = price_sources(params, settings)
    region = settings.ec2.region
    rate = worst_box_rate(params, settings, sources)
    # An EC2 box outlives the deadline by at most the watchdog's margin (its expiry).
    on_ec2 = params.compute_backend == "ec2"
    margin_s = outlives_deadline_s(settings.ec2.watchdog_margin_min) if on_ec2 else 0
    sizing = sizing_budget(params, settings, region, sources)
    reserve_usd = sizing.reserve_usd if sizing else 0.0
    training_usd = params.max_cost_usd - reserve_usd
    if training_usd <= 0:
        raise BudgetTooSmallError(
            f"${params.max_cost_usd:.2f} does not cover the sizing boxes' reserve "
            f"(${reserve_usd:.4f}: size on ec2); raise max_cost_usd, "
            "lower sizing_boxes or sizing_max_s, or size on the host"
        )
    budget_s, reason = time_budget(
        training_usd, params.time_budget_s, boxes=params.num_nodes, rate=rate, margin_s=margin_s
    )
    if on_ec2:
        refuse_a_deadline_before_boot(
            params, sources.artifact_root, training_usd, budget_s, rate, margin_s
        )
    serving, unpriced = serving_quotes(list(params.serving_families), region, sources)
    # The one-GPU types the gate may advise serving on, priced alike (unpriced: advised so).
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
        sizing=sizing,
    )


def sizing_budget(
    params: RunParams, settings: Settings, region: str, sources: PriceSources
) -> SizingBudget | None:
    """Return what the run sets aside for its sizing boxes (the most they can cost, whichever
    types they size), or None when it sizes on the host."""
    if params.sizes_on(settings.artifact_root) != "ec2":
        return None
    if not storage.is_s3(settings.artifact_root):
        raise ValueError(
            f"size_on ec2: sizing boxes read the model and write their figures in S3, and the "
            f"artifact root {settings.artifact_root} is not; set BURSTCV_ARTIFACT_ROOT to an "
            "s3:// URI, or size_on host"
        )
    quotes, _ = serving_quotes(list(params.serving_families), region, sources)
    if not quotes:
        why = (
            f"no CPU type of the serving families ({', '.join(params.serving_families)}) has "
            f"a price in {region}, so sizing boxes cannot be budgeted"
        )
        if params.size_on == "ec2":
            raise UnpricedRunError(f"size_on ec2: {why}; set BURSTCV_PRICE_TABLE or size_on host")
        # Chosen by default: the host sizes the fleet, as it would be reported unpriced anyway.
        log.warning("sizing on the host: %s", why)
        return None
    priciest = max(quotes, key=lambda q: q.usd_per_hour)
    rate = _on_demand_rate(priciest, region, settings.ec2.sizing_volume_gb)
    margin_s = outlives_deadline_s(settings.ec2.sizing_margin_min)
    reserve = params.sizing_boxes * box_usd_per_hour(rate) * (params.sizing_max_s + margin_s)
    if params.size_on == "auto" and reserve / 3600.0 > AUTO_SIZING_SHARE * params.max_cost_usd:
        # Chosen by default, the boxes may not take the training's budget: the host sizes.
        log.warning(
            "sizing on the host: %d sizing boxes would set aside $%.4f, over %d%% of the "
            "$%.2f budget (size_on ec2 asks for them anyway)",
            params.sizing_boxes,
            reserve / 3600.0,
            round(AUTO_SIZING_SHARE * 100),
            params.max_cost_usd,
        )
        return None
    return SizingBudget(
        boxes=params.sizing_boxes,
        max_s=params.sizing_max_s,
        margin_s=margin_s,
        box_rate=rate,
        reserve_usd=round(reserve / 3600.0, 6),
    )


def relaunch_refusal(costs: RunCosts, spent_usd: float) -> str | None:
    """Return why the run's training budget cannot start another attempt, or None: what its
    boxes have cost and the new attempt's boxes for the billed minimum and the margin must fit."""
    rate, boxes = costs.box_rate, costs.boxes
    needed = attempt_minimum_usd(rate, boxes, costs.margin_s)
    budget = costs.training_usd
    left = budget - spent_usd
    # Rounded to the microdollar: a budget that covers exactly the attempt is not short of it.
    if round(needed, 6) <= round(left, 6):
        return None
    return (
        f"the run's boxes have cost ${spent_usd:.4f} of its ${budget:.4f} training budget, "
        f"${max(0.0, left):.4f} left; another attempt of {boxes} x {rate.instance_type} "
        f"needs ${needed:.4f} (at ${box_usd_per_hour(rate):.4f}/h a box, its "
        f"{MINIMUM_BILLED_S} s minimum and the watchdog's {costs.margin_s} s margin): over the "
        "budget; no relaunch"
    )
