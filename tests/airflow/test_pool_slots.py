"""A run of N training boxes takes N slots of the GPU pool, by burstcv's Airflow cluster policy.

Runs are made by Airflow's own ``create_dagrun`` on the DAG as the dag-processor stores it, so
the task instances get their slots where the scheduler gives them theirs. Each test works in
a session that it rolls back: nothing it creates outlives it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from airflow import settings as airflow_settings
from airflow.models.dagrun import DagRun
from airflow.models.pool import Pool
from airflow.models.taskinstance import TaskInstance
from airflow.utils.state import DagRunState, TaskInstanceState
from airflow.utils.types import DagRunTriggeredByType, DagRunType
from sqlalchemy.orm import Session

from burstcv.links import DAG_ID
from burstcv.params import RunParams
from burstcv.settings import get_settings

REPO = Path(__file__).resolve().parents[2]
GPU_TASKS = {"provision", "train"}


@pytest.fixture(scope="module")
def pipeline() -> Any:
    """Return burstcv_pipeline as the scheduler reads it: parsed, stored, read back."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    from airflow.models.dagbag import DBDagBag
    from airflow.utils.session import create_session

    with create_session() as session:
        DagBundlesManager().sync_bundles_to_db(session=session)
    bag = DagBag(dag_folder=str(REPO / "dags" / "burstcv_pipeline.py"))
    assert bag.import_errors == {}
    sync_bag_to_db(bag, "dags-folder", None)
    with create_session() as session:
        return DBDagBag().get_latest_version_of_dag(DAG_ID, session=session)


@pytest.fixture
def session() -> Iterator[Session]:
    """Yield a metadata-DB session that is rolled back afterwards (the runs go with it)."""
    assert airflow_settings.Session is not None
    db = airflow_settings.Session()
    try:
        yield db
    finally:
        db.rollback()
        db.close()


def make_run(
    dag: Any,
    session: Session,
    run_type: DagRunType,
    conf: dict[str, Any] | None,
) -> DagRun:
    """Create a run of ``dag`` with Airflow's own create_dagrun (task instances included)."""
    now = datetime.now(UTC)
    # A scheduled run has a logical date, unique to the DAG: a random minute after the
    # DAG's start date (tasks are only made for runs after it).
    logical_date = (
        pipeline_start(dag) + timedelta(minutes=1 + uuid.uuid4().int % 10**6)
        if run_type == DagRunType.SCHEDULED
        else None
    )
    return dag.create_dagrun(  # type: ignore[no-any-return]
        run_id=f"{run_type.value}__{uuid.uuid4().hex}",
        logical_date=logical_date,
        data_interval=None if logical_date is None else (logical_date, logical_date),
        run_after=now,
        conf=conf,
        run_type=run_type,
        triggered_by=DagRunTriggeredByType.TEST,
        state=DagRunState.RUNNING,
        session=session,
    )


def pipeline_start(dag: Any) -> datetime:
    """Return the latest start date among the DAG's tasks."""
    return max(t.start_date for t in dag.tasks if t.start_date is not None)  # type: ignore[no-any-return]


def slots(run: DagRun, session: Session) -> dict[str, int]:
    """Return each task instance's pool_slots as stored in the metadata DB."""
    session.flush()
    session.expire_all()
    return {ti.task_id: ti.pool_slots for ti in run.get_task_instances(session=session)}


