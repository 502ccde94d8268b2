"""Measure validate and pack spread over 1 and 2 Celery workers: images/s and per-chunk cost.

Used by ``bench/validate.py --celery`` and ``bench/pack.py``. Each side starts a real
distributed Airflow (tests/burstcv_airflow_stack.py: PostgreSQL, Redis, scheduler,
dag-processor, api-server and N Celery workers of one task slot each, worker n pinned to CPU
n-1 as if each were a one-core machine of its own), runs a DAG of the pipeline's own data
stages (``burstcv.airflow.data_stages``: plan_scan, a scan task per chunk, validate,
plan_pack, a pack_shards task per chunk, pack) on the dataset, and reads every task
instance's start and end from the REST API:

* scan (pack) images/s: the dataset's images over the wall time from the first chunk task's
  start to the last one's end; stage images/s: from plan_scan's start to validate's end (from
  plan_pack's start to pack's end), the plan and the join included;
* per-chunk overhead, in two parts: inside the task, the mean of (a chunk task's duration
  minus the same files' work measured in this process, one core, no Airflow): reading the plan
  and writing the part; between tasks, the mean time a worker slot sat idle per chunk while
  chunks were left ((chunk wall x workers - the chunk tasks' durations) / chunks): the
  scheduler's loop, the Celery queue, and the start of the task's process and its DAG parse.

The sides run one after the other in one invocation (1 worker, then 2); the ratio is the
scaling. On a shared 2-core machine read it as an upper bound of what a second core buys.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

DAG_ID = "burstcv_data_bench"
BENCH_DAG = '''"""Benchmark DAG: the pipeline's data stages alone (validate and pack, in chunks)."""

from datetime import datetime

from airflow.sdk import dag

from burstcv.airflow.data_stages import data_stages
from burstcv.airflow.form import trigger_form
from burstcv.settings import get_settings


@dag(
    dag_id="burstcv_data_bench",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    params=trigger_form(get_settings()),
)
def burstcv_data_bench() -> None:
    data_stages()


