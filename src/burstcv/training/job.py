"""Define job.json: the whole contract between the orchestrator and a training box.

Each attempt (a relaunch is the next) writes its markers and logs under ``attempts/<n>/``, so an
earlier attempt's marker never ends the wait for a later one. Runs on the AMI's Python (3.10+).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from burstcv.training.names import (
    FREEZE_NEEDS_WEIGHTS,
    check_architecture,
    is_pretrained,
    pretrained_value,
)
from burstcv.training.recipe import BatchScaling
from burstcv_spec import storage
from burstcv_spec.contracts import ArtifactError, FailedMarker, read_artifact, write_artifact
from burstcv_spec.layout import FAILED_MARKER, RANK_MARKERS

log = logging.getLogger(__name__)


class AugmentSpec(BaseModel):
    """Describe the on-device augmentation applied to training batches ("shift" suits digits)."""

    mode: Literal["auto", "shift", "random_resized_crop"] = "auto"
    crop_padding_px: int = Field(default=2, ge=0, le=16)  # random shift of up to N pixels
    # None: on for random_resized_crop, off for shift (mirrored digits are other classes).
    hflip: bool | None = None
    rrc_scale: tuple[float, float] = (0.35, 1.0)  # share of the stored image's area
    rrc_ratio: tuple[float, float] = (3 / 4, 4 / 3)  # width / height of the crop

    @field_validator("rrc_scale", "rrc_ratio")
    @classmethod
    def _ordered_range(
        cls, value: tuple[float, float], info: ValidationInfo
    ) -> tuple[float, float]:
        low, high = value
        if not 0 < low <= high or (info.field_name == "rrc_scale" and high > 1):
            raise ValueError(
                f"{info.field_name} must be (low, high) with 0 < low <= high"
                + (" <= 1" if info.field_name == "rrc_scale" else "")
                + f", got {value}"
            )
        return value


class JobSpec(BaseModel):
    """Hold everything a training run needs; written once by the orchestrator, read by the box."""

    run_id: str
    arch: str = "resnet10"
    classes: list[str]
    train_shards: list[str]
    val_shards: list[str]
    preprocess: dict[str, Any]
    output_uri: str
    epochs: int = Field(default=6, ge=1, le=1000)
    batch_size: int = Field(default=128, ge=1, le=65536)
    # per_gpu: batch and rate are one rank's (the box scales both); global: all ranks' together.
    batch_scaling: BatchScaling = "global"
    learning_rate: float = Field(default=0.2, gt=0)  # peak of the schedule (after the warm-up)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    # None: the optimiser's usual decay (SGD 5e-4, AdamW's decoupled 0.05).
    weight_decay: float | None = Field(default=None, ge=0)
    # Steps of linear warm-up before the cosine decay; None: the first quarter of the run.
    warmup_steps: int | None = Field(default=None, ge=0)
    label_smoothing: float = Field(default=0.1, ge=0, lt=1)
    # Stop when validation accuracy has not improved for this many epochs; None: never.
    early_stop_patience: int | None = Field(default=None, ge=1)
    # A diverged epoch is undone (last good state, lower rate) at most this many times.
    max_recoveries: int = Field(default=3, ge=0, le=10)
    # Sweep the rate on the box and train at the one found; learning_rate is the fallback.
    lr_range_test: bool = False
    seed: int = 0
    time_budget_s: int = Field(default=3600, ge=10)  # the run's budget; sets deadline_at
    # The whole run's end, across attempts: no epoch starts that would end past it.
    deadline_at: datetime | None = None
    require_cuda: bool = False  # the preflight fails without CUDA (the ec2 backend sets it)
    source_commit: str = ""  # the orchestrator's commit: the box has no git checkout
    runtime_sha256: str = ""  # sha256 of the training wheel the box installs (ec2)
    checkpoint_every_s: float = Field(default=60.0, gt=0)  # a spot box loses at most this much
    # Host memory (MiB) for the data: within it, loaded whole onto the device; beyond, streamed.
    data_memory_budget_mb: int = Field(default=2048, ge=1)
    target_accuracy: float | None = Field(default=None, gt=0, le=1)  # early stop once reached
    augment: AugmentSpec = Field(default_factory=AugmentSpec)
    compile: str = Field(default="auto", pattern="^(auto|on|off)$")  # torch.compile on CUDA
    # "none", a torchvision weights name of arch ("DEFAULT") or a state_dict URI.
    pretrained: str = "none"
    # Where named weights are kept by sha256; None: download every run.
    weights_store_uri: str | None = None
    # Epochs that train the new head alone (pretrained only); 0: the warm-up keeps it gentle.
    freeze_backbone_epochs: int = Field(default=0, ge=0, le=1000)
    # Backbone rate / head rate: pretrained features need smaller steps (torchvision: <= 0.1x).
    backbone_lr_scale: float = Field(default=0.1, gt=0, le=1)
    dataset_fingerprint: str = ""

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, value: str) -> str:
        return check_architecture(value)

    @field_validator("pretrained")
    @classmethod
    def _pretrained_form(cls, value: str) -> str:
        return pretrained_value(value, auto_allowed=False)

    @model_validator(mode="after")
    def _freeze_needs_weights(self) -> JobSpec:
        if self.freeze_backbone_epochs and not is_pretrained(self.pretrained):
            raise ValueError(FREEZE_NEEDS_WEIGHTS)
        return self

    @field_validator("classes")
    @classmethod
    def _enough_classes(cls, value: list[str]) -> list[str]:
        if len(value) < 2 or len(set(value)) != len(value):
            raise ValueError("classes must hold at least 2 distinct names")
        return value

    @field_validator("train_shards", "val_shards")
    @classmethod
    def _some_shards(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one shard is required")
        return value

    def uri(self, *parts: str) -> str:
        """Return a URI under the job's output folder."""
        return storage.join(self.output_uri, *parts)

    def attempt_uri(self, attempt: int, *parts: str) -> str:
        """Return a URI under one attempt's folder (its markers and logs)."""
        return attempt_dir(self.output_uri, attempt, *parts)


