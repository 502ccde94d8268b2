"""Draw the run report's figures with matplotlib (Agg) and return them as PNG bytes.

matplotlib is imported only to draw: importing this module stays cheap.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from burstcv_spec.contracts import EpochRecord, LoadStep, SizePoint

DPI = 100
CANDIDATE_COLOUR = "#1f77b4"
PRODUCTION_COLOUR = "#ff7f0e"


def _png(fig: Any) -> bytes:
    """Lay a figure out, return it as PNG bytes and free it."""
    buf = io.BytesIO()
    try:
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    finally:
        _pyplot().close(fig)
    return buf.getvalue()


def _pyplot() -> Any:
    """Return pyplot on the non-interactive Agg backend (no display, safe in workers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def training_curves(epochs: Sequence[EpochRecord]) -> bytes:
    """Draw loss (train and val) and validation accuracy per epoch, side by side."""
    plt = _pyplot()
    xs = [e.epoch for e in epochs]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9.5, 3.4))
    ax_loss.plot(xs, [e.train_loss for e in epochs], "-o", label="train")
    ax_loss.plot(xs, [e.val_loss for e in epochs], "-s", label="validation")
    ax_loss.set(title="Loss", xlabel="epoch", ylabel="cross-entropy")
    ax_loss.legend()
    ax_acc.plot(xs, [e.val_accuracy for e in epochs], "-o", color="#2ca02c")
    ax_acc.set(title="Validation accuracy", xlabel="epoch", ylabel="top-1")
    ax_acc.set_ylim(0.0, 1.0)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.set_xticks(xs)
    return _png(fig)


def confusion_matrix(matrix: Sequence[Sequence[int]], classes: Sequence[str]) -> bytes:
    """Draw a confusion-matrix heatmap (rows: true class, columns: predicted) with counts."""
    import numpy as np

    plt = _pyplot()
    data = np.asarray(matrix, dtype=float)
    n = len(classes)
    size = min(8.0, max(4.0, 0.4 * n + 2.0))
    fig, ax = plt.subplots(figsize=(size, size * 0.85))
    image = ax.imshow(data, cmap="Blues")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="images")
    ax.set_xticks(range(n), labels=list(classes), rotation=45 if n > 12 else 0)
    ax.set_yticks(range(n), labels=list(classes))
    ax.set(xlabel="predicted class", ylabel="true class", title="Confusion matrix (validation)")
    if n <= 20:  # counts stay legible up to ~20 classes
        threshold = data.max() / 2 if data.size else 0
        for (i, j), count in np.ndenumerate(data):
            colour = "white" if count > threshold else "black"
            ax.text(j, i, f"{int(count)}", ha="center", va="center", fontsize=8, color=colour)
    return _png(fig)


def latency_histogram(
    candidate_ms: Sequence[float],
    production_ms: Sequence[float] | None,
    *,
    slo_ms: float | None = None,
    production_label: str = "production",
) -> bytes:
    """Overlay the candidate's and production's request latencies, with p95 and SLO lines."""
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 3.6))
    series = [("candidate", np.asarray(candidate_ms, dtype=float), CANDIDATE_COLOUR)]
    if production_ms:
        series.append((production_label, np.asarray(production_ms, dtype=float), PRODUCTION_COLOUR))
    everything = np.concatenate([s[1] for s in series])
    # Shared bins up to the 99.5th percentile keep one outlier from squashing the shape.
    upper = float(np.percentile(everything, 99.5)) if everything.size else 1.0
    bins = np.linspace(0.0, max(upper, 1e-3) * 1.05, 50)
    for label, values, colour in series:
        p95 = float(np.percentile(values, 95))
        legend = f"{label} (n={values.size}, p95 {p95:.1f} ms)"
        ax.hist(np.clip(values, 0, bins[-1]), bins=bins, alpha=0.55, color=colour, label=legend)
        ax.axvline(p95, color=colour, linestyle="--", linewidth=1.2)
    if slo_ms is not None:
        ax.axvline(slo_ms, color="#d62728", linewidth=1.5, label=f"SLO {slo_ms:g} ms")
    ax.set(xlabel="latency per request over HTTP (ms)", ylabel="requests")
    ax.set_title("Request latency: candidate vs production (dashed: p95)")
    ax.legend()
    ax.grid(alpha=0.3)
    return _png(fig)


def sizing_curves(points: Sequence[SizePoint], slo_ms: float) -> bytes:
    """Draw p95 against the offered load per CPU size, with the SLO line and each size's limit."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 3.6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def xy(some: Sequence[LoadStep]) -> tuple[list[float], list[float]]:  # p95 capped at 4 SLOs
        return [s.rate_rps for s in some], [min(s.p95_ms, slo_ms * 4) for s in some]

    for i, point in enumerate(p for p in points if p.steps):
        steps = sorted((s for s in point.steps if not s.scouting), key=lambda s: s.rate_rps)
        scouts = [s for s in point.steps if s.scouting]
        colour = colours[i % len(colours)]
        label = f"{point.vcpus} vCPU: {point.sustainable_rps:.0f} req/s within the SLO"
        ax.plot(*xy(steps), marker="o", color=colour, label=label)
        if scouts:  # the short steps that bracketed the limit: hollow, unjoined
            label = f"{point.vcpus} vCPU: scouting steps"
            ax.scatter(*xy(scouts), marker="o", facecolors="none", edgecolors=colour, label=label)
        if point.sustainable_rps > 0:
            ax.axvline(point.sustainable_rps, color=colour, linestyle="--", linewidth=1)
    ax.axhline(slo_ms, color="#d62728", linewidth=1.5, label=f"SLO {slo_ms:g} ms")
    ax.set(xlabel="offered load, open loop (req/s)", ylabel="p95 latency (ms)")
    ax.set_title(
        "p95 under load per CPU size (dashed: the highest rate within the SLO; hollow: scouting)"
    )
    ax.legend()
    ax.grid(alpha=0.3)
    return _png(fig)
