"""Hold the objects one running service shares between requests, and their typed dependencies.

The dependencies are ``async def`` although they never await: FastAPI runs a plain ``def``
one in the thread pool. The prediction routes await them directly: resolving dependencies
costs more than everything else in FastAPI's routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from burstcv_serving.admission import AdmissionGate
from burstcv_serving.batcher import MicroBatcher
from burstcv_serving.manager import ModelManager
from burstcv_serving.metrics import ServiceMetrics
from burstcv_serving.model import LoadedModel
from burstcv_serving.settings import Settings


@dataclass(frozen=True)
class ServiceState:
    """Group what the lifespan builds: the model manager, the micro-batcher, admission."""

    manager: ModelManager
    batcher: MicroBatcher
    gate: AdmissionGate


async def get_settings(request: Request) -> Settings:
    """Return the app's settings."""
    settings: Settings = request.app.state.settings
    return settings


async def get_metrics(request: Request) -> ServiceMetrics:
    """Return the app's metrics."""
    metrics: ServiceMetrics = request.app.state.metrics
    return metrics


async def get_service(request: Request) -> ServiceState:
    """Return what the lifespan built; 503 if the service has not started."""
    service: ServiceState | None = getattr(request.app.state, "service", None)
    if service is None:
        raise HTTPException(
            503, detail="the service is starting; retry shortly", headers={"Retry-After": "1"}
        )
    return service


async def require_model(service: Annotated[ServiceState, Depends(get_service)]) -> LoadedModel:
    """Return the model serving now; 503 with the reason when there is none."""
    model = service.manager.current
    if model is None:
        error = service.manager.last_error
        reason = f": {error.describe()}" if error else " yet"
        raise HTTPException(
            503, detail=f"no model is loaded{reason}; retry later", headers={"Retry-After": "1"}
        )
    return model


SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]
ServiceDep = Annotated[ServiceState, Depends(get_service)]
ModelDep = Annotated[LoadedModel, Depends(require_model)]
