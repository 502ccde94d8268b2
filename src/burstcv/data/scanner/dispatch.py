"""Spread the inspection of listed files over processes: this one, or a pool started once it pays.

Each chunk's columns are appended straight into the scan's column lists, so memory grows with
the number of rows, never with image bytes.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import threading
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from burstcv.data.scanner.columns import extend
from burstcv.data.scanner.inspection import inspect_chunk
from burstcv.data.scanner.listing import Task

# Files per task sent to a worker: large enough to amortise pickling, small enough to balance.
CHUNK_FILES = 256
# Below this many files a process pool costs more to start than it saves.
POOL_MIN_FILES = 2000


class Dispatcher:
    """Inspect listed files in chunks; the pool starts once ``POOL_MIN_FILES`` files are
    listed, so listing overlaps inspection."""

    def __init__(
        self, requested: int | None, options: tuple[int, int, bool], cap: int | None = None
    ) -> None:
        self.requested = requested
        self.cap = cap  # the most processes the task may run (its slot's CPUs); None: all
        self.options = options
        self.listed = 0
        self.workers = 1
        self._pending: list[Task] = []
        self._pool: ProcessPoolExecutor | None = None
        self._futures: deque[Future[list[list[Any]]]] = deque()

    def __enter__(self) -> Dispatcher:
        # The rows are plain values, never cycles: a cyclic GC pass while they pile up would
        # only walk the whole process heap (large in an Airflow worker) again and again.
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=exc_type is not None)
        finally:
            if self._gc_was_enabled:
                gc.enable()

    def add(self, tasks: list[Task]) -> None:
        """Take a listed batch; start the pool once it pays, and send out every full chunk."""
        self.listed += len(tasks)
        self._pending.extend(tasks)
        if self._pool is None and self.listed >= POOL_MIN_FILES:
            self._start_if_it_pays()
        if self._pool is not None and len(self._pending) >= CHUNK_FILES:
            full = len(self._pending) - len(self._pending) % CHUNK_FILES
            for start in range(0, full, CHUNK_FILES):
                self._submit(self._pending[start : start + CHUNK_FILES])
            del self._pending[:full]

    def finish(self, columns: dict[str, list[Any]]) -> None:
        """Inspect what is left and append every chunk's columns to ``columns``, in order."""
        tasks, self._pending = self._pending, []
        if self._pool is None:
            self._start_if_it_pays()
        # Several chunks per worker for what is left keep every core busy to the end.
        size = max(1, min(CHUNK_FILES, -(-len(tasks) // (self.workers * 4))))
        chunks = [tasks[i : i + size] for i in range(0, len(tasks), size)]
        if self._pool is None:
            for chunk in chunks:
                extend(columns, inspect_chunk(chunk, *self.options))
            return
        for chunk in chunks:
            self._submit(chunk)
        while self._futures:  # popped: each chunk's result is freed once its rows are copied
            extend(columns, self._futures.popleft().result())

    def _start_if_it_pays(self) -> None:
        wanted = worker_count(self.requested, self.listed, self.cap)
        if wanted > 1:
            self.workers = wanted
            self._pool = ProcessPoolExecutor(
                max_workers=wanted, mp_context=pool_context(), initializer=_worker_init
            )

    def _submit(self, chunk: list[Task]) -> None:
        assert self._pool is not None
        self._futures.append(self._pool.submit(inspect_chunk, chunk, *self.options))


def worker_count(requested: int | None, n_files: int, cap: int | None = None) -> int:
    """Return how many processes inspect ``n_files`` files (``requested``, else by size:
    one below ``POOL_MIN_FILES``, then the usable CPUs, at most ``cap``)."""
    if requested is not None:  # scan() refused anything below 1
        return max(1, min(requested, n_files))
    if n_files < POOL_MIN_FILES:
        return 1
    return max(1, min(usable_cpus(), cap or usable_cpus()))


def usable_cpus() -> int:
    """Return the CPUs this process may run on (its affinity: a container's or taskset's)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _worker_init() -> None:
    """Freeze what a forked worker inherited (pandas, GX, Airflow): its GC then never walks
    those objects, nor copies their pages on write."""
    gc.freeze()


def pool_context() -> multiprocessing.context.BaseContext:
    """Return fork (workers in milliseconds) where it is safe: on Linux with no other thread
    alive (one could hold a lock at fork time: an Airflow heartbeat, an emulator); else spawn."""
    if sys.platform.startswith("linux") and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")
