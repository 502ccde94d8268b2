"""Serve GET /healthz (the process answers) and GET /readyz (a warmed model is serving)."""

from __future__ import annotations

from fastapi import APIRouter

from burstcv_serving.schemas import ErrorOut, HealthOut, ReadyOut
from burstcv_serving.state import ModelDep

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthOut)
async def healthz() -> HealthOut:
    """Answer 200 while the process is alive."""
    return HealthOut()


@router.get(
    "/readyz",
    response_model=ReadyOut,
    responses={503: {"model": ErrorOut, "description": "No model is loaded and warmed yet."}},
)
async def readyz(model: ModelDep) -> ReadyOut:
    """Answer 200 only when a loaded, warmed model can serve."""
    return ReadyOut(version=model.version)
