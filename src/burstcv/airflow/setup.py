"""Prepare an Airflow metadata DB for burstcv: the pool that bounds live GPU instances."""

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
