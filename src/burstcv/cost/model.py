"""Price what burstcv rents, one way: a box, a run of boxes, its budget, a serving fleet.

EC2's rules, as billed (Linux):
- the instance per second from ``running`` (``pending`` is not billed), at least 60 s a start;
- its EBS root volume per GB-month (730 hours), per second from launch to termination, at
  least 60 s;
- a public IPv4 address per hour while attached, from launch to termination.
A run is every box of every attempt; an attempt starts ``num_nodes`` boxes at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from burstcv_spec.contracts import BoxBill, BoxRate

HOURS_PER_MONTH = 730.0
MINIMUM_BILLED_S = 60  # per instance start, and per volume
# A serving replica runs at most at 70% of its sustainable rate: load moves faster than a
# fleet scales, and a replica near its limit breaks the SLO.
DEFAULT_HEADROOM = 0.3
# One-GPU types the gate may advise serving on (the cheapest priced one is suggested).
GPU_SERVING_TYPES: tuple[str, ...] = ("g4dn.xlarge", "g6.xlarge", "g5.xlarge")
LOCAL_RATE = BoxRate(
    instance_type="local", market="local", usd_per_hour=0.0, price_source="local compute"
)


class BudgetTooSmallError(ValueError):
    """Raise when a dollar budget does not buy even the minimum billed minute of its boxes."""


def box_usd_per_hour(rate: BoxRate) -> float:
    """Return what one box costs an hour: instance, root volume and public IPv4 together."""
    volume = rate.volume_gb * rate.ebs_usd_per_gb_month / HOURS_PER_MONTH
    return rate.usd_per_hour + volume + rate.public_ipv4_usd_per_hour


def outlives_deadline_s(margin_min: int) -> int:
    """Return the seconds a box may outlive the run's deadline: the watchdog's margin and the
    minute its ``shutdown -h +N`` rounds up to."""
    return (margin_min + 1) * 60


def _at(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} is not a timezone-aware time")
    return moment


@dataclass(frozen=True)
class BoxCost:
    """What one box cost up to its end (or now): the instance's billed seconds and the dollars."""

    instance_s: float  # billed instance seconds (0 for a box that never ran)
    usd: float


def box_cost(box: BoxBill, now: datetime) -> BoxCost:
    """Return what one box of an attempt cost up to its end (or ``now``), as EC2 bills it; an
    unknown ``running_at`` bills the instance from launch (an upper bound)."""
    launched = _at(box.launched_at)
    ended = max(_at(box.ended_at) if box.ended_at else now, launched)
    if box.market == "local":
        return BoxCost((ended - launched).total_seconds(), 0.0)
    running = min(max(_at(box.running_at), launched), ended) if box.running_at else launched
    instance_s = float(max(MINIMUM_BILLED_S, math.ceil((ended - running).total_seconds())))
    attached_s = float(max(MINIMUM_BILLED_S, math.ceil((ended - launched).total_seconds())))
    attached_usd_per_hour = box_usd_per_hour(box) - box.usd_per_hour
    usd = (box.usd_per_hour * instance_s + attached_usd_per_hour * attached_s) / 3600.0
    return BoxCost(instance_s, usd)


def attempt_minimum_usd(rate: BoxRate, boxes: int, margin_s: int) -> float:
    """Return what an attempt of ``boxes`` boxes at ``rate`` is sure to cost if it starts late:
    each box's billed minimum and the ``margin_s`` it may outlive the deadline."""
    return boxes * box_usd_per_hour(rate) * (MINIMUM_BILLED_S + margin_s) / 3600.0


def time_budget(
    max_cost_usd: float, cap_s: int, *, boxes: int, rate: BoxRate, margin_s: int
) -> tuple[int, str]:
    """Return (seconds from provision to the deadline, why): at most ``cap_s``, and what
    ``max_cost_usd`` buys the boxes living until the deadline plus ``margin_s``."""
    if cap_s <= 0:
        raise ValueError(f"cap_s must be positive, got {cap_s}")
    if boxes < 1:
        raise ValueError(f"boxes must be at least 1, got {boxes}")
    per_hour = boxes * box_usd_per_hour(rate)
    if per_hour <= 0:
        return cap_s, f"{cap_s} s: the run's time budget (its compute costs nothing)"
    # Rounded to the microsecond first: a budget that buys exactly N seconds is not a float
    # rounding short of them.
    affordable_s = math.floor(round(max_cost_usd / per_hour * 3600.0, 6)) - margin_s
    where = f"{boxes} x {rate.instance_type} {rate.market} at ${per_hour / boxes:.4f}/h a box"
    if affordable_s < MINIMUM_BILLED_S:
        needed = attempt_minimum_usd(rate, boxes, margin_s)
        raise BudgetTooSmallError(
            f"${max_cost_usd:.4f} does not cover {where} for the {MINIMUM_BILLED_S} s minimum "
            f"and the watchdog's {margin_s} s margin (${needed:.4f}); raise max_cost_usd"
        )
    if affordable_s >= cap_s:
        return cap_s, f"{cap_s} s: the run's time budget ({where} costs less than its budget)"
    return affordable_s, (
        f"{affordable_s} s: what ${max_cost_usd:.2f} buys {where}, less the watchdog's "
        f"{margin_s} s margin (the time budget was {cap_s} s)"
    )


def replicas_for(target_rps: float, rate_rps: float, headroom: float) -> int:
    """Return the replicas that serve ``target_rps`` when each runs at most at 1 - headroom."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    if rate_rps <= 0 or target_rps <= 0:
        raise ValueError(f"rates must be positive, got {rate_rps} and {target_rps}")
    return max(1, math.ceil(target_rps / (rate_rps * (1 - headroom))))


@dataclass(frozen=True)
class FleetCost:
    """What a serving fleet costs: per hour, per month and per million predictions."""

    usd_per_hour: float
    usd_per_month: float
    usd_per_million: float


def fleet_cost(usd_per_hour_each: float, replicas: int, target_rps: float) -> FleetCost:
    """Return what ``replicas`` on-demand instances cost serving ``target_rps`` around the clock."""
    if target_rps <= 0:
        raise ValueError(f"target_rps must be positive, got {target_rps}")
    per_hour = replicas * usd_per_hour_each
    return FleetCost(
        usd_per_hour=per_hour,
        usd_per_month=per_hour * HOURS_PER_MONTH,
        usd_per_million=per_hour / (target_rps * 3600.0) * 1e6,
    )