burstcv_data_bench()
'''


@dataclass
class TaskSpan:
    """Hold one task instance's name, map index and start/end (seconds since the epoch)."""

    task_id: str
    map_index: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        """Return the task instance's duration."""
        return self.end - self.start


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@contextlib.contextmanager
def data_stack(dataset: Path, workers: int, scratch: Path) -> Iterator[Any]:
    """Run a Celery stack of ``workers`` one-slot, pinned workers with the bench DAG."""
    from burstcv_airflow_stack import airflow_stack, burstcv_env

    dags = scratch / f"dags-{workers}"
    dags.mkdir(parents=True)
    (dags / "burstcv_data_bench.py").write_text(BENCH_DAG)
    store = scratch / f"store-{workers}"
    home = store / "airflow"
    home.mkdir(parents=True)
    env = {**burstcv_env(store, dataset), "AIRFLOW__CORE__DAGS_FOLDER": str(dags)}
    more = [f"celery-worker-{n}" for n in range(2, workers + 1)]
    components = ("dag-processor", "scheduler", "api-server", "celery-worker", *more)
    with airflow_stack(
        env,
        executor="CeleryExecutor",
        components=components,
        home=home,
        worker_concurrency=1,
        pin_workers=True,
    ) as stack:
        yield stack


def run_once(stack: Any, conf: dict[str, Any], timeout_s: float = 3600) -> list[TaskSpan]:
    """Trigger the bench DAG with ``conf``; return its task spans once it succeeded."""
    with stack.client() as client:
        deadline = time.monotonic() + 300
        while client.get(f"/api/v2/dags/{DAG_ID}").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{DAG_ID} never parsed\n{stack.all_log_tails()}")
            time.sleep(2)
        client.patch(f"/api/v2/dags/{DAG_ID}", json={"is_paused": False}).raise_for_status()
        response = client.post(
            f"/api/v2/dags/{DAG_ID}/dagRuns", json={"logical_date": None, "conf": conf}
        )
        response.raise_for_status()
        run_id = response.json()["dag_run_id"]
        deadline = time.monotonic() + timeout_s
        while True:
            stack.assert_running()
            state = client.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}").json()["state"]
            if state in ("success", "failed"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"run {run_id} still {state} after {timeout_s} s")
            time.sleep(2)
        listed = client.get(
            f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances", params={"limit": 1000}
        ).json()["task_instances"]
        if state != "success":
            states = {(ti["task_id"], ti["map_index"]): ti["state"] for ti in listed}
            raise RuntimeError(f"run {run_id} {state}: {states}\n{stack.all_log_tails()}")
    return [
        TaskSpan(ti["task_id"], ti["map_index"], _epoch(ti["start_date"]), _epoch(ti["end_date"]))
        for ti in listed
        if ti["start_date"] and ti["end_date"]
    ]


def figures(
    spans: list[TaskSpan], images: int, stage: str, work_s: float, workers: int
) -> dict[str, float]:
    """Return a stage's images/s (chunks, whole stage) and mean per-chunk overheads."""
    plan, chunk_task, join = {
        "validate": ("plan_scan", "scan", "validate"),
        "pack": ("plan_pack", "pack_shards", "pack"),
    }[stage]
    by_task = {s.task_id: s for s in spans if s.map_index < 0}
    chunks = [s for s in spans if s.task_id == chunk_task]
    chunk_wall = max(s.end for s in chunks) - min(s.start for s in chunks)
    stage_wall = by_task[join].end - by_task[plan].start
    return {
        "chunks": len(chunks),
        "chunk_images_per_s": images / chunk_wall,
        "stage_images_per_s": images / stage_wall,
        "chunk_wall_s": chunk_wall,
        "stage_wall_s": stage_wall,
        "overhead_per_chunk_s": (sum(s.seconds for s in chunks) - work_s) / len(chunks),
        "idle_per_chunk_s": (chunk_wall * workers - sum(s.seconds for s in chunks)) / len(chunks),
    }


def in_process_work(dataset: Path, scratch: Path, image_size: int) -> dict[str, float]:
    """Time the scan and the pack of the whole dataset in this process, pinned to one CPU."""
    from burstcv.data.chunks import scan_chunk
    from burstcv.data.pack import pack_shards
    from burstcv.params import RunParams
    from burstcv.settings import Settings
    from burstcv.stages import data as data_stage
    from burstcv.stages import resolve
    from burstcv_spec.contracts import DataChunk, RunRef

    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        settings = Settings(home=str(scratch / "inproc"), artifact_root=str(scratch / "inproc"))
        params = RunParams.resolve(
            {"dataset_uri": str(dataset), "pretrained": "none", "image_size": image_size},
            settings,
        )
        run = RunRef.of("manual__in_process")
        plan = data_stage.plan_scan(run, params, settings)
        whole = DataChunk(
            index=0,
            start=0,
            stop=plan.files,
            files=plan.files,
            bytes=plan.bytes,
            part_uri=str(scratch / "inproc" / "whole.parquet"),
        )
        started = time.perf_counter()
        scan_chunk(plan, whole, params.validation_config(), workers=1)
        scan_s = time.perf_counter() - started
        validated = data_stage.validate(run, settings, params=params)
        order = data_stage.shard_order(resolve.resolved_run(run, settings), validated)
        started = time.perf_counter()
        shards = [order.shard(n) for n in range(order.total)]
        pack_shards(shards, order.spec, order.classes, str(scratch / "inproc" / "shards"))
        pack_s = time.perf_counter() - started
    finally:
        os.sched_setaffinity(0, cpus)
    return {"validate": scan_s, "pack": pack_s}


def compare(dataset: Path, images: int, chunk_files: int, image_size: int) -> dict[str, Any]:
    """Run 1 and 2 workers side by side; return every figure (and print nothing)."""
    with tempfile.TemporaryDirectory(prefix="burstcv-scaleout-") as tmp:
        scratch = Path(tmp)
        work = in_process_work(dataset, scratch, image_size)
        conf = {
            "dataset_uri": str(dataset),
            "chunk_files": chunk_files,
            "pretrained": "none",
            "image_size": image_size,
        }
        sides: dict[int, list[TaskSpan]] = {}
        for workers in (1, 2):
            with data_stack(dataset, workers, scratch) as stack:
                sides[workers] = run_once(stack, conf)
    return {
        "images": images,
        "chunk_files": chunk_files,
        "in_process_one_core_s": work,
        "sides": {
            workers: {stage: figures(spans, images, stage, work[stage], workers) for stage in work}
            for workers, spans in sides.items()
        },
    }


def report(result: dict[str, Any], stage: str) -> str:
    """Return a stage's side-by-side table and its scaling ratio."""
    one, two = (result["sides"][n][stage] for n in (1, 2))
    lines = [
        f"{stage}: {result['images']} images, {one['chunks']} chunks of at most "
        f"{result['chunk_files']} files; one core in-process: "
        f"{result['images'] / result['in_process_one_core_s'][stage]:.0f} images/s",
        f"  {'workers':>7s} {'chunk tasks img/s':>18s} {'whole stage img/s':>18s} "
        f"{'stage wall s':>12s} {'in-task s/chunk':>15s} {'between s/chunk':>15s}",
    ]
    for workers, side in ((1, one), (2, two)):
        lines.append(
            f"  {workers:7d} {side['chunk_images_per_s']:18.1f} {side['stage_images_per_s']:18.1f} "
            f"{side['stage_wall_s']:12.1f} {side['overhead_per_chunk_s']:15.2f} "
            f"{side['idle_per_chunk_s']:15.2f}"
        )
    lines.append(
        f"  scaling 2 vs 1 worker: chunk tasks "
        f"{two['chunk_images_per_s'] / one['chunk_images_per_s']:.2f}x, whole stage "
        f"{two['stage_images_per_s'] / one['stage_images_per_s']:.2f}x"
    )
    return "\n".join(lines)
