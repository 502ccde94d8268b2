"""The latency benchmark's request schedule: paired services are driven in turns, like with like.

Two small HTTP servers on 127.0.0.1 record the order their requests arrive in (one shared
log); the real staging service is measured in test_busy_host.py, which judges its figures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from http.server import HTTPServer, ThreadingHTTPServer
from itertools import groupby

import pytest
from burstcv_testkit import predict_handler, served

from burstcv.gate.latency import drive, drive_paired


@contextlib.contextmanager
def recording_server(name: str, arrivals: list[str], status: int = 200) -> Iterator[str]:
    """Serve POST /v1/predict on a free port, logging ``name`` per request; yield its URL."""
    handler = predict_handler(0.002, status, on_request=lambda: arrivals.append(name))
    with served(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as url:
        yield url


def test_paired_services_take_turns_reversed_every_other_round() -> None:
    arrivals: list[str] = []
    with (
        recording_server("candidate", arrivals) as candidate,
        recording_server("production", arrivals) as production,
    ):
        figures = drive_paired(
            {"candidate": candidate, "production": production},
            [b"image"],
            requests=40,
            concurrency=2,
            warmup=3,
            rounds=4,
        )
    measured = arrivals[6:]  # each was warmed first, on its own
    assert arrivals[:6] == ["candidate"] * 3 + ["production"] * 3
    turns = [(name, len(list(run))) for name, run in groupby(measured)]
    assert turns == [
        ("candidate", 10),
        ("production", 20),  # B B
        ("candidate", 20),  # A A
        ("production", 20),
        ("candidate", 10),
    ]
    for label in ("candidate", "production"):
        assert figures[label].label == label
        assert figures[label].requests == 40 and figures[label].errors == 0
        assert figures[label].concurrency == 2 and len(figures[label].latencies_ms) == 40


def test_an_uneven_split_still_sends_every_request_and_sheds_are_counted_apart() -> None:
    arrivals: list[str] = []
    with (
        recording_server("candidate", arrivals) as candidate,
        recording_server("production", arrivals, status=503) as production,
    ):
        figures = drive_paired(
            {"candidate": candidate, "production": production},
            [b"a", b"b"],
            requests=7,
            concurrency=1,
            warmup=0,
            rounds=3,
        )
    assert arrivals.count("candidate") == 7 and arrivals.count("production") == 7
    assert [len(list(run)) for _, run in groupby(arrivals)] == [2, 2 + 2, 2 + 3, 3]
    shed = figures["production"]
    assert shed.shed == 7 and shed.errors == 0 and shed.status_counts == {"503": 7}


def test_nothing_to_send_is_refused_and_no_service_is_no_figures() -> None:
    with pytest.raises(ValueError, match="no images"):
        drive_paired({"candidate": "http://127.0.0.1:9"}, [], requests=1, concurrency=1, warmup=0)
    assert drive_paired({}, [b"x"], requests=1, concurrency=1, warmup=0) == {}


def test_paired_open_loop_sends_each_model_the_same_rate_and_records_it() -> None:
    arrivals: list[str] = []
    with (
        recording_server("candidate", arrivals) as candidate,
        recording_server("production", arrivals) as production,
    ):
        figures = drive_paired(
            {"candidate": candidate, "production": production},
            [b"image"],
            requests=40,
            rate_rps=80.0,
            warmup=0,
            rounds=2,
        )
    assert [(name, len(list(run))) for name, run in groupby(arrivals)] == [
        ("candidate", 20),
        ("production", 40),
        ("candidate", 20),
    ]
    for label in ("candidate", "production"):
        assert figures[label].offered_rps == 80.0 and figures[label].requests == 40
        # Sent at about 80 req/s, not as fast as the answers came back.
        assert 60 <= figures[label].throughput_rps <= 100, figures[label].throughput_rps
        assert 1 <= figures[label].concurrency <= 40


def test_an_open_loop_shows_the_queue_a_closed_loop_hides() -> None:
    # One request at a time, 20 ms each: at most 50 req/s. Asked for 100 req/s, the open
    # loop's latencies (from when each request was due) grow with the queue; one closed-loop
    # client waits for each answer and sees only the 20 ms.
    server = HTTPServer(("127.0.0.1", 0), predict_handler(0.02))
    server.request_queue_size = 256
    with served(server) as url:
        closed = drive(url, [b"x"], requests=40, concurrency=1, warmup=0, label="candidate")
        opened = drive(url, [b"x"], requests=80, rate_rps=100.0, warmup=0, label="candidate")
    assert closed.offered_rps is None and closed.concurrency == 1
    assert closed.p95_ms < 200, closed.p95_ms
    assert opened.offered_rps == 100.0
    assert opened.p95_ms > 2 * closed.p95_ms and opened.p95_ms > 200, opened.p95_ms
    assert opened.concurrency > 1  # requests waited in flight behind each other


def test_a_load_needs_a_rate_or_clients() -> None:
    with pytest.raises(ValueError, match="give a rate"):
        drive("http://127.0.0.1:9", [b"x"], requests=1, warmup=0, label="candidate")
    with pytest.raises(ValueError, match="rate_rps must be positive"):
        drive("http://127.0.0.1:9", [b"x"], requests=1, rate_rps=0.0, warmup=0, label="c")
