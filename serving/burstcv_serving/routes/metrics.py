"""Serve GET /metrics in the Prometheus text format."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from burstcv_serving.state import MetricsDep

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text"}},
)
async def metrics(metrics: MetricsDep) -> Response:
    """Return request counts, latency and batch-size histograms, model version, queue depth."""
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
