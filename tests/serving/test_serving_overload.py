"""Overload: shed early with 503 + Retry-After, count it, and refuse so every client can read it."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from servingkit import Registry, image_bytes, make_settings, running_server
from starlette.types import Message, Scope

from burstcv_serving.admission import RETRY_AFTER_S
from burstcv_serving.main import create_app
from burstcv_serving.metrics import SHED_REASONS

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


def _scope(body: bytes, client: tuple[str, int] = ("127.0.0.1", 1)) -> Scope:
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
        "client": client,
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


def test_the_middleware_knows_an_early_retry_by_its_client_and_makes_it_wait_retry_after(
    registry: Registry,
) -> None:
    """uvicorn's public protocol admits in ASGI middleware, which sees no connection: a client
    (address and port) that sends again before its 503's Retry-After waits that long for its
    503, while another client's request is refused at the target."""
    settings = make_settings(registry, queue_delay_target_ms=60, service_slots=1, inline_max_ms=0)
    app = create_app(settings)
    body = _multipart(image_bytes("PNG"))
    upload_arrives = asyncio.Event()

    async def receive() -> Message:
        await upload_arrives.wait()
        return {"type": "http.request", "body": body, "more_body": False}

    async def request(client: tuple[str, int]) -> tuple[int, float]:
        """Send a request from ``client``; return its status and how long it took."""
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        started = time.perf_counter()
        await app(_scope(body, client), receive, send)
        return sent[0]["status"], time.perf_counter() - started

    def shed(reason: str) -> float:
        value = app.state.metrics.registry.get_sample_value(
            "burstcv_serving_shed_requests_total", {"reason": reason}
        )
        return float(value or 0.0)

    async def scenario() -> list[tuple[int, float]]:
        async with app.router.lifespan_context(app):
            gate = app.state.service.gate
            upload = asyncio.create_task(request(("127.0.0.1", 1)))
            while gate.in_service == 0:  # the upload takes the only slot, waits for its body
                await asyncio.sleep(0.001)
            first = await request(("127.0.0.1", 2))
            retry, other = await asyncio.gather(
                request(("127.0.0.1", 2)), request(("127.0.0.1", 3))
            )
            upload_arrives.set()
            return [first, retry, other, await upload]

    (first, retry, other, upload) = asyncio.run(scenario())

    assert [first[0], retry[0], other[0], upload[0]] == [503, 503, 503, 200]
    assert first[1] < RETRY_AFTER_S / 2 and other[1] < RETRY_AFTER_S / 2  # at the 60 ms target
    assert retry[1] >= RETRY_AFTER_S * 0.99  # the early retry waited out its Retry-After
    assert (shed("queue_delay"), shed("early_retry")) == (2, 1)


def test_overload_sheds_with_retry_after_and_the_counters_move(
    registry: Registry, tmp_path: Path, protocol: str
) -> None:
    """48 closed-loop clients against a slow model for two seconds, on a real server process,
    with each HTTP protocol."""
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
        registry,
        tmp_path,
        protocol=protocol,
        QUEUE_DELAY_TARGET_MS="100",
        MAX_BATCH_SIZE="4",
        SERVICE_SLOTS="4",
    ) as server:
        asyncio.run(load(server.url))
        metrics = httpx.get(f"{server.url}/metrics").text

    assert set(statuses) == {200, 503}, set(statuses)
    assert retry_after == {"1"}  # every 503 says when to come back
    admitted = _metric(metrics, "burstcv_serving_admitted_requests_total")
    shed = {
        reason: _metric(metrics, f'burstcv_serving_shed_requests_total{{reason="{reason}"}}')
        for reason in SHED_REASONS
    }
    # Refused from the headers, before the body was read: at the target, or (httpx retries
    # at once on the same connection) at the Retry-After of the 503 before.
    assert shed["queue_delay"] + shed["early_retry"] > 0
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


