"""Decide whether a candidate may replace production: SLO, errors, accuracy, no regression.

When the candidate misses the latency SLO, the verdict also carries priced suggestions
(INT8, a smaller architecture, a larger CPU instance, GPU serving), each with an estimated
p95 and cost per 1M predictions at the run's expected load (``burstcv.cost.model``, the
run's resolved prices), and the assumption behind the estimate.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from burstcv.cost.model import DEFAULT_HEADROOM, fleet_cost, replicas_for
from burstcv.cost.pricing import instance_shapes
from burstcv.training.names import ARCHITECTURE_NAMES
from burstcv_spec.contracts import (
    BenchFigures,
    GateCheck,
    GateVerdict,
    SizingReport,
    Suggestion,
    SuggestionAction,
)

log = logging.getLogger(__name__)

DEFAULT_SERVING_INSTANCE = "c7i.large"
DEFAULT_SERVING_REGION = "us-east-1"

# vCPUs per instance type: the CPU types of the price table's shapes, and the one-GPU types
# (AWS's published figures).
VCPUS: dict[str, int] = {
    **{name: vcpus for name, (vcpus, _) in instance_shapes().items()},
    "g4dn.xlarge": 4,
    "g5.xlarge": 4,
    "g6.xlarge": 4,
}
# Larger CPU types to consider, smallest first.
CPU_UPGRADES: tuple[str, ...] = ("c7i.xlarge", "c7i.2xlarge")
# One-GPU types to consider for GPU serving; the cheapest priced one is suggested.
GPU_SERVING_TYPES: tuple[str, ...] = ("g4dn.xlarge", "g6.xlarge", "g5.xlarge")

# onnxruntime's CPU time per image (ms; median at batch 1, one intra-op thread, each model run
# steadily), measured by bench/arch_cpu.py on an AMD EPYC with onnxruntime 1.32: at 32 px
# with the small-input stem (trained from scratch, inputs up to 64 px) and at 224 px with
# torchvision's stem. Measured, not multiply-adds: the depthwise nets (mobilenet,
# efficientnet) run fewer operations per second on CPU, so efficientnet_b0, with half
# resnet10's multiply-adds, costs about as much as resnet10 at 32 px.
ARCH_CPU_MS: dict[str, tuple[float, float]] = {
    "resnet10": (2.29, 17.6),
    "resnet18": (5.67, 35.0),
    "resnet34": (11.51, 69.6),
    "resnet50": (11.64, 78.3),
    "mobilenet_v3_small": (0.423, 2.23),
    "mobilenet_v3_large": (1.26, 6.78),
    "efficientnet_b0": (2.20, 12.35),
    "convnext_tiny": (13.79, 104.6),
}
# An architecture is advised for a latency miss only when it is measured at least this much
# cheaper per image: closer figures are within the measurement's spread between hosts.
MAX_COST_RATIO = 0.8
assert set(ARCH_CPU_MS) == set(ARCHITECTURE_NAMES), "keep ARCH_CPU_MS in step with names.py"
SMALL_STEM_MAX_PX = 64  # burstcv.training.models.SMALL_INPUT_PX (not imported: it pulls torch)


def small_stem(input_px: int | None) -> bool:
    """Tell whether a model of this input side has the small-input stem's figures."""
    return input_px is not None and input_px <= SMALL_STEM_MAX_PX


def arch_cpu_ms(arch: str, input_px: int | None) -> float | None:
    """Return ``arch``'s measured CPU time per image at the input size's stem, or None."""
    costs = ARCH_CPU_MS.get(arch)
    if costs is None:
        return None
    return costs[0] if small_stem(input_px) else costs[1]


INT8_SPEEDUP = 2.0  # onnxruntime INT8 vs FP32 on CPUs with VNNI/AMX (c7i): 1.5-3x for CNNs
GPU_COMPUTE_MS = 1.0  # a small CNN at batch 1 on one data-centre GPU, copies included


@dataclass
class GateThresholds:
    """Hold the limits a candidate must meet."""

    latency_slo_ms: float  # p95 over HTTP, one image per request
    accuracy_floor: float  # validation top-1
    max_accuracy_drop: float  # against production on the same validation split
    # p95 against production's, as a fraction (0.2: at most 20% slower); None: not checked.
    max_latency_increase: float | None = None


