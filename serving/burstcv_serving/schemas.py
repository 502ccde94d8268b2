"""Define the JSON bodies the service returns, errors included (they appear in /openapi.json)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field


class ErrorOut(BaseModel):
    """Describe any 4xx/5xx answer: a reason a client can act on."""

    detail: str = Field(examples=["unsupported image format GIF; send one of PNG, JPEG, WEBP"])


class PredictionItem(BaseModel):
    """Give one class of a top-k answer."""

    label: str
    index: int = Field(description="index of the class in the model's logits")
    score: float = Field(description="softmax probability, 0..1")


class PredictionOut(BaseModel):
    """Answer one image: the model version that answered and its top-k classes."""

    version: int | str = Field(description="registry version, or 'candidate' for a staging copy")
    model: str
    predictions: list[PredictionItem]
    server_time_ms: float = Field(description="time from receiving the request to answering")


class FilePredictionOut(BaseModel):
    """Give the top-k classes of one file of a batch request."""

    filename: str | None
    predictions: list[PredictionItem]


class BatchPredictionOut(BaseModel):
    """Answer several images, all by the same model version, in the order they were sent."""

    version: int | str
    model: str
    results: list[FilePredictionOut]
    server_time_ms: float


class LoadErrorOut(BaseModel):
    """Report a version that failed to load (version null: the alias itself was unreadable)."""

    version: int | str | None
    sha256: str | None
    reason: str
    at: datetime

    def describe(self) -> str:
        """Return one line for logs and API answers."""
        what = "the alias" if self.version is None else f"version {self.version}"
        return f"{what} failed to load: {self.reason}"


class ModelInfo(BaseModel):
    """Describe the model serving now and the last version that failed to replace it."""

    name: str
    version: int | str
    registry: str | None = Field(
        default=None, description="the registry this service reads (none: one model folder)"
    )
    classes: list[str]
    sha256: str
    metrics: dict[str, Any]
    loaded_at: datetime
    last_error: LoadErrorOut | None


class HealthOut(BaseModel):
    """Say the process is alive."""

    status: str = "ok"


class ReadyOut(BaseModel):
    """Say a warmed model is serving, and which."""

    status: str = "ready"
    version: int | str


class ReloadOut(BaseModel):
    """Report the version serving after an admin reload."""

    version: int | str
    previous_version: int | str | None
    changed: bool
