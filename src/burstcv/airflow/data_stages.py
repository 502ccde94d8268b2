"""Define the data stages of the pipeline DAG: validate and pack, each spread over chunks.

Each stage is a plan, one mapped task per chunk and a join (``plan_scan``, ``scan``,
``validate``; ``plan_pack``, ``pack_shards``, ``pack``); a chunk that fails is retried alone.
``plan_scan``, the run's first task, also resolves the run once (into run.json).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import XComArg, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from burstcv.params import RunParams
from burstcv.settings import get_settings
from burstcv_spec.contracts import DataChunk, RunRef, Validated

# Retries only where a retry is safe (idempotent stages: each rewrites its own outputs).
SAFE_RETRY: dict[str, Any] = {
    "retries": 2,
    "retry_delay": timedelta(seconds=30),
    "retry_exponential_backoff": True,
}


def _run(run_id: str | None) -> RunRef:
    return RunRef.of(str(run_id))


@task(execution_timeout=timedelta(minutes=30), **SAFE_RETRY)
def plan_scan(
    params: dict[str, Any] | None = None,
    run_id: str | None = None,
    triggering_asset_events: Any = None,
    dag_run: Any = None,
) -> list[dict[str, Any]]:
    """Resolve the run, list the dataset and cut it into scan chunks; fail before any GPU."""
    from burstcv.airflow.callbacks import dataset_from_asset_events
    from burstcv.airflow.runs import state_value
    from burstcv.stages import data, resolve

    given = dict(params or {})
    if uri := dataset_from_asset_events(triggering_asset_events):
        given["dataset_uri"] = uri  # the data the event says changed is the data trained on
    try:
        run_params = RunParams.resolve(given, get_settings())
        plan = data.plan_scan(
            _run(run_id),
            run_params,
            get_settings(),
            trigger=state_value(getattr(dag_run, "run_type", None)),
        )
    except (ValueError, resolve.ValidationFailed) as exc:
        raise AirflowFailException(str(exc)) from exc  # retrying cannot fix the data
    return [chunk.model_dump(mode="json") for chunk in plan.chunks]


@task(
    execution_timeout=timedelta(minutes=60),
    # A mapped task's docs come from its partial arguments only, never from the docstring.
    doc_md="Read, hash and decode one chunk's files into its part of the manifest.",
    **SAFE_RETRY,
)
def scan(chunk: dict[str, Any], run_id: str | None = None) -> int:
    """Read, hash and decode one chunk's files into its part of the manifest."""
    from burstcv.stages import data

    return data.scan_chunk(_run(run_id), DataChunk.model_validate(chunk), get_settings())


@task(execution_timeout=timedelta(minutes=30))
def validate(run_id: str | None = None) -> dict[str, Any]:
    """Check the whole dataset with Great Expectations; fail before any GPU exists."""
    from burstcv.stages import data, resolve

    try:
        return data.validate(_run(run_id), get_settings()).model_dump(mode="json")
    except resolve.ValidationFailed as exc:
        raise AirflowFailException(str(exc)) from exc  # retrying cannot fix the data


@task(execution_timeout=timedelta(minutes=30), **SAFE_RETRY)
def plan_pack(validated: dict[str, Any], run_id: str | None = None) -> list[dict[str, Any]]:
    """Cut the shards into chunks (skip: production's data, nothing new to train on)."""
    from burstcv.stages import data, resolve

    checked = Validated.model_validate(validated)
    if reason := resolve.nothing_new_to_train(_run(run_id), checked, settings=get_settings()):
        raise AirflowSkipException(reason)  # everything after it is skipped: no GPU rented
    plan = data.plan_pack(_run(run_id), checked, get_settings())
    return [chunk.model_dump(mode="json") for chunk in plan.chunks]


@task(
    execution_timeout=timedelta(minutes=60),
    doc_md="Decode one chunk's images once into its uint8 shards.",
    **SAFE_RETRY,
)
def pack_shards(
    validated: dict[str, Any], chunk: dict[str, Any], run_id: str | None = None
) -> dict[str, Any]:
    """Decode one chunk's images once into its uint8 shards."""
    from burstcv.stages import data

    checked, part = Validated.model_validate(validated), DataChunk.model_validate(chunk)
    return data.pack_chunk(_run(run_id), checked, part, get_settings()).model_dump(mode="json")


@task(execution_timeout=timedelta(minutes=30), **SAFE_RETRY)
def pack(validated: dict[str, Any], run_id: str | None = None) -> dict[str, Any]:
    """List every chunk's shards and fix the preprocessing from their training images."""
    from burstcv.stages import data

    return data.pack(
        _run(run_id),
        Validated.model_validate(validated),
        settings=get_settings(),
        packed_chunks=True,
    ).model_dump(mode="json")


def data_stages() -> XComArg:
    """Add validate and pack (plans, mapped chunks, joins) to the DAG; return pack's result."""
    scanned = scan.expand(chunk=plan_scan())
    validated: Any = validate()  # an XComArg, handed on as the dict it will be
    scanned >> validated
    shards = pack_shards.partial(validated=validated).expand(chunk=plan_pack(validated))
    packed = pack(validated)
    shards >> packed
    return packed