@dataclass(frozen=True)
class ServingContext:
    """Say what was measured and where it would serve, so advice can be priced."""

    arch: str | None = None  # the candidate's architecture; None: no smaller-model advice
    input_px: int | None = None  # the candidate's input side; None: the 224 px figures
    int8_tried: bool = False  # an INT8 model was already measured: do not suggest it again
    region: str = DEFAULT_SERVING_REGION
    # On-demand USD per hour by instance type, as the run resolved them; a type without one
    # is advised unpriced.
    prices: dict[str, float] = field(default_factory=dict)
    target_rps: float = 10.0  # the run's expected peak load: advice is priced at it
    instance_type: str = DEFAULT_SERVING_INSTANCE  # the CPU type production serves on
    # vCPUs of the benchmark host; None: assume it matches instance_type.
    measured_vcpus: int | None = None
    # The rate a service on measured_vcpus sustains within the SLO (the fleet sizing's); None:
    # unmeasured, and a closed-loop benchmark's throughput stands in for it.
    capacity_rps: float | None = None


def verdict_of(checks: list[GateCheck], suggestions: list[Suggestion]) -> GateVerdict:
    """Return the verdict of these checks: promote when all passed, else each reason.

    The summary is one line: 'promote' or 'not promoted: <reasons>' (+ the cheapest fix).
    """
    reasons = [c.reason or c.name for c in checks if not c.passed]
    summary = "promote"
    if reasons:
        summary = "not promoted: " + "; ".join(reasons)
        fix = next((s for s in suggestions if s.meets_slo), None)
        if fix is not None:
            summary += f"; cheapest fix: {fix.title} (est. p95 {fix.estimated_p95_ms:.1f} ms"
            cost = fix.cost_per_million_usd
            summary += f", ${cost:.2f} per 1M)" if cost is not None else ")"
    return GateVerdict(
        promote=not reasons,
        reasons=reasons,
        checks=checks,
        suggestions=suggestions,
        summary=summary,
        failed_figures=[describe_check(c) for c in checks if not c.passed],
    )


def check_lines(verdict: GateVerdict) -> list[str]:
    """Return a line per check (observed vs limit, passed or failed) and the verdict."""
    lines = [
        f"gate check {c.name}: {describe_check(c)}: {'passed' if c.passed else 'FAILED'}"
        for c in verdict.checks
    ]
    lines.append(f"gate verdict: {verdict.summary}")
    return lines


# How each check reads as "<observed> <op> <limit>": (what, limit's name, format, unit).
_CHECK_FIGURES: dict[str, tuple[str, str, str, str]] = {
    "latency_p95": ("p95", "SLO", ".2f", " ms"),
    "error_rate": ("error rate", "allowed", ".1%", ""),
    "accuracy_floor": ("accuracy", "floor", ".4f", ""),
    "no_regression": ("accuracy", "production minus allowed drop", ".4f", ""),
    "no_latency_regression": ("p95", "production's plus allowed increase", ".2f", " ms"),
    "serving_fleet": ("best rate within the SLO", "at least", ".1f", " req/s"),
}
# Checks whose observed value must stay at or under the limit (the others: at or over it).
_AT_MOST = {"latency_p95", "error_rate", "no_latency_regression"}
_COMPUTED_LIMITS = {"no_regression", "no_latency_regression"}
# A CPU size must sustain at least this rate within the SLO for a fleet to exist.
MIN_SUSTAINABLE_RPS = 1.0


def format_figure(name: str, value: float | None) -> str:
    """Return a check's observed value or limit with its unit (``4.85 ms``, ``0.5%``)."""
    if value is None:
        return "—"
    _, _, spec, unit = _CHECK_FIGURES.get(name, (name, "limit", ".4g", ""))
    return f"{format(float(value), spec)}{unit}"


