"""Gather concurrent prediction requests into micro-batches for one session.run each.

One worker task drains the queue: it takes every job already waiting (up to the batch size)
and runs them at once, so a lone request runs immediately and a busy service runs full
batches. Only when a batch already holds several jobs does it wait, at most
``max_batch_wait_ms``, for more. Each batch takes the model reference once, and every job
in it is answered with that model.

A single image that is the only request in the service (none other being read, decoded,
queued or run) skips the queue and the inference thread: it runs right on the event loop,
which saves two thread hand-offs (a few tenths of a millisecond on a small CPU) when the
model answers within ``inline_max_ms``. No other request can be delayed by it, as there is
none; under concurrency every request goes through the batches. Slower models always go
through the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from burstcv_serving.manager import ModelManager
from burstcv_serving.metrics import ServiceMetrics
from burstcv_serving.model import LoadedModel
from burstcv_serving.preprocess import ImageDecodeError, PreprocessSpec, decode_to_uint8

logger = logging.getLogger(__name__)

BatchResult = tuple[LoadedModel, np.ndarray]  # the model that answered, probabilities (n, K)


class QueueFullError(RuntimeError):
    """Raise when the inference queue holds as many images as allowed (shed with 503)."""


class NoModelError(RuntimeError):
    """Raise when no model is loaded (or the service is stopping)."""


@dataclass(eq=False)
class _Job:
    """One request's images, decoded with ``spec``; the raw bytes allow re-decoding."""

    payloads: list[bytes]
    images: np.ndarray  # uint8 NHWC at spec's size
    spec: PreprocessSpec
    future: asyncio.Future[BatchResult] = field(repr=False)

    @property
    def size(self) -> int:
        return len(self.images)


