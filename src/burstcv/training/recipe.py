"""Choose the training recipe a run leaves on auto, from the validated data and the model.

Chosen at validate time, before anything is rented (torch-free: the orchestrator imports it);
a value the run names wins. The optimizer (AdamW for short runs, else SGD with Nesterov) and the
warm-up follow Ultralytics' auto; SGD's rate is 0.1 per 256 images (Goyal et al.).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

Optimizer = Literal["sgd", "adamw"]
# per_gpu: batch_size is each GPU's, scaled with the GPUs; global: all GPUs' together.
BatchScaling = Literal["per_gpu", "global"]
T = TypeVar("T")

PHOTO_MODEL = "resnet18"
SMALL_IMAGE_MODEL = "resnet10"
MIN_BATCH = 8
MAX_BATCH = 128
MIN_STEPS_PER_EPOCH = 8
IMAGES_SEEN = 4_500  # images seen over the run that a small dataset gets at least
MIN_EPOCHS = 6
MAX_EPOCHS = 30
SGD_MIN_STEPS = 10_000
ADAMW_LR_AT_32 = 1e-3
SGD_LR_PER_256 = 0.1
MIN_WARMUP_CAP_STEPS = 100
MIN_PATIENCE = 4


@dataclass(frozen=True)
class RecipeRequest:
    """Hold what the run asked for: None where the run left the value on auto."""

    model: str | None = None
    batch_size: int | None = None
    learning_rate: float | None = None
    epochs: int | None = None
    optimizer: Optimizer | None = None
    warmup_steps: int | None = None
    early_stop_patience: int | None = None
    batch_scaling: BatchScaling = "per_gpu"
    nodes: int = 1  # the run's boxes: with per_gpu, a step takes a batch from each


@dataclass(frozen=True)
class Recipe:
    """Hold the chosen values, which of them were derived, and why, in one line."""

    model: str
    batch_size: int
    learning_rate: float
    epochs: int
    optimizer: Optimizer
    warmup_steps: int
    early_stop_patience: int
    steps_per_epoch: int
    derived: tuple[str, ...]
    reason: str


def _pow2_floor(value: float) -> int:
    return 1 << max(0, math.floor(math.log2(max(1.0, value))))


def learning_rate_for(optimizer: Optimizer, batch_size: int) -> float:
    """Return the rate the rules give an optimiser at a batch size (scaled with it)."""
    if optimizer == "adamw":
        return ADAMW_LR_AT_32 * math.sqrt(batch_size / 32)
    return SGD_LR_PER_256 * batch_size / 256


def world_lr_factor(optimizer: Optimizer, world: int) -> float:
    """Return the rate of ``world`` ranks at one rank's batch each over one rank's (the rules')."""
    if world < 1:
        raise ValueError(f"a run has at least one rank, not {world}")
    return float(world) if optimizer == "sgd" else math.sqrt(world)


def choose_recipe(
    train_images: int, *, photos: bool, request: RecipeRequest | None = None
) -> Recipe:
    """Return the training recipe for ``train_images`` training images (at least one)."""
    if train_images < 1:
        raise ValueError("no training image to choose a training recipe for")
    req = request or RecipeRequest()
    derived: list[str] = []
    why: list[str] = []

    def pick(name: str, asked: T | None, rule: Callable[[], tuple[T, str]]) -> T:
        if asked is not None:
            return asked
        value, reason = rule()
        derived.append(name)
        why.append(reason)
        return value

    model = pick("model", req.model, lambda: _model(photos))
    # Batches a step takes: one a box with per_gpu (one GPU a box counted), one in all else.
    per_step = req.nodes if req.batch_scaling == "per_gpu" else 1
    batch = pick("batch_size", req.batch_size, lambda: _batch(train_images, per_step))
    steps_per_epoch = max(1, train_images // (batch * per_step))
    epochs = pick("epochs", req.epochs, lambda: _epochs(train_images))
    total_steps = steps_per_epoch * epochs
    optimizer: Optimizer = pick(
        "optimizer", req.optimizer, lambda: _optimizer(train_images, batch, epochs)
    )
    lr = pick("learning_rate", req.learning_rate, lambda: _learning_rate(optimizer, batch))
    if per_step > 1:
        factor = world_lr_factor(optimizer, per_step)
        rule = "linear" if optimizer == "sgd" else "square root"
        why.append(
            f"rate {lr:.3g} a GPU, x{factor:.3g} over {per_step} boxes ({rule} rule; "
            "each box's GPUs scale it further)"
        )
    warmup = pick("warmup_steps", req.warmup_steps, lambda: _warmup(steps_per_epoch, total_steps))
    patience = pick("early_stop_patience", req.early_stop_patience, lambda: _patience(epochs))
    return Recipe(
        model=model,
        batch_size=batch,
        learning_rate=lr,
        epochs=epochs,
        optimizer=optimizer,
        warmup_steps=warmup,
        early_stop_patience=patience,
        steps_per_epoch=steps_per_epoch,
        derived=tuple(derived),
        reason=("; ".join(why) if why else "every value is the run's own")
        + (f"; cosine decay over {total_steps:,} steps"),
    )


def _model(photos: bool) -> tuple[str, str]:
    model = PHOTO_MODEL if photos else SMALL_IMAGE_MODEL
    return model, f"model {model} ({'photos' if photos else 'small images'})"


def _batch(train_images: int, per_step: int) -> tuple[int, str]:
    batch = min(
        MAX_BATCH, max(MIN_BATCH, _pow2_floor(train_images / (MIN_STEPS_PER_EPOCH * per_step)))
    )
    step = (
        f"{batch} a GPU, {batch * per_step} a step over {per_step} boxes"
        if per_step > 1
        else str(batch)
    )
    return batch, (
        f"batch {step} ({train_images} training images: "
        f"{max(1, train_images // (batch * per_step))} steps an epoch, at least "
        f"{MIN_STEPS_PER_EPOCH} wanted, at most {MAX_BATCH})"
    )


def _epochs(train_images: int) -> tuple[int, str]:
    epochs = min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(IMAGES_SEEN / train_images)))
    return epochs, (
        f"{epochs} epochs ({epochs * train_images:,} images seen, {IMAGES_SEEN:,} wanted, "
        f"{MIN_EPOCHS}-{MAX_EPOCHS} epochs)"
    )


