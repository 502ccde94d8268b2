"""Decide whether a candidate may replace production: SLO, errors, accuracy, no regression;
a latency miss also gets priced suggestions, each with its estimate's assumption."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from burstcv.cost.model import DEFAULT_HEADROOM, GPU_SERVING_TYPES, fleet_cost, replicas_for
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

DEFAULT_SERVING_INSTANCE = "c7i.large"
DEFAULT_SERVING_REGION = "us-east-1"

# vCPUs per instance type: the price table's CPU types, and the one-GPU types (AWS: 4 each).
VCPUS: dict[str, int] = {name: vcpus for name, (vcpus, _) in instance_shapes().items()}
VCPUS.update(dict.fromkeys(GPU_SERVING_TYPES, 4))
CPU_UPGRADES: tuple[str, ...] = ("c7i.xlarge", "c7i.2xlarge")  # larger CPU types, smallest first

# onnxruntime's CPU time per image (ms; median at batch 1, one intra-op thread; bench/arch_cpu.py
# on an AMD EPYC, onnxruntime 1.32) at 32 px (small-input stem) and 224 px. Measured, not
# multiply-adds: depthwise nets run fewer operations per second on CPU.
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
    return None if costs is None else costs[0 if small_stem(input_px) else 1]


INT8_SPEEDUP = 2.0  # onnxruntime INT8 vs FP32 on CPUs with VNNI/AMX (c7i): 1.5-3x for CNNs
GPU_COMPUTE_MS = 1.0  # a small CNN at batch 1 on one data-centre GPU, copies included


@dataclass
class GateThresholds:
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
    # On-demand USD per hour by instance type, as the run resolved them.
    prices: dict[str, float] = field(default_factory=dict)
    target_rps: float = 10.0  # the run's expected peak load: advice is priced at it
    instance_type: str = DEFAULT_SERVING_INSTANCE  # the CPU type production serves on
    measured_vcpus: int | None = None  # the benchmark host's; None: instance_type's
    # The rate a service on measured_vcpus sustains within the SLO (the fleet sizing's); None:
    # unmeasured, and a closed-loop benchmark's throughput stands in for it.
    capacity_rps: float | None = None


def verdict_of(checks: list[GateCheck], suggestions: list[Suggestion]) -> GateVerdict:
    """Return the verdict of these checks, naming the cheapest fix when one failed."""
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
    lines = [
        f"gate check {c.name}: {describe_check(c)}: {'passed' if c.passed else 'FAILED'}"
        for c in verdict.checks
    ]
    return [*lines, f"gate verdict: {verdict.summary}"]


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
MIN_SUSTAINABLE_RPS = 1.0  # a fleet needs a CPU size that sustains this rate within the SLO


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
    if name in _COMPUTED_LIMITS:  # derived from production's figures: rounded like observed
        limit = format(check.limit, spec)
    else:  # as the user set it (SLO 0.001 ms, floor 0.9)
        limit = f"{check.limit * 100:g}%" if spec.endswith("%") else format(check.limit, ".6g")
    return f"{what} {format(check.observed, spec)}{unit} {op} {limit_name} {limit}{unit}"


def judge(
    candidate: BenchFigures,
    production: BenchFigures | None,
    limits: GateThresholds,
    serving: ServingContext | None = None,
    sizing: SizingReport | None = None,
) -> GateVerdict:
    """Judge a candidate's figures (p95, error rate, accuracy) against limits and production."""
    latency = _latency_check(candidate, limits)
    errors = candidate.error_rate
    checks = [
        latency,
        _check(
            "error_rate", errors == 0.0, errors, 0.0, f"{errors:.1%} of benchmark requests failed"
        ),
        *_accuracy_checks(candidate, production, limits),
    ]
    if limits.max_latency_increase is not None and production is not None:
        p95, prod_p95 = candidate.p95_ms, production.p95_ms
        ceiling = prod_p95 * (1.0 + limits.max_latency_increase)
        why = (
            f"p95 {p95:.2f} ms is {p95 / prod_p95:.1f}x production v{production.version}"
            f"'s {prod_p95:.2f} ms; at most +{limits.max_latency_increase:.0%} allowed"
        )
        checks.append(_check("no_latency_regression", p95 <= ceiling, p95, ceiling, why))
    if sizing is not None:
        best = max((p.sustainable_rps for p in sizing.sizes if p.measured), default=0.0)
        fleet = sizing.chosen is not None
        checks.append(_check("serving_fleet", fleet, best, MIN_SUSTAINABLE_RPS, sizing.reason))
    suggestions = [] if latency.passed else advise(candidate, limits, serving or ServingContext())
    return verdict_of(checks, suggestions)