class MicroBatcher:
    """Queue decoded images and answer them in batches from a single inference thread."""

    def __init__(
        self,
        manager: ModelManager,
        executor: Executor,
        metrics: ServiceMetrics,
        *,
        max_batch_size: int,
        max_batch_wait_s: float,
        max_queue: int,
        max_pixels: int,
        inline_max_s: float = 0.0,
    ) -> None:
        self._manager = manager
        self._executor = executor
        self._metrics = metrics
        self._max_batch_size = max_batch_size
        self._max_wait_s = max_batch_wait_s
        self._max_queue = max_queue
        self._max_pixels = max_pixels
        self._inline_max_s = inline_max_s
        self._running = False  # the worker holds jobs (gathering or running a batch)
        self._active = 0  # prediction requests inside the routes (see tracking())
        self._pending: deque[_Job] = deque()
        self._pending_images = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def queue_depth(self) -> int:
        """Return the number of images waiting for inference."""
        return self._pending_images

    @property
    def active_requests(self) -> int:
        """Return the number of prediction requests being handled now."""
        return self._active

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Count one prediction request for as long as the block runs (from body to answer)."""
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1

    def start(self) -> None:
        """Start the worker task on the running event loop."""
        self._task = asyncio.create_task(self._work(), name="burstcv-batcher")

    async def stop(self) -> None:
        """Stop the worker and fail whatever still waits."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        while self._pending:
            job = self._pending.popleft()
            if not job.future.done():
                job.future.set_exception(NoModelError("the service is shutting down"))
        self._pending_images = 0

    async def submit(
        self, payloads: list[bytes], images: np.ndarray, spec: PreprocessSpec
    ) -> BatchResult:
        """Queue one request's images and wait for the model and probabilities that answer it."""
        n = len(images)
        if self._pending_images + n > self._max_queue:
            self._metrics.rejected.inc()
            raise QueueFullError(
                f"the inference queue is full ({self._pending_images} images waiting, "
                f"limit {self._max_queue}); retry shortly"
            )
        if n == 1 and self._inline_model(spec) is not None:
            # Requests that arrived in the same burst are tasks that have not started yet:
            # let them run up to their own submit first, then look again.
            await asyncio.sleep(0)
            model = self._inline_model(spec)
            if model is not None:
                return self._run_inline(model, images)
        future: asyncio.Future[BatchResult] = asyncio.get_running_loop().create_future()
        self._pending.append(_Job(payloads, images, spec, future))
        self._pending_images += n
        self._metrics.queue_depth.set(self._pending_images)
        self._wakeup.set()
        return await future

    def _inline_model(self, spec: PreprocessSpec) -> LoadedModel | None:
        """Return the model a single image may run on right now, skipping the queue, or None.

        See the module docstring: only when no other request is in the service.
        """
        model = self._manager.current
        if (
            self._active <= 1
            and not self._pending
            and not self._running
            and model is not None
            and model.spec == spec
            and model.single_latency_s <= self._inline_max_s
        ):
            return model
        return None

    def _take(self, jobs: list[_Job], size: int) -> int:
        """Move waiting jobs into ``jobs`` while they fit the batch; return the new size."""
        while self._pending:
            job = self._pending[0]
            if jobs and size + job.size > self._max_batch_size:
                break
            self._pending.popleft()
            self._pending_images -= job.size
            if job.future.done():  # the client went away
                continue
            jobs.append(job)
            size += job.size
        self._metrics.queue_depth.set(self._pending_images)
        return size

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._running = True
            try:
                await self._gather_and_run(loop)
            finally:
                self._running = False

    async def _gather_and_run(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take waiting jobs (and, when busy, wait briefly for more), then run them."""
        jobs: list[_Job] = []
        size = self._take(jobs, 0)
        if len(jobs) > 1 and size < self._max_batch_size and self._max_wait_s > 0:
            # Requests are arriving together: give the next few a moment to join.
            deadline = loop.time() + self._max_wait_s
            while size < self._max_batch_size:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except TimeoutError:
                    break
                size = self._take(jobs, size)
        if jobs:
            await self._run_batch(loop, jobs)

    def _run_inline(self, model: LoadedModel, images: np.ndarray) -> BatchResult:
        """Answer a lone single-image job on the event loop (see the module docstring)."""
        started = time.perf_counter()
        try:
            probabilities = model.predict_proba(images)
        except Exception:
            logger.exception("inference failed for a single image")
            raise
        self._metrics.inference.observe(time.perf_counter() - started)
        self._metrics.batch_size.observe(len(probabilities))
        return model, probabilities

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, jobs: list[_Job]) -> None:
        model = self._manager.current  # taken once: the whole batch answers with this model
        if model is None:
            for job in jobs:
                _settle(job, error=NoModelError("no model is loaded"))
            return
        started = time.perf_counter()
        try:
            ran, probabilities, failures = await loop.run_in_executor(
                self._executor, self._infer, model, jobs
            )
        except Exception as exc:
            # Not hidden: logged here and raised again in every request of the batch (a 500).
            logger.exception("inference failed for a batch of %d jobs", len(jobs))
            for job in jobs:
                _settle(job, error=exc)
            return
        self._metrics.inference.observe(time.perf_counter() - started)
        self._metrics.batch_size.observe(len(probabilities))
        offset = 0
        for job in ran:
            _settle(job, result=(model, probabilities[offset : offset + job.size]))
            offset += job.size
        for job, error in failures:
            _settle(job, error=error)

    def _infer(
        self, model: LoadedModel, jobs: list[_Job]
    ) -> tuple[list[_Job], np.ndarray, list[tuple[_Job, ImageDecodeError]]]:
        """Run one batch in the inference thread, re-decoding jobs prepared for another model."""
        arrays: list[np.ndarray] = []
        ran: list[_Job] = []
        failures: list[tuple[_Job, ImageDecodeError]] = []
        for job in jobs:
            images = job.images
            if job.spec != model.spec:  # the model changed its input size since decoding
                try:
                    images = np.stack(
                        [
                            decode_to_uint8(p, model.spec, max_pixels=self._max_pixels)
                            for p in job.payloads
                        ]
                    )
                except ImageDecodeError as exc:
                    failures.append((job, exc))
                    continue
            arrays.append(images)
            ran.append(job)
        if not arrays:
            return ran, np.empty((0, len(model.classes)), dtype=np.float32), failures
        batch = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        return ran, model.predict_proba(batch), failures


def _settle(
    job: _Job, *, result: BatchResult | None = None, error: BaseException | None = None
) -> None:
    if job.future.done():
        return
    if error is not None:
        job.future.set_exception(error)
    else:
        job.future.set_result(result)  # type: ignore[arg-type]
