"""Define job.json: the whole contract between the orchestrator and a training box.

A run has one job.json and one or more attempts (a relaunch after a spot interruption or a
lost box is the next attempt). Each attempt writes its markers (DONE / FAILED) and logs
under ``attempts/<n>/`` of the job folder, so a marker of an earlier attempt can never end
the wait for a later one; checkpoints, metrics and weights are shared by the attempts.

This module ships in the training wheel and runs on the AMI's Python (3.10+).
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
    """Describe the on-device augmentation applied to training batches.

    ``mode`` "shift" moves each image by up to crop_padding_px (digits); "random_resized_crop"
    takes a random area share (rrc_scale) and aspect ratio (rrc_ratio) of the stored image
    and resizes it to the input size (photos, torchvision's recipe); "auto" picks the latter
    when the shards carry the pack margin (stored larger than the input size).
    """

    mode: Literal["auto", "shift", "random_resized_crop"] = "auto"
    crop_padding_px: int = Field(default=2, ge=0, le=16)  # random shift of up to N pixels
    # None: on for random_resized_crop (photos), off for shift (mirrored digits and text are
    # different classes).
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
    # per_gpu: batch_size is each rank's, the rate one rank's (the box scales both by the
    # ranks); global: batch_size is all ranks' together. A job.json without it is global.
    batch_scaling: BatchScaling = "global"
    learning_rate: float = Field(default=0.2, gt=0)  # peak of the schedule (after the warm-up)
    # The optimiser: SGD with Nesterov momentum (long runs, the torchvision recipes) or AdamW
    # (short runs: it needs fewer steps to settle; Ultralytics' optimizer=auto rule).
    optimizer: Literal["sgd", "adamw"] = "sgd"
    # None: the optimiser's usual decay (SGD 5e-4, AdamW's decoupled 0.05).
    weight_decay: float | None = Field(default=None, ge=0)
    # Optimizer steps of linear warm-up before the cosine decay; None: the first quarter of
    # the run (the one-cycle shape the digits were tuned with).
    warmup_steps: int | None = Field(default=None, ge=0)
    label_smoothing: float = Field(default=0.1, ge=0, lt=1)
    # Stop when validation accuracy has not improved for this many epochs; None: never.
    early_stop_patience: int | None = Field(default=None, ge=1)
    # A diverged epoch (a non-finite loss, or one far above where training started) is
    # undone: the last good state is restored and the rate lowered, at most this many times.
    max_recoveries: int = Field(default=3, ge=0, le=10)
    # Before training, sweep the rate over a few steps on the box and train at the one the
    # sweep suggests (learning_rate=auto); learning_rate is then only the fallback.
    lr_range_test: bool = False
    seed: int = 0
    time_budget_s: int = Field(default=3600, ge=10)  # the run's budget; sets deadline_at
    # Absolute end of the whole run, across attempts, bootstrap included: training stops
    # before an epoch that would end past it, and at any step once it is reached.
    deadline_at: datetime | None = None
    require_cuda: bool = False  # the preflight fails without CUDA (the ec2 backend sets it)
    source_commit: str = ""  # the orchestrator's commit: the box has no git checkout
    runtime_sha256: str = ""  # sha256 of the training wheel the box installs (ec2)
    checkpoint_every_s: float = Field(default=60.0, gt=0)  # a spot box loses at most this much
    # Host memory (MiB) the training data may take. Shards whose decoded images fit (train +
    # val, from their headers) are loaded whole onto the device, the fastest path; a larger
    # dataset is streamed shard by shard, holding at most 3 shards (window + prefetch) at once.
    data_memory_budget_mb: int = Field(default=2048, ge=1)
    target_accuracy: float | None = Field(default=None, gt=0, le=1)  # early stop once reached
    augment: AugmentSpec = Field(default_factory=AugmentSpec)
    compile: str = Field(default="auto", pattern="^(auto|on|off)$")  # torch.compile on CUDA
    # "none", a torchvision weights name of arch ("DEFAULT", "IMAGENET1K_V2") or a state_dict
    # URI (path, file://, s3://); burstcv.training.weights.check_pretrained vets it on CPU.
    pretrained: str = "none"
    # Where named weights are kept by sha256 (weights_store_uri(artifact root)): the box reads
    # them from there and downloads them (once) only when missing. None: download every run.
    weights_store_uri: str | None = None
    # Fine-tuning (pretrained runs only). Epochs that train the new head alone (backbone
    # weights and BatchNorm statistics untouched): 0, since the one-cycle warm-up already keeps
    # the first, largest updates of a random head small.
    freeze_backbone_epochs: int = Field(default=0, ge=0, le=1000)
    # Backbone learning rate / head learning rate: pretrained features need smaller steps
    # than the fresh head (torchvision's fine-tuning recipes use 0.1x or less).
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


# Marker stages: where an attempt ended. Only "interrupted" (a spot notice or a SIGTERM,
# checkpoint saved) and a box lost without a marker are worth a relaunch.
STAGE_BOOTSTRAP = "bootstrap"
STAGE_PREFLIGHT = "preflight"
STAGE_TRAIN = "train"
STAGE_BUDGET = "budget"
STAGE_INTERRUPTED = "interrupted"
STAGE_STALLED = "stalled"  # written by the train task's trigger: the trainer stopped beating
STAGE_BOOT = "boot"  # written by the orchestrator: a box never got through to S3
# The training loop writes its progress beat (TrainingBeat) at most this often: a write to
# the artifact store (S3 on a box) per interval (burstcv.compute.liveness reads it).
BEAT_EVERY_S = 10.0


def write_failed(
    job_dir_uri: str, attempt: int, stage: str, reason: str, *, resumable: bool
) -> str:
    """Write an attempt's FAILED marker: where it stopped, why, and whether to resume."""
    from burstcv import lineage

    return write_artifact(
        attempt_dir(job_dir_uri, attempt, FAILED_MARKER),
        FailedMarker(
            stage=stage,
            reason=reason,
            resumable=resumable,
            attempt=attempt,
            at=lineage.utc_now_iso(),
        ),
    )


def write_rank_failed(job_dir_uri: str, marker: FailedMarker) -> str:
    """Write one rank's own FAILED marker (``marker.rank`` set) in its attempt's ranks/."""
    if marker.rank is None:
        raise ValueError("a rank's FAILED marker names its rank")
    return write_artifact(
        attempt_dir(job_dir_uri, marker.attempt, RANK_MARKERS, str(marker.rank), FAILED_MARKER),
        marker,
    )


def rank_failures(job_dir_uri: str, attempt: int) -> list[FailedMarker]:
    """Return the FAILED markers an attempt's ranks wrote, by rank.

    One that cannot be read (a write cut short) is left out with a warning: the attempt's
    own marker and its boxes still say how it ended.
    """
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
    """Return the marker of the lowest rank whose error is its own (not resumable), or None.

    The other ranks' resumable markers ("a peer box was lost") are what its exit did to them.
    """
    return next((m for m in rank_failures(job_dir_uri, attempt) if not m.resumable), None)


def attempt_failure(job_dir_uri: str, attempt: int) -> FailedMarker | None:
    """Return why an attempt failed, from its markers alone: the owning rank's marker, else
    the attempt's FAILED; None when it wrote neither (or that cannot be read)."""
    owner = owning_rank_failure(job_dir_uri, attempt)
    if owner is not None:
        return owner
    uri = attempt_dir(job_dir_uri, attempt, FAILED_MARKER)
    if not storage.exists(uri):
        return None
    try:
        return read_artifact(uri, FailedMarker)
    except ArtifactError as exc:
        log.warning("unreadable FAILED marker %s: %s", uri, exc)
        return None
