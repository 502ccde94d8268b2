"""Micro-batching: concurrent requests share a session.run, a lone one does not wait."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from servingkit import Registry, image_bytes, make_settings

from burstcv_serving.batcher import BatchResult, MicroBatcher, QueueFullError
from burstcv_serving.main import create_app, make_source
from burstcv_serving.manager import ModelManager
from burstcv_serving.metrics import ServiceMetrics
from burstcv_serving.settings import Settings
from burstcv_spec.preprocess import decode_to_uint8


async def _start(
    settings: Settings, executor: ThreadPoolExecutor, inline_max_s: float = 0.0
) -> tuple[ModelManager, MicroBatcher, ServiceMetrics]:
    metrics = ServiceMetrics()
    manager = ModelManager(make_source(settings), settings, metrics)
    await manager.refresh()
    batcher = MicroBatcher(
        manager,
        executor,
        metrics,
        max_batch_size=settings.max_batch_size,
        max_batch_wait_s=settings.max_batch_wait_ms / 1000,
        max_queue=settings.max_queue,
        max_pixels=settings.max_pixels,
        inline_max_s=inline_max_s,
    )
    batcher.start()
    return manager, batcher, metrics


def test_concurrent_requests_run_as_one_batch(registry: Registry) -> None:
    settings = make_settings(registry, max_batch_size=32, max_batch_wait_ms=0)
    payload = image_bytes("PNG")

    async def scenario() -> tuple[list[int], ServiceMetrics]:
        with ThreadPoolExecutor(1) as executor:
            manager, batcher, metrics = await _start(settings, executor)
            assert manager.current is not None
            spec = manager.current.spec
            image = decode_to_uint8(payload, spec)[None]
            results = await asyncio.gather(
                *(batcher.submit([payload], image, spec) for _ in range(20))
            )
            await batcher.stop()
        return [int(np.argmax(probabilities[0])) for _, probabilities in results], metrics

    top_classes, metrics = asyncio.run(scenario())

    assert top_classes == [1] * 20
    assert metrics.registry.get_sample_value("burstcv_serving_batch_size_count") == 1
    assert metrics.registry.get_sample_value("burstcv_serving_batch_size_sum") == 20


def test_a_lone_request_does_not_wait_for_the_batch_to_fill(registry: Registry) -> None:
    settings = make_settings(registry, max_batch_size=64, max_batch_wait_ms=500)
    payload = image_bytes("PNG")

    async def scenario() -> float:
        with ThreadPoolExecutor(1) as executor:
            manager, batcher, _ = await _start(settings, executor)
            assert manager.current is not None
            spec = manager.current.spec
            image = decode_to_uint8(payload, spec)[None]
            await batcher.submit([payload], image, spec)  # first run: thread start-up
            started = time.perf_counter()
            await batcher.submit([payload], image, spec)
            elapsed = time.perf_counter() - started
            await batcher.stop()
        return elapsed

    assert asyncio.run(scenario()) < 0.1  # far below the 500 ms batch wait


def test_a_full_queue_refuses_at_once_then_drains(registry: Registry) -> None:
    settings = make_settings(registry, max_batch_size=2, max_queue=4, max_batch_wait_ms=0)
    payload = image_bytes("PNG")
    release = threading.Event()

    async def scenario() -> tuple[int, str]:
        with ThreadPoolExecutor(1) as executor:
            manager, batcher, metrics = await _start(settings, executor)
            assert manager.current is not None
            spec = manager.current.spec
            image = decode_to_uint8(payload, spec)[None]

            def submit() -> asyncio.Task[BatchResult]:
                return asyncio.create_task(batcher.submit([payload], image, spec))

            executor.submit(release.wait)  # the inference thread is busy
            try:
                waiting = [submit() for _ in range(4)]
                await asyncio.sleep(0.02)  # queued; the thread cannot take them yet
                assert batcher.queue_depth == 4  # the limit
                with pytest.raises(QueueFullError) as refused:
                    await batcher.submit([payload], image, spec)
            finally:
                release.set()
            answered = await asyncio.gather(*waiting)
            assert batcher.queue_depth == 0
            await batcher.stop()
            shed = metrics.registry.get_sample_value(
                "burstcv_serving_shed_requests_total", {"reason": "queue_full"}
            )
            assert shed == 1
        return len(answered), str(refused.value)

    answered, reason = asyncio.run(scenario())
    assert answered == 4
    assert "queue is full" in reason and "retry" in reason


def test_queued_images_are_redecoded_for_a_new_input_size(registry: Registry) -> None:
    """A request decoded for version 1 (32x32) but run by version 2 (24x24) still succeeds."""
    settings = make_settings(registry, max_batch_wait_ms=0)
    payload = image_bytes("PNG")
    release = threading.Event()

    async def scenario() -> int | str:
        with ThreadPoolExecutor(1) as executor:
            manager, batcher, _ = await _start(settings, executor)
            assert manager.current is not None
            old_spec = manager.current.spec
            image = decode_to_uint8(payload, old_spec)[None]
            executor.submit(release.wait)
            try:
                first = asyncio.create_task(batcher.submit([payload], image, old_spec))
                await asyncio.sleep(0.02)  # first is in a batch; second waits in the queue
                second = asyncio.create_task(batcher.submit([payload], image, old_spec))
                registry.publish_and_promote(2, image_size=24)
                await manager.refresh()  # version 2 loads while second is queued
            finally:
                release.set()
            await first
            model, probabilities = await second
            await batcher.stop()
            assert model.spec.height == 24
            assert int(np.argmax(probabilities[0])) == 2
        return model.version

    assert asyncio.run(scenario()) == 2


def test_http_answers_503_with_retry_after_when_the_waiting_room_is_full(
    registry: Registry,
) -> None:
    """Many concurrent requests against a slow model and a tiny waiting room: some are shed."""
    registry.publish_and_promote(2, slow=True)
    settings = make_settings(
        registry, max_batch_size=1, max_batch_wait_ms=0, service_slots=1, max_waiting=2
    )
    app = create_app(settings)
    payload = image_bytes("PNG")

    async def scenario() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await asyncio.gather(
                    *(
                        client.post("/v1/predict", files={"file": ("x.png", payload, "image/png")})
                        for _ in range(24)
                    )
                )

    responses = asyncio.run(scenario())

    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}
    assert statuses.count(200) >= 1 and statuses.count(503) >= 1
    shed = next(r for r in responses if r.status_code == 503)
    assert shed.headers["retry-after"] == "1"
    assert "waiting room is full" in shed.json()["detail"]


class _CountingExecutor(ThreadPoolExecutor):
    """Count the calls handed to the inference thread."""

    def __init__(self) -> None:
        super().__init__(1)
        self.calls = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize(
    ("inline_max_s", "others_in_flight", "inline"),
    [(1.0, 0, True), (1.0, 1, False), (0.0, 0, False)],
    ids=["alone and fast: inline", "another request in flight", "model too slow"],
)
def test_a_lone_request_runs_on_the_event_loop_only_when_alone_and_fast(
    registry: Registry, inline_max_s: float, others_in_flight: int, inline: bool
) -> None:
    settings = make_settings(registry)
    payload = image_bytes("PNG")

    async def scenario() -> tuple[int, int, int]:
        with _CountingExecutor() as executor:
            manager, batcher, metrics = await _start(settings, executor, inline_max_s)
            assert manager.current is not None
            assert 0 < manager.current.single_latency_s < 1.0  # measured at warm-up
            spec = manager.current.spec
            image = decode_to_uint8(payload, spec)[None]
            with contextlib.ExitStack() as stack:
                for _ in range(others_in_flight + 1):
                    stack.enter_context(batcher.tracking())
                _, probabilities = await batcher.submit([payload], image, spec)
            assert batcher.active_requests == 0
            await batcher.stop()
        batches = metrics.registry.get_sample_value("burstcv_serving_batch_size_count")
        return executor.calls, int(np.argmax(probabilities[0])), int(batches or 0)

    calls, top_class, batches = asyncio.run(scenario())

    assert top_class == 1 and batches == 1  # answered and counted either way
    assert calls == (0 if inline else 1)


def test_a_burst_of_requests_is_batched_not_run_inline_one_by_one(registry: Registry) -> None:
    """Requests arriving together must not each look alone (their tasks start one by one)."""
    settings = make_settings(registry, max_batch_size=32, max_batch_wait_ms=0)
    payload = image_bytes("PNG")

    async def scenario() -> tuple[int, float, float]:
        with _CountingExecutor() as executor:
            manager, batcher, metrics = await _start(settings, executor, inline_max_s=1.0)
            assert manager.current is not None
            spec = manager.current.spec
            image = decode_to_uint8(payload, spec)[None]

            async def request() -> BatchResult:
                with batcher.tracking():
                    return await batcher.submit([payload], image, spec)

            results = await asyncio.gather(*(request() for _ in range(8)))
            await batcher.stop()
        assert all(int(np.argmax(p[0])) == 1 for _, p in results)
        batches = metrics.registry.get_sample_value("burstcv_serving_batch_size_count") or 0
        images = metrics.registry.get_sample_value("burstcv_serving_batch_size_sum") or 0
        return executor.calls, batches, images

    calls, batches, images = asyncio.run(scenario())

    assert images == 8
    assert calls >= 1 and batches <= 2  # one batch (or two), not eight inline runs
