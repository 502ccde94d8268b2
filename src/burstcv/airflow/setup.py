"""Prepare an Airflow metadata DB for burstcv: migrated, with its pools (GPU boxes, benchmarks)."""

from __future__ import annotations

import logging

from burstcv.settings import Settings, get_settings

log = logging.getLogger(__name__)


def ensure_pools(settings: Settings | None = None) -> None:
    """Create or resize burstcv's pools: the GPU boxes' and the benchmarks'.

    Deferred tasks keep their GPU slot, so a run waiting on its box holds one until the
    teardown and further runs queue instead of renting more GPUs. The bench pool keeps two
    runs' latency benchmarks and sizings from measuring each other.
    """
    from airflow.models.pool import Pool

    s = settings or get_settings()
    boxes = "training boxes that may exist at once (the account's GPU quota)"
    measurements = "gate measurements (latency, sizing) that may run at once"
    for name, slots, what, deferred in (
        (s.gpu_pool, s.gpu_pool_slots, boxes, True),
        (s.bench_pool, s.bench_pool_slots, measurements, False),
    ):
        Pool.create_or_update_pool(
            name=name, slots=slots, description=f"burstcv: {what}", include_deferred=deferred
        )
        log.info(
            "pool %s: %d slot(s)%s", name, slots, " (deferred tasks count)" if deferred else ""
        )


def ensure_metadata_db() -> bool:
    """Create or migrate the Airflow metadata DB when it is missing or behind; return if it did
    (what ``airflow db migrate`` does, so ``burstcv run`` works on a fresh ``AIRFLOW_HOME``)."""
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
