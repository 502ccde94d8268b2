"""Isolate every test session: its own Airflow home, artifact store and registry under a temp dir.

The environment is set at import time, before anything reads settings or imports Airflow.
Session fixtures build the expensive things once: the demo dataset and a trained model, and
a small photo set trained in photo mode (margin shards, random-resized crops).
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from burstcv_testkit import init_airflow_db
from localserver import moto_server, use_moto

REPO = Path(__file__).resolve().parents[1]
# One folder per test session; a caller that runs many sessions in one process (mutation
# testing, tests/mutation/run.py) names its own and removes it itself.
if os.environ.get("BURSTCV_TEST_SESSION_DIR"):
    SESSION_DIR = Path(os.environ["BURSTCV_TEST_SESSION_DIR"])
else:
    SESSION_DIR = Path(tempfile.mkdtemp(prefix="burstcv-tests-"))
    atexit.register(shutil.rmtree, SESSION_DIR, ignore_errors=True)

AIRFLOW_HOME = SESSION_DIR / "airflow"
TEST_ENV = {
    "AIRFLOW_HOME": str(AIRFLOW_HOME),
    "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
    "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{AIRFLOW_HOME}/airflow.db",
    "BURSTCV_ARTIFACT_ROOT": str(SESSION_DIR / "artifacts"),
    "BURSTCV_REGISTRY_URI": str(SESSION_DIR / "registry"),
    "BURSTCV_COMPUTE_STATE_DIR": str(SESSION_DIR / "compute"),
    "BURSTCV_DATASET_URI": str(SESSION_DIR / "data" / "digits"),
    "BURSTCV_SERVING_URL": "",
    "BURSTCV_SOURCE_COMMIT": "test",
    # Fleet sizing in every pipeline run: short load steps, one CPU size.
    "BURSTCV_SIZING_STEP_S": "0.5",
    "BURSTCV_SIZING_MAX_VCPUS": "1",
}
os.environ.update(TEST_ENV)
AIRFLOW_HOME.mkdir(parents=True, exist_ok=True)

# Reproducible CPU numbers: tests must not fight over the 2 cores with oversubscribed threads.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--shuffle SEED``: every test must pass alone and in any order."""
    parser.addoption(
        "--shuffle",
        metavar="SEED",
        default=os.environ.get("BURSTCV_TEST_SHUFFLE") or None,
        help="run the test modules, and the tests within each, in an order shuffled by SEED "
        "(the same seed repeats the order; BURSTCV_TEST_SHUFFLE sets it too)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Shuffle the modules and the tests in each (module fixtures still set up once each)."""
    seed = config.getoption("--shuffle")
    if not seed:
        return
    rng = random.Random(str(seed))
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    groups = list(modules.values())
    rng.shuffle(groups)
    for group in groups:
        rng.shuffle(group)
    items[:] = [item for group in groups for item in group]


def pytest_report_header(config: pytest.Config) -> str | None:
    """Say the order's seed, so a failure that depends on it can be repeated."""
    seed = config.getoption("--shuffle")
    return f"test order shuffled with seed {seed} (--shuffle {seed} repeats it)" if seed else None


def pytest_configure(config: pytest.Config) -> None:
    """Create the Airflow metadata DB once per process (a few seconds on SQLite).

    A second pytest session in the same process (mutation testing runs one per mutant, in a
    fork) reuses the DB the first one made.
    """
    del config
    db = AIRFLOW_HOME / "airflow.db"
    if os.environ.get("BURSTCV_TEST_AIRFLOW_DB") == str(db) and db.exists():
        return
    init_airflow_db({**os.environ})
    os.environ["BURSTCV_TEST_AIRFLOW_DB"] = str(db)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Terminate any training box a failed test left running (every run's records are here)."""
    del config
    from burstcv.compute.local import LocalBackend

    backend = LocalBackend(TEST_ENV["BURSTCV_COMPUTE_STATE_DIR"])
    if (Path(TEST_ENV["BURSTCV_COMPUTE_STATE_DIR"])).exists():
        backend.terminate([info.instance_id for info in backend.list_managed()])


@pytest.fixture(scope="session")
def demo_dataset() -> Path:
    """Return the demo digits dataset (1,797 PNGs), written once per session."""
    from burstcv.data.demo import write_demo_dataset

    root = SESSION_DIR / "data" / "digits"
    if not root.exists():
        write_demo_dataset(root)
    return root


@pytest.fixture(scope="session")
def packed_demo(demo_dataset: Path) -> dict[str, Any]:
    """Return the demo dataset packed into shards (a manifest built from the folder layout)."""
    from burstcv.data.demo import pack_demo

    result, spec = pack_demo(demo_dataset, str(SESSION_DIR / "packed"))
    return {
        "classes": result.classes,
        "train_shards": result.train_shards,
        "val_shards": result.val_shards,
        "spec": spec,
        "counts": result.counts,
    }


@pytest.fixture(scope="session")
def trained_demo(packed_demo: dict[str, Any]) -> dict[str, Any]:
    """Train resnet10 on the demo digits for 3 epochs once per session; return its outputs."""
    from burstcv_testkit import make_job

    from burstcv.training.job import write_job
    from burstcv.training.train import run_job

    out = SESSION_DIR / "trained" / "job"
    job = make_job(packed_demo, out)
    job_uri = write_job(job, str(out.parent / "job.json"))
    assert run_job(job_uri) == 0
    import json

    return {
        "job": job,
        "job_uri": job_uri,
        "out": out,
        "metrics": json.loads((out / "metrics.json").read_text()),
    }


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Clear the cached settings so a test's environment changes take effect."""
    from burstcv.settings import get_settings

    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture(scope="session")
def moto_url() -> Iterator[str]:
    """Run one AWS emulator (moto in server mode) on 127.0.0.1 for the session; yield its URL.

    Tests that use it start from an emptied emulator (``use_moto``, or the ``s3`` fixture).
    """
    with moto_server() as url:
        yield url


@pytest.fixture
def s3(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Point boto3 at the emptied emulator with buckets datasets and artifacts; return a client."""
    from burstcv_spec import storage

    use_moto(moto_url, monkeypatch)
    client = storage.s3_client()
    client.create_bucket(Bucket="datasets")
    client.create_bucket(Bucket="artifacts")
    return client


@pytest.fixture(scope="session")
def trained_photos() -> dict[str, Any]:
    """Pack a two-class JPEG set with the margin and train resnet10 on it for 3 epochs once."""
    import json

    import pandas as pd
    from burstcv_testkit import write_photo_dataset

    from burstcv.data.pack import pack_dataset
    from burstcv.training.job import JobSpec, write_job
    from burstcv.training.train import run_job
    from burstcv_spec.preprocess import PreprocessSpec, resize_short_for

    root = SESSION_DIR / "photos"
    rows = write_photo_dataset(root / "data")
    size_only = PreprocessSpec(height=32, width=32, resize_short=resize_short_for(32))
    packed = pack_dataset(pd.DataFrame(rows), str(root / "shards"), size_only, margin=True)
    spec = PreprocessSpec(
        height=32,
        width=32,
        resize_short=size_only.resize_short,
        mean=packed.preprocess.mean,
        std=packed.preprocess.std,
    )
    out = root / "job"
    job = JobSpec(
        run_id="photos",
        classes=packed.classes,
        train_shards=packed.train_shards,
        val_shards=packed.val_shards,
        preprocess=spec.to_dict(),
        output_uri=str(out),
        epochs=3,
        batch_size=16,
        learning_rate=0.05,
        source_commit="test",
    )
    job_uri = write_job(job, str(root / "job.json"))
    assert run_job(job_uri) == 0
    return {
        "rows": rows,
        "packed": packed,
        "spec": spec,
        "job": job,
        "out": out,
        "metrics": json.loads((out / "metrics.json").read_text()),
    }
