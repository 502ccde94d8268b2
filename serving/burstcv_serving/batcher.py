"""Gather concurrent prediction requests into micro-batches for one session.run each.

The inference thread drains the queue itself: it takes every job already waiting (up to the
batch size), runs them, hands the answers to the event loop in one callback and takes the next
batch at once; it waits (at most ``max_batch_wait_ms``) for more only when a batch already
holds several jobs. The thread, not an event-loop task, moves between batches because under
overload a loop turn grows with the connections that have a request ready: a batch per turn
would tie the model's throughput to the load it is shedding.

Every job carries a deadline: the queueing-delay target less what its request waited for a
service slot. A job whose batch cannot start by then is answered 503 instead of late.

A single image that is the only request in the service runs right on the event loop when the
model answers within ``inline_max_ms``: that saves two thread hand-offs and delays no one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import numpy as np

from burstcv_serving.manager import ModelManager
from burstcv_serving.metrics import ServiceMetrics
from burstcv_serving.model import LoadedModel
from burstcv_spec.preprocess import ImageDecodeError, PreprocessSpec, decode_to_uint8

logger = logging.getLogger(__name__)

BatchResult = tuple[LoadedModel, np.ndarray]  # the model that answered, probabilities (n, K)

# Weight of the newest batch in the moving averages of batch time: about the last ten count,
# so the estimate follows a model swap within milliseconds and one GC pause moves it little.
_BATCH_TIME_WEIGHT = 0.1


class QueueFullError(RuntimeError):
    """Raise when the inference queue holds as many images as allowed (shed with 503)."""


class DeadlineExceededError(RuntimeError):
    """Raise when a job waited past its deadline before a batch could take it (503)."""


class NoModelError(RuntimeError):
    """Raise when no model is loaded (or the service is stopping)."""


@dataclass(eq=False)
class _Job:
    """One request's images, decoded with ``spec``; the raw bytes allow re-decoding."""

    payloads: list[bytes]
    images: np.ndarray  # uint8 NHWC at spec's size
    spec: PreprocessSpec
    future: asyncio.Future[BatchResult] = field(repr=False)
    waited: float  # seconds its request waited for a service slot before being queued
    queued_at: float  # time.perf_counter() when it was queued
    deadline: float  # time.perf_counter() after which running it would answer too late

    @property
    def size(self) -> int:
        return len(self.images)