def describe_check(check: GateCheck) -> str:
    """Return one gate check as observed vs limit with the comparison that decided it."""
    name = check.name
    what, limit_name, spec, unit = _CHECK_FIGURES.get(name, (name, "limit", ".4g", ""))
    ops = ("<=", ">") if name in _AT_MOST else (">=", "<")
    op = ops[0] if check.passed else ops[1]
    observed = format(check.observed, spec)
    limit_value = check.limit
    if name in _COMPUTED_LIMITS:  # derived from production's figures: rounded like observed
        limit = format(limit_value, spec)
    else:  # as the user set it (SLO 0.001 ms, floor 0.9)
        limit = f"{limit_value * 100:g}%" if spec.endswith("%") else format(limit_value, ".6g")
    return f"{what} {observed}{unit} {op} {limit_name} {limit}{unit}"


def judge(
    candidate: BenchFigures,
    production: BenchFigures | None,
    limits: GateThresholds,
    serving: ServingContext | None = None,
    sizing: SizingReport | None = None,
) -> GateVerdict:
    """Judge a candidate's figures (p95, error rate, accuracy) against limits and production.

    With ``sizing`` (the benchmark's fleet sizing), a candidate no CPU size can serve within
    the SLO at any rate fails ``serving_fleet``, with the sizing's reason.

    A candidate that misses the SLO gets priced suggestions from ``advise``, using ``serving``
    (default: unknown architecture, INT8 not tried, c7i.large in us-east-1).
    """
    checks: list[GateCheck] = []

    def check(name: str, ok: bool, observed: float, limit: float, reason: str) -> None:
        checks.append(
            GateCheck(
                name=name, passed=ok, observed=observed, limit=limit, reason=None if ok else reason
            )
        )

    p95 = candidate.p95_ms
    slo_met = p95 <= limits.latency_slo_ms
    check(
        "latency_p95",
        slo_met,
        p95,
        limits.latency_slo_ms,
        f"p95 {p95:.2f} ms exceeds the SLO {limits.latency_slo_ms:g} ms by "
        f"{p95 - limits.latency_slo_ms:.2f} ms ({p95 / limits.latency_slo_ms:.1f}x)"
        + (
            f", {candidate.shed} of {candidate.requests} requests queued past it and were shed"
            if candidate.shed
            else ""
        ),
    )
    errors = candidate.error_rate
    check("error_rate", errors == 0.0, errors, 0.0, f"{errors:.1%} of benchmark requests failed")
    acc = candidate.accuracy if candidate.accuracy is not None else 0.0
    check(
        "accuracy_floor",
        candidate.accuracy is not None and acc >= limits.accuracy_floor,
        acc,
        limits.accuracy_floor,
        f"accuracy {acc:.4f} is below the floor {limits.accuracy_floor:.4f}"
        if candidate.accuracy is not None
        # Not measured: it fails the floor, with the benchmark's reason.
        else f"accuracy was not measured ({candidate.accuracy_note or 'no reason given'})",
    )
    if production is not None and production.accuracy is not None:
        prod_acc = production.accuracy
        floor = prod_acc - limits.max_accuracy_drop
        check(
            "no_regression",
            acc >= floor,
            acc,
            floor,
            f"accuracy {acc:.4f} drops {prod_acc - acc:.4f} below production "
            f"v{production.version} ({prod_acc:.4f}); "
            f"at most {limits.max_accuracy_drop:.4f} allowed",
        )
    if limits.max_latency_increase is not None and production is not None:
        prod_p95 = production.p95_ms
        ceiling = prod_p95 * (1.0 + limits.max_latency_increase)
        check(
            "no_latency_regression",
            p95 <= ceiling,
            p95,
            ceiling,
            f"p95 {p95:.2f} ms is {p95 / prod_p95:.1f}x production v{production.version}"
            f"'s {prod_p95:.2f} ms; at most +{limits.max_latency_increase:.0%} allowed",
        )
    if sizing is not None:
        best = max((p.sustainable_rps for p in sizing.sizes if p.measured), default=0.0)
        check(
            "serving_fleet",
            sizing.chosen is not None,
            best,
            MIN_SUSTAINABLE_RPS,
            sizing.reason,
        )
    suggestions: list[Suggestion] = []
    if not slo_met:
        ctx = serving or ServingContext()
        suggestions = advise(candidate, limits, ctx)
    return verdict_of(checks, suggestions)


