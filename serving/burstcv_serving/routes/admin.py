"""Serve the admin calls (bearer token required): reload the alias now, stage a version.

A deploy stages a version on every service (load, verify, warm; no switch), moves the alias
only when all succeeded, then has each reload, which swaps in the staged model at once.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

from burstcv_serving.model import LoadedModel, ModelLoadError
from burstcv_serving.registry import SourceError
from burstcv_serving.schemas import ErrorOut, ReloadOut
from burstcv_serving.settings import Settings
from burstcv_serving.state import ServiceDep, SettingsDep

_bearer = HTTPBearer(auto_error=False)


def _version(model: LoadedModel | None) -> int | str | None:
    return None if model is None else model.version


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


router = APIRouter(
    prefix="/v1/admin",
    tags=["admin"],
    dependencies=[Depends(require_admin)],
    responses={401: {"model": ErrorOut, "description": "Missing or wrong bearer token."}},
)


@router.post(
    "/reload",
    response_model=ReloadOut,
    responses={
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
        previous_version=_version(previous),
        changed=model is not previous,
    )


class StageIn(BaseModel):
    """Name the registry version to stage and the sha256 its ONNX file must have."""

    version: int = Field(gt=0, description="registry version number")
    sha256: str | None = Field(
        default=None,
        pattern="^[0-9a-f]{64}$",
        description="sha256 the alias will carry; the file must match it",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        description="the model name the deploy is for; refused if this service serves another",
    )
    registry: str | None = Field(
        default=None,
        min_length=1,
        description="the deploying registry (s3:// or an absolute folder); refused if this "
        "service reads another",
    )


class StagedOut(BaseModel):
    """Say which version is staged (loaded, verified, warmed) and whether this call loaded it."""

    version: int
    sha256: str
    loaded_now: bool
    serving_version: int | str | None


@router.post(
    "/stage",
    response_model=StagedOut,
    responses={409: {"model": ErrorOut, "description": "The version cannot serve here, and why."}},
)
async def stage_model(body: StageIn, service: ServiceDep, settings: SettingsDep) -> StagedOut:
    """Load, verify and warm a version beside the serving model without switching to it."""
    if other := another_registrys_deploy(settings, body.model, body.registry):
        raise HTTPException(409, detail=other)
    manager = service.manager
    try:
        model, loaded_now = await manager.stage(body.version, body.sha256)
    except (ModelLoadError, SourceError) as exc:
        serving = manager.current
        still = "nothing is serving" if serving is None else f"still serving {serving.version}"
        raise HTTPException(
            409, detail=f"version {body.version} failed to load: {exc}; {still}"
        ) from exc
    return StagedOut(
        version=body.version,
        sha256=model.sha256,
        loaded_now=loaded_now,
        serving_version=_version(manager.current),
    )


def same_registry(mine: str, theirs: str) -> bool | None:
    """Return whether two registry locations are one (None: this host cannot tell): S3 URIs as
    written, folders as files here (a container may see the deployer's elsewhere, or not)."""
    if mine.startswith("s3://") or theirs.startswith("s3://"):
        return mine.rstrip("/") == theirs.rstrip("/")
    theirs_path = Path(theirs)
    if not theirs_path.is_absolute() or not theirs_path.exists():
        return None
    try:
        return Path(mine).resolve().samefile(theirs_path)
    except OSError:
        return False


def another_registrys_deploy(settings: Settings, model: str | None, registry: str | None) -> str:
    """Return why a deploy of ``model`` from ``registry`` is not this service's, or ''."""
    if settings.model_dir is not None:
        return ""  # serving one model directory: no registry to compare
    elsewhere = "the deploy is meant for another service (check the serving URL)"
    if model is not None and model != settings.model_name:
        return f"this service serves model {settings.model_name!r}, not {model!r}: {elsewhere}"
    if registry is not None and same_registry(settings.registry_uri, registry) is False:
        return f"this service reads registry {settings.registry_uri}, not {registry}: {elsewhere}"
    return ""


class StagedListOut(BaseModel):
    """List the versions staged now (loaded and warm, waiting for the alias), oldest first."""

    staged: list[int | str]
    serving_version: int | str | None


@router.get("/staged", response_model=StagedListOut)
async def staged_models(service: ServiceDep) -> StagedListOut:
    """Say which versions are staged beside the serving model."""
    return StagedListOut(
        staged=service.manager.staged_versions(), serving_version=_version(service.manager.current)
    )
