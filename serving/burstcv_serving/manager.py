"""Keep the serving model current: load the alias's version, hot-swap it, remember failures.

A staged version (``routes.admin``) is taken at the swap: no load happens after the alias moves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from datetime import UTC, datetime

from starlette.concurrency import run_in_threadpool

from burstcv_serving.metrics import ServiceMetrics
from burstcv_serving.model import LoadedModel, ModelLoadError, load_model
from burstcv_serving.registry import ModelRef, ModelSource, SourceError
from burstcv_serving.schemas import LoadErrorOut
from burstcv_serving.settings import Settings

logger = logging.getLogger(__name__)

# Staged models held beside the serving one (each costs a model's memory): two lets two
# overlapping deploys both stage; an older one is dropped (its switch then loads it again).
MAX_STAGED = 2


class ModelManager:
    """Own the one reference to the serving model and replace it only with a warmed model."""

    def __init__(self, source: ModelSource, settings: Settings, metrics: ServiceMetrics) -> None:
        self._source = source
        self._settings = settings
        self._metrics = metrics
        self._current: LoadedModel | None = None
        self._lock = asyncio.Lock()
        # Staging has its own lock: loading a candidate must not hold up alias polling.
        self._stage_lock = asyncio.Lock()
        self._staged: dict[tuple[int | str, str | None], LoadedModel] = {}
        # (version, sha256) pairs that failed: not retried by polling, only by refresh(force).
        self._failed: set[tuple[int | str, str | None]] = set()
        self.last_error: LoadErrorOut | None = None
        self.target_version: int | str | None = None  # what the alias named at the last check
        # Called with the new model right after each swap (the service's queueing target
        # follows the SLO recorded with the model it serves).
        self.on_swap: Callable[[LoadedModel], None] | None = None

    @property
    def current(self) -> LoadedModel | None:
        """Return the model serving now (read once per batch; never mutated)."""
        return self._current

    async def refresh(self, *, force: bool = False) -> LoadedModel | None:
        """Check the alias and swap in its version if it changed; return the serving model."""
        async with self._lock:
            try:
                ref = await run_in_threadpool(self._source.resolve)
            except SourceError as exc:
                self._record_failure(None, None, str(exc))
                return self._current
            self.target_version = ref.version
            current = self._current
            if (
                current is not None
                and current.version == ref.version
                and ref.expected_sha256 in (None, current.sha256)
            ):
                return current
            key = (ref.version, ref.expected_sha256)
            staged = self._staged.pop(key, None)
            if key in self._failed and not force and staged is None:
                return current
            try:
                model = staged if staged is not None else await run_in_threadpool(self._load, ref)
            except ModelLoadError as exc:
                self._failed.add(key)
                self._record_failure(ref.version, ref.expected_sha256, str(exc))
                return current
            self._current = model  # the swap: one reference assignment
            if self.on_swap is not None:
                self.on_swap(model)
            self._failed.discard(key)
            self.last_error = None
            self._metrics.model_loads.labels(outcome="loaded").inc()
            self._metrics.set_serving(model.name, model.version, model.sha256)
            logger.info(
                "serving %s version %s (sha256 %s…), was %s",
                model.name or "model",
                model.version,
                model.sha256[:12],
                "nothing" if current is None else f"version {current.version}",
            )
            return model

    async def stage(self, version: int, sha256: str | None) -> tuple[LoadedModel, bool]:
        """Load, verify and warm ``version`` beside the serving model, without switching; return
        it and whether it was loaded now (False: already staged or serving)."""
        ref = self._source.ref_for(version, sha256)
        key = (ref.version, ref.expected_sha256)
        current = self._current
        if current is not None and current.version == version and sha256 in (None, current.sha256):
            return current, False
        async with self._stage_lock:
            if key in self._staged:
                return self._staged[key], False
            model = await run_in_threadpool(self._load, ref)
            self._staged[key] = model
            while len(self._staged) > MAX_STAGED:
                dropped = next(iter(self._staged))
                del self._staged[dropped]
                logger.info("dropped staged version %s to stage %s", dropped[0], version)
            logger.info(
                "staged version %s (sha256 %s…), ready to switch", version, model.sha256[:12]
            )
            return model, True

    def staged_versions(self) -> list[int | str]:
        """Return the versions staged now, oldest first."""
        return [version for version, _ in self._staged]

    def _load(self, ref: ModelRef) -> LoadedModel:
        try:
            model = load_model(
                ref,
                intra_op_threads=self._settings.intra_op_threads,
                max_batch_size=self._settings.max_batch_size,
                spinning=self._settings.intra_op_spinning,
            )
        except ModelLoadError:
            self._metrics.model_loads.labels(outcome="failed").inc()
            raise
        return dataclasses.replace(model, latency_slo_ms=self._source.recorded_slo_ms(ref))

    async def poll_forever(self, interval_s: float) -> None:
        """Check the alias every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh()

    def _record_failure(self, version: int | str | None, sha256: str | None, reason: str) -> None:
        failure = LoadErrorOut(version=version, sha256=sha256, reason=reason, at=datetime.now(UTC))
        previous = self.last_error
        self.last_error = failure
        # Log a failure once, not on every poll.
        if previous is None or (previous.version, previous.reason) != (version, reason):
            serving = self._current
            logger.error(
                "%s; %s",
                failure.describe(),
                "no model is serving" if serving is None else f"still serving {serving.version}",
            )
