"""A run whose training fails, run for real with dag.test(): its report has the bill and why."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from airflow.dag_processing.dagbag import DagBag

from burstcv.report.render import RunDocs, usd
from burstcv.settings import get_settings
from burstcv.stages.resolve import run_layout
from burstcv_spec import storage

pytestmark = pytest.mark.e2e

DAGS = Path(__file__).resolve().parents[2] / "dags"


def test_a_run_whose_training_fails_reports_its_cost_and_its_reason(
    demo_dataset: Path, tmp_path: Path
) -> None:
    data = tmp_path / "digits"
    for split, per_class in (("train", 20), ("val", 8)):
        for cls in range(10):
            (data / split / str(cls)).mkdir(parents=True)
            for f in sorted((demo_dataset / split / str(cls)).glob("*.png"))[:per_class]:
                shutil.copy(f, data / split / str(cls) / f.name)
    get_settings.cache_clear()
    dag = DagBag(dag_folder=str(DAGS)).dags["burstcv_pipeline"]
    # The shortest time budget, and more epochs than it holds: the trainer stops at the
    # deadline (stage budget, not resumable), so the train task fails at once.
    conf = {
        "dataset_uri": str(data),
        "epochs": 500,
        "early_stop_patience": 500,
        "time_budget_s": 60,
        "force_train": True,
    }
    dag_run = dag.test(run_conf=conf)
    tasks = {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}
    assert str(dag_run.state) == "failed", tasks
    assert tasks["train"] == "failed" and tasks["terminate"] == "success", tasks
    assert tasks["report"] == "success" and tasks["outcome"] == "failed", tasks
    root = run_layout(dag_run.run_id).root
    docs = RunDocs.read(root)
    # The bill terminate wrote was there when the report was: it ran after the teardown.
    assert docs.billing is not None and "billing" not in docs.missing, docs.missing
    assert docs.billing.terminated_at is not None and sum(docs.billing.billed_seconds.values()) > 0
    assert docs.failure is not None and docs.failure.stage == "budget", docs.failure
    page = storage.read_bytes(storage.join(root, "report", "index.html")).decode()
    assert "billing.json was not written" not in page
    assert usd(docs.billing.cost_usd) in page
    assert "Training failed in attempt 1" in page and "at the budget stage" in page
    assert "deadline" in page
    report_ti = next(ti for ti in dag_run.get_task_instances() if ti.task_id == "report")
    terminate_ti = next(ti for ti in dag_run.get_task_instances() if ti.task_id == "terminate")
    assert report_ti.start_date >= terminate_ti.end_date