class _Connection:
    """A raw keep-alive HTTP/1.1 connection: send exactly the bytes given, read one answer."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self._recv()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            self.buffer += self._recv()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(lines[0].split()[1]), headers, body

    def _recv(self) -> bytes:
        chunk = self.sock.recv(65536)
        assert chunk, "the server closed the connection"
        return chunk

    def close(self) -> None:
        self.sock.close()


def _request(body: bytes, extra: str = "") -> bytes:
    return (
        f"POST /v1/predict HTTP/1.1\r\nHost: test\r\n{extra}"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def test_waiting_requests_parsed_or_not_are_served_or_refused_on_a_kept_connection(
    registry: Registry, tmp_path: Path, protocol: str
) -> None:
    """One slot, held by a slow upload. Behind it wait a request that was parsed (it found the
    room empty) and one that, with the fast protocol, waits as raw bytes (it found the room
    in use; the public protocol parses both). Both are served when the slot frees in time,
    both refused with 503 when it does not, and the connection of a refused request goes on
    serving."""
    body = _multipart(image_bytes("PNG"))
    plain = _request(body)  # waits unparsed when the room is in use
    keep_alive = _request(body, "Connection: keep-alive\r\n")  # so does this one

    def gauge(url: str, name: str) -> float:
        return _metric(httpx.get(f"{url}/metrics").text, name)

    def wait_for(url: str, name: str, value: float) -> None:
        deadline = time.monotonic() + 10
        while gauge(url, name) != value:
            assert time.monotonic() < deadline, f"{name} never reached {value}"
            time.sleep(0.01)

    with running_server(
        registry, tmp_path, protocol=protocol, SERVICE_SLOTS="1", QUEUE_DELAY_TARGET_MS="1500"
    ) as server:
        for slot_frees_in_time in (True, False):
            upload, parsed, unparsed = (_Connection(server.url) for _ in range(3))
            head, rest = plain[:-200], plain[-200:]
            upload.send(head)  # admitted; its task waits for the rest of the body
            wait_for(server.url, "burstcv_serving_in_service_requests", 1)
            parsed.send(plain)
            wait_for(server.url, "burstcv_serving_waiting_requests", 1)
            unparsed.send(keep_alive)
            wait_for(server.url, "burstcv_serving_waiting_requests", 2)
            if slot_frees_in_time:
                upload.send(rest)
                answers = [c.answer() for c in (upload, parsed, unparsed)]
                assert [status for status, _, _ in answers] == [200, 200, 200]
                assert all(json.loads(b)["predictions"] for _, _, b in answers)
            else:
                for waiting in (parsed, unparsed):
                    status, headers, answer = waiting.answer()  # after the 1.5 s target
                    assert status == 503
                    assert headers["retry-after"] == "1"
                    assert "connection" not in headers  # the connection stays open
                    assert "queueing-delay target of 1500 ms" in json.loads(answer)["detail"]
                upload.send(rest)
                assert upload.answer()[0] == 200
                unparsed.send(keep_alive)  # the refused connection serves the next request
                assert unparsed.answer()[0] == 200
            for connection in (upload, parsed, unparsed):
                connection.close()
        metrics = httpx.get(f"{server.url}/metrics").text

    shed = _metric(metrics, 'burstcv_serving_shed_requests_total{reason="queue_delay"}')
    assert shed == 2
    # Served: three in the first round; the upload and the next request in the second.
    assert _metric(metrics, "burstcv_serving_admitted_requests_total") == 5


def test_a_send_first_client_reads_the_503_of_a_request_that_waited_in_vain(
    registry: Registry, tmp_path: Path, protocol: str
) -> None:
    """urllib sends its whole body (here 1 MiB, past uvicorn's read buffer) before reading and
    asks to close: its 503 from the waiting room still reaches it, with Retry-After."""
    payload = image_bytes("PNG")
    padded = _multipart(payload + b"\0" * (1024 * 1024))  # trailing bytes after the PNG
    with running_server(
        registry, tmp_path, protocol=protocol, SERVICE_SLOTS="1", QUEUE_DELAY_TARGET_MS="200"
    ) as server:
        upload = _Connection(server.url)
        held = _request(_multipart(payload))
        upload.send(held[:-200])  # holds the only slot
        deadline = time.monotonic() + 10
        while (
            _metric(httpx.get(f"{server.url}/metrics").text, "burstcv_serving_in_service_requests")
            != 1
        ):
            assert time.monotonic() < deadline, "the upload never got the slot"
            time.sleep(0.01)
        request = urllib.request.Request(
            f"{server.url}/v1/predict",
            data=padded,
            headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 503
        assert refused.value.headers["Retry-After"] == "1"
        assert "overloaded" in json.loads(refused.value.read())["detail"]
        upload.send(held[-200:])
        assert upload.answer()[0] == 200
        upload.close()
