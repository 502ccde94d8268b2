"""Serve POST /v1/admin/reload: re-read the alias now (bearer token required)."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from burstcv_serving.schemas import ErrorOut, ReloadOut
from burstcv_serving.state import ServiceDep, SettingsDep

router = APIRouter(prefix="/v1/admin", tags=["admin"])

_bearer = HTTPBearer(auto_error=False)


def require_admin(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    settings: SettingsDep,
) -> None:
    """Refuse with 401 unless the request carries ``Authorization: Bearer <admin token>``."""
    challenge = {"WWW-Authenticate": "Bearer"}
    if credentials is None:
        raise HTTPException(
            401,
            detail="missing bearer token; send 'Authorization: Bearer <admin token>'",
            headers=challenge,
        )
    if not hmac.compare_digest(credentials.credentials.encode(), settings.admin_token.encode()):
        raise HTTPException(401, detail="invalid admin token", headers=challenge)


@router.post(
    "/reload",
    response_model=ReloadOut,
    dependencies=[Depends(require_admin)],
    responses={
        401: {"model": ErrorOut, "description": "Missing or wrong bearer token."},
        409: {"model": ErrorOut, "description": "The alias's version failed to load."},
        503: {"model": ErrorOut, "description": "No model could be loaded at all."},
    },
)
async def reload_model(service: ServiceDep) -> ReloadOut:
    """Re-read the alias, load its version if it changed (retrying a failed one), report."""
    manager = service.manager
    previous = manager.current
    model = await manager.refresh(force=True)
    error = manager.last_error
    if model is None:
        reason = error.describe() if error else "no model is configured"
        raise HTTPException(503, detail=f"{reason}; nothing is serving")
    if error is not None:
        raise HTTPException(409, detail=f"{error.describe()}; still serving {model.version}")
    return ReloadOut(
        version=model.version,
        previous_version=None if previous is None else previous.version,
        changed=model is not previous,
    )
