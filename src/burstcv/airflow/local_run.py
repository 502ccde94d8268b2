"""Run the real burstcv_pipeline DAG once in this process with ``dag.test()`` (embedded Airflow)."""

from __future__ import annotations

import logging
import os
from typing import Any

from burstcv.settings import REPO_ROOT, VAR_DIR
from burstcv_spec import storage

log = logging.getLogger(__name__)

DAG_ID = "burstcv_pipeline"


def embedded_airflow_env() -> dict[str, str]:
    """Return the environment of the embedded Airflow: SQLite under var/, the repo's DAGs."""
    home = os.environ.get("AIRFLOW_HOME", str(VAR_DIR / "airflow"))
    return {
        "AIRFLOW_HOME": home,
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO_ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO_ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
    }


def run_pipeline_once(conf: dict[str, Any]) -> tuple[str, str]:
    """Run the DAG once with ``conf`` as its params; return (state, a human summary)."""
    for key, value in embedded_airflow_env().items():
        os.environ.setdefault(key, value)
    from airflow.dag_processing.dagbag import DagBag

    from burstcv.airflow.setup import ensure_gpu_pool

    ensure_gpu_pool()
    bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
    if bag.import_errors:
        raise RuntimeError(f"DAG import errors: {bag.import_errors}")
    dag = bag.dags[DAG_ID]
    dag_run = dag.test(run_conf=conf)
    states = {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}
    lines = [f"{DAG_ID} run {dag_run.run_id}: {dag_run.state}"]
    lines += [f"  {task:<10} {state}" for task, state in sorted(states.items())]
    from burstcv.pipeline import RunPaths

    verdict_uri = storage.join(RunPaths.of(dag_run.run_id).bench, "verdict.json")
    if storage.exists(verdict_uri):
        verdict = storage.read_json(verdict_uri)
        lines.append(f"  version {verdict['version']}: {verdict['summary']}")
    return str(dag_run.state), "\n".join(lines)
