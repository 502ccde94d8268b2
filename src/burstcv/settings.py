"""Read burstcv's deployment settings from the environment (prefix ``BURSTCV_``).

``Settings`` say where things live; ``Ec2Settings`` (prefix ``BURSTCV_EC2_``) how the EC2
backend rents boxes. Both are deployment facts, read without importing any AWS client (the
DAG file reads them). What one run chooses (model, epochs, data checks, gates, budget) is a
run parameter (``burstcv.params.RunParams``), set on the trigger form or the command line,
never here.

Every local default lives under one home folder, ``BURSTCV_HOME``, never beside the installed
code (an installed package's folder is no place for data): when ``BURSTCV_HOME`` is unset it
is ``$AIRFLOW_HOME/burstcv`` where Airflow has a home, else ``var/`` of the working directory
(the repo's ``var/`` when run from a checkout; ``make`` exports ``BURSTCV_HOME`` to it). The
home is resolved to an absolute path once, when the settings are read. Every figure carries
its unit in its name.
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
    # A run's default number of training boxes (ec2): what scheduled and asset-triggered runs,
    # which carry no conf, train on. Each box takes a slot of the GPU pool.
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
    # Relaunches of a run's training after a lost or interrupted box (spot reclaim), within
    # the same train task try; the run's deadline and max_cost_usd bound them too. A run whose
    # boxes keep vanishing is more likely broken (a boot that cannot start) than unlucky.
    max_relaunches: int = Field(default=3, ge=0)
    # Before a relaunch starts its boxes, the ended attempt's boxes are waited for at most this
    # long (never past the run's deadline): out of pending and running, and for a run of
    # several boxes terminated (they hold its placement group; EC2 ends a reclaimed box in a
    # few minutes). Past it the relaunch goes on: the attempt tag keeps the boxes apart, and
    # the teardown takes every box of every attempt.
    relaunch_wait_s: float = Field(default=180.0, ge=0.0)
    # A training box ships its log as soon as its boot reached S3 (a few minutes after launch:
    # the instance boots, cloud-init starts the script). One with no log this long after its
    # launch is stuck before S3 (no egress, no KMS key use, a script that never ran): the
    # attempt ends FAILED at boot, not relaunched, and the teardown terminates the box.
    boot_bound_s: float = Field(default=900.0, ge=60.0)
    # A trainer that makes no progress (stopped, hung in a collective) is ended after this many
    # seconds without a new beat at least (burstcv.compute.liveness), or after
    # STALL_STEPS of its own measured steps when that is longer; the attempt ends resumable
    # and is relaunched from its checkpoint, instead of holding its GPU until the deadline.
    train_stall_min_s: float = Field(default=300.0, ge=10.0)
    gpu_pool: str = "burstcv_gpu"  # Airflow pool that bounds live training boxes
    gpu_pool_slots: int = 4  # set to the account's GPU instance quota

    # Pack: how training shards store their images (bench/shards.py has the figures). auto:
    # JPEG at quality 90 when the stored images are photo-sized (a side of 128 px or more:
    # at 224 px a tenth of the bytes, taken in faster than raw below ~13 Gbit/s on 4 vCPUs),
    # raw uint8 for small ones (decoding would cost more than the bytes). Validation shards
    # stay raw: the accuracy the gate reads is measured on exact pixels.
    shard_format: Literal["auto", "raw", "jpeg"] = "auto"

    # Export: this deployment's toolchain limits, not a run's choice.
    onnx_opset: int = 18
    parity_max_abs_diff: float = 1e-3  # logits; fp32 torch vs onnxruntime on the same images
    # Validation images the INT8 check and the accuracy gate score on the orchestrator, evenly
    # spaced over the split (all of a smaller one); bounds its memory, read a shard at a time.
    eval_max_images: int = Field(default=2048, ge=32)

    # Benchmark load: how this deployment measures latency (the SLO is a run parameter).
    # The latency benchmark is open-loop: each model gets up to ``bench_requests`` requests at
    # the rate one replica of the chosen fleet carries at most (the sizing's sustainable rate
    # at the staging service's CPUs, less the headroom; never above the run's target_rps),
    # or at ``bench_rate_rps`` when set; at most ``bench_max_s`` seconds of load per model.
    bench_requests: int = Field(default=200, ge=1)
    bench_rate_rps: float | None = Field(default=None, gt=0)
    bench_max_s: float = Field(default=30.0, gt=0)
    bench_warmup_requests: int = 20
    # Processes one data task (a scan chunk) inspects its files with. 0: the CPUs this worker
    # may use divided by its task slots (a CeleryExecutor's worker_concurrency; 1 otherwise),
    # so chunks running side by side on one worker do not oversubscribe its cores.
    task_processes: int = Field(default=0, ge=0)
    # Isolation: the benchmark task (latency and sizing) runs in a pool of its own, one slot by
    # default, so no two runs' measurements overlap.
    bench_pool: str = "burstcv_bench"
    bench_pool_slots: int = Field(default=1, ge=1)
    # The Celery queue the benchmark task goes to ("": the executor's default queue). The
    # production stack sets it, and runs a worker of its own for that queue alone
    # (docker-compose.yaml's airflow-bench-worker): no training shares its CPUs.
    bench_queue: str = ""
    # Interference (burstcv.gate.interference): a measurement is busy when other processes
    # took more than this share of its CPUs, or the calibration kernel ran this much slower
    # than its quiet figure; it is tried this many times, the pause doubling from the
    # backoff, before the gate is inconclusive (the task fails and is retried, nothing judged).
    # Half: Airflow's own components on a 2-CPU host (scheduler, DAG processor, health checks)
    # take a steady third of it; a neighbour's training or test run takes three quarters.
    bench_busy_share: float = Field(default=0.5, gt=0.0, le=1.0)
    bench_busy_slowdown: float = Field(default=1.5, gt=1.0)
    bench_attempts: int = Field(default=3, ge=1)
    bench_busy_backoff_s: float = Field(default=5.0, ge=0.0)
    # Fleet sizing (burstcv.gate.sizing): seconds of open-loop load per rate tried, and the
    # most CPUs measured (0: every CPU of the benchmark host).
    sizing_step_s: float = Field(default=3.0, gt=0)
    sizing_max_vcpus: int = Field(default=0, ge=0)
    # A model whose speed key (burstcv.gate.sizing.speed_key: architecture, input,
    # preprocessing, quantization, host, SLO, these settings) equals one measured before on
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
        """Return the EC2 backend's settings (``BURSTCV_EC2_*``), read once per ``Settings``.

        Stages reach them through the settings they are given, so a caller (or a test) that
        passes settings decides them; nothing below reads the environment again.
        """
        return Ec2Settings()

    def with_ec2(self, ec2: Ec2Settings) -> Settings:
        """Return a copy of these settings whose EC2 settings are ``ec2``."""
        copy = self.model_copy()
        copy.__dict__["ec2"] = ec2
        return copy

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


# The PyTorch Deep Learning AMI for the region, resolved through its public SSM parameter at
# each launch (the resolved ami-… is recorded in billing.json). It brings the NVIDIA driver,
# CUDA torch + torchvision and boto3 in /opt/pytorch (Python 3.12), so a box downloads only
# burstcv's own training wheel (tens of KB) before its first step; its S3 calls go through that
# boto3 (the boot never needs the AWS CLI).
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
    # Comma-separated, tried in order for each instance type and market when one refuses for
    # capacity (capacity is per Availability Zone), before the next type; empty: the default
    # subnet of every AZ of the region. Security groups must be in the subnets' VPC.
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
    # Sizing boxes (size_on ec2): Amazon Linux 2023 for the type's architecture ({arch}:
    # x86_64 or arm64), whose Python 3.11 the box installs with dnf at boot; the serving
    # wheel's pins come from the package index (the box needs egress to it, or a mirror).
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
