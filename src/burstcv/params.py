"""Define the per-run parameters: what a user may set for one pipeline run, with safe bounds.

The DAG's typed Airflow ``Params`` (the trigger form) mirror these fields; the stages accept
a plain dict (from ``params`` in the task context or the CLI) and validate it here once.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from burstcv.settings import Settings, get_settings
from burstcv.training.names import check_architecture

DEFAULT_INSTANCE_TYPES = ("g6.xlarge", "g5.xlarge", "g4dn.xlarge")


class RunParams(BaseModel):
    """Hold one run's choices; every field has a default from settings."""

    model_config = ConfigDict(extra="ignore")

    dataset_uri: str
    model: str = "resnet10"
    epochs: int = Field(default=6, ge=1, le=500)
    batch_size: int = Field(default=128, ge=8, le=8192)
    learning_rate: float = Field(default=0.2, gt=0, le=10)
    seed: int = Field(default=0, ge=0)
    expected_classes: list[str] = Field(default_factory=list)  # empty: take them from the data
    compute_backend: Literal["local", "ec2"] = "local"
    instance_types: list[str] = Field(default_factory=lambda: list(DEFAULT_INSTANCE_TYPES))
    use_spot: bool = True
    max_cost_usd: float = Field(default=5.0, gt=0, le=10_000)
    time_budget_s: int = Field(default=3600, ge=60, le=7 * 24 * 3600)
    latency_slo_ms: float = Field(default=50.0, gt=0)
    accuracy_floor: float = Field(default=0.9, ge=0, le=1)
    max_accuracy_drop: float = Field(default=0.02, ge=0, le=1)
    promote: bool = True
    int8: bool = True  # try static INT8; it serves only if as accurate (within bound) and faster
    # Train even when the data and params are those of the production model (a scheduled or
    # asset-triggered run then ends after validation, renting nothing).
    force_train: bool = False

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        return check_architecture(value)

    @classmethod
    def defaults(cls, settings: Settings | None = None) -> dict[str, Any]:
        """Return the default values, taken from settings where settings define them."""
        s = settings or get_settings()
        return {
            "dataset_uri": s.dataset_uri,
            "model": s.arch,
            "epochs": s.epochs,
            "batch_size": s.batch_size,
            "learning_rate": s.learning_rate,
            "seed": s.seed,
            "compute_backend": s.compute_backend,
            "time_budget_s": s.train_timeout_s,
            "latency_slo_ms": s.latency_slo_ms,
            "accuracy_floor": s.accuracy_floor,
            "max_accuracy_drop": s.max_accuracy_drop,
        }

    @classmethod
    def resolve(
        cls, given: dict[str, Any] | None = None, settings: Settings | None = None
    ) -> RunParams:
        """Merge given values (None means 'use the default') over the defaults, then validate."""
        merged = cls.defaults(settings)
        merged.update({k: v for k, v in (given or {}).items() if v is not None and v != ""})
        return cls.model_validate(merged)
