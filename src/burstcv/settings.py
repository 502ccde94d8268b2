"""Read burstcv's deployment settings from the environment (prefix ``BURSTCV_``).

``Settings`` say where things live, ``Ec2Settings`` (``BURSTCV_EC2_``) how the EC2 backend
rents boxes; both are read without importing any AWS client (the DAG file reads them). What
one run chooses is a run parameter (``burstcv.params.RunParams``), never a setting.

Every local default lives under ``BURSTCV_HOME``, never beside the installed code: unset, it
is ``$AIRFLOW_HOME/burstcv`` where Airflow has a home, else ``var/`` of the working directory.
Every figure carries its unit in its name.
"""

from __future__ import annotations

import os
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

BackendName = Literal["local", "ec2"]

HOME_ENV = "BURSTCV_HOME"

# Settings that became run parameters: a deployment that still sets one is told where it
# went rather than silently ignored (the value would no longer take effect).
RETIRED_SETTINGS = {
    "BURSTCV_ARCH": "model",
    "BURSTCV_EPOCHS": "epochs",
    "BURSTCV_BATCH_SIZE": "batch_size",
    "BURSTCV_LEARNING_RATE": "learning_rate",
    "BURSTCV_SEED": "seed",
    "BURSTCV_MIN_IMAGES_PER_CLASS": "min_images_per_class",
    "BURSTCV_MIN_WIDTH_PX": "min_width",
    "BURSTCV_MIN_HEIGHT_PX": "min_height",
    "BURSTCV_MAX_WIDTH_PX": "max_width",
    "BURSTCV_MAX_HEIGHT_PX": "max_height",
    "BURSTCV_INT8_MAX_ACCURACY_DROP": "int8_max_accuracy_drop",
    "BURSTCV_LATENCY_SLO_MS": "latency_slo_ms",
    "BURSTCV_ACCURACY_FLOOR": "accuracy_floor",
    "BURSTCV_MAX_ACCURACY_DROP": "max_accuracy_drop",
}


def default_home() -> Path:
    """Return the home folder when ``BURSTCV_HOME`` is unset (see the module docstring)."""
    airflow_home = os.environ.get("AIRFLOW_HOME")
    if airflow_home:
        return Path(airflow_home).expanduser() / "burstcv"
    return Path.cwd() / "var"


def _under_home(*parts: str) -> Any:
    """Return a field default: a path under the (already validated) home folder."""
    return Field(default_factory=lambda data: str(Path(data["home"]).joinpath(*parts)))


