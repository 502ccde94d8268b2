"""Read the prediction service's configuration from the environment (prefix BURSTCV_SERVING_).

Every figure carries its unit in its name; the defaults suit a developer's machine.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from burstcv_spec.admin_token import PLACEHOLDER_ADMIN_TOKEN, admin_token_problem

Environment = Literal["development", "staging", "production"]

# The queueing-delay target when neither the setting nor the serving version's record names
# one: far above a batch, with room for a model swap's warm-up on a busy 2-core machine (50 ms
# shed a few requests at concurrency 16 during swaps).
DEFAULT_QUEUE_DELAY_TARGET_MS = 100.0


def _host_cores() -> int:
    """Return the cores this process may run on: its CPU affinity, capped by a cgroup quota
    (a container limited with ``--cpus=2`` sees every host CPU in its affinity)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = max(1, os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return min(cores, max(1, math.ceil(quota))) if quota else cores


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """Return the CPUs this process's cgroup may use (quota / period), or None when unlimited."""
    try:  # cgroup v2: "max 100000" or "200000 100000"
        quota, period = Path(root, "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota_us = int(Path(root, "cpu", "cpu.cfs_quota_us").read_text())
        period_us = int(Path(root, "cpu", "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


class Settings(BaseSettings):
    """Hold every setting of one prediction-service process."""

    model_config = SettingsConfigDict(
        env_prefix="BURSTCV_SERVING_", env_file=None, extra="ignore", frozen=True
    )

    # Which model to serve.
    registry_uri: str = Field(default="var/registry", description="local folder or s3://")
    model_name: str = "digits"
    alias: str = "production"
    # Serve this one model directory (model.json + onnx file) and ignore the registry: the
    # benchmark's staging copy of a candidate that has no registry version yet.
    model_dir: str | None = None
    poll_interval_s: float = Field(default=1.0, ge=0.0)  # alias check period; 0 disables

    # Security and environment.
    admin_token: str = PLACEHOLDER_ADMIN_TOKEN
    environment: Environment = "development"

    # Network.
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)

    # Micro-batching and load shedding.
    max_batch_size: int = Field(default=32, ge=1)  # images per session.run
    max_batch_wait_ms: float = Field(default=1.0, ge=0.0)  # extra wait, only when already busy
    # A lone image runs on the event loop (no thread hand-off) when the model's single-image
    # latency, measured at warm-up, is at most this; 0: always through the inference thread.
    inline_max_ms: float = Field(default=10.0, ge=0.0)
    max_queue: int = Field(default=256, ge=1)  # images waiting for inference; beyond → 503
    # A prediction request whose batch cannot start within this many ms of its arrival is
    # answered 503 + Retry-After. Unset: the latency SLO the gate held the serving version to
    # (a model judged against 2 s is not shed at 100 ms), else DEFAULT_QUEUE_DELAY_TARGET_MS.
    queue_delay_target_ms: float | None = Field(default=None, gt=0.0)
    # Prediction requests in service at once; the others wait for a slot. 0: follow the
    # measured answer rate (see burstcv_serving.admission); a number fixes it.
    service_slots: int = Field(default=0, ge=0)
    # Requests that may wait for a service slot at once; beyond → 503 at once. Each holds
    # at most uvicorn's read buffer (64 KiB) of its body while it waits.
    max_waiting: int = Field(default=2048, ge=0)
    max_batch_files: int = Field(default=64, ge=1)  # files in one /v1/predict/batch request
    # Admit in the service's own HTTP protocol (burstcv_serving.protocol) when the installed
    # uvicorn is the one it was written for; false: always admit in ASGI middleware.
    fast_protocol: bool = True

    # Input limits.
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1)  # whole request body
    max_pixels: int = Field(default=4096 * 4096, ge=1)  # width × height declared by the image
    # A refused request's body up to this size is read and thrown away, so that a client that
    # sends its whole body before reading (urllib) reads the 413/503, not a connection reset.
    max_discard_bytes: int = Field(default=64 * 1024 * 1024, ge=0)

    # onnxruntime.
    intra_op_threads: int = Field(default_factory=_host_cores, ge=1)
    # Spinning ORT threads burn the cores the event loop needs; off unless measured to help.
    intra_op_spinning: bool = False

    top_k: int = Field(default=3, ge=1)
    log_level: str = "info"
    access_log: bool = False  # one log line per request; /metrics already counts them

    @field_validator("registry_uri")
    @classmethod
    def _strip_trailing_slash(cls, value: str) -> str:
        return value.rstrip("/") if value not in ("/", "") else value

    @model_validator(mode="after")
    def _refuse_unsafe_admin_tokens(self) -> Settings:
        if problem := admin_token_problem(self.admin_token, self.host, self.environment):
            raise ValueError(problem)
        return self


def queue_target_ms(settings: Settings, recorded_slo_ms: float | None) -> tuple[float, str]:
    """Return the queueing-delay target for a model judged against ``recorded_slo_ms``, and
    where it comes from: the setting, else the SLO recorded with the model, else the default."""
    if settings.queue_delay_target_ms is not None:
        return settings.queue_delay_target_ms, "BURSTCV_SERVING_QUEUE_DELAY_TARGET_MS"
    if recorded_slo_ms is not None:
        return recorded_slo_ms, "the latency SLO the gate held the serving version to"
    return DEFAULT_QUEUE_DELAY_TARGET_MS, "the default: no SLO is recorded with the version"
