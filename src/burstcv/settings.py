"""Read burstcv's configuration from the environment (prefix ``BURSTCV_``) with safe defaults.

The defaults are the embedded setup: artifact store and registry under ``var/`` of the repo,
local compute, the service on 127.0.0.1:8000. Every figure carries its unit in its name.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# src/burstcv/settings.py -> repo root (an editable install keeps the package in the repo).
REPO_ROOT = Path(__file__).resolve().parents[2]
VAR_DIR = REPO_ROOT / "var"

ComputeBackend = Literal["local", "ec2"]


class Settings(BaseSettings):
    """Hold every setting the pipeline stages read; DAG params override per run."""

    model_config = SettingsConfigDict(env_prefix="BURSTCV_", env_file=None, extra="ignore")

    # Where things live.
    artifact_root: str = Field(default=str(VAR_DIR / "artifacts"), description="local dir or s3://")
    registry_uri: str = Field(default=str(VAR_DIR / "registry"), description="local dir or s3://")
    model_name: str = "digits"
    dataset_uri: str = str(VAR_DIR / "data" / "digits")

    # Scheduling: a cron expression or preset; empty for manual and data-triggered runs only.
    schedule: str = "@weekly"

    # Compute.
    compute_backend: ComputeBackend = "local"
    compute_state_dir: str = str(VAR_DIR / "compute")  # local backend's record of live processes
    train_timeout_s: int = 3600  # hard budget for one training job, watchdog included
    # Comma-separated backends the reaper sweeps; empty: local, and ec2 whenever AWS is
    # configured (a run may pick ec2 on the trigger form whatever compute_backend says).
    reaper_backends: str = ""
    # Comma-separated EC2 regions the reaper looks in; empty: every region enabled for the
    # account (so every region burstcv ever launched in, whatever the settings said then).
    reaper_regions: str = ""
    gpu_pool: str = "burstcv_gpu"  # Airflow pool that bounds live training boxes
    gpu_pool_slots: int = 4  # set to the account's GPU instance quota

    # Training defaults (a job may override each).
    arch: str = "resnet10"
    epochs: int = 6
    batch_size: int = 128
    learning_rate: float = 0.2
    seed: int = 0

    # Validation thresholds (issue 3 adds more; each may be overridden by DAG params).
    min_images_per_class: int = 5
    min_width_px: int = 8
    min_height_px: int = 8
    max_width_px: int = 4096
    max_height_px: int = 4096

    # Export.
    onnx_opset: int = 18
    parity_max_abs_diff: float = 1e-3  # logits; fp32 torch vs onnxruntime on the same images
    int8_max_accuracy_drop: float = 0.01  # INT8 serves only within this drop and if faster

    # Benchmark and gate.
    latency_slo_ms: float = 50.0  # p95 over HTTP, one image per request
    accuracy_floor: float = 0.9  # validation top-1
    max_accuracy_drop: float = 0.02  # allowed drop against the production model
    bench_requests: int = 200
    bench_concurrency: int = 4
    bench_warmup_requests: int = 20

    # Serving (the deployed service that deploy notifies and verifies).
    serving_url: str = "http://127.0.0.1:8000"
    serving_admin_token: str = "dev-token"
    deploy_verify_timeout_s: float = 30.0

    @field_validator("artifact_root", "registry_uri", "dataset_uri", "compute_state_dir")
    @classmethod
    def _strip_trailing_slash(cls, value: str) -> str:
        return value.rstrip("/") if value not in ("/", "") else value

    def reaper_backend_names(self) -> list[str]:
        """Return the backends the reaper sweeps (see ``reaper_backends``)."""
        if self.reaper_backends.strip():
            return [b.strip() for b in self.reaper_backends.split(",") if b.strip()]
        return ["local", "ec2"] if self.aws_configured() else ["local"]

    def aws_configured(self) -> bool:
        """Return whether this deployment can reach AWS (settings or credentials say so)."""
        if self.compute_backend == "ec2" or self.artifact_root.startswith("s3://"):
            return True
        return any(os.environ.get(key) for key in _AWS_ENVIRONMENT) or any(
            key.startswith("BURSTCV_EC2_") for key in os.environ
        )

    def reaper_region_names(self) -> list[str]:
        """Return the configured reaper regions (empty: every enabled region)."""
        return [r.strip() for r in self.reaper_regions.split(",") if r.strip()]


# Any of these in the environment means AWS credentials or the aws_default connection exist.
_AWS_ENVIRONMENT = (
    "AIRFLOW_CONN_AWS_DEFAULT",
    "AWS_ACCESS_KEY_ID",
    "AWS_PROFILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Return the process-wide settings (read once from the environment)."""
    return Settings()
