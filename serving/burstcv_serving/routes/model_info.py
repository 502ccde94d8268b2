"""Serve GET /v1/model: what is serving, and the last version that failed to load."""

from __future__ import annotations

from fastapi import APIRouter

from burstcv_serving.schemas import ErrorOut, ModelInfo
from burstcv_serving.state import ModelDep, ServiceDep, SettingsDep

router = APIRouter(prefix="/v1", tags=["model"])


@router.get(
    "/model",
    response_model=ModelInfo,
    responses={503: {"model": ErrorOut, "description": "No model is loaded."}},
)
async def model_info(model: ModelDep, service: ServiceDep, settings: SettingsDep) -> ModelInfo:
    """Describe the serving model: name, version, classes, sha256, metrics, load error."""
    return ModelInfo(
        name=model.name,
        version=model.version,
        registry=None if settings.model_dir is not None else settings.registry_uri,
        classes=list(model.classes),
        sha256=model.sha256,
        metrics=dict(model.metrics),
        loaded_at=model.loaded_at,
        last_error=service.manager.last_error,
    )