@dataclass(frozen=True)
class _LatencySplit:
    """Split a measured p95 into a fixed part and a part that scales with compute speed."""

    p95_ms: float
    fixed_ms: float  # HTTP, decode, preprocessing: the median's share outside onnxruntime
    scalable_ms: float  # onnxruntime compute and the queueing behind it
    note: str

    @classmethod
    def of(cls, candidate: BenchFigures) -> _LatencySplit:
        p95 = candidate.p95_ms
        bare = candidate.bare_onnxruntime_p50_ms
        p50 = candidate.p50_ms
        if bare is None:
            return cls(
                p95,
                0.0,
                p95,
                "no bare-onnxruntime figure: all of p95 is assumed to scale (optimistic)",
            )
        fixed = min(max(0.0, p50 - bare), p95)
        return cls(
            p95,
            fixed,
            p95 - fixed,
            f"p95 split into {fixed:.2f} ms fixed (HTTP + decode: p50 minus bare onnxruntime "
            f"p50) and {p95 - fixed:.2f} ms that scales with compute speed",
        )

    def scaled(self, factor: float) -> float:
        """Return the p95 when the compute share runs ``factor`` times as long."""
        return self.fixed_ms + self.scalable_ms * factor


def _price(
    ctx: ServingContext, instance_type: str, throughput_rps: float | None
) -> tuple[float | None, str]:
    """Return (cost per 1M predictions at the run's load, note); None with why it cannot be.

    The fleet of ``instance_type`` replicas serving the run's ``target_rps``, each at most
    at its estimated throughput less the headroom: the serving fleet's own formula.
    """
    if not throughput_rps or throughput_rps <= 0:
        return None, "no measured throughput to price from"
    usd_per_hour = ctx.prices.get(instance_type)
    if usd_per_hour is None:
        return None, f"no price for {instance_type} in {ctx.region}"
    replicas = replicas_for(ctx.target_rps, throughput_rps, DEFAULT_HEADROOM)
    cost = fleet_cost(usd_per_hour, replicas, ctx.target_rps).usd_per_million
    return cost, (
        f"{replicas} x {instance_type} on-demand in {ctx.region} at {throughput_rps:.1f} req/s "
        f"each, serving {ctx.target_rps:g} req/s"
    )


