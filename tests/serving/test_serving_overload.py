"""Overload: shed early with 503 + Retry-After, count it, and refuse so every client can read it."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from servingkit import Registry, image_bytes, make_settings, running_server
from starlette.types import Message, Scope

from burstcv_serving.main import create_app

BOUNDARY = "overloadtest"


def _multipart(payload: bytes) -> bytes:
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="x.png"\r\n'
        "Content-Type: image/png\r\n\r\n"
    ).encode()
    return head + payload + f"\r\n--{BOUNDARY}--\r\n".encode()


def _metric(text: str, sample: str) -> float:
    """Return the value of one sample line of a Prometheus text answer (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def test_a_send_first_client_reads_the_413_for_an_oversized_body(
    registry: Registry, tmp_path: Path
) -> None:
    """urllib writes the whole body before reading: the 413 must still reach it, twice."""
    oversized = _multipart(b"\0" * (4 * 1024 * 1024))  # 64x the limit: many socket buffers
    with running_server(registry, tmp_path, MAX_BODY_BYTES=str(64 * 1024)) as server:
        for _ in range(2):  # the connection survives, or a new one works as well
            request = urllib.request.Request(
                f"{server.url}/v1/predict",
                data=oversized,
                headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
            )
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 413
            detail = json.loads(refused.value.read())["detail"]
            assert "larger than the limit of 65536 bytes" in detail
        # The service goes on answering.
        ok = httpx.post(
            f"{server.url}/v1/predict", files={"file": ("x.png", image_bytes("PNG"), "image/png")}
        )
        assert ok.status_code == 200


def _scope(body: bytes) -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/predict",
        "raw_path": b"/v1/predict",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"test"),
            (b"content-type", f"multipart/form-data; boundary={BOUNDARY}".encode()),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }


def test_a_request_that_gets_no_slot_within_the_target_is_refused_unread(
    registry: Registry,
) -> None:
    """A slow upload holds the only service slot: the next request waits the target, unread,
    then gets 503 + Retry-After; the upload is still served once its body arrives."""
    settings = make_settings(registry, queue_delay_target_ms=60, service_slots=1, inline_max_ms=0)
    app = create_app(settings)
    body = _multipart(image_bytes("PNG"))
    upload_arrives = asyncio.Event()
    reads: dict[str, int] = {"upload": 0, "shed": 0}
    sent: dict[str, list[Message]] = {"upload": [], "shed": []}

    def receive_for(name: str) -> Callable[[], Awaitable[Message]]:
        async def receive() -> Message:
            reads[name] += 1
            if name == "upload":
                await upload_arrives.wait()
            return {"type": "http.request", "body": body, "more_body": False}

        return receive

    def send_for(name: str) -> Callable[[Message], Awaitable[None]]:
        async def send(message: Message) -> None:
            sent[name].append(message)

        return send

    def shed_count() -> float:
        value = app.state.metrics.registry.get_sample_value(
            "burstcv_serving_shed_requests_total", {"reason": "queue_delay"}
        )
        return float(value or 0.0)

    async def scenario() -> float:
        async with app.router.lifespan_context(app):
            gate = app.state.service.gate
            upload = asyncio.create_task(
                app(_scope(body), receive_for("upload"), send_for("upload"))
            )
            while gate.in_service == 0:  # the upload takes the slot and waits for its body
                await asyncio.sleep(0.001)
            started = time.perf_counter()
            await app(_scope(body), receive_for("shed"), send_for("shed"))
            waited = time.perf_counter() - started
            upload_arrives.set()
            await upload
            return waited

    waited = asyncio.run(scenario())

    start, answer = sent["shed"]
    headers = dict(start["headers"])
    assert start["status"] == 503
    assert headers[b"retry-after"] == b"1"
    assert b"connection" not in headers  # a small body is discarded; the connection stays
    assert "overloaded" in json.loads(answer["body"])["detail"]
    assert reads["shed"] == 0  # refused from the headers: the body was never read
    assert waited >= 0.06  # it waited the whole target for a slot first
    assert shed_count() == 1
    assert sent["upload"][0]["status"] == 200


def test_overload_sheds_with_retry_after_and_the_counters_move(
    registry: Registry, tmp_path: Path
) -> None:
    """48 closed-loop clients against a slow model for two seconds, on a real server process."""
    registry.publish_and_promote(2, slow=True)
    payload = image_bytes("PNG")
    statuses: list[int] = []
    retry_after: set[str | None] = set()

    async def client(url: str, until: float) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            while time.monotonic() < until:
                response = await http.post(
                    "/v1/predict", files={"file": ("x.png", payload, "image/png")}
                )
                statuses.append(response.status_code)
                if response.status_code == 503:
                    retry_after.add(response.headers.get("retry-after"))

    async def load(url: str) -> None:
        until = time.monotonic() + 2.0
        await asyncio.gather(*(client(url, until) for _ in range(48)))

    # One batch of the slow model (4 images, tens of ms) in service at a time and 44 clients
    # waiting: slots stay taken far longer than the 100 ms target, so the room refuses on any
    # machine; the first batch starts on an idle model, so some requests are answered too.
    with running_server(
        registry, tmp_path, QUEUE_DELAY_TARGET_MS="100", MAX_BATCH_SIZE="4", SERVICE_SLOTS="4"
    ) as server:
        asyncio.run(load(server.url))
        metrics = httpx.get(f"{server.url}/metrics").text

    assert set(statuses) == {200, 503}, set(statuses)
    assert retry_after == {"1"}  # every 503 says when to come back
    admitted = _metric(metrics, "burstcv_serving_admitted_requests_total")
    shed = {
        reason: _metric(metrics, f'burstcv_serving_shed_requests_total{{reason="{reason}"}}')
        for reason in ("queue_delay", "queue_full", "deadline", "no_model")
    }
    assert shed["queue_delay"] > 0  # refused from the headers, before the body was read
    assert sum(shed.values()) == statuses.count(503)
    # Every admitted request was answered or shed late (48 clients cannot fill the queue).
    assert shed["queue_full"] == 0
    assert admitted == statuses.count(200) + shed["deadline"]
    # Every answered request started its batch within the target: its queueing delay (the
    # wait for a slot plus the wait in the inference queue) is in the 100 ms bucket.
    within_target = 'burstcv_serving_queue_delay_seconds_bucket{le="0.1"}'
    assert _metric(metrics, within_target) >= statuses.count(200)
    assert _metric(metrics, "burstcv_serving_admission_wait_seconds_count") == admitted
    predict_503 = 'burstcv_serving_requests_total{method="POST",path="/v1/predict",status="503"}'
    assert _metric(metrics, predict_503) == statuses.count(503)
