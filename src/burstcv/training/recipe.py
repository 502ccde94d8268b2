"""Choose the training recipe a run leaves on auto, from the validated data and the model.

Like the image size (``burstcv.data.imagesize``), the recipe is chosen at validate time, before
anything is rented, logged in one line and recorded for the report; a value the run names
explicitly wins over the rule. The rules, each with its anchor:

- model: photos train ``resnet18`` (it has ImageNet weights, and it is the plain torchvision
  recipe's model); small images such as the digits train ``resnet10`` from scratch.
- batch size: the largest power of two up to ``MAX_BATCH`` that still gives an epoch
  ``MIN_STEPS_PER_EPOCH`` optimizer steps (300 photos: 32, 9 steps; 1,437 digits: 128).
  With ``batch_scaling`` ``per_gpu`` (the default) it is each GPU's batch: a run of N boxes
  steps over N times as many images (counted one GPU a box here; the box multiplies by its
  GPUs), and the rate, given for one GPU, is scaled on the box by ``world_lr_factor``. With
  ``global`` it is the batch of all GPUs together, split between them.
- epochs: enough passes that a small training set is seen ``IMAGES_SEEN`` times over in all
  (300 photos: 15 epochs, the issue's working recipe), between ``MIN_EPOCHS`` and
  ``MAX_EPOCHS``; early stopping ends a run that stops improving.
- optimizer: AdamW for runs of fewer than ``SGD_MIN_STEPS`` steps, SGD with Nesterov momentum
  for longer ones (Ultralytics' ``optimizer=auto``).
- learning rate, scaled with the batch: AdamW 1e-3 at batch 32 times sqrt(batch / 32) (the
  square-root rule for Adam); SGD 0.1 per 256 images, linearly (torchvision's reference
  recipes, Goyal et al.).
- warm-up: a quarter of the run, at most ``max(3 epochs, 100 steps)`` (Ultralytics' warm-up).

This module is torch-free: the orchestrator imports it to validate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Optimizer = Literal["sgd", "adamw"]
# per_gpu: batch_size is each GPU's (each training process's) batch, and more GPUs step over
# more images at a rate scaled by the rule; global: batch_size is all GPUs' together.
BatchScaling = Literal["per_gpu", "global"]

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
    """Return the rate of ``world`` ranks, each at one rank's batch, over one rank's rate.

    The batch grows ``world`` times, so the rate follows the rule ``learning_rate_for``
    scales it by: linearly for SGD (Goyal et al., with the warm-up), by the square root for
    AdamW.
    """
    if world < 1:
        raise ValueError(f"a run has at least one rank, not {world}")
    return float(world) if optimizer == "sgd" else math.sqrt(world)


def choose_recipe(
    train_images: int, *, photos: bool, request: RecipeRequest | None = None
) -> Recipe:
    """Return the training recipe for ``train_images`` training images.

    ``photos``: the data is in photo mode (resize and centre crop, random-resized crops).
    Raises ValueError when there is no training image.
    """
    if train_images < 1:
        raise ValueError("no training image to choose a training recipe for")
    req = request or RecipeRequest()
    derived: list[str] = []
    why: list[str] = []

    model = req.model
    if model is None:
        model = PHOTO_MODEL if photos else SMALL_IMAGE_MODEL
        derived.append("model")
        why.append(f"model {model} ({'photos' if photos else 'small images'})")

    # Batches a step takes: one a box with per_gpu (one GPU a box counted), one in all else.
    per_step = req.nodes if req.batch_scaling == "per_gpu" else 1
    batch = req.batch_size
    if batch is None:
        batch = min(
            MAX_BATCH,
            max(MIN_BATCH, _pow2_floor(train_images / (MIN_STEPS_PER_EPOCH * per_step))),
        )
        derived.append("batch_size")
        step = (
            f"{batch} a GPU, {batch * per_step} a step over {per_step} boxes"
            if per_step > 1
            else str(batch)
        )
        why.append(
            f"batch {step} ({train_images} training images: "
            f"{max(1, train_images // (batch * per_step))} steps an epoch, at least "
            f"{MIN_STEPS_PER_EPOCH} wanted, at most {MAX_BATCH})"
        )
    steps_per_epoch = max(1, train_images // (batch * per_step))

    epochs = req.epochs
    if epochs is None:
        epochs = min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(IMAGES_SEEN / train_images)))
        derived.append("epochs")
        why.append(
            f"{epochs} epochs ({epochs * train_images:,} images seen, {IMAGES_SEEN:,} wanted, "
            f"{MIN_EPOCHS}-{MAX_EPOCHS} epochs)"
        )
    total_steps = steps_per_epoch * epochs

    optimizer = req.optimizer
    if optimizer is None:
        # Counted at the batch asked for, one batch a step: more boxes never change it.
        asked_steps = max(1, train_images // batch) * epochs
        optimizer = "adamw" if asked_steps < SGD_MIN_STEPS else "sgd"
        derived.append("optimizer")
        why.append(
            f"{'AdamW' if optimizer == 'adamw' else 'SGD'} ({asked_steps:,} steps at batch "
            f"{batch}: {'under' if optimizer == 'adamw' else 'at least'} {SGD_MIN_STEPS:,})"
        )

    lr = req.learning_rate
    if lr is None:
        lr = learning_rate_for(optimizer, batch)
        derived.append("learning_rate")
        why.append(
            f"learning rate {lr:.3g} ("
            + (
                f"{ADAMW_LR_AT_32:g} at batch 32 x sqrt({batch}/32)"
                if optimizer == "adamw"
                else f"{SGD_LR_PER_256:g} x {batch}/256"
            )
            + ")"
        )
    if per_step > 1:
        factor = world_lr_factor(optimizer, per_step)
        rule = "linear" if optimizer == "sgd" else "square root"
        why.append(
            f"rate {lr:.3g} a GPU, x{factor:.3g} over {per_step} boxes ({rule} rule; "
            "each box's GPUs scale it further)"
        )

    warmup = req.warmup_steps
    if warmup is None:
        cap = max(3 * steps_per_epoch, MIN_WARMUP_CAP_STEPS)
        warmup = min(round(total_steps / 4), cap)
        derived.append("warmup_steps")
        why.append(f"warm-up {warmup} steps (a quarter of the run, at most {cap})")

    patience = req.early_stop_patience
    if patience is None:
        patience = max(MIN_PATIENCE, math.ceil(epochs / 4))
        derived.append("early_stop_patience")
        why.append(f"early stop after {patience} epochs without improvement")

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
