"""Build the pipeline DAG's trigger form (Airflow Params) from the run parameters.

Every field of ``burstcv.params.RunParams`` becomes one typed Param: its title, description,
type, bounds, choices and form section come from the model, its default from the model or
the deployment's settings. Numeric bounds sit under ``allOf``: Airflow validates them there
like any JSON-schema keyword and refuses the trigger (the form shows the error, the REST API
answers 400), whereas top-level bounds make the UI's number input clamp a value silently.
"""

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