def test_airflow_loads_the_policy_through_its_entry_point_in_a_fresh_process() -> None:
    # A fresh interpreter with no airflow_local_settings: only the entry point can bring it.
    probe = (
        "import importlib.util, json, airflow.settings as s\n"
        "pm = s.get_policy_plugin_manager()\n"
        "impls = pm.hook.task_instance_mutation_hook.get_hookimpls()\n"
        "print(json.dumps({\n"
        "  'hooks': [[i.plugin_name, getattr(i.plugin, '__name__', '')] for i in impls],\n"
        "  'dists': [d.project_name for _, d in pm.list_plugin_distinfo()],\n"
        "  'noop': getattr(s.task_instance_mutation_hook, 'is_noop', False),\n"
        "  'local_settings': importlib.util.find_spec('airflow_local_settings') is not None,\n"
        "}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["local_settings"] is False
    assert ["burstcv", "burstcv.airflow.policy"] in found["hooks"]
    assert "burstcv" in found["dists"]  # loaded from the installed package's entry point
    # Else Airflow creates a run's task instances in bulk without calling any policy.
    assert found["noop"] is False


def test_a_three_box_run_gives_provision_and_train_three_slots_and_nothing_else_more(
    pipeline: Any, session: Session
) -> None:
    run = make_run(pipeline, session, DagRunType.MANUAL, {"num_nodes": 3})
    stored = slots(run, session)
    assert {task: stored[task] for task in GPU_TASKS} == {"provision": 3, "train": 3}
    others = {task: n for task, n in stored.items() if task not in GPU_TASKS}
    assert others == {task: pipeline.get_task(task).pool_slots for task in others}
    assert set(others.values()) == {1}
    # The GPU tasks are exactly the pipeline's tasks in the GPU pool.
    in_pool = {t.task_id for t in pipeline.tasks if t.pool == get_settings().gpu_pool}
    assert in_pool == GPU_TASKS


@pytest.mark.parametrize(
    ("run_type", "conf"),
    [(DagRunType.SCHEDULED, None), (DagRunType.ASSET_TRIGGERED, {}), (DagRunType.MANUAL, {})],
    ids=["scheduled", "asset-triggered", "manual-without-num_nodes"],
)
def test_a_run_that_does_not_say_num_nodes_takes_the_run_params_default(
    pipeline: Any, session: Session, run_type: DagRunType, conf: dict[str, Any] | None
) -> None:
    run = make_run(pipeline, session, run_type, conf)
    default = RunParams.defaults(get_settings())["num_nodes"]
    assert default == 1
    stored = slots(run, session)
    assert {task: stored[task] for task in GPU_TASKS} == {"provision": default, "train": default}


def test_a_scheduled_run_takes_a_slot_per_box_of_the_deployments_default(
    pipeline: Any, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BURSTCV_NUM_NODES: the boxes a run without a conf trains on, and the slots it takes."""
    monkeypatch.setenv("BURSTCV_NUM_NODES", "3")
    get_settings.cache_clear()
    try:
        run = make_run(pipeline, session, DagRunType.SCHEDULED, None)
        stored = slots(run, session)
    finally:
        monkeypatch.delenv("BURSTCV_NUM_NODES")
        get_settings.cache_clear()
    assert {task: stored[task] for task in GPU_TASKS} == {"provision": 3, "train": 3}


@pytest.mark.parametrize(
    "conf",
    [{"num_nodes": "many"}, {"num_nodes": 0}, {"num_nodes": 99}, {"num_nodes": None}, ["x"]],
    ids=["text", "zero", "over-the-bound", "null", "not-a-mapping"],
)
def test_a_num_nodes_the_run_would_refuse_keeps_the_declared_slot_and_warns(
    pipeline: Any, session: Session, conf: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The trigger form refuses such values, so the run is made valid and its conf spoiled
    # afterwards; Airflow reapplies the policy in refresh_from_task (a cleared task, say).
    run = make_run(pipeline, session, DagRunType.MANUAL, {"num_nodes": 2})
    train = run.get_task_instance("train", session=session)
    assert train is not None and train.pool_slots == 2
    run.conf = conf
    with caplog.at_level(logging.WARNING, logger="burstcv.airflow.policy"):
        train.refresh_from_task(pipeline.get_task("train"), dag_run=run)
    assert train.pool_slots == pipeline.get_task("train").pool_slots == 1
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == "burstcv.airflow.policy" and r.levelno == logging.WARNING
    ]
    assert len(warned) == 1 and "keeps its declared 1 pool slot" in warned[0], warned


def test_other_dags_and_runs_not_given_keep_their_own_slots(
    pipeline: Any, session: Session
) -> None:
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG
    from airflow.serialization.serialized_objects import DagSerialization

    # Another DAG with a task in the same pool and a conf that says num_nodes.
    with DAG("not_burstcv_pipeline", schedule=None) as other:
        EmptyOperator(task_id="train", pool=get_settings().gpu_pool, pool_slots=2)
    stored = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(other))
    ti = TaskInstance(stored.get_task("train"), dag_version_id=None, run_id="manual__other")
    run = DagRun(dag_id=other.dag_id, run_id="manual__other", conf={"num_nodes": 3})
    airflow_settings.task_instance_mutation_hook(ti, dag_run=run)
    assert ti.pool_slots == 2
    # A pipeline task instance refreshed without its run keeps what the task declares.
    three = make_run(pipeline, session, DagRunType.MANUAL, {"num_nodes": 3})
    train = three.get_task_instance("train", session=session)
    assert train is not None and train.pool_slots == 3
    train.refresh_from_task(pipeline.get_task("train"))
    assert train.pool_slots == 1


def test_a_deferred_three_box_train_task_holds_three_of_the_pools_slots(
    pipeline: Any, session: Session
) -> None:
    pool = Pool.get_pool(get_settings().gpu_pool, session=session)
    assert pool is not None and pool.include_deferred
    assert pool.slots == get_settings().gpu_pool_slots == 4
    open_before = pool.open_slots(session=session)
    run = make_run(pipeline, session, DagRunType.MANUAL, {"num_nodes": 3})
    train = run.get_task_instance("train", session=session)
    assert train is not None
    train.state = TaskInstanceState.DEFERRED
    session.flush()
    assert pool.open_slots(session=session) == open_before - 3
    assert pool.deferred_slots(session=session) >= 3


def test_the_benchmark_runs_alone_in_a_pool_of_its_own(pipeline: Any, session: Session) -> None:
    # burstcv airflow-init made it (the session's Airflow setup ran it), one slot by default.
    s = get_settings()
    pool = Pool.get_pool(s.bench_pool, session=session)
    assert pool is not None and pool.slots == s.bench_pool_slots == 1
    assert pipeline.get_task("benchmark").pool == s.bench_pool
    # A benchmark task that runs takes the slot: a second run's benchmark waits for it.
    first = make_run(pipeline, session, DagRunType.MANUAL, {})
    second = make_run(pipeline, session, DagRunType.MANUAL, {"num_nodes": 1})
    benchmark = first.get_task_instance("benchmark", session=session)
    assert benchmark is not None and benchmark.pool_slots == 1  # not the policy's: one box's
    assert pool.open_slots(session=session) == 1
    benchmark.state = TaskInstanceState.RUNNING
    session.flush()
    assert pool.open_slots(session=session) == 0
    waiting = second.get_task_instance("benchmark", session=session)
    assert waiting is not None and waiting.pool == s.bench_pool
