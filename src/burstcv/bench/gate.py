"""Decide whether a candidate may replace production: SLO, errors, accuracy, no regression."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GateThresholds:
    """Hold the limits a candidate must meet."""

    latency_slo_ms: float  # p95 over HTTP, one image per request
    accuracy_floor: float  # validation top-1
    max_accuracy_drop: float  # against production on the same validation split


@dataclass
class Verdict:
    """Say whether to promote and, if not, every reason why."""

    promote: bool
    reasons: list[str] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def summary(self) -> str:
        """Return one line: 'promoted' or 'not promoted: <reasons>'."""
        return "promote" if self.promote else "not promoted: " + "; ".join(self.reasons)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        data = asdict(self)
        data["summary"] = self.summary
        return data


def judge(
    candidate: dict[str, Any], production: dict[str, Any] | None, limits: GateThresholds
) -> Verdict:
    """Judge a candidate's figures (p95_ms, error_rate, accuracy) against limits and production."""
    checks: list[dict[str, Any]] = []

    def check(name: str, ok: bool, observed: float, limit: float, reason: str) -> None:
        checks.append(
            {
                "name": name,
                "passed": ok,
                "observed": observed,
                "limit": limit,
                **({} if ok else {"reason": reason}),
            }
        )

    p95 = float(candidate["p95_ms"])
    check(
        "latency_p95",
        p95 <= limits.latency_slo_ms,
        p95,
        limits.latency_slo_ms,
        f"p95 {p95:.2f} ms exceeds the SLO {limits.latency_slo_ms:g} ms by "
        f"{p95 - limits.latency_slo_ms:.2f} ms ({p95 / limits.latency_slo_ms:.1f}x)",
    )
    errors = float(candidate["error_rate"])
    check("error_rate", errors == 0.0, errors, 0.0, f"{errors:.1%} of benchmark requests failed")
    acc = float(candidate["accuracy"])
    check(
        "accuracy_floor",
        acc >= limits.accuracy_floor,
        acc,
        limits.accuracy_floor,
        f"accuracy {acc:.4f} is below the floor {limits.accuracy_floor:.4f}",
    )
    if production is not None and production.get("accuracy") is not None:
        prod_acc = float(production["accuracy"])
        floor = prod_acc - limits.max_accuracy_drop
        check(
            "no_regression",
            acc >= floor,
            acc,
            floor,
            f"accuracy {acc:.4f} drops {prod_acc - acc:.4f} below production "
            f"v{production.get('version')} ({prod_acc:.4f}); "
            f"at most {limits.max_accuracy_drop:.4f} allowed",
        )
    reasons = [c["reason"] for c in checks if not c["passed"]]
    return Verdict(promote=not reasons, reasons=reasons, checks=checks)
