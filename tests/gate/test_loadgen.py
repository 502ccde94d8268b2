"""The load generator: open-loop sends over persistent connections, from one or several
processes, every kind of answer read, and its own ceiling measured against a trivial endpoint."""

from __future__ import annotations

import socket
import socketserver
import sys
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from burstcv.gate import loadgen, sizing
from burstcv.gate.loadgen import encode_predict, send, trivial_endpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from burstcv_testkit import predict_handler, served
from servingkit import image_bytes

IMAGE = image_bytes("PNG")


@pytest.fixture(scope="module")
def trivial() -> Iterator[str]:
    with trivial_endpoint() as url:
        yield url


def test_every_request_is_sent_once_when_due_and_answered(trivial: str) -> None:
    sample = send(trivial, [IMAGE, b"second"], requests=200, rate_rps=400.0)
    assert sample.statuses == {"200": 200} and sample.shed == 0
    assert len(sample.latencies) == len(sample.lags) == 200
    # 200 requests due over 0.5 s: sent over that span, answered at once.
    assert 0.45 <= sample.wall_s <= 1.0
    assert max(sample.lags) < 500 and sorted(sample.latencies)[100] < 100


def test_several_processes_share_one_schedule() -> None:
    arrived: list[bytes] = []
    lock = threading.Lock()

    class Recording(predict_handler()):  # type: ignore[misc,valid-type]
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                arrived.append(body)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    images = [f"image-{k:03d}".encode() for k in range(60)]
    with served(ThreadingHTTPServer(("127.0.0.1", 0), Recording)) as url:
        sample = send(url, images, requests=60, rate_rps=120.0, processes=3)
    assert sample.statuses == {"200": 60}
    assert len(sample.latencies) == len(sample.lags) == 60
    # Each image exactly once: the three processes split the schedule, none repeats another's.
    sent = sorted(next(i for i in images if i in body) for body in arrived)
    assert sent == images
    assert 0.4 <= sample.wall_s <= 2.0  # 60 due over half a second, not three times that


def test_a_search_s_rates_are_sent_by_the_same_processes_started_once(trivial: str) -> None:
    import psutil

    with loadgen.senders(1) as none:
        assert none is None  # one process: the caller's own
    with loadgen.senders(3) as pool:
        assert pool is not None and pool.processes == 3
        first = send(trivial, [IMAGE], requests=60, rate_rps=120.0, pool=pool)
        second = send(trivial, [IMAGE], requests=90, rate_rps=180.0, pool=pool)
        # Both rates from the same three processes: none started for the second.
        assert {p.pid for p in psutil.Process().children()} >= pool.pids
        assert loadgen._ready() not in pool.pids
        assert pool.pool.submit(loadgen._ready).result() in pool.pids
        pids = pool.pids
    assert first.statuses == {"200": 60} and second.statuses == {"200": 90}
    assert 0.4 <= first.wall_s <= 2.0 and 0.4 <= second.wall_s <= 2.0
    assert not any(psutil.pid_exists(pid) for pid in pids)  # stopped at the end


def test_request_k_carries_image_first_plus_k() -> None:
    bodies: list[bytes] = []

    class Recording(predict_handler()):  # type: ignore[misc,valid-type]
        def do_POST(self) -> None:
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    images = [b"zero", b"one", b"two"]
    with served(ThreadingHTTPServer(("127.0.0.1", 0), Recording)) as url:
        send(url, images, requests=4, rate_rps=20.0, first=1)
    assert [next(i for i in images if b"\r\n\r\n" + i + b"\r\n" in b) for b in bodies] == [
        b"one",
        b"two",
        b"zero",
        b"one",
    ]
    assert b'filename="1.png"' in bodies[0] and b"Content-Type: image/png" in bodies[0]


def test_a_request_is_a_multipart_upload_the_service_parses() -> None:
    raw = encode_predict("127.0.0.1:9", b"\x89PNG-bytes", "7.png", "image/png")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/predict HTTP/1.1\r\nHost: 127.0.0.1:9\r\n")
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    assert length == len(body) and b"\x89PNG-bytes" in body
    assert body.endswith(f"--{loadgen.BOUNDARY}--\r\n".encode())


def test_sheds_are_told_from_failures() -> None:
    with served(ThreadingHTTPServer(("127.0.0.1", 0), predict_handler(status=503))) as url:
        shed = send(url, [IMAGE], requests=10, rate_rps=50.0)
    assert shed.statuses == {"503": 10} and shed.shed == 10
    with served(ThreadingHTTPServer(("127.0.0.1", 0), predict_handler(status=500))) as url:
        failed = send(url, [IMAGE], requests=10, rate_rps=50.0)
    assert failed.statuses == {"500": 10} and failed.shed == 0


