"""The latency benchmark's request schedule: paired services are driven in turns, like with like.

Two small HTTP servers on 127.0.0.1 record the order their requests arrive in (one shared
log); the real staging service is measured in test_busy_host.py, which judges its figures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from itertools import groupby

import pytest
from burstcv_testkit import predict_handler, served

from burstcv.gate.latency import drive_paired


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
