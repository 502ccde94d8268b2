"""Make a pipeline run's GPU tasks take one slot of the GPU pool per training box it rents.

An Airflow cluster policy (the ``airflow.policy`` entry point in pyproject.toml): ``pool_slots``
is a static operator argument, so a run's ``num_nodes`` (its conf) can reach the pool only
here. Within burstcv_pipeline the GPU pool marks the tasks that hold boxes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pluggy

from burstcv.links import DAG_ID

if TYPE_CHECKING:
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from pydantic import TypeAdapter

log = logging.getLogger(__name__)

NUM_NODES = "num_nodes"  # the RunParams field (and conf key) that counts a run's boxes
# Airflow's own marker (airflow.policies.hookimpl) is made exactly so. Importing it from
# airflow would start Airflow, which loads this entry point while this module is half
# imported: Airflow would then register a plugin with no hooks, silently.
POLICY_PROJECT = "airflow.policy"
hookimpl = pluggy.HookimplMarker(POLICY_PROJECT)


@hookimpl
def task_instance_mutation_hook(task_instance: TaskInstance, dag_run: DagRun | None) -> None:
    """Set a burstcv_pipeline GPU task's ``pool_slots`` to its run's number of training boxes.

    The scheduler calls this inside its own transaction: no DB session, no network, and no
    exception may leave it (one would abort scheduling for every DAG).
    """
    if task_instance.dag_id != DAG_ID or dag_run is None:
        return
    try:
        _set_pool_slots(task_instance, dag_run)
    except Exception:  # raising here would stop the scheduler: see the docstring
        log.exception(
            "burstcv pool policy failed on %s: it keeps its declared %s pool slot(s)",
            _where(task_instance),
            task_instance.pool_slots,
        )


def _set_pool_slots(task_instance: TaskInstance, dag_run: DagRun) -> None:
    from burstcv.settings import get_settings

    settings = get_settings()
    if task_instance.pool != settings.gpu_pool:
        return
    boxes, where = requested_boxes(dag_run.conf), _where(task_instance)
    if boxes is None:
        conf = dag_run.conf
        log.warning(
            "%s: conf %s=%r is not a number of boxes; it keeps its declared %s pool slot(s)",
            where,
            NUM_NODES,
            conf.get(NUM_NODES) if isinstance(conf, Mapping) else conf,
            task_instance.pool_slots,
        )
        return
    if boxes > settings.gpu_pool_slots:
        log.warning(
            "%s needs %d slots of pool %s, which has %d (BURSTCV_GPU_POOL_SLOTS): it will wait "
            "until the pool is that large",
            where,
            boxes,
            settings.gpu_pool,
            settings.gpu_pool_slots,
        )
    if task_instance.pool_slots != boxes:
        log.info(
            "%s: %d slot(s) of pool %s, one per training box (%s)",
            where,
            boxes,
            settings.gpu_pool,
            NUM_NODES,
        )
    task_instance.pool_slots = boxes


def _where(task_instance: TaskInstance) -> str:
    """Name a task instance in a log line: dag.task run <run id>."""
    return f"{task_instance.dag_id}.{task_instance.task_id} run {task_instance.run_id}"


def requested_boxes(conf: Any) -> int | None:
    """Return the run's number of training boxes: conf's ``num_nodes``, else RunParams' default;
    None for a value RunParams would refuse, or a conf that is not a mapping."""
    if conf is None:
        conf = {}
    if not isinstance(conf, Mapping):
        return None
    if NUM_NODES not in conf:
        from burstcv.params import RunParams
        from burstcv.settings import get_settings

        return int(RunParams.defaults(get_settings())[NUM_NODES])
    from pydantic import ValidationError

    try:
        return _num_nodes_adapter().validate_python(conf[NUM_NODES])
    except ValidationError:
        return None


@functools.cache
def _num_nodes_adapter() -> TypeAdapter[int]:
    """Validate one num_nodes value exactly as RunParams validates its field."""
    from typing import Annotated

    from pydantic import TypeAdapter

    from burstcv.params import RunParams

    field = RunParams.model_fields[NUM_NODES]
    return TypeAdapter(Annotated[int, field])


def _make_airflow_call_the_hook() -> None:
    """Undo Airflow's "no policy" shortcut, which only its local-settings file would undo.

    Airflow (3.3 included) marks its task-instance hook a no-op unless
    ``airflow_local_settings`` defines one, and then calls no policy; the flag is cleared only
    where it is set. Called last: imported before Airflow, this import starts Airflow, which
    registers the finished module through the entry point.
    """
    from airflow import settings as airflow_settings

    hook = airflow_settings.task_instance_mutation_hook
    if getattr(hook, "is_noop", False):
        hook.is_noop = False  # type: ignore[attr-defined]


_make_airflow_call_the_hook()
