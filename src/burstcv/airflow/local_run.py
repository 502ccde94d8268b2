"""Run the real burstcv_pipeline DAG once in this process with ``dag.test()`` (embedded Airflow)."""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

from burstcv import lineage
from burstcv.links import DAG_ID
from burstcv.settings import HOME_ENV, get_settings
from burstcv_spec import storage

log = logging.getLogger(__name__)

DAGS_FOLDER_ENV = "AIRFLOW__CORE__DAGS_FOLDER"
# Airflow's folders in a source checkout, each found by a file it must hold.
_CHECKOUT_FOLDERS = (
    (DAGS_FOLDER_ENV, "dags/burstcv_pipeline.py"),
    ("AIRFLOW__CORE__PLUGINS_FOLDER", "plugins/burstcv_plugin.py"),
)


def embedded_airflow_env() -> dict[str, str]:
    """Return the embedded Airflow's environment: SQLite in the burstcv home, burstcv's DAGs.

    The home is named too, so settings read once ``AIRFLOW_HOME`` is set find the same folder;
    an installed package has no DAG folder, and then ``AIRFLOW__CORE__DAGS_FOLDER`` must say.
    """
    home = os.environ.get(HOME_ENV) or get_settings().home
    airflow_home = os.environ.get("AIRFLOW_HOME") or str(Path(home) / "airflow")
    env = {
        HOME_ENV: home,
        "AIRFLOW_HOME": airflow_home,
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{airflow_home}/airflow.db",
    }
    for variable, marker in _CHECKOUT_FOLDERS:
        if (lineage.REPO_ROOT / marker).is_file():
            env[variable] = str((lineage.REPO_ROOT / marker).parent)
    return env


def use_embedded_airflow() -> None:
    """Point this process at the embedded Airflow, wherever a variable does not say otherwise
    (before Airflow is imported: its first import reads ``AIRFLOW_HOME``)."""
    for key, value in embedded_airflow_env().items():
        os.environ.setdefault(key, value)


def run_pipeline_once(conf: dict[str, Any]) -> tuple[str, str]:
    """Run the DAG once with ``conf`` as its params; return (state, a human summary)."""
    use_embedded_airflow()
    dags_folder = os.environ.get(DAGS_FOLDER_ENV)
    if not dags_folder:
        raise RuntimeError(
            f"no DAG folder: burstcv runs from an installed package, so set {DAGS_FOLDER_ENV} "
            "to the folder holding burstcv_pipeline.py (dags/ of the source)"
        )
    from airflow.dag_processing.dagbag import DagBag

    from burstcv.airflow.setup import ensure_metadata_db, ensure_pools

    ensure_metadata_db()  # a fresh AIRFLOW_HOME: created here, not a missing-table traceback
    ensure_pools()
    bag = DagBag(dag_folder=dags_folder)
    if bag.import_errors:
        raise RuntimeError(f"DAG import errors: {bag.import_errors}")
    if DAG_ID not in bag.dags:
        raise RuntimeError(f"no DAG {DAG_ID} in {dags_folder} ({DAGS_FOLDER_ENV})")
    dag = bag.dags[DAG_ID]
    dag_run = dag.test(run_conf=conf)
    # A mapped task (a chunk of scan or pack_shards) has one instance per chunk: one line.
    states: dict[str, list[str]] = {}
    for ti in dag_run.get_task_instances():
        states.setdefault(ti.task_id, []).append(str(ti.state))
    lines = [f"{DAG_ID} run {dag_run.run_id}: {dag_run.state}"]
    lines += [f"  {task:<10} {_states_line(found)}" for task, found in sorted(states.items())]
    from burstcv.stages.resolve import run_layout
    from burstcv_spec.contracts import LatencyRecord, VerdictRecord, read_artifact

    layout = run_layout(dag_run.run_id)
    if storage.exists(layout.verdict):
        verdict = read_artifact(layout.verdict, VerdictRecord)
        lines.append(f"  version {verdict.version}: {verdict.summary}")
    elif storage.exists(layout.latency):
        latency = read_artifact(layout.latency, LatencyRecord)
        if latency.inconclusive:
            lines.append(f"  gate inconclusive, nothing judged: {latency.inconclusive}")
    return str(dag_run.state), "\n".join(lines)


def _states_line(states: list[str]) -> str:
    """Return a task's state, or a mapped task's states with their counts (worst first)."""
    if len(states) == 1:
        return states[0]
    counts = Counter(states)
    worst = ("failed", "upstream_failed", "up_for_retry", "running", "skipped", "success")
    ranked = sorted(counts, key=lambda s: (worst.index(s) if s in worst else -1, s))
    return ", ".join(f"{counts[state]} {state}" for state in ranked) + " (mapped)"