def _optimizer(train_images: int, batch: int, epochs: int) -> tuple[Optimizer, str]:
    # Counted at the batch asked for, one batch a step: more boxes never change it.
    asked_steps = max(1, train_images // batch) * epochs
    optimizer: Optimizer = "adamw" if asked_steps < SGD_MIN_STEPS else "sgd"
    return optimizer, (
        f"{'AdamW' if optimizer == 'adamw' else 'SGD'} ({asked_steps:,} steps at batch "
        f"{batch}: {'under' if optimizer == 'adamw' else 'at least'} {SGD_MIN_STEPS:,})"
    )


def _learning_rate(optimizer: Optimizer, batch: int) -> tuple[float, str]:
    lr = learning_rate_for(optimizer, batch)
    rule = (
        f"{ADAMW_LR_AT_32:g} at batch 32 x sqrt({batch}/32)"
        if optimizer == "adamw"
        else f"{SGD_LR_PER_256:g} x {batch}/256"
    )
    return lr, f"learning rate {lr:.3g} ({rule})"


def _warmup(steps_per_epoch: int, total_steps: int) -> tuple[int, str]:
    cap = max(3 * steps_per_epoch, MIN_WARMUP_CAP_STEPS)
    warmup = min(round(total_steps / 4), cap)
    return warmup, f"warm-up {warmup} steps (a quarter of the run, at most {cap})"


def _patience(epochs: int) -> tuple[int, str]:
    patience = max(MIN_PATIENCE, math.ceil(epochs / 4))
    return patience, f"early stop after {patience} epochs without improvement"
