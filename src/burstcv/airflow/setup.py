"""Prepare an Airflow metadata DB for burstcv: migrated, with its pools (GPU boxes, benchmarks)."""

from __future__ import annotations

import logging

from burstcv.settings import Settings, get_settings

log = logging.getLogger(__name__)


def ensure_gpu_pool(settings: Settings | None = None) -> None:
    """Create or resize the pool whose slots bound concurrent training boxes (the GPU quota).

    Deferred tasks keep their slot (``include_deferred``), so a run waiting on its training
    box holds one until the teardown; further runs queue instead of renting more GPUs.
    """
    from airflow.models.pool import Pool

    s = settings or get_settings()
    Pool.create_or_update_pool(
        name=s.gpu_pool,
        slots=s.gpu_pool_slots,
        description="burstcv: training boxes that may exist at once (the account's GPU quota)",
        include_deferred=True,
    )
    log.info("pool %s: %d slots (deferred tasks count)", s.gpu_pool, s.gpu_pool_slots)


def ensure_pools(settings: Settings | None = None) -> None:
    """Create or resize burstcv's pools: the GPU boxes' and the benchmarks'."""
    s = settings or get_settings()
    ensure_gpu_pool(s)
    ensure_bench_pool(s)


def ensure_bench_pool(settings: Settings | None = None) -> None:
    """Create or resize the pool the benchmark task runs in (one slot by default).

    Two runs' latency benchmarks and fleet sizings on one worker would measure each other:
    the pool keeps them one at a time (``BURSTCV_BENCH_POOL_SLOTS``, per worker pool).
    """
    from airflow.models.pool import Pool

    s = settings or get_settings()
    Pool.create_or_update_pool(
        name=s.bench_pool,
        slots=s.bench_pool_slots,
        description="burstcv: gate measurements (latency, sizing) that may run at once",
        include_deferred=False,
    )
    log.info("pool %s: %d slot(s)", s.bench_pool, s.bench_pool_slots)


def ensure_metadata_db() -> bool:
    """Create or migrate the Airflow metadata DB when it is missing or behind; return if it did.

    What ``airflow db migrate`` does, so ``burstcv run`` works on a fresh ``AIRFLOW_HOME``
    instead of failing on a missing table. A DB that is up to date is left alone.
    """
    from airflow import settings as airflow_settings
    from airflow.utils import db

    try:
        db.check_migrations(timeout=1)
        return False
    except TimeoutError:
        pass
    engine = airflow_settings.engine
    where = engine.url.render_as_string(hide_password=True) if engine is not None else "?"
    log.info("the Airflow metadata DB (%s) is missing or behind: migrating it", where)
    db.upgradedb()
    return True