@dataclass
class _Outcome:
    """What the inference thread hands back to the event loop for one batch."""

    model: LoadedModel | None
    ran: list[_Job]
    probabilities: np.ndarray | None = None
    failures: list[tuple[_Job, BaseException]] = field(default_factory=list)


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
        queue_delay_target_s: float = float("inf"),
    ) -> None:
        self._manager = manager
        self._executor = executor
        self._metrics = metrics
        self._max_batch_size = max_batch_size
        self._max_wait_s = max_batch_wait_s
        self._max_queue = max_queue
        self._max_pixels = max_pixels
        self._inline_max_s = inline_max_s
        self.queue_delay_target_s = queue_delay_target_s  # follows the serving model's SLO
        self._active = 0  # prediction requests inside the routes (see tracking())
        # Requests inside the routes that have not reached submit() yet (read, decode).
        self._arriving: set[asyncio.Task[object] | None] = set()
        # Shared with the inference thread, under the lock.
        self._lock = threading.Lock()
        self._more = threading.Condition(self._lock)
        self._pending: deque[_Job] = deque()
        self._pending_images = 0
        self._running_jobs = 0  # in the batch the thread is gathering or running
        self._closed = False
        self._idle = False  # the thread sleeps until a job is queued
        self._wake_scheduled = False  # a _wake call waits on the event loop
        self._drain: Future[None] | None = None  # the thread's loop, from the first job to stop()
        # Moving averages of batch wall time (GIL waits included): of every batch, and of a
        # full batch (scaled from batches at least half full); 0 until one has run.
        self._batch_s = 0.0
        self._full_batch_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def queue_depth(self) -> int:
        """Return the number of images waiting for inference."""
        return self._pending_images

    @property
    def active_requests(self) -> int:
        """Return the number of prediction requests being handled now."""
        return self._active

    def expected_delay_s(self) -> float:
        """Return how long a request admitted now would wait before its batch starts: the running
        batch, then a measured full batch per batch's worth of images ahead (waiting, and one
        per request still being read or decoded)."""
        ahead = self._pending_images + len(self._arriving)
        running_s = self._batch_s if self._running_jobs else 0.0
        full_batch_s = self._full_batch_s or self._batch_s
        estimate = running_s + (ahead // self._max_batch_size) * full_batch_s
        # The oldest waiting job has already waited this long: the estimate cannot be less
        # (it would be if the thread stalled, on a busy machine, or the model slowed down).
        try:
            waited = time.perf_counter() - self._pending[0].queued_at
        except IndexError:  # nothing waits (read without the lock: the thread may take it)
            waited = 0.0
        return max(estimate, waited)

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Count one prediction request for as long as the block runs (from body to answer)."""
        task = asyncio.current_task()
        self._active += 1
        self._arriving.add(task)
        try:
            yield
        finally:
            self._active -= 1
            self._arriving.discard(task)

    def start(self) -> None:
        """Bind to the running event loop; batches start when the first job is queued."""
        self._loop = asyncio.get_running_loop()
        self._closed = False

    async def stop(self) -> None:
        """Let the running batch finish, then fail whatever still waits."""
        with self._lock:
            self._closed = True
            waiting = list(self._pending)
            self._pending.clear()
            self._pending_images = 0
            self._more.notify_all()
            drain = self._drain
        if drain is not None:
            # The thread answers its batch through the event loop, so keep the loop running.
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(drain)
        for job in waiting:
            _fail(job, NoModelError("the service is shutting down"))
        self._metrics.queue_depth.set(0)

    async def submit(
        self,
        payloads: list[bytes],
        images: np.ndarray,
        spec: PreprocessSpec,
        waited: float = 0.0,
    ) -> BatchResult:
        """Queue one request's images and wait for the model and probabilities that answer it
        (``waited``: seconds it waited for a service slot, counted against its deadline)."""
        self._arriving.discard(asyncio.current_task())
        n = len(images)
        if self._pending_images + n > self._max_queue:
            self._metrics.shed.labels(reason="queue_full").inc()
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
                return self._run_inline(model, images, waited)
        loop = self._loop or asyncio.get_running_loop()
        queued_at = time.perf_counter()
        future: asyncio.Future[BatchResult] = loop.create_future()
        deadline = queued_at + self.queue_delay_target_s - waited
        job = _Job(payloads, images, spec, future, waited, queued_at, deadline)
        with self._lock:
            if self._closed:
                raise NoModelError("the service is shutting down")
            self._pending.append(job)
            self._pending_images += n
            # Wake a sleeping thread now, not at the end of this loop turn (under overload as
            # long as reading every waiting request); a gathering one only when the batch is
            # full: every wake-up is a GIL hand-off that the busy event loop pays for.
            if self._idle or self._pending_images >= self._max_batch_size:
                self._more.notify()
            if self._drain is None and not self._wake_scheduled:
                # The first job starts the thread's loop at the end of this turn, so that
                # requests that arrived together share the first batch.
                self._wake_scheduled = True
                loop.call_soon(self._wake, loop)
        self._metrics.queue_depth.set(self._pending_images)
        return await future

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake the sleeping inference thread, or start its loop for the first job."""
        with self._lock:
            self._wake_scheduled = False
            if self._drain is None:
                if not self._closed:
                    self._drain = self._executor.submit(self._drain_queue, loop)
            else:
                self._more.notify()

    def _inline_model(self, spec: PreprocessSpec) -> LoadedModel | None:
        """Return the model a lone single image may run on now, skipping the queue, or None."""
        model = self._manager.current
        if (
            self._active <= 1
            and not self._pending
            and self._running_jobs == 0
            and model is not None
            and model.spec == spec
            and model.single_latency_s <= self._inline_max_s
        ):
            return model
        return None

    def _run_inline(self, model: LoadedModel, images: np.ndarray, waited: float) -> BatchResult:
        """Answer a lone single-image job on the event loop (see the module docstring)."""
        started = time.perf_counter()
        self._metrics.queue_delay.observe(waited)
        try:
            probabilities = model.predict_proba(images)
        except Exception:
            logger.exception("inference failed for a single image")
            raise
        self._metrics.inference.observe(time.perf_counter() - started)
        self._metrics.batch_size.observe(len(probabilities))
        return model, probabilities

    # --- the inference thread ----------------------------------------------------------------

    def _drain_queue(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run batches back to back, and sleep while the queue is empty, until stop()."""
        try:
            while True:
                with self._lock:
                    # Waiting here, not in a new executor call per burst: a job queued while
                    # the event loop is busy wakes the thread at once, not a loop turn later.
                    while not self._pending and not self._closed:
                        self._idle = True
                        self._more.wait()
                        self._idle = False
                    jobs = self._gather()
                    if self._closed and not jobs:
                        self._drain = None
                        return
                if not jobs:  # every waiting client had gone away
                    continue
                try:
                    outcome = self._run(jobs)
                finally:
                    with self._lock:
                        self._running_jobs = 0
                loop.call_soon_threadsafe(self._deliver, outcome)
        except BaseException:
            with self._lock:
                self._drain = None  # let the next submit start over rather than stall
            raise

    def _gather(self) -> list[_Job]:
        """Take waiting jobs (and, when busy, wait briefly for more); the lock is held."""
        jobs: list[_Job] = []
        if self._closed:
            return jobs
        size = self._take(jobs, 0)
        if len(jobs) > 1 and size < self._max_batch_size and self._max_wait_s > 0:
            # Requests are arriving together: give the next few a moment to join.
            deadline = time.monotonic() + self._max_wait_s
            while size < self._max_batch_size and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._more.wait(remaining):
                    break
                size = self._take(jobs, size)
        self._running_jobs = len(jobs)
        return jobs

    def _take(self, jobs: list[_Job], size: int) -> int:
        """Move waiting jobs into ``jobs`` while they fit the batch; return the new size."""
        now = time.perf_counter()
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
        for job in jobs:
            self._metrics.queue_delay.observe(now - job.queued_at + job.waited)
        return size

    def _run(self, jobs: list[_Job]) -> _Outcome:
        """Run one batch: expire late jobs, re-decode for a new input size, call the model."""
        model = self._manager.current  # taken once: the whole batch answers with this model
        outcome = _Outcome(model, [])
        max_pixels = self._max_pixels
        started = time.perf_counter()
        if model is None:
            outcome.failures = [(job, NoModelError("no model is loaded")) for job in jobs]
            return outcome
        arrays: list[np.ndarray] = []
        for job in jobs:
            if started > job.deadline:
                waited_ms = (started - job.queued_at + job.waited) * 1000.0
                late = DeadlineExceededError(
                    f"the service is overloaded: the request waited {waited_ms:.0f} ms for the "
                    f"model, over the target of {self.queue_delay_target_s * 1000:.0f} ms; "
                    "retry shortly"
                )
                outcome.failures.append((job, late))
                continue
            images = job.images
            if job.spec != model.spec:  # the model changed its input size since decoding
                try:
                    decoded = [
                        decode_to_uint8(p, model.spec, max_pixels=max_pixels) for p in job.payloads
                    ]
                    images = np.stack(decoded)
                except ImageDecodeError as exc:
                    outcome.failures.append((job, exc))
                    continue
            arrays.append(images)
            outcome.ran.append(job)
        if not arrays:
            return outcome
        batch = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        try:
            outcome.probabilities = model.predict_proba(batch)
        except Exception as exc:
            # Not hidden: logged here and raised again in every request of the batch (a 500).
            logger.exception("inference failed for a batch of %d jobs", len(outcome.ran))
            outcome.failures += [(job, exc) for job in outcome.ran]
            outcome.ran = []
            return outcome
        elapsed = time.perf_counter() - started
        # Only this thread writes the averages; the event loop reads them.
        self._batch_s = moving_average(self._batch_s, elapsed)
        if 2 * len(batch) >= self._max_batch_size:
            full_s = elapsed * self._max_batch_size / len(batch)
            self._full_batch_s = moving_average(self._full_batch_s, full_s)
        self._metrics.inference.observe(elapsed)
        self._metrics.batch_size.observe(len(batch))
        return outcome

    # --- back on the event loop --------------------------------------------------------------

    def _deliver(self, outcome: _Outcome) -> None:
        """Answer every job of one batch (on the event loop)."""
        if outcome.probabilities is not None and outcome.model is not None:
            offset = 0
            for job in outcome.ran:
                rows = outcome.probabilities[offset : offset + job.size]
                if not job.future.done():
                    job.future.set_result((outcome.model, rows))
                offset += job.size
        for job, error in outcome.failures:
            if isinstance(error, DeadlineExceededError):
                self._metrics.shed.labels(reason="deadline").inc()
            _fail(job, error)


def moving_average(previous: float, sample: float, weight: float = _BATCH_TIME_WEIGHT) -> float:
    """Return an average after one more sample (the sample itself while the average is 0)."""
    return sample if previous == 0.0 else previous + weight * (sample - previous)


def _fail(job: _Job, error: BaseException) -> None:
    if not job.future.done():  # the client may have gone away
        job.future.set_exception(error)