class Settings(BaseSettings):
    """Hold a deployment's facts: where things live, which cloud, how its services are reached."""

    model_config = SettingsConfigDict(env_prefix="BURSTCV_", env_file=None, extra="ignore")

    # Where things live. ``home`` comes first: the local defaults below are folders in it.
    home: str = Field(
        default_factory=lambda: str(default_home()),
        description="folder of every local default (BURSTCV_HOME)",
    )
    artifact_root: str = _under_home("artifacts")  # a local folder or s3://bucket/prefix
    registry_uri: str = _under_home("registry")  # a local folder or s3://bucket/prefix
    model_name: str = "digits"
    # The dataset a run validates unless it names another (the trigger form's default).
    dataset_uri: str = _under_home("data", "digits")

    # Scheduling: a cron expression or preset; empty for manual and data-triggered runs only.
    schedule: str = "@weekly"

    # Compute.
    compute_backend: BackendName = "local"  # a run's default backend (the form's default)
    # Training boxes (ec2) of a run that names none (scheduled and asset-triggered runs).
    num_nodes: int = Field(default=1, ge=1)
    compute_state_dir: str = _under_home("compute")  # local backend's record of live processes
    # The longest a run may train, watchdog included: the train task's execution timeout is
    # set from it, so a run's time_budget_s above it is refused (it would be cut short).
    train_timeout_s: int = Field(default=3600, ge=60)
    # Comma-separated backends the reaper sweeps; empty: local, and ec2 whenever AWS is
    # configured (a run may pick ec2 on the trigger form whatever compute_backend says).
    reaper_backends: str = ""
    # Comma-separated EC2 regions the reaper looks in; empty: every region enabled for the
    # account (so every region burstcv ever launched in, whatever the settings said then).
    reaper_regions: str = ""
    # Relaunches after a lost or interrupted box (spot reclaim), within one train task try: a
    # run whose boxes keep vanishing is more likely broken than unlucky.
    max_relaunches: int = Field(default=3, ge=0)
    # How long a relaunch waits for the ended attempt's boxes to go (they hold the placement
    # group; never past the deadline). Past it, the attempt tag keeps the boxes apart.
    relaunch_wait_s: float = Field(default=180.0, ge=0.0)
    # A box with no log in S3 this long after launch is stuck before S3 (no egress, no KMS key
    # use, a script that never ran): the attempt ends FAILED at boot, not relaunched.
    boot_bound_s: float = Field(default=900.0, ge=60.0)
    # A trainer with no new beat this long (or STALL_STEPS of its steps, if longer) is relaunched
    # from its checkpoint rather than hold its GPU to the deadline (burstcv.compute.liveness).
    train_stall_min_s: float = Field(default=300.0, ge=10.0)
    gpu_pool: str = "burstcv_gpu"  # Airflow pool that bounds live training boxes
    gpu_pool_slots: int = 4  # set to the account's GPU instance quota

    # Pack: how training shards store images (figures: bench/shards.py). auto: JPEG q90 for
    # photo-sized images (a side of 128 px or more: a tenth of the bytes at 224 px), raw for
    # small ones. Validation shards stay raw: the gate's accuracy is read on exact pixels.
    shard_format: Literal["auto", "raw", "jpeg"] = "auto"

    # Export: this deployment's toolchain limits, not a run's choice.
    onnx_opset: int = 18
    parity_max_abs_diff: float = 1e-3  # logits; fp32 torch vs onnxruntime on the same images
    # Validation images the INT8 check and the accuracy gate score on the orchestrator, evenly
    # spaced over the split (all of a smaller one); bounds its memory, read a shard at a time.
    eval_max_images: int = Field(default=2048, ge=32)

    # Benchmark load, open-loop: up to ``bench_requests`` per model at the rate one replica of
    # the chosen fleet carries (less the headroom, at most target_rps), or ``bench_rate_rps``
    # when set; at most ``bench_max_s`` seconds of load per model.
    bench_requests: int = Field(default=200, ge=1)
    bench_rate_rps: float | None = Field(default=None, gt=0)
    bench_max_s: float = Field(default=30.0, gt=0)
    bench_warmup_requests: int = 20
    # Processes a scan chunk inspects its files with; 0: this worker's CPUs over its task
    # slots, so chunks side by side on one worker do not oversubscribe its cores.
    task_processes: int = Field(default=0, ge=0)
    # The benchmark task's own pool, one slot by default: no two runs' measurements overlap.
    bench_pool: str = "burstcv_bench"
    bench_pool_slots: int = Field(default=1, ge=1)
    # The benchmark task's Celery queue ("": the default); the production stack gives it a
    # worker of its own (airflow-bench-worker), so no training shares its CPUs.
    bench_queue: str = ""
    # Interference (burstcv.gate.interference): a measurement is busy when others took more
    # than this share of its CPUs or the calibration kernel ran this much slower; tried this
    # many times, the pause doubling, before the gate is inconclusive. Half: on a 2-CPU host
    # Airflow itself takes a steady third; a neighbour's training takes three quarters.
    bench_busy_share: float = Field(default=0.5, gt=0.0, le=1.0)
    bench_busy_slowdown: float = Field(default=1.5, gt=1.0)
    bench_attempts: int = Field(default=3, ge=1)
    bench_busy_backoff_s: float = Field(default=5.0, ge=0.0)
    # Fleet sizing (burstcv.gate.sizing): seconds of open-loop load per rate tried, and the
    # most CPUs measured (0: every CPU of the benchmark host).
    sizing_step_s: float = Field(default=3.0, gt=0)
    sizing_max_vcpus: int = Field(default=0, ge=0)
    # A model whose speed key (burstcv.gate.sizing.speed_key) equals one measured before on
    # this host reuses those sizes (<BURSTCV_HOME>/bench/sizing/); true measures every time.
    sizing_remeasure: bool = False
    # Sizing boxes (size_on ec2) up at once: each is one CPU type's own box.
    sizing_parallel: int = Field(default=2, ge=1, le=8)

    # Serving (the deployed service that deploy notifies and verifies).
    serving_url: str = "http://127.0.0.1:8000"
    serving_admin_token: str = "dev-token"
    deploy_verify_timeout_s: float = 30.0

    @cached_property
    def ec2(self) -> Ec2Settings:
        """Return the EC2 backend's settings, read once: who passes ``Settings`` decides them."""
        return Ec2Settings()

    @model_validator(mode="before")
    @classmethod
    def _no_retired_settings(cls, data: Any) -> Any:
        retired = [
            f"{k} (now the run parameter {v})"
            for k, v in RETIRED_SETTINGS.items()
            if k in os.environ
        ]
        if retired:
            raise ValueError(
                "these settings are per-run choices now; set them on the trigger form, in the "
                f"run's conf or as `burstcv run` options, and unset them: {', '.join(retired)}"
            )
        return data

    @field_validator("home")
    @classmethod
    def _absolute_home(cls, value: str) -> str:
        if not value:
            raise ValueError(f"{HOME_ENV} is empty; unset it for the default, or name a folder")
        return str(Path(value).expanduser().resolve())

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
        # A variable set to nothing (compose passes `${VAR:-}` through) configures nothing.
        return any(os.environ.get(key) for key in _AWS_ENVIRONMENT) or any(
            value for key, value in os.environ.items() if key.startswith("BURSTCV_EC2_")
        )

    def reaper_region_names(self) -> list[str]:
        """Return the configured reaper regions (empty: every enabled region)."""
        return [r.strip() for r in self.reaper_regions.split(",") if r.strip()]