def attempt_dir(job_dir_uri: str, attempt: int, *parts: str) -> str:
    """Return ``<job dir>/attempts/<attempt>/<parts>``: where one attempt's markers live."""
    if attempt < 1:
        raise ValueError(f"attempts count from 1, got {attempt}")
    return storage.join(job_dir_uri, "attempts", str(attempt), *parts)


def load_job(uri: str) -> JobSpec:
    """Read and validate job.json from a URI."""
    return JobSpec.model_validate(storage.read_json(uri))


def write_job(job: JobSpec, uri: str) -> str:
    """Write job.json to a URI and return it."""
    return storage.write_json(uri, job.model_dump(mode="json"))


# Where an attempt ended; only "interrupted" (or a box lost without a marker) earns a relaunch.
STAGE_PREFLIGHT = "preflight"
STAGE_TRAIN = "train"
STAGE_BUDGET = "budget"
STAGE_INTERRUPTED = "interrupted"
STAGE_STALLED = "stalled"  # written by the train task's trigger: the trainer stopped beating
STAGE_BOOT = "boot"  # written by the orchestrator: a box never got through to S3
# The training loop's progress beat (TrainingBeat) is written at most this often.
BEAT_EVERY_S = 10.0


def place(epoch: int, step: int) -> str:
    """Say where training stands (``epoch`` epochs done, ``step`` steps into the next), epochs
    counted from 1 as every line a user reads counts them."""
    if step:
        return f"at epoch {epoch + 1} step {step}"
    return f"after epoch {epoch}" if epoch else "before the first epoch"


def write_failed(
    job_dir_uri: str, attempt: int, stage: str, reason: str, *, resumable: bool
) -> str:
    """Write an attempt's FAILED marker: where it stopped, why, and whether to resume. The
    trigger's "stalled" stands: the trainer it ended writes its own end after it, never over it."""
    from burstcv import lineage

    uri = attempt_dir(job_dir_uri, attempt, FAILED_MARKER)
    if stage != STAGE_STALLED and (verdict := _stalled(uri)) is not None:
        log.warning(
            "attempt %d stays %s (%s); its trainer's end: %s", attempt, verdict, uri, reason
        )
        return uri
    return write_artifact(
        uri,
        FailedMarker(
            stage=stage,
            reason=reason,
            resumable=resumable,
            attempt=attempt,
            at=lineage.utc_now_iso(),
        ),
    )


def _stalled(uri: str) -> str | None:
    """Return the stage of the FAILED marker at ``uri`` when it is the trigger's stall verdict."""
    try:
        marker = read_artifact(uri, FailedMarker)
    except (storage.ArtifactNotFoundError, ArtifactError):
        return None
    return marker.stage if marker.stage == STAGE_STALLED else None


def write_rank_failed(job_dir_uri: str, marker: FailedMarker) -> str:
    """Write one rank's own FAILED marker (``marker.rank`` set) in its attempt's ranks/."""
    if marker.rank is None:
        raise ValueError("a rank's FAILED marker names its rank")
    return write_artifact(
        attempt_dir(job_dir_uri, marker.attempt, RANK_MARKERS, str(marker.rank), FAILED_MARKER),
        marker,
    )


def rank_failures(job_dir_uri: str, attempt: int) -> list[FailedMarker]:
    """Return the FAILED markers an attempt's ranks wrote, by rank; skip unreadable ones."""
    found: list[tuple[int, FailedMarker]] = []
    for uri in storage.list_files(attempt_dir(job_dir_uri, attempt, RANK_MARKERS)):
        *_, rank, name = uri.split("/")
        if name != FAILED_MARKER or not rank.isdigit():
            continue
        try:
            found.append((int(rank), read_artifact(uri, FailedMarker)))
        except ArtifactError as exc:
            log.warning("unreadable rank marker %s: %s", uri, exc)
    return [marker for _, marker in sorted(found, key=lambda pair: pair[0])]


def owning_rank_failure(job_dir_uri: str, attempt: int) -> FailedMarker | None:
    """Return the marker of the lowest rank whose error is its own (not resumable), or None;
    the other ranks' resumable markers ("a peer box was lost") are what its exit did to them."""
    return next((m for m in rank_failures(job_dir_uri, attempt) if not m.resumable), None)


def attempt_failure(job_dir_uri: str, attempt: int) -> FailedMarker | None:
    """Return why an attempt failed: the owning rank's marker, else the attempt's FAILED."""
    if owner := owning_rank_failure(job_dir_uri, attempt):
        return owner
    uri = attempt_dir(job_dir_uri, attempt, FAILED_MARKER)
    if not storage.exists(uri):
        return None
    try:
        return read_artifact(uri, FailedMarker)
    except ArtifactError as exc:
        log.warning("unreadable FAILED marker %s: %s", uri, exc)
        return None
