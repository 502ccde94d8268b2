"""Build the pipeline DAG's trigger form (Airflow Params) from the run parameters."""

from __future__ import annotations

from airflow.sdk import Param

from burstcv.params import RunParams, run_fields
from burstcv.settings import Settings


def trigger_form(settings: Settings | None = None) -> dict[str, Param]:
    """Return one Param per run parameter, in the model's order, with this deployment's defaults."""
    defaults = RunParams.defaults(settings)
    return {
        name: Param(
            defaults[name], description=spec.description, **spec.deployment_schema(settings)
        )
        for name, spec in run_fields().items()
    }