# The PyTorch Deep Learning AMI, resolved through its public SSM parameter at each launch: its
# NVIDIA driver, CUDA torch and boto3 in /opt/pytorch leave a box only burstcv's own training
# wheel (tens of KB) to download before its first step.
DEFAULT_AMI = (
    "/aws/service/deeplearning/ami/x86_64/oss-nvidia-driver-gpu-pytorch-2.9-ubuntu-24.04"
    "/latest/ami-id"
)
DEFAULT_PYTHON = "/opt/pytorch/bin/python"  # the PyTorch environment of that AMI


class Ec2Settings(BaseSettings):
    """Hold the EC2 backend's settings (env prefix ``BURSTCV_EC2_``)."""

    # A variable set to nothing (compose passes `${VAR:-}` through) leaves the default.
    model_config = SettingsConfigDict(
        env_prefix="BURSTCV_EC2_", env_file=None, extra="ignore", env_ignore_empty=True
    )

    aws_conn_id: str = "aws_default"
    region: str = "us-east-1"
    ami: str = Field(default=DEFAULT_AMI, description="AMI id (ami-…) or SSM parameter name")
    # The defaults of a run's instance_types and use_spot (its trigger form's): comma-separated,
    # most preferred first; spot is tried on each before on-demand on each.
    instance_types: Annotated[tuple[str, ...], NoDecode] = ("g6.xlarge", "g5.xlarge", "g4dn.xlarge")
    # Comma-separated, tried in order per type and market on a capacity refusal (capacity is
    # per AZ); empty: every AZ's default subnet. Security groups must be in the subnets' VPC.
    subnet_ids: Annotated[tuple[str, ...], NoDecode] = ()
    security_group_ids: Annotated[tuple[str, ...], NoDecode] = ()  # no inbound rule is needed
    # Name or ARN of the instance profile (deploy/instance-role-policy.json): required, the
    # box reads its job and writes its results with it.
    instance_profile: str | None = None
    volume_gb: int = Field(default=100, ge=8, le=16384)  # root volume, holds the AMI + shards
    use_spot: bool = True
    python: str = DEFAULT_PYTHON  # the AMI's interpreter with CUDA torch (Python 3.10-3.13)
    require_gpu: bool = True  # the box's preflight fails without CUDA and a working driver
    watchdog_margin_min: int = Field(default=5, ge=1)  # after the deadline: the last upload
    log_every_s: int = Field(default=30, ge=5)  # how often the box ships its log to S3
    # The AWS-side backstop: a one-time EventBridge Scheduler schedule per instance that
    # terminates it at its expiry, assuming this role (name or ARN; docs/aws.md creates it).
    backstop: bool = True
    backstop_role: str = "burstcv-backstop"
    waiter_delay_s: float = Field(default=5.0, gt=0)  # between describe calls while waiting
    waiter_max_attempts: int = Field(default=120, ge=1)
    # Sizing boxes (size_on ec2): Amazon Linux 2023 for the type's {arch} (x86_64, arm64); the
    # box installs Python 3.11 and the serving wheel's pins from the index (egress or a mirror).
    sizing_ami: str = Field(
        default="/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-{arch}",
        description="AMI id (ami-…) or SSM parameter name, {arch} filled in",
    )
    sizing_python: str = "python3.11"
    sizing_volume_gb: int = Field(default=16, ge=8, le=16384)
    sizing_margin_min: int = Field(default=2, ge=1)  # a sizing box's watchdog, after its bound

    @model_validator(mode="before")
    @classmethod
    def _no_single_subnet_setting(cls, data: Any) -> Any:
        if "BURSTCV_EC2_SUBNET_ID" in os.environ:
            raise ValueError(
                "BURSTCV_EC2_SUBNET_ID is now BURSTCV_EC2_SUBNET_IDS (comma-separated subnets, "
                "tried in order on a capacity shortage; empty: every AZ's default subnet); "
                "rename it"
            )
        return data

    @field_validator("instance_types", "security_group_ids", "subnet_ids", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("instance_types")
    @classmethod
    def _some_types(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("instance_types needs at least one instance type")
        return value

    def required_instance_profile(self) -> str:
        """Return the instance profile, or raise the one-line reason a launch cannot go on."""
        if not self.instance_profile:
            raise MissingInstanceProfileError(
                "set BURSTCV_EC2_INSTANCE_PROFILE: a training box reads its job and writes its "
                "results with the instance role (deploy/instance-role-policy.json; docs/aws.md)"
            )
        return self.instance_profile


class MissingInstanceProfileError(ValueError):
    """Raise when an EC2 launch is asked for without an instance profile."""


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
