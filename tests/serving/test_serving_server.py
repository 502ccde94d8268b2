"""Run the service as a real uvicorn process and hot-swap versions under concurrent load."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from servingkit import Registry, Server, image_bytes, running_server

TOTAL_REQUESTS = 2000
CLIENT_THREADS = 16
ALIAS_MOVES_AT = (300, 600, 900, 1200, 1500)  # completed requests when the alias moves
SWAP_LAG_S = 1.5  # poll interval + load + warm-up, with room for a busy CI box


@pytest.fixture
def server(registry: Registry, tmp_path: Path) -> Iterator[Server]:
    """Start ``python -m burstcv_serving`` on a free port; stop it after the test."""
    with running_server(registry, tmp_path, POLL_INTERVAL_S="0.05") as running:
        yield running


@dataclass(frozen=True)
class Answer:
    sent: float
    received: float
    status: int
    version: int | None
    top_index: int | None


def test_hot_swaps_under_load_drop_nothing_and_answer_with_live_versions(
    server: Server, registry: Registry
) -> None:
    shas = {v: registry.publish(v) for v in range(2, 2 + len(ALIAS_MOVES_AT))}
    timeline: list[tuple[float, int]] = [(0.0, 1)]  # (monotonic time of the move, version)
    answers: list[Answer] = []
    lock = threading.Lock()
    next_request = iter(range(TOTAL_REQUESTS))
    payload = image_bytes("PNG", size=(64, 48))

    def move_alias_when_due() -> None:
        for moves_done, due in enumerate(ALIAS_MOVES_AT):
            while True:
                with lock:
                    if len(answers) >= due:
                        break
                time.sleep(0.005)
            version = moves_done + 2
            # The service may answer with the new version as soon as the move starts; a time
            # taken after move_alias returns could follow answers a busy machine let through.
            moving_at = time.monotonic()
            registry.move_alias(version, shas[version])
            timeline.append((moving_at, version))

    def client() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            while True:
                with lock:
                    if next(next_request, None) is None:
                        return
                sent = time.monotonic()
                response = http.post("/v1/predict", files={"file": ("x.png", payload, "image/png")})
                received = time.monotonic()
                ok = response.status_code == 200
                body = response.json() if ok else {}
                answer = Answer(
                    sent,
                    received,
                    response.status_code,
                    body.get("version"),
                    body["predictions"][0]["index"] if ok else None,
                )
                with lock:
                    answers.append(answer)

    mover = threading.Thread(target=move_alias_when_due)
    mover.start()
    clients = [threading.Thread(target=client) for _ in range(CLIENT_THREADS)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(timeout=120)
    mover.join(timeout=10)

    assert len(answers) == TOTAL_REQUESTS
    failures = [a for a in answers if a.status != 200]
    assert failures == [], f"{len(failures)} non-2xx answers, e.g. {failures[:3]}"
    assert len(timeline) == 1 + len(ALIAS_MOVES_AT)

    def live_between(start: float, end: float) -> set[int]:
        """Return the versions the alias named at some moment in [start, end]."""
        live = set()
        for i, (moved_at, version) in enumerate(timeline):
            until = timeline[i + 1][0] if i + 1 < len(timeline) else float("inf")
            if moved_at <= end and until >= start:
                live.add(version)
        return live

    for answer in answers:
        assert answer.version is not None
        # The version that computed the answer is the version the answer names.
        assert answer.top_index == answer.version % 10
        assert answer.version in live_between(answer.sent - SWAP_LAG_S, answer.received), answer

    seen = {a.version for a in answers}
    assert {1, 2 + len(ALIAS_MOVES_AT) - 1} <= seen
    assert httpx.get(f"{server.url}/v1/model").json()["version"] == 6

    metrics = httpx.get(f"{server.url}/metrics").text
    predict_ok = 'burstcv_serving_requests_total{method="POST",path="/v1/predict",status="200"}'
    count_line = next(line for line in metrics.splitlines() if line.startswith(predict_ok))
    assert float(count_line.split()[-1]) == TOTAL_REQUESTS
    assert 'burstcv_serving_model_loads_total{outcome="loaded"} 6.0' in metrics
    assert "burstcv_serving_batch_size_bucket" in metrics
    assert "burstcv_serving_queue_depth" in metrics