def advise(
    candidate: BenchFigures, limits: GateThresholds, ctx: ServingContext
) -> list[Suggestion]:
    """Return priced ways to bring p95 under the SLO, those that meet it first, cheapest first.

    A suggestion's cost is None when it cannot be priced (``price_note`` says why). Estimates
    scale the measured p95's compute share; they are a guide for the next run, not a promise.
    Only a smaller architecture's rests on a measured CPU cost (``measured``); the others on
    an assumed factor, and say so.
    """
    split = _LatencySplit.of(candidate)
    slo = limits.latency_slo_ms
    # What a replica sustains: the sizing's rate, or a closed-loop benchmark's throughput (an
    # open-loop benchmark's is only the rate it was sent at).
    throughput = (
        ctx.capacity_rps
        or (candidate.throughput_rps if candidate.offered_rps is None else None)
        or None
    )
    arch, instance_type, region = ctx.arch, ctx.instance_type, ctx.region
    base_vcpus = ctx.measured_vcpus or VCPUS.get(instance_type, 2)
    gap = split.p95_ms - slo
    out: list[Suggestion] = []

    def suggest(
        action: SuggestionAction,
        title: str,
        p95_est: float,
        on_type: str,
        throughput_est: float | None,
        assumption: str,
        *,
        measured: bool = False,
    ) -> None:
        cost, price_note = _price(ctx, on_type, throughput_est)
        out.append(
            Suggestion(
                action=action,
                title=title,
                estimated_p95_ms=round(p95_est, 3),
                meets_slo=p95_est <= slo,
                gap_ms=round(gap, 3),
                instance_type=on_type,
                region=region,
                estimated_throughput_rps=None
                if throughput_est is None
                else round(throughput_est, 2),
                cost_per_million_usd=None if cost is None else round(cost, 4),
                price_note=price_note,
                assumption=f"{assumption}; {split.note}",
                measured=measured,
                detail=f"{title}: p95 {split.p95_ms:.1f} → ~{p95_est:.1f} ms "
                f"(SLO {slo:g} ms) on {on_type}",
            )
        )

    def throughput_at(p95_est: float) -> float | None:
        # A replica's capacity goes as 1 / its latency: scale it inversely.
        return None if throughput is None else throughput * split.p95_ms / max(p95_est, 1e-6)

    if not ctx.int8_tried:
        est = split.scaled(1.0 / INT8_SPEEDUP)
        suggest(
            "int8",
            "export an INT8 model (onnxruntime static quantization)",
            est,
            instance_type,
            throughput_at(est),
            f"INT8 runs the compute share {INT8_SPEEDUP:g}x faster (typically 1.5-3x on "
            "VNNI/AMX CPUs); accuracy must be re-measured",
        )

    own_ms = arch_cpu_ms(arch, ctx.input_px) if arch is not None else None
    if arch is not None and own_ms is not None:
        # Only architectures measured materially cheaper per image on CPU: never a slower one,
        # nor one as costly within the measurement's spread.
        costs = {a: arch_cpu_ms(a, ctx.input_px) or math.inf for a in ARCH_CPU_MS}
        cheaper = sorted(
            (a for a in costs if costs[a] <= MAX_COST_RATIO * own_ms),
            key=lambda a: costs[a],
            reverse=True,
        )
        if cheaper:
            # The costliest architecture that meets the SLO keeps the most accuracy.
            estimates = {a: split.scaled(costs[a] / own_ms) for a in cheaper}
            pick = next((a for a in cheaper if estimates[a] <= slo), cheaper[-1])
            at = "32 px, small-input stem" if small_stem(ctx.input_px) else "224 px"
            suggest(
                "smaller_model",
                f"retrain as {pick} instead of {arch}",
                estimates[pick],
                instance_type,
                throughput_at(estimates[pick]),
                f"the compute share scales with onnxruntime's measured CPU time per image "
                f"({costs[pick]:g} ms vs {own_ms:g} ms at {at}, bench/arch_cpu.py); "
                "accuracy must be re-measured",
                measured=True,
            )

    upgrades = [t for t in CPU_UPGRADES if VCPUS[t] > base_vcpus]
    if upgrades:
        estimates = {t: split.scaled(base_vcpus / VCPUS[t]) for t in upgrades}
        pick = next((t for t in upgrades if estimates[t] <= slo), upgrades[-1])
        suggest(
            "larger_instance",
            f"serve on {pick} ({VCPUS[pick]} vCPUs) instead of {instance_type}",
            estimates[pick],
            pick,
            None if throughput is None else throughput * VCPUS[pick] / base_vcpus,
            f"the compute share shrinks linearly with vCPUs ({base_vcpus} measured → "
            f"{VCPUS[pick]}; optimistic, intra-op scaling is sub-linear) and throughput grows "
            "with them",
        )

    gpu = _cheapest_gpu(ctx.prices)
    if gpu is not None:
        est = split.fixed_ms + GPU_COMPUTE_MS
        suggest(
            "gpu_serving",
            f"serve on GPU ({gpu}, onnxruntime CUDA provider)",
            est,
            gpu,
            None if throughput is None else throughput * VCPUS[gpu] / base_vcpus,
            f"the compute share becomes ~{GPU_COMPUTE_MS:g} ms on the GPU; HTTP and decoding "
            f"stay on its {VCPUS[gpu]} vCPUs, which bound throughput as the CPUs did here",
        )

    # At the same cost, the option whose estimate rests on a measurement comes first.
    out.sort(
        key=lambda s: (
            not s.meets_slo,
            s.cost_per_million_usd is None,
            s.cost_per_million_usd or 0.0,
            not s.measured,
        )
    )
    return out


def _cheapest_gpu(prices: dict[str, float]) -> str | None:
    """Return the one-GPU instance type with the lowest on-demand price the run resolved."""
    priced = [(prices[t], t) for t in GPU_SERVING_TYPES if t in prices]
    return min(priced)[1] if priced else None