def _check(name: str, ok: bool, observed: float, limit: float, reason: str) -> GateCheck:
    return GateCheck(
        name=name, passed=ok, observed=observed, limit=limit, reason=None if ok else reason
    )


def _latency_check(candidate: BenchFigures, limits: GateThresholds) -> GateCheck:
    p95, slo, shed = candidate.p95_ms, limits.latency_slo_ms, candidate.shed
    why = f"p95 {p95:.2f} ms exceeds the SLO {slo:g} ms by {p95 - slo:.2f} ms ({p95 / slo:.1f}x)"
    if shed:
        why += f", {shed} of {candidate.requests} requests queued past it and were shed"
    return _check("latency_p95", p95 <= slo, p95, slo, why)


def _accuracy_checks(
    candidate: BenchFigures, production: BenchFigures | None, limits: GateThresholds
) -> list[GateCheck]:
    measured = candidate.accuracy is not None
    acc = candidate.accuracy if candidate.accuracy is not None else 0.0
    least = limits.accuracy_floor
    why = f"accuracy {acc:.4f} is below the floor {least:.4f}"
    if not measured:  # it fails the floor, with the benchmark's reason
        why = f"accuracy was not measured ({candidate.accuracy_note or 'no reason given'})"
    checks = [_check("accuracy_floor", measured and acc >= least, acc, least, why)]
    if production is not None and production.accuracy is not None:
        prod_acc = production.accuracy
        floor = prod_acc - limits.max_accuracy_drop
        why = (
            f"accuracy {acc:.4f} drops {prod_acc - acc:.4f} below production v{production.version} "
            f"({prod_acc:.4f}); at most {limits.max_accuracy_drop:.4f} allowed"
        )
        checks.append(_check("no_regression", acc >= floor, acc, floor, why))
    return checks


@dataclass(frozen=True)
class _LatencySplit:
    """Split a measured p95 into a fixed part and a part that scales with compute speed."""

    p95_ms: float
    fixed_ms: float  # HTTP, decode, preprocessing: the median's share outside onnxruntime
    scalable_ms: float  # onnxruntime compute and the queueing behind it
    note: str

    @classmethod
    def of(cls, candidate: BenchFigures) -> _LatencySplit:
        p95, bare = candidate.p95_ms, candidate.bare_onnxruntime_p50_ms
        if bare is None:
            note = "no bare-onnxruntime figure: all of p95 is assumed to scale (optimistic)"
            return cls(p95, 0.0, p95, note)
        fixed = min(max(0.0, candidate.p50_ms - bare), p95)
        note = (
            f"p95 split into {fixed:.2f} ms fixed (HTTP + decode: p50 minus bare onnxruntime "
            f"p50) and {p95 - fixed:.2f} ms that scales with compute speed"
        )
        return cls(p95, fixed, p95 - fixed, note)

    def scaled(self, factor: float) -> float:
        """Return the p95 when the compute share runs ``factor`` times as long."""
        return self.fixed_ms + self.scalable_ms * factor


def _price(
    ctx: ServingContext, instance_type: str, throughput_rps: float | None
) -> tuple[float | None, str]:
    """Return (cost per 1M predictions at the run's load, note); None with why it cannot be."""
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
    """Return priced ways to bring p95 under the SLO, those that meet it first, cheapest first
    (estimates scale the measured p95's compute share: a guide for the next run, no promise)."""
    # What a replica sustains: the sizing's rate, or a closed-loop benchmark's throughput (an
    # open-loop benchmark's is only the rate it was sent at).
    throughput = (
        ctx.capacity_rps
        or (candidate.throughput_rps if candidate.offered_rps is None else None)
        or None
    )
    base_vcpus = ctx.measured_vcpus or VCPUS.get(ctx.instance_type, 2)
    split = _LatencySplit.of(candidate)
    advice = _Advice(split, limits.latency_slo_ms, ctx, throughput, base_vcpus)
    options = (advice.int8(), advice.smaller_model(), advice.larger_instance(), advice.gpu())
    # At the same cost, the option whose estimate rests on a measurement comes first.
    return sorted(
        (s for s in options if s is not None),
        key=lambda s: (
            not s.meets_slo,
            s.cost_per_million_usd is None,
            s.cost_per_million_usd or 0.0,
            not s.measured,
        ),
    )


