"""Every DAG file imports cleanly, cheaply, and has the structure the design promises."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DAG_FILES = sorted((REPO / "dags").glob("*.py"))


@pytest.fixture(scope="module")
def dagbag():  # type: ignore[no-untyped-def]
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


def test_every_dag_file_imports_without_errors(dagbag) -> None:  # type: ignore[no-untyped-def]
    assert DAG_FILES, "no DAG files found"
    assert dagbag.import_errors == {}
    assert "burstcv_pipeline" in dagbag.dags


@pytest.mark.parametrize("dag_file", DAG_FILES, ids=lambda p: p.name)
def test_parsing_a_dag_file_does_not_import_heavy_libraries(dag_file: Path) -> None:
    """The scheduler parses DAG files over and over: no torch, onnx, GX, sklearn or AWS SDK.

    (The AWS SDK is not even installed in the torch-free Python 3.12 environment.)
    """
    code = (
        "import runpy, sys; runpy.run_path(sys.argv[1]); "
        "heavy = [m for m in ('torch', 'torchvision', 'onnx', 'onnxruntime', 'great_expectations', "
        "'sklearn', 'pandas', 'botocore') if m in sys.modules]; print('heavy=' + ','.join(heavy))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(dag_file)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "heavy=", result.stdout[-500:]


def test_pipeline_structure(dagbag) -> None:  # type: ignore[no-untyped-def]
    dag = dagbag.dags["burstcv_pipeline"]
    assert set(dag.task_ids) >= {
        "plan_scan",
        "scan",
        "validate",
        "plan_pack",
        "pack_shards",
        "pack",
        "provision",
        "train",
        "terminate",
        "export",
        "benchmark",
        "gate",
        "deploy",
    }
    t = dag.task_dict
    assert t["provision"].is_setup and t["terminate"].is_teardown
    assert t["provision"].task_id in t["terminate"].upstream_task_ids
    assert "train" in t["terminate"].upstream_task_ids
    # Nothing that costs money starts before validation passed.
    assert t["validate"].task_id in t["pack"].upstream_task_ids
    assert "pack" in t["provision"].upstream_task_ids
    assert "train" in t["export"].upstream_task_ids
    assert "gate" in t["deploy"].upstream_task_ids
    assert dag.dagrun_timeout is None, "dagrun_timeout skips teardown tasks"
    for task in dag.tasks:
        assert isinstance(task.execution_timeout, timedelta), (
            f"{task.task_id} has no execution_timeout"
        )
        assert task.doc_md or task.doc, f"{task.task_id} has no docs"
    assert dag.doc_md and "burstcv_pipeline" in dag.doc_md


def test_pipeline_params_form_schema(dagbag) -> None:  # type: ignore[no-untyped-def]
    dag = dagbag.dags["burstcv_pipeline"]
    params = dag.params
    schema = {k: params.get_param(k).schema for k in params}
    assert schema["model"]["enum"][:2] == ["auto", "resnet10"]
    assert schema["compute_backend"]["enum"] == ["local", "ec2"]
    # Bounds under allOf: Airflow refuses an out-of-range value there (tests/test_params.py),
    # where top-level ones make the UI's number input clamp it without a word.
    assert schema["epochs"]["allOf"] == [{"minimum": 1, "maximum": 500}]
    assert schema["drift_max"]["type"] == ["null", "number"]  # may be left empty
    assert schema["batch_size"]["section"] == "Training details"
    assert schema["latency_slo_ms"]["type"] == "number"
    for key, spec in schema.items():
        assert spec.get("title"), f"param {key} has no title"


def test_every_failure_fails_the_run_and_the_report_is_written_whatever_failed(dagbag) -> None:  # type: ignore[no-untyped-def]
    t = dagbag.dags["burstcv_pipeline"].task_dict
    # The page that says what went wrong: a teardown with no setup of its own, it runs once
    # the verdict, deploy and the boxes' end are done, whatever they ended as (all_done: no
    # setup upstream of it to wait for). Airflow's mark-failed skips every pending task but
    # the teardowns (set_dag_run_state_to_failed), so it runs then too.
    report = t["report"]
    assert report.is_teardown and not report.on_failure_fail_dagrun
    assert report.trigger_rule == "all_done_setup_success"
    assert not [u for u in report.upstream_list if u.is_setup]
    assert report.upstream_task_ids == {"gate", "deploy", "terminate", "clean_up_failed_provision"}
    # The bill is written by terminate, a teardown: the report reads it after, never beside it.
    assert t["terminate"].is_teardown and "report" in t["terminate"].downstream_task_ids
    outcome = t["outcome"]
    # A teardown: Airflow skips every other pending task of a run a user marks failed, and
    # runs its teardowns; on_failure_fail_dagrun makes its failure the run's. Last: everything
    # else is upstream of it.
    assert outcome.is_teardown and outcome.on_failure_fail_dagrun
    assert outcome.upstream_task_ids == {"report"}
    assert outcome.downstream_task_ids == set()
    assert set(outcome.get_flat_relative_ids(upstream=True)) == set(t) - {"outcome"}


def test_reaper_is_on_from_the_start(dagbag) -> None:  # type: ignore[no-untyped-def]
    dag = dagbag.dags["burstcv_reaper"]
    assert dag.is_paused_upon_creation is False  # a safety net nobody has to remember
    assert dag.schedule is not None or dag.timetable is not None
    (task,) = dag.tasks
    assert isinstance(task.execution_timeout, timedelta)


def test_a_failed_provision_has_its_own_clean_up_path(dagbag) -> None:  # type: ignore[no-untyped-def]
    from airflow.utils.trigger_rule import TriggerRule

    t = dagbag.dags["burstcv_pipeline"].task_dict
    clean_up = t["clean_up_failed_provision"]
    # Airflow runs no teardown for a failed setup; this task runs when train is
    # upstream_failed (provision failed) or failed, and never otherwise.
    assert clean_up.trigger_rule == TriggerRule.ONE_FAILED
    assert clean_up.upstream_task_ids == {"train"}
    assert "provision" in t["train"].upstream_task_ids
    assert not clean_up.is_setup and not clean_up.is_teardown


def test_every_form_field_is_described_here_and_in_the_docs(dagbag) -> None:  # type: ignore[no-untyped-def]
    dag = dagbag.dags["burstcv_pipeline"]
    docs = (REPO / "docs" / "airflow.md").read_text()
    for key in dag.params:
        param = dag.params.get_param(key)
        schema = param.schema
        assert param.description, f"form field {key} has no description"
        assert f"| {schema['title']} (`{key}`) |" in docs, f"docs/airflow.md omits {key}"
    assert "**Details** tab" in docs  # where the task links are
    assert "Trigger DAG w/ config" not in dag.doc_md and "**Trigger**" in dag.doc_md
    readme = (REPO / "README.md").read_text()
    stages = readme.split("## The stages", 1)[1].split("```")[1]
    assert all(f"─ {task} " in stages for task in dag.task_ids), stages


def test_a_task_is_retried_where_a_retry_is_safe_and_says_why_where_not(dagbag) -> None:  # type: ignore[no-untyped-def]
    t = dagbag.dags["burstcv_pipeline"].task_dict
    # Idempotent: a retry rewrites the same outputs (gate finds the version it registered;
    # a failed deploy left production as it was).
    # Provision too: a retry launches against the deadline its first try armed.
    for task_id in (
        "plan_scan",
        "provision",
        "export",
        "benchmark",
        "gate",
        "deploy",
        "report",
        "outcome",
    ):
        assert t[task_id].retries >= 1, f"{task_id} has no retries"
    provision = t["provision"]
    assert "against the first try's" in (provision.doc_md or provision.doc or "")