class _Raw(socketserver.StreamRequestHandler):
    """Answers each request with the server's canned bytes, then keeps or drops the link."""

    def handle(self) -> None:
        answer, keep = self.server.answer, self.server.keep  # type: ignore[attr-defined]
        while True:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                byte = self.rfile.read(1)
                if not byte:
                    return
                head += byte
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            self.rfile.read(length)
            self.wfile.write(answer)
            self.wfile.flush()
            if not keep:
                return


@pytest.fixture
def raw_server() -> Iterator[socketserver.ThreadingTCPServer]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Raw)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _answering(server: socketserver.ThreadingTCPServer, answer: bytes, keep: bool) -> str:
    server.answer, server.keep = answer, keep  # type: ignore[attr-defined]
    return f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize(
    ("answer", "keep", "status"),
    [
        # chunked, kept open
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", True, "200"),
        # HTTP/1.0 with a length: the server closes after each answer
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}", False, "200"),
        # no length: the body runs to the end of the connection
        (b"HTTP/1.1 404 Not Found\r\nConnection: close\r\n\r\nnothing here", False, "404"),
        # a 503 with Retry-After after a chunked body
        (
            b"HTTP/1.1 503 Busy\r\nRetry-After: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            True,
            "503",
        ),
    ],
)
def test_every_framing_of_an_answer_is_read(
    raw_server: socketserver.ThreadingTCPServer, answer: bytes, keep: bool, status: str
) -> None:
    url = _answering(raw_server, answer, keep)
    sample = send(url, [IMAGE], requests=12, rate_rps=60.0, timeout_s=5.0)
    assert sample.statuses == {status: 12}
    assert sample.shed == (12 if status == "503" else 0)


def test_an_answer_that_is_not_http_is_an_error_not_a_crash(
    raw_server: socketserver.ThreadingTCPServer,
) -> None:
    url = _answering(raw_server, b"SSH-2.0-OpenSSH\r\n\r\n", True)
    sample = send(url, [IMAGE], requests=5, rate_rps=50.0, timeout_s=5.0)
    assert sample.statuses == {"ReadError": 5}
    url = _answering(raw_server, b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", True)
    sample = send(url, [IMAGE], requests=5, rate_rps=50.0, timeout_s=5.0)
    assert sample.statuses == {"ProtocolError": 5}


def test_nothing_listening_and_no_answer_are_named() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        refused = send(f"http://127.0.0.1:{port}", [IMAGE], requests=4, rate_rps=40.0)
    assert refused.statuses == {"ConnectError": 4}
    with socket.socket() as sock:  # accepts, never answers
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        port = sock.getsockname()[1]
        silent = send(f"http://127.0.0.1:{port}", [IMAGE], requests=3, rate_rps=30.0, timeout_s=0.5)
    assert silent.statuses == {"ReadTimeout": 3}
    assert min(silent.latencies) >= 500  # each waited its whole timeout


def test_a_rate_and_images_are_required() -> None:
    with pytest.raises(ValueError, match="rate_rps"):
        send("http://127.0.0.1:9", [IMAGE], requests=1, rate_rps=0)
    with pytest.raises(ValueError, match="images"):
        send("http://127.0.0.1:9", [], requests=1, rate_rps=1)


def test_the_generator_check_passes_a_rate_it_outruns() -> None:
    check = sizing.generator_check(
        [IMAGE], service_cpus=None, rate_rps=100.0, latency_slo_ms=100.0, duration_s=0.5
    )
    # Twice the rate, sent on time to an endpoint that computes nothing.
    assert not check.bound and check.rps == 200.0 and check.processes == 1
    assert 0 <= check.send_lag_p95_ms < 10.0


def test_the_generator_check_finds_a_rate_it_cannot_send() -> None:
    # Far past what one Python process sends: neither 2x nor 1.25x can hold.
    check = sizing.generator_check(
        [IMAGE], service_cpus=None, rate_rps=100_000.0, latency_slo_ms=100.0, duration_s=0.15
    )
    assert check.bound
    assert 0 < check.rps < 125_000.0  # what it reached, not what it was asked


def test_a_tight_slo_still_allows_the_generator_a_loopback_round_trip() -> None:
    # 5 ms SLO: a tenth is 0.5 ms, under what a request over loopback takes however fast the
    # generator is; the floor keeps a generator that outruns the service from reading as bound.
    check = sizing.generator_check(
        [IMAGE], service_cpus=None, rate_rps=100.0, latency_slo_ms=5.0, duration_s=0.5
    )
    assert not check.bound, check