@dataclass(frozen=True)
class _Advice:
    """Estimate each way out of a latency miss from the candidate's measured p95."""

    split: _LatencySplit
    slo: float
    ctx: ServingContext
    throughput: float | None  # what one replica sustains as measured; None: unknown
    base_vcpus: int  # the vCPUs it was measured on

    def suggest(
        self,
        action: SuggestionAction,
        title: str,
        p95_est: float,
        on_type: str,
        throughput_est: float | None,
        assumption: str,
        *,
        measured: bool = False,
    ) -> Suggestion:
        cost, price_note = _price(self.ctx, on_type, throughput_est)
        return Suggestion(
            action=action,
            title=title,
            estimated_p95_ms=round(p95_est, 3),
            meets_slo=p95_est <= self.slo,
            gap_ms=round(self.split.p95_ms - self.slo, 3),
            instance_type=on_type,
            region=self.ctx.region,
            estimated_throughput_rps=None if throughput_est is None else round(throughput_est, 2),
            cost_per_million_usd=None if cost is None else round(cost, 4),
            price_note=price_note,
            assumption=f"{assumption}; {self.split.note}",
            measured=measured,
            detail=f"{title}: p95 {self.split.p95_ms:.1f} → ~{p95_est:.1f} ms "
            f"(SLO {self.slo:g} ms) on {on_type}",
        )

    def throughput_at(self, p95_est: float) -> float | None:
        """Scale a replica's capacity inversely with its latency, on the same CPUs."""
        if self.throughput is None:
            return None
        return self.throughput * self.split.p95_ms / max(p95_est, 1e-6)

    def throughput_on(self, instance_type: str) -> float | None:
        if self.throughput is None:
            return None
        return self.throughput * VCPUS[instance_type] / self.base_vcpus

    def int8(self) -> Suggestion | None:
        if self.ctx.int8_tried:
            return None
        est = self.split.scaled(1.0 / INT8_SPEEDUP)
        return self.suggest(
            "int8",
            "export an INT8 model (onnxruntime static quantization)",
            est,
            self.ctx.instance_type,
            self.throughput_at(est),
            f"INT8 runs the compute share {INT8_SPEEDUP:g}x faster (typically 1.5-3x on "
            "VNNI/AMX CPUs); accuracy must be re-measured",
        )

    def smaller_model(self) -> Suggestion | None:
        arch, input_px = self.ctx.arch, self.ctx.input_px
        own_ms = arch_cpu_ms(arch, input_px) if arch is not None else None
        if arch is None or own_ms is None:
            return None
        costs = {a: arch_cpu_ms(a, input_px) or math.inf for a in ARCH_CPU_MS}
        cheaper = sorted(
            (a for a in costs if costs[a] <= MAX_COST_RATIO * own_ms),
            key=lambda a: costs[a],
            reverse=True,
        )
        if not cheaper:
            return None
        # The costliest architecture that meets the SLO keeps the most accuracy.
        estimates = {a: self.split.scaled(costs[a] / own_ms) for a in cheaper}
        pick = next((a for a in cheaper if estimates[a] <= self.slo), cheaper[-1])
        at = "32 px, small-input stem" if small_stem(input_px) else "224 px"
        return self.suggest(
            "smaller_model",
            f"retrain as {pick} instead of {arch}",
            estimates[pick],
            self.ctx.instance_type,
            self.throughput_at(estimates[pick]),
            f"the compute share scales with onnxruntime's measured CPU time per image "
            f"({costs[pick]:g} ms vs {own_ms:g} ms at {at}, bench/arch_cpu.py); "
            "accuracy must be re-measured",
            measured=True,
        )

    def larger_instance(self) -> Suggestion | None:
        base = self.base_vcpus
        upgrades = [t for t in CPU_UPGRADES if VCPUS[t] > base]
        if not upgrades:
            return None
        estimates = {t: self.split.scaled(base / VCPUS[t]) for t in upgrades}
        pick = next((t for t in upgrades if estimates[t] <= self.slo), upgrades[-1])
        return self.suggest(
            "larger_instance",
            f"serve on {pick} ({VCPUS[pick]} vCPUs) instead of {self.ctx.instance_type}",
            estimates[pick],
            pick,
            self.throughput_on(pick),
            f"the compute share shrinks linearly with vCPUs ({base} measured → "
            f"{VCPUS[pick]}; optimistic, intra-op scaling is sub-linear) and throughput grows "
            "with them",
        )

    def gpu(self) -> Suggestion:
        gpu = _cheapest_gpu(self.ctx.prices)
        return self.suggest(
            "gpu_serving",
            f"serve on GPU ({gpu}, onnxruntime CUDA provider)",
            self.split.fixed_ms + GPU_COMPUTE_MS,
            gpu,
            self.throughput_on(gpu),
            f"the compute share becomes ~{GPU_COMPUTE_MS:g} ms on the GPU; HTTP and decoding "
            f"stay on its {VCPUS[gpu]} vCPUs, which bound throughput as the CPUs did here",
        )


def _cheapest_gpu(prices: dict[str, float]) -> str:
    """Return the cheapest priced GPU type, or (none priced where it serves) the first, unpriced."""
    priced = [(prices[t], t) for t in GPU_SERVING_TYPES if t in prices]
    return min(priced)[1] if priced else GPU_SERVING_TYPES[0]
