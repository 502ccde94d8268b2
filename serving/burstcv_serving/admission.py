"""Decide whether one more prediction request can start within the queueing-delay target.

The decision reads only the batcher's figures (images ahead, measured time per image, the
oldest job's wait), so it can be taken as soon as a request's headers are parsed: before a
task is started for it, its body read, parsed or decoded. Both the HTTP protocol
(``burstcv_serving.protocol``, under uvicorn) and the ASGI middleware (any other server, and
the test client) ask it, and answer a refusal the same way: 503 with ``Retry-After``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from burstcv_serving.state import ServiceState

PREDICTION_PATHS = frozenset({"/v1/predict", "/v1/predict/batch"})

# Seconds a shed client is asked to wait. HTTP allows whole seconds only; the queue drains
# in milliseconds, so the smallest value is the right one.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Refusal:
    """Say why a request is shed: the metric's reason label and the client's message."""

    reason: str  # one of metrics.SHED_REASONS
    detail: str

    def body(self) -> bytes:
        """Return the JSON body of the 503, as FastAPI writes an HTTPException's."""
        return json.dumps({"detail": self.detail}).encode()


def refusal(service: ServiceState | None) -> Refusal | None:
    """Return why a prediction request arriving now must be shed, or None to admit it.

    None too when no model is loaded: the route answers that 503 itself, saying why.
    """
    if service is None or service.manager.current is None:
        return None
    batcher = service.batcher
    expected_s = batcher.expected_delay_s()
    target_s = batcher.queue_delay_target_s
    if expected_s > target_s:
        return Refusal(
            "queue_delay",
            f"the service is overloaded: a request would wait about {expected_s * 1000:.0f} ms "
            f"for the model, over the target of {target_s * 1000:.0f} ms; retry after "
            f"{RETRY_AFTER_S} s",
        )
    if batcher.queue_depth >= batcher.max_queue:
        return Refusal(
            "queue_full",
            f"the inference queue is full ({batcher.queue_depth} images waiting, limit "
            f"{batcher.max_queue}); retry after {RETRY_AFTER_S} s",
        )
    return None
