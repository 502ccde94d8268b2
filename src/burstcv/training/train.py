"""Run one training job from job.json: on CPU, one GPU or many (torchrun), resumable, then DONE.

Data within the job's memory budget moves to the device whole, so a GPU step never waits for a
host-to-device copy; larger data is streamed (burstcv.training.stream).
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
import os
import signal
import time
import traceback
from collections.abc import Callable, Generator
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from burstcv import lineage
from burstcv.training.checkpoint import (
    BEST_CHECKPOINT,
    CHECKPOINT,
    PREVIOUS_CHECKPOINT,
    CheckpointError,
    load_checkpoint,
    remove_leftovers,
    resume_checkpoint,
    save_checkpoint,
)
from burstcv.training.job import (
    BEAT_EVERY_S,
    STAGE_BUDGET,
    STAGE_INTERRUPTED,
    STAGE_TRAIN,
    JobSpec,
    attempt_dir,
    load_job,
    place,
    write_failed,
    write_rank_failed,
)
from burstcv.training.models import architecture, build_model, split_head
from burstcv.training.names import is_pretrained, pretrained_kind
from burstcv.training.preflight import native_bf16
from burstcv.training.stream import (
    EVAL_BATCH,
    JobSpecError,
    ShardCache,
    ShardInfo,
    ShardStream,
    load_shard,
    node_shards,
    read_shard_info,
)
from burstcv.training.transforms import train_transform
from burstcv.training.weights import load_pretrained, resolve_weights
from burstcv.training.world import Dist, WorldScale, dist_from_env, peer_lost, scale_to_world
from burstcv_spec import storage
from burstcv_spec.contracts import (
    Contract,
    DoneMarker,
    EpochRecord,
    FailedMarker,
    HostInfo,
    OptimizerBlock,
    PretrainedLoad,
    RangeTest,
    Recovery,
    TrainingBeat,
    TrainingMetrics,
    TrainingProgress,
    WallSeconds,
    write_artifact,
)
from burstcv_spec.layout import DONE_MARKER, METRICS, PROGRESS, TRAINING_BEAT
from burstcv_spec.preprocess import PreprocessSpec, eval_view

C = TypeVar("C", bound=Contract)

log = logging.getLogger(__name__)

# DDP ranks agree on a SIGTERM or the deadline every this many steps (a spot notice: 2 min).
DDP_STOP_CHECK_STEPS = 10

EXIT_INTERRUPTED = 143  # the conventional code of a SIGTERM'd process
EXIT_BUDGET = 4  # the run's deadline was reached: a checkpoint exists, no relaunch
EXIT_DIVERGED = 5  # training diverged after every recovery: nothing worth exporting


__all__ = ["JobSpecError", "load_shards", "main", "run_job"]  # JobSpecError: stream's, re-exported


class Interrupted(Exception):
    """Raise inside the loop when SIGTERM asked for a checkpoint-and-exit."""

    stage, resumable, exit_code = STAGE_INTERRUPTED, True, EXIT_INTERRUPTED


class BudgetExhausted(Exception):
    """Raise inside the loop when the run's deadline is reached (checkpoint saved)."""

    stage, resumable, exit_code = STAGE_BUDGET, False, EXIT_BUDGET


class Diverged(Exception):
    """Raise inside an epoch when the loss left the range training can come back from."""


class TrainingDiverged(RuntimeError):
    """Raise when training still diverges after every recovery the job allows."""

    stage, resumable, exit_code = STAGE_TRAIN, False, EXIT_DIVERGED


@dataclass(frozen=True)
class Share:
    """What a rank trains on: its place among the ranks reading the same shards, and the steps."""

    rank: int
    world_size: int
    batch_size: int  # images the ranks reading the same shards take together per step
    steps: int  # steps per epoch, the same on every rank
    images: int  # the whole training split's, every box's shards together

    @classmethod
    def whole(cls, images: int, batch_size: int, d: Dist | None = None) -> Share:
        """Return the share of a rank that reads every shard (one box, or the range test)."""
        d = d or Dist()
        return cls(d.rank, d.world_size, batch_size, max(1, images // batch_size), images)


def share_shards(counts: list[int], batch_size: int, d: Dist) -> tuple[Share, list[int]]:
    """Return this rank's share of the training split and the shards (indices) its box reads."""
    total = sum(counts)
    if d.nodes <= 1 or len(counts) < d.nodes:
        if d.nodes > 1:
            log.warning(
                "%d training shard(s) for %d boxes: every box reads every shard (pack with "
                "smaller shards to split them)",
                len(counts),
                d.nodes,
            )
        return Share.whole(total, batch_size, d), list(range(len(counts)))
    deal = node_shards(counts, d.nodes)
    local = d.world_size // d.nodes
    box_batch = max(1, batch_size // d.world_size) * local
    fewest = min(sum(counts[i] for i in part) for part in deal)
    share = Share(d.local_rank, local, box_batch, max(1, fewest // box_batch), total)
    mine = deal[d.node]
    log.info(
        "box %d of %d reads %d of %d training shards (%d of %d images), %d steps an epoch",
        d.node,
        d.nodes,
        len(mine),
        len(counts),
        sum(counts[i] for i in mine),
        total,
        share.steps,
    )
    return share, mine


@dataclass
class Split:
    """Hold one split on the device: uint8 NCHW images and int64 labels."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def device(self) -> torch.device:
        return self.images.device


def load_shards(uris: list[str], classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Read .npz shards into one uint8 NHWC array and int64 labels, checking the class list."""
    parts = [load_shard(uri, classes) for uri in uris]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def to_device_split(images: np.ndarray, labels: np.ndarray, device: torch.device) -> Split:
    """Move a whole split to the device once, as uint8 NCHW (4x smaller than float)."""
    tensor = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    return Split(tensor.to(device), torch.from_numpy(labels).to(device))


def open_splits(
    job: JobSpec, device: torch.device, cache: ShardCache | None = None, d: Dist | None = None
) -> tuple[Split | ShardStream, Split | ShardStream, Share]:
    """Return (train, val, share): whole on the device where the data fits, else streamed; on
    several boxes train holds this box's own shards, and every box evaluates all of val."""
    infos = {
        name: [read_shard_info(uri, job.classes) for uri in uris]
        for name, uris in (("train", job.train_shards), ("val", job.val_shards))
    }
    share, mine = share_shards([i.count for i in infos["train"]], job.batch_size, d or Dist())
    infos["train"] = [infos["train"][i] for i in mine]
    for size in {(i.height, i.width) for i in infos["train"] + infos["val"]}:
        # Fail here when a shard's size fits the spec neither with nor without the pack margin.
        eval_images(np.zeros((0, *size, 3), np.uint8), job)
    budget = job.data_memory_budget_mb * 2**20
    sizes = {name: sum(i.nbytes for i in split) for name, split in infos.items()}

    def whole(split: list[ShardInfo], *, for_eval: bool) -> Split:
        images, labels = load_shards([i.uri for i in split], job.classes)
        return to_device_split(eval_images(images, job) if for_eval else images, labels, device)

    if sizes["train"] + sizes["val"] <= budget:
        return whole(infos["train"], for_eval=False), whole(infos["val"], for_eval=True), share
    stream = partial(
        ShardStream, classes=job.classes, device=device, budget_bytes=budget, cache=cache
    )
    train = stream(infos["train"])
    val: Split | ShardStream = (
        whole(infos["val"], for_eval=True)
        if train.peak_bytes + sizes["val"] <= budget
        else stream(infos["val"], eval_view=lambda images: eval_images(images, job))
    )
    log.info(
        "data of %.0f MB > budget of %d MB: streaming train shards (%d per window, %d ahead, "
        "%.0f MB at most), validation %s",
        (sizes["train"] + sizes["val"]) / 2**20,
        job.data_memory_budget_mb,
        train.mix,
        train.prefetch,
        train.peak_bytes / 2**20,
        "streamed" if isinstance(val, ShardStream) else "whole",
    )
    return train, val, share


Batches = Generator[tuple[torch.Tensor, torch.Tensor], None, None]


def split_batches(train: Split, seed: int, epoch: int, start_step: int, share: Share) -> Batches:
    """Yield an epoch's batches of a split on the device from ``start_step``: this rank's share."""
    batch_size = share.batch_size
    per_rank = batch_size // share.world_size or 1
    order_gen = torch.Generator().manual_seed(seed * 7919 + epoch)
    order = torch.randperm(len(train.labels), generator=order_gen)
    for step in range(start_step, share.steps):
        idx = order[step * batch_size : (step + 1) * batch_size]
        idx = idx[share.rank :: share.world_size][:per_rank].to(train.device)  # each its own
        yield train.images[idx], train.labels[idx]


def _train_batches(
    train: Split | ShardStream, seed: int, epoch: int, start_step: int, share: Share
) -> Batches:
    if isinstance(train, Split):
        return split_batches(train, seed, epoch, start_step, share)
    return train.train_batches(
        seed=seed,
        epoch=epoch,
        batch_size=share.batch_size,
        start_step=start_step,
        rank=share.rank,
        world_size=share.world_size,
        steps=share.steps,
    )


def _eval_batches(split: Split | ShardStream, batch_size: int) -> Batches:
    if isinstance(split, ShardStream):
        yield from split.eval_batches(batch_size)
        return
    for start in range(0, len(split.labels), batch_size):
        yield split.images[start : start + batch_size], split.labels[start : start + batch_size]


def normalize(
    batch_u8: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, scale: float
) -> torch.Tensor:
    """Apply the eval transform to uint8 NCHW on the device (same math as serving's numpy)."""
    return (batch_u8.float() * scale - mean) / std


def augment(batch_u8: torch.Tensor, job: JobSpec, gen: torch.Generator) -> torch.Tensor:
    """Apply the job's training transform (burstcv.training.transforms) to stored images."""
    size = (int(job.preprocess["height"]), int(job.preprocess["width"]))
    return train_transform(batch_u8, job.augment, size, gen)


def eval_images(images: np.ndarray, job: JobSpec) -> np.ndarray:
    """Return stored uint8 NHWC images as serving sees them (the centre of a pack margin)."""
    try:
        return eval_view(images, PreprocessSpec.from_dict(job.preprocess))
    except ValueError as exc:
        raise JobSpecError(f"shards do not fit the job's preprocess block: {exc}") from exc


def _norm(job: JobSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Return the job's eval-transform mean and std (NCHW, on ``device``) and pixel scale."""
    mean, std = (
        torch.tensor(job.preprocess[key], dtype=torch.float32, device=device).view(1, 3, 1, 1)
        for key in ("mean", "std")
    )
    return mean, std, float(job.preprocess.get("scale", 1.0 / 255.0))


def _step_generator(seed: int, epoch: int, step: int) -> torch.Generator:
    # A generator per (epoch, step) makes the stream independent of where a run resumed.
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch * 10_007 + step)


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if x.device.type == "cuda" else x


def _autocast(device: torch.device, amp_dtype: torch.dtype | None) -> torch.autocast:
    return torch.autocast(
        device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None
    )


def evaluate(
    model: nn.Module,
    split: Split | ShardStream,
    mean: torch.Tensor,
    std: torch.Tensor,
    scale: float,
    num_classes: int,
    batch_size: int,
    amp_dtype: torch.dtype | None,
    on_batch: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Return loss, top-1 accuracy and the confusion matrix; ``on_batch`` after each batch."""
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)
    total_loss = 0.0
    with torch.no_grad(), closing(_eval_batches(split, batch_size)) as batches:
        for x_u8, y in batches:
            x = _channels_last(normalize(x_u8, mean, std, scale))
            with _autocast(x.device, amp_dtype):
                logits = model(x)
            total_loss += float(F.cross_entropy(logits.float(), y, reduction="sum"))
            confusion += torch.bincount(
                (y * num_classes + logits.argmax(1)).cpu(), minlength=num_classes * num_classes
            ).reshape(num_classes, num_classes)
            if on_batch is not None:
                on_batch()
    model.train()
    n = max(1, len(split))
    return {
        "loss": total_loss / n,
        "accuracy": float(confusion.diag().sum()) / n,
        "confusion": confusion.tolist(),
    }


@dataclass(frozen=True)
class Run:
    """Hold what stays the same through a run: the job, where it runs, the model, its optimiser."""

    job: JobSpec  # its learning_rate is the range test's where the job asked for the sweep
    attempt: int
    d: Dist
    device: torch.device
    t_setup: float  # time.perf_counter() when the job started
    deadline: float | None  # time.time() of the run's deadline
    mean: torch.Tensor
    std: torch.Tensor
    scale: float
    amp_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler  # enabled for fp16 only: a pass-through otherwise
    model: nn.Module  # the bare model: state dicts, evaluation
    net: nn.Module  # what a training step calls: the model for DDP and/or compiled, or itself
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    lr_scale: LrScale  # a recovery lowers it in place
    share: Share  # what this rank trains on each step, and the steps an epoch
    loaded: PretrainedLoad | None  # what load_pretrained reported (None from scratch)
    range_test: RangeTest | None  # None unless the job asked for the sweep
    world: WorldScale  # how the batch and the rate follow the ranks


class MetricLogger:
    """Meter the run's wall-time split and the epoch's loss and images/s. Losses are summed on
    the device and read once an epoch (or a divergence window): reading a GPU value every step
    would make the host wait for each step, leaving the GPU idle."""

    def __init__(self) -> None:
        self.setup_s = self.data_s = self.compute_s = self.eval_s = 0.0
        self.start_epoch(torch.device("cpu"))

    def start_epoch(self, device: torch.device) -> None:
        """Zero the epoch's meters (kept on ``device``) and start its clock."""
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.window_sum, self.window_n = torch.zeros_like(self.loss_sum), 0
        self.seen, self.t_epoch = 0, time.perf_counter()

    def update(self, loss: torch.Tensor, images: int, data_s: float, compute_s: float) -> None:
        """Add a step: its mean loss over ``images`` images, and where its time went."""
        self.loss_sum += loss.detach().float() * images
        self.window_sum += loss.detach().float()
        self.window_n += 1
        self.seen += images
        self.data_s += data_s
        self.compute_s += compute_s

    def window_loss(self) -> torch.Tensor:
        """Return the mean loss of the steps since the last call (on the device); start anew."""
        window = self.window_sum / self.window_n
        self.window_sum, self.window_n = torch.zeros_like(self.window_sum), 0
        return window

    def end_epoch(self, world_size: int) -> dict[str, float]:
        """Return the epoch's mean training loss and images/s (every rank's)."""
        t_drain = time.perf_counter()
        train_loss = float(self.loss_sum) / max(1, self.seen)  # waits for the last queued steps
        self.compute_s += time.perf_counter() - t_drain
        elapsed = time.perf_counter() - self.t_epoch
        return {
            "train_loss": train_loss,
            "images_per_s": self.seen * world_size / max(elapsed, 1e-9),
        }


# Training steps whose median is a beat's step time: recent enough to follow a change of pace.
BEAT_STEPS = 50


@dataclass
class Beat:
    """Write the training loop's heartbeat (``TrainingBeat``) only on progress, at most every
    ``every_s``: a trainer alive but stalled stops beating, and the train task's trigger ends
    its attempt (``burstcv.compute.liveness``)."""

    uri: str
    attempt: int
    every_s: float = BEAT_EVERY_S
    beats: int = 0
    written_at: float = -math.inf  # time.monotonic() of the last write
    last_step_at: float | None = None  # of the last training step, to time the next one
    step_times: list[float] = field(default_factory=list)

    def tick(self, epoch: int, step: int, phase: str = "train") -> None:
        """Note progress (a training step, or a validation batch); write when due."""
        now = time.monotonic()
        if phase == "train":
            if self.last_step_at is not None:
                self.step_times = [*self.step_times[-(BEAT_STEPS - 1) :], now - self.last_step_at]
            self.last_step_at = now
        else:
            self.last_step_at = None  # the next step's time would include the validation
        if now - self.written_at < self.every_s:
            return
        self.written_at = now
        self.beats += 1
        beat = TrainingBeat(
            attempt=self.attempt,
            beats=self.beats,
            epoch=epoch,
            step=step,
            phase="train" if phase == "train" else "validate",
            step_s=round(float(np.median(self.step_times)), 4) if self.step_times else None,
            written_at=lineage.utc_now_iso(),
        )
        try:
            write_artifact(self.uri, beat)
        except Exception as exc:  # a beat is advisory: training goes on
            log.warning("could not write the progress beat %s: %s", self.uri, exc)


@dataclass
class RunState:
    """Hold what the loop changes as it goes; the steps that change it are passed it."""

    epoch: int = 0  # where training is: the epoch, and the last step done in it
    step: int = 0
    epochs: list[EpochRecord] = field(default_factory=list)
    # The best validation epoch so far (ties: the later) and its weights: what is exported.
    # "improved_at": the last epoch that beat every earlier one: early stopping counts from it.
    best: dict[str, Any] = field(
        default_factory=lambda: {"epoch": 0, "val_accuracy": -1.0, "improved_at": 0}
    )
    best_state: dict[str, torch.Tensor] | None = None
    recoveries: list[Recovery] = field(default_factory=list)
    good: dict[str, Any] = field(default_factory=dict)  # what a recovery goes back to
    epoch_seconds: list[float] = field(default_factory=list)
    meters: MetricLogger = field(default_factory=MetricLogger)
    started: float = 0.0  # time.monotonic() when the loop started
    last_ckpt: float = 0.0  # time.monotonic() of the last periodic or end-of-epoch checkpoint
    # last.pt loads (this attempt wrote it or resumed from it): only then is it kept as prev.pt.
    keep_last: bool = False
    first_step_logged: bool = False
    sigterm: bool = False
    beat: Beat | None = None  # the first rank's progress heartbeat (main sets it)

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """Note a SIGTERM: the loop checkpoints and exits where the ranks next agree."""
        self.sigterm = True


def train_one_epoch(ctx: Run, state: RunState, train: Split | ShardStream) -> dict[str, float]:
    """Train for the rest of epoch ``state.epoch`` from ``state.step``; return loss and images/s."""
    job, epoch, device, meters = ctx.job, state.epoch, train.device, state.meters
    frozen = backbone_frozen(job, epoch)
    if frozen:  # the backbone in eval mode: its BatchNorm statistics are kept too
        ctx.model.eval()
        ctx.model.get_submodule(architecture(job.arch).head).train()
    else:
        ctx.model.train()
    frozen_params = split_head(ctx.model, job.arch)[0] if frozen else []
    meters.start_epoch(device)
    # closing: stops the stream's loader thread
    with closing(_train_batches(train, job.seed, epoch, state.step, ctx.share)) as batches:
        for step in range(state.step, ctx.share.steps):
            t0 = time.perf_counter()
            gpu_wait = getattr(train, "gpu_wait_s", 0.0)
            gen = _step_generator(job.seed, epoch, step)
            x_u8, y = next(batches)
            t0 += getattr(train, "gpu_wait_s", 0.0) - gpu_wait  # GPU time, not data time
            x = _channels_last(normalize(augment(x_u8, job, gen), ctx.mean, ctx.std, ctx.scale))
            t1 = time.perf_counter()
            with _autocast(device, ctx.amp_dtype):
                loss = F.cross_entropy(ctx.net(x), y, label_smoothing=job.label_smoothing)
            ctx.opt.zero_grad(set_to_none=True)
            ctx.scaler.scale(loss).backward()
            # A frozen backbone's gradients: computed (DDP expects them all), never applied.
            for param in frozen_params:
                param.grad = None
            ctx.scaler.step(ctx.opt)
            ctx.scaler.update()
            ctx.sched.step()
            meters.update(loss, len(y), t1 - t0, time.perf_counter() - t1)
            check = (step + 1) % DIVERGENCE_CHECK_STEPS == 0 or step + 1 == ctx.share.steps
            _after_step(ctx, state, step + 1, meters.window_loss() if check else None)
    return meters.end_epoch(ctx.d.world_size)


def _after_step(ctx: Run, state: RunState, step: int, window: torch.Tensor | None) -> None:
    """Note ``step`` done; stop on divergence, SIGTERM or the deadline; checkpoint when due."""
    d, job, epoch = ctx.d, ctx.job, state.epoch
    state.step = step
    if state.beat is not None:
        state.beat.tick(epoch, step)
    if not state.first_step_logged:
        state.first_step_logged = True
        log.info("first step done %.2f s after the job started", time.perf_counter() - ctx.t_setup)
    # Agreeing is an all-reduce the host waits on: only every DDP_STOP_CHECK_STEPS and at the end.
    if d.world_size == 1 or step % DDP_STOP_CHECK_STEPS == 0 or step == ctx.share.steps:
        why = divergence(float(window), len(job.classes)) if window is not None else None
        past = ctx.deadline is not None and time.time() >= ctx.deadline
        sigterm, past_deadline, diverged = _any_rank(ctx, state.sigterm, past, why is not None)
        if diverged:
            raise Diverged(f"{why or PEER_DIVERGED} at epoch {epoch + 1} step {step}")
        if sigterm:
            _save_last(ctx, state)
            raise Interrupted(f"SIGTERM: checkpoint saved {place(epoch, step)}")
        if past_deadline:
            _save_last(ctx, state)
            raise BudgetExhausted(
                f"the run's deadline {job.deadline_at} was reached at epoch {epoch + 1} step "
                f"{step}; checkpoint saved (raise max_cost_usd or time_budget_s to train longer)"
            )
    if time.monotonic() - state.last_ckpt >= job.checkpoint_every_s:
        _save_last(ctx, state)
        state.last_ckpt = time.monotonic()


PEER_DIVERGED = "another rank's training loss diverged"


def _any_rank(ctx: Run, *flags: bool) -> list[bool]:
    """Return each flag set where any rank set it: every rank must decide alike, or the others
    hang in the next collective."""
    if ctx.d.world_size == 1:
        return list(flags)
    t = torch.tensor([int(f) for f in flags], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


# The rate grows geometrically from RANGE_START to RANGE_END times the job's over two epochs'
# steps (within RANGE_MIN_STEPS..RANGE_TEST_STEPS), until the loss is RANGE_STOP_FACTOR its min.
RANGE_TEST_STEPS = 100
RANGE_MIN_STEPS = 30
RANGE_START, RANGE_END = 1e-3, 30.0
RANGE_STOP_FACTOR = 4.0
RANGE_SMOOTHING = 0.9  # exponential moving average of the step losses
RANGE_SKIP_START = 5  # the first smoothed losses are noise: no slope is read from them
RANGE_EPOCH = 1_000_000  # the sweep's batches are those of epochs no run reaches


def lr_range_test(
    model: nn.Module, train: Split | ShardStream, job: JobSpec, amp_dtype: torch.dtype | None
) -> RangeTest:
    """Sweep the rate over a few steps (weights restored after); return the rate to train at."""
    t0 = time.perf_counter()
    saved = copy.deepcopy(model.state_dict())
    lrs, losses = _sweep(model, train, job, amp_dtype)
    model.load_state_dict(saved)
    result = _pick_rate(lrs, losses, job.learning_rate, t0)
    log.info(
        "learning-rate range test: %d steps in %.1f s, lowest loss at %.3g: training at %.3g "
        "(instead of %.3g)",
        result.steps,
        result.seconds,
        result.min_loss_lr,
        result.chosen_lr,
        job.learning_rate,
    )
    return result


def _sweep(
    model: nn.Module, train: Split | ShardStream, job: JobSpec, amp_dtype: torch.dtype | None
) -> tuple[list[float], list[float]]:
    """Train at a geometrically growing rate; return the rates and the smoothed losses."""
    mean, std, scale = _norm(job, train.device)
    opt = make_optimizer(param_groups(model, job), job)
    shares = [group["lr"] / job.learning_rate for group in opt.param_groups]
    whole = Share.whole(len(train), job.batch_size)  # one rank's sweep over its box's shards
    steps = max(RANGE_MIN_STEPS, min(RANGE_TEST_STEPS, 2 * whole.steps))
    ratio = (RANGE_END / RANGE_START) ** (1 / max(1, steps - 1))
    lrs: list[float] = []
    losses: list[float] = []
    smooth, best_loss, step = 0.0, math.inf, 0
    model.train()
    for epoch in range(RANGE_EPOCH, RANGE_EPOCH + RANGE_TEST_STEPS):  # until enough steps
        with closing(_train_batches(train, job.seed, epoch, 0, whole)) as batches:
            for x_u8, y in batches:
                lr = job.learning_rate * RANGE_START * ratio**step
                for group, share in zip(opt.param_groups, shares, strict=True):
                    group["lr"] = lr * share
                gen = _step_generator(job.seed, epoch, step)
                x = _channels_last(normalize(augment(x_u8, job, gen), mean, std, scale))
                with _autocast(train.device, amp_dtype):
                    loss = F.cross_entropy(model(x), y, label_smoothing=job.label_smoothing)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                # The sweep reads every step's loss: it is short.
                smooth = RANGE_SMOOTHING * smooth + (1 - RANGE_SMOOTHING) * float(loss.detach())
                debiased = smooth / (1 - RANGE_SMOOTHING**step)
                lrs.append(lr)
                losses.append(debiased)
                best_loss = min(best_loss, debiased)
                diverged = debiased > RANGE_STOP_FACTOR * best_loss
                if step >= steps or not math.isfinite(debiased) or diverged:
                    return lrs, losses
    return lrs, losses


def _pick_rate(lrs: list[float], losses: list[float], fallback: float, t0: float) -> RangeTest:
    """Return the sweep's verdict: the lower of a tenth of the rate at the lowest loss (past it
    the loss is about to climb; fastai's ``lr_min``) and the steepest descent's, in range."""
    finite = [(loss, lr) for loss, lr in zip(losses, lrs, strict=True) if math.isfinite(loss)]
    at_min = min(finite)[1] if finite else fallback
    # Steepest descent before the minimum: on a short sweep from scratch the model is still
    # learning, so the minimum sits late and the lower of the two is the safer rate.
    before = [(loss, lr) for loss, lr in finite[RANGE_SKIP_START:] if lr <= at_min]
    slopes = [(b[0] - a[0], a[1]) for a, b in itertools.pairwise(before)]
    steepest = min(slopes)[1] if slopes else at_min
    chosen = min(steepest, at_min / 10)
    return RangeTest(
        chosen_lr=min(max(chosen, fallback * RANGE_START), fallback * RANGE_END),
        min_loss_lr=at_min,
        steepest_lr=steepest,
        fallback_lr=fallback,
        steps=len(lrs),
        seconds=time.perf_counter() - t0,
        lrs=lrs,
        losses=losses,
    )


# The mean loss is read at the cadence DDP ranks agree on stopping, so they decide together.
DIVERGENCE_CHECK_STEPS = DDP_STOP_CHECK_STEPS
# Times the loss of a model that knows nothing (ln of the class count). Validation counts only
# near chance: early at the peak rate BatchNorm lags the weights and its loss spikes harmlessly.
DIVERGENCE_FACTOR = 3.0
VAL_DIVERGENCE_FACTOR = 10.0
RECOVERY_LR_FACTOR = 0.3  # the rate (the whole schedule) is multiplied by this per recovery


def divergence(
    loss: float, num_classes: int, *, validation: bool = False, guessing: bool = False
) -> str | None:
    """Return why a loss counts as diverged (non-finite, or far above chance), or None."""
    what = "validation loss" if validation else "training loss"
    if not math.isfinite(loss):
        return f"{what} is {loss}"
    factor = VAL_DIVERGENCE_FACTOR if validation else DIVERGENCE_FACTOR
    limit = factor * max(1.0, math.log(num_classes))
    if loss > limit and (guessing or not validation):
        return (
            f"{what} {loss:.4g} is over {limit:.3g} (a model that knows nothing scores "
            f"{math.log(num_classes):.3g})"
            + (" and the accuracy is near chance" if validation else "")
        )
    return None


# Within this much of the better of chance and the majority-class rate, the model guesses.
NEAR_CHANCE_MARGIN = 0.1


def near_chance(accuracy: float, confusion: list[list[int]]) -> bool:
    """Return True when ``accuracy`` is within NEAR_CHANCE_MARGIN of guessing (per the matrix)."""
    totals = [sum(row) for row in confusion]
    floor = max(1 / len(confusion), max(totals) / max(1, sum(totals)))
    return accuracy < floor + NEAR_CHANCE_MARGIN


def _amp_dtype(device: torch.device) -> torch.dtype | None:
    if device.type != "cuda":
        return None  # fp32 on CPU: bf16 autocast is slower than fp32 on most CPUs
    # Not is_bf16_supported(): it is also true where bf16 is emulated (a T4), which is slow.
    major, minor = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if native_bf16((int(major), int(minor))) else torch.float16


def _should_compile(job: JobSpec, device: torch.device, total_steps: int) -> bool:
    if job.compile == "off" or device.type != "cuda":
        return False
    # Compilation costs ~30-60 s; it pays back only over a few thousand steps.
    return job.compile == "on" or total_steps >= 2000


def param_groups(model: nn.Module, job: JobSpec) -> list[dict[str, Any]]:
    """Return parameter groups: head then backbone, each with and without weight decay (none
    for 1-D biases and norms); a pretrained backbone learns at ``backbone_lr_scale`` x."""
    backbone, head = split_head(model, job.arch)
    scale = job.backbone_lr_scale if is_pretrained(job.pretrained) else 1.0
    groups: list[dict[str, Any]] = []
    for params, lr in ((head, job.learning_rate), (backbone, job.learning_rate * scale)):
        decay = [p for p in params if p.ndim > 1]
        no_decay = [p for p in params if p.ndim <= 1]
        groups += [
            {"params": decay, "weight_decay": weight_decay(job), "lr": lr},
            {"params": no_decay, "weight_decay": 0.0, "lr": lr},
        ]
    return [g for g in groups if g["params"]]


# The optimiser's usual weight decay: SGD's L2 (torchvision's recipes), AdamW's decoupled one.
WEIGHT_DECAY = {"sgd": 5e-4, "adamw": 0.05}
WARMUP_START = 0.04  # the warm-up starts at this share of the peak rate (one-cycle's 1/25)
FINAL_LR_SHARE = 1e-3  # the cosine decay ends here, a share of the peak


def weight_decay(job: JobSpec) -> float:
    """Return the job's weight decay, or its optimiser's usual one."""
    return WEIGHT_DECAY[job.optimizer] if job.weight_decay is None else job.weight_decay


def make_optimizer(groups: list[dict[str, Any]], job: JobSpec) -> torch.optim.Optimizer:
    """Return the job's optimiser over the parameter groups (each with its own rate)."""
    if job.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=job.learning_rate)
    return torch.optim.SGD(groups, lr=job.learning_rate, momentum=0.9, nesterov=True)


def warmup_steps(job: JobSpec, total_steps: int) -> int:
    """Return the steps of linear warm-up: the job's, else a quarter of the run (one-cycle)."""
    steps = round(total_steps / 4) if job.warmup_steps is None else job.warmup_steps
    return min(steps, max(0, total_steps - 1))


class LrScale:
    """Hold the factor every rate of the schedule is multiplied by (lowered on divergence)."""

    def __init__(self, value: float = 1.0) -> None:
        self.value = value


def warmup_cosine(
    opt: torch.optim.Optimizer, total_steps: int, warmup: int, scale: LrScale
) -> torch.optim.lr_scheduler.LambdaLR:
    """Return linear warm-up to each group's rate, then cosine decay; all times ``scale.value``."""

    def factor(step: int) -> float:
        if step < warmup:
            share = WARMUP_START + (1 - WARMUP_START) * step / warmup
        else:
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            share = FINAL_LR_SHARE + (1 - FINAL_LR_SHARE) * 0.5 * (1 + math.cos(math.pi * progress))
        return share * scale.value

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def backbone_frozen(job: JobSpec, epoch: int) -> bool:
    """Return True during the first ``freeze_backbone_epochs`` epochs (0-based ``epoch``)."""
    return epoch < job.freeze_backbone_epochs


def _warn_on_normalisation(job: JobSpec) -> None:
    if pretrained_kind(job.pretrained) != "torchvision":
        return
    expected = resolve_weights(job.arch, job.pretrained).transforms()
    spec = job.preprocess
    if not np.allclose([spec["mean"], spec["std"]], [expected.mean, expected.std], atol=1e-4):
        log.warning(
            "preprocess mean/std %s/%s are not those of %s (%s/%s): the pretrained features "
            "see shifted inputs",
            spec["mean"],
            spec["std"],
            job.pretrained,
            expected.mean,
            expected.std,
        )


def _deadline_ts(job: JobSpec) -> float | None:
    return job.deadline_at.timestamp() if job.deadline_at is not None else None


def _from_checkpoint(ckpt: dict[str, Any] | None, key: str, model: type[C]) -> C | None:
    """Return a contract a checkpoint keeps as JSON under ``key`` (None when it has none)."""
    raw = (ckpt or {}).get(key, "null")
    return None if raw == "null" else model.model_validate_json(raw)


def main(job: JobSpec, attempt: int = 1) -> TrainingMetrics:
    """Train as the job says; write checkpoints, metrics, weights and DONE; return the metrics."""
    t_setup = time.perf_counter()
    deadline = _deadline_ts(job)
    if deadline is not None and time.time() >= deadline:
        raise BudgetExhausted(f"the run's deadline {job.deadline_at} passed before training")
    d = dist_from_env()
    if d.world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", d.local_rank)
        torch.cuda.set_device(d.local_rank)
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(job.seed)
    cache = ShardCache.from_env(job.run_id)  # set on the training box: a folder on its disk
    if d.is_main:  # the attempt before this one has ended: nothing else writes there
        remove_leftovers(job.output_uri)
    resume = resume_checkpoint(job.output_uri)
    ckpt = resume[1] if resume is not None else None
    job, world = scale_to_world(job, d, ckpt)
    train, val, share = open_splits(job, device, cache, d)
    ctx = _build_run(job, attempt, d, device, t_setup, train, share, ckpt, world)
    state = _resume(ctx, resume)
    if d.is_main:  # one beat per attempt: a stalled peer stops the first rank's steps too
        state.beat = Beat(attempt_dir(job.output_uri, attempt, TRAINING_BEAT), attempt)
    signal.signal(signal.SIGTERM, state.on_sigterm)  # checkpoint-and-exit at the next agreement
    state.started = state.last_ckpt = time.monotonic()
    state.good = _snapshot(ctx, state)
    state.meters.setup_s = time.perf_counter() - t_setup
    stop_reason: str | None = None
    while stop_reason is None and state.epoch < job.epochs:
        t_epoch = time.perf_counter()
        try:
            stats = train_one_epoch(ctx, state, train)
            ev = _validate(ctx, state, val, stats["train_loss"])
        except Diverged as exc:
            _recover(ctx, state, str(exc))
            continue
        _end_epoch(ctx, state, stats, ev)
        state.epoch_seconds.append(time.perf_counter() - t_epoch)
        stop_reason = _stop_reason(ctx, state, ev["accuracy"])
    metrics = _final_metrics(ctx, state, train, val, stop_reason or "epochs")
    if d.is_main:
        _write_results(ctx, metrics)
    if d.world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    if cache is not None and d.is_main:  # every rank is done with the shards
        if cache.hits or cache.downloads:
            log.info("shard cache: %d downloads, %d local reads", cache.downloads, cache.hits)
        cache.clear()
    return metrics


def _build_run(
    job: JobSpec,
    attempt: int,
    d: Dist,
    device: torch.device,
    t_setup: float,
    train: Split | ShardStream,
    share: Share,
    ckpt: dict[str, Any] | None,
    world: WorldScale,
) -> Run:
    """Build the model, its optimiser and schedule: a new run's, or restored from ``ckpt``."""
    mean, std, scale = _norm(job, device)
    model, loaded = _build_model(job, device, ckpt)
    amp_dtype = _amp_dtype(device)
    range_test = _from_checkpoint(ckpt, "lr_range_test", RangeTest)
    if ckpt is None and job.lr_range_test:
        swept = lr_range_test(model, train, world.sweep_job(job), amp_dtype)
        if job.batch_scaling == "per_gpu":  # found at one rank's batch: scaled by the rule
            swept = swept.model_copy(update={"chosen_lr": swept.chosen_lr * world.lr_factor})
        if d.world_size > 1:  # rank 0's for all: boxes that read other shards may choose apart
            box = [swept]
            dist.broadcast_object_list(box, src=0)
            swept = box[0]
        range_test = swept
    if range_test is not None:  # the rate the sweep found is the run's peak rate
        job = job.model_copy(update={"learning_rate": range_test.chosen_lr})
    total_steps = share.steps * job.epochs
    opt = make_optimizer(param_groups(model, job), job)
    lr_scale = LrScale()
    sched = warmup_cosine(opt, total_steps, warmup_steps(job, total_steps), lr_scale)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        torch.set_rng_state(ckpt["rng_cpu"])
        lr_scale.value = float(ckpt.get("lr_scale", 1.0))
    net: nn.Module = model
    if d.world_size > 1:
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[d.local_rank] if device.type == "cuda" else None
        )
    if _should_compile(job, device, total_steps):
        net = torch.compile(net)  # type: ignore[assignment]
    return Run(
        job=job,
        attempt=attempt,
        d=d,
        device=device,
        t_setup=t_setup,
        deadline=_deadline_ts(job),
        mean=mean,
        std=std,
        scale=scale,
        amp_dtype=amp_dtype,
        scaler=torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16),
        model=model,
        net=net,
        opt=opt,
        sched=sched,
        lr_scale=lr_scale,
        share=share,
        loaded=loaded,
        range_test=range_test,
        world=world,
    )


def _build_model(
    job: JobSpec, device: torch.device, ckpt: dict[str, Any] | None
) -> tuple[nn.Module, PretrainedLoad | None]:
    """Return the job's model on the device, with what load_pretrained reported (or ``ckpt``)."""
    pretrained = is_pretrained(job.pretrained)
    height = int(job.preprocess["height"])
    model = build_model(job.arch, len(job.classes), height, pretrained=pretrained)
    loaded = _from_checkpoint(ckpt, "pretrained_loaded", PretrainedLoad)
    if ckpt is None and pretrained:  # a resumed run has its weights in the checkpoint already
        _warn_on_normalisation(job)
        loaded = load_pretrained(
            model, job.arch, job.pretrained, weights_store=job.weights_store_uri
        )
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return model, loaded


def _resume(ctx: Run, resume: tuple[str, dict[str, Any]] | None) -> RunState:
    """Return the loop's state: a new run's, or where the checkpoint (URI, contents) left it."""
    state = RunState()
    if resume is None:
        return state
    uri, ckpt = resume
    job = ctx.job
    state.keep_last = uri == job.uri(CHECKPOINT)
    state.epoch, state.step = int(ckpt["epoch"]), int(ckpt["step"])
    state.epochs = [EpochRecord.model_validate(e) for e in json.loads(ckpt["history"])]
    state.recoveries = [
        Recovery.model_validate(r) for r in json.loads(ckpt.get("recoveries", "[]"))
    ]
    best_uri = job.uri(BEST_CHECKPOINT)
    try:
        saved_best = ckpt if uri == best_uri else load_checkpoint(best_uri, ("model", "best"))
    except CheckpointError as exc:
        log.warning("%s: the exported model is the best of the epochs from here on", exc)
        saved_best = None
    if saved_best is not None:
        state.best_state = saved_best["model"]
        state.best = json.loads(saved_best["best"])
    log.log(
        logging.INFO if state.keep_last else logging.WARNING,  # a fallback: worth a look
        "attempt %d resumed from %s %s",
        ctx.attempt,
        uri,
        place(state.epoch, state.step),
    )
    return state


def _snapshot(ctx: Run, state: RunState) -> dict[str, Any]:
    # In memory: a periodic checkpoint may already hold diverged weights; a checked epoch not.
    return {
        "model": copy.deepcopy(ctx.model.state_dict()),
        "optimizer": copy.deepcopy(ctx.opt.state_dict()),
        "scheduler": ctx.sched.state_dict(),
        "epoch": state.epoch,
        "step": state.step,
    }


def _save_last(ctx: Run, state: RunState, best: dict[str, Any] | None = None) -> None:
    """Write last.pt (the one before kept as prev.pt), and best.pt for a ``best``; ranks wait."""
    job, range_test, loaded = ctx.job, ctx.range_test, ctx.loaded
    if ctx.d.is_main:
        ckpt = {
            "model": ctx.model.state_dict(),
            "optimizer": ctx.opt.state_dict(),
            "scheduler": ctx.sched.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "epoch": state.epoch,
            "step": state.step,
            "history": json.dumps([e.model_dump(mode="json") for e in state.epochs]),
            "lr_scale": ctx.lr_scale.value,
            "batch_world": ctx.world.world,  # a resume keeps the global batch (per_gpu)
            "recoveries": json.dumps([r.model_dump(mode="json") for r in state.recoveries]),
            "lr_range_test": range_test.model_dump_json() if range_test else "null",
            "job": json.dumps(job.model_dump(mode="json")),
            "seed": job.seed,
            "source_commit": job.source_commit or lineage.source_commit(),
            "dataset_fingerprint": job.dataset_fingerprint,
            "attempt": ctx.attempt,
            "pretrained_loaded": loaded.model_dump_json() if loaded else "null",
        }
        if best is not None:
            save_checkpoint(job.uri(BEST_CHECKPOINT), {**ckpt, "best": json.dumps(best)})
        keep_as = job.uri(PREVIOUS_CHECKPOINT) if state.keep_last else None
        save_checkpoint(job.uri(CHECKPOINT), ckpt, keep_as=keep_as)
    state.keep_last = True
    if ctx.d.world_size > 1:
        dist.barrier()


def _validate(
    ctx: Run, state: RunState, val: Split | ShardStream, train_loss: float
) -> dict[str, Any]:
    """Evaluate the epoch's model; raise Diverged when a loss (any rank's) says it diverged."""
    n, t_eval = len(ctx.job.classes), time.perf_counter()
    beat = state.beat
    tick = None if beat is None else lambda: beat.tick(state.epoch, state.step, "validate")
    ev = evaluate(ctx.model, val, ctx.mean, ctx.std, ctx.scale, n, EVAL_BATCH, ctx.amp_dtype, tick)
    state.meters.eval_s += time.perf_counter() - t_eval
    why = divergence(train_loss, n) or divergence(
        ev["loss"], n, validation=True, guessing=near_chance(ev["accuracy"], ev["confusion"])
    )
    if _any_rank(ctx, why is not None)[0]:  # each rank's training loss is its own share's
        raise Diverged(f"{why or PEER_DIVERGED} after epoch {state.epoch + 1}")
    return ev


def _recover(ctx: Run, state: RunState, reason: str) -> None:
    """Go back to the last good state, the whole schedule lowered; bounded."""
    job, lr_scale, recoveries, good = ctx.job, ctx.lr_scale, state.recoveries, state.good
    lowered = lr_scale.value * RECOVERY_LR_FACTOR
    recoveries.append(
        Recovery(epoch=state.epoch + 1, step=state.step, reason=reason, lr_scale=lowered)
    )
    if len(recoveries) > job.max_recoveries:
        raise TrainingDiverged(
            f"training diverged {len(recoveries)} times and {job.max_recoveries} "
            f"recoveries are allowed; the last: {reason}, with the learning rate already "
            f"lowered to {lr_scale.value:.3g}x {job.learning_rate:g}; lower learning_rate "
            "(or leave it at auto)"
        )
    ctx.model.load_state_dict(good["model"])
    ctx.opt.load_state_dict(good["optimizer"])
    ctx.sched.load_state_dict(good["scheduler"])
    lr_scale.value = lowered
    opt, sched = ctx.opt, ctx.sched  # every rate as the lowered schedule says now
    for group, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
        group["lr"] = base * fn(sched.last_epoch)
    ctx.scaler.update(2.0**16)  # fp16: its scale may have collapsed on the non-finite steps
    state.epoch, state.step = int(good["epoch"]), int(good["step"])
    log.warning(
        "%s: restored the state %s and lowered the learning rate to %.3gx (recovery %d of %d)",
        reason,
        place(state.epoch, state.step),
        lr_scale.value,
        len(recoveries),
        job.max_recoveries,
    )


def _end_epoch(ctx: Run, state: RunState, stats: dict[str, float], ev: dict[str, Any]) -> None:
    """Record a finished epoch (best weights, log line), checkpoint it, then progress.json."""
    job, epoch, best, device = ctx.job, state.epoch, state.best, ctx.device
    improved = ev["accuracy"] >= best["val_accuracy"]  # ties: the later epoch
    record = EpochRecord(
        epoch=epoch + 1,
        train_loss=stats["train_loss"],
        images_per_s=stats["images_per_s"],
        val_loss=ev["loss"],
        val_accuracy=ev["accuracy"],
        lr=float(ctx.sched.get_last_lr()[0]),
        elapsed_s=time.monotonic() - state.started,
        attempt=ctx.attempt,
        backbone_frozen=backbone_frozen(job, epoch) if is_pretrained(job.pretrained) else None,
        gpu_max_memory_mb=torch.cuda.max_memory_allocated(device) / 2**20
        if device.type == "cuda"
        else None,
    )
    state.epochs.append(record)
    if improved:
        state.best = {
            "epoch": epoch + 1,
            "val_accuracy": ev["accuracy"],
            "val_loss": ev["loss"],
            "improved_at": (
                epoch + 1 if ev["accuracy"] > best["val_accuracy"] else best["improved_at"]
            ),
        }
        state.best_state = copy.deepcopy(ctx.model.state_dict())
    log.info(
        "epoch %d/%d %s%s",
        epoch + 1,
        job.epochs,
        " ".join(f"{k}={v:.4g}" for k, v in dict(record).items() if isinstance(v, float)),
        " (best so far)" if improved else "",
    )
    state.epoch, state.step = epoch + 1, 0
    _save_last(ctx, state, best=state.best if improved else None)
    if ctx.d.is_main:
        # Written after the checkpoint: it never shows an epoch the next attempt trains again.
        write_artifact(
            job.uri(PROGRESS),
            TrainingProgress(attempt=ctx.attempt, epochs_total=job.epochs, epochs=state.epochs),
        )
    state.good = _snapshot(ctx, state)
    state.last_ckpt = time.monotonic()


def _stop_reason(ctx: Run, state: RunState, accuracy: float) -> str | None:
    """Return why to stop after the epoch just recorded (even the last), or None to go on."""
    job, best, epoch, epoch_s = ctx.job, state.best, state.epoch, state.epoch_seconds[-1]
    if job.target_accuracy is not None and accuracy >= job.target_accuracy:
        return f"target accuracy {job.target_accuracy} reached"
    patience = job.early_stop_patience
    stale_from = int(best.get("improved_at", best["epoch"]))
    if patience is not None and epoch < job.epochs and epoch - stale_from >= patience:
        return (
            f"early stop: validation accuracy has not improved for {patience} epochs "
            f"(best {best['val_accuracy']:.4f}, reached at epoch {stale_from}, "
            f"last at epoch {best['epoch']})"
        )
    if ctx.deadline is not None and time.time() + epoch_s > ctx.deadline:
        return f"another epoch (~{epoch_s:.0f} s) would end past the run's deadline"
    if ctx.deadline is None and time.monotonic() - state.started > job.time_budget_s:
        return f"time budget {job.time_budget_s}s spent"
    return None


def _final_metrics(
    ctx: Run, state: RunState, train: Split | ShardStream, val: Split | ShardStream, stop: str
) -> TrainingMetrics:
    """Evaluate the best epoch's model (it is the model) and return the run's metrics."""
    job, model, device, amp_dtype = ctx.job, ctx.model, ctx.device, ctx.amp_dtype
    n, epoch_seconds = len(job.classes), state.epoch_seconds
    if state.best_state is not None:  # the best validation epoch is the model, not the last
        model.load_state_dict(state.best_state)
    final = evaluate(model, val, ctx.mean, ctx.std, ctx.scale, n, EVAL_BATCH, amp_dtype)
    if state.recoveries and near_chance(final["accuracy"], final["confusion"]):
        raise TrainingDiverged(
            f"training diverged {len(state.recoveries)} time(s) and recovered only to a "
            f"near-chance model (validation accuracy {final['accuracy']:.3f}, chance "
            f"{1 / n:.3f}); the first: {state.recoveries[0].reason}; lower "
            "learning_rate (or leave it at auto)"
        )
    epochs_run, meters = len(state.epochs), state.meters
    return TrainingMetrics(
        val_accuracy=final["accuracy"],
        val_loss=final["loss"],
        confusion=final["confusion"],
        classes=job.classes,
        arch=job.arch,
        epochs=state.epochs,
        best_epoch=state.best["epoch"],
        epochs_asked=job.epochs,
        epochs_run=epochs_run,
        seconds_saved=(
            (job.epochs - epochs_run) * sum(epoch_seconds) / len(epoch_seconds)
            if stop.startswith(("early stop", "target accuracy")) and epoch_seconds
            else 0.0
        ),
        stop_reason=stop,
        recoveries=state.recoveries,
        lr_range_test=ctx.range_test,
        optimizer=_optimizer_block(ctx),
        wall_s=WallSeconds(
            setup=meters.setup_s, data=meters.data_s, compute=meters.compute_s, eval=meters.eval_s
        ),
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        world_size=ctx.d.world_size,
        pretrained=job.pretrained,
        pretrained_loaded=ctx.loaded,
        amp_dtype=str(amp_dtype) if amp_dtype else "float32",
        # What ran: bf16 (native), fp16 with a gradient scaler (GPUs below 8.0), or fp32 (CPU).
        precision={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
            amp_dtype or torch.float32, "fp32"
        ),
        versions={"torch": torch.__version__},
        host=HostInfo.model_validate(lineage.host_description()),
        train_images=ctx.share.images,
        val_images=len(val),
        source_commit=job.source_commit or lineage.source_commit(),
        dataset_fingerprint=job.dataset_fingerprint,
        finished_at=lineage.utc_now_iso(),
        attempt=ctx.attempt,
    )


def _optimizer_block(ctx: Run) -> OptimizerBlock:
    """Return what the run's optimiser and schedule were, for metrics.json."""
    job, steps_per_epoch = ctx.job, ctx.share.steps
    return OptimizerBlock(
        name=job.optimizer,
        learning_rate=job.learning_rate,
        lr_scale=ctx.lr_scale.value,
        weight_decay=weight_decay(job),
        batch_size=job.batch_size,
        batch_scaling=job.batch_scaling,
        batch_per_rank=ctx.world.per_rank,
        lr_world_factor=ctx.world.lr_factor,
        warmup_steps=warmup_steps(job, steps_per_epoch * job.epochs),
        steps_per_epoch=steps_per_epoch,
        total_steps=steps_per_epoch * job.epochs,
        schedule="linear warm-up, cosine decay",
    )


def _write_results(ctx: Run, metrics: TrainingMetrics) -> None:
    """Write the exported weights (model.pt), metrics.json, then the attempt's DONE."""
    job, attempt = ctx.job, ctx.attempt
    save_checkpoint(job.uri("model.pt"), ctx.model.state_dict())
    write_artifact(job.uri(METRICS), metrics)
    write_artifact(
        job.attempt_uri(attempt, DONE_MARKER),
        DoneMarker(
            val_accuracy=metrics.val_accuracy, finished_at=metrics.finished_at, attempt=attempt
        ),
    )


def run_job(job_uri: str, attempt: int = 1) -> int:
    """Run the job at ``job_uri`` as ``attempt``; return the exit code; FAILED on any error."""
    output_uri: str | None = None
    try:
        raw = storage.read_json(job_uri)
        output_uri = raw.get("output_uri") if isinstance(raw, dict) else None
        job = load_job(job_uri)
        output_uri = job.output_uri
        main(job, attempt)
        return 0
    except (Interrupted, BudgetExhausted, TrainingDiverged) as exc:  # an ending the job foresaw
        _write_failed(output_uri, attempt, exc.stage, str(exc), resumable=exc.resumable, exc=exc)
        log.log(logging.WARNING if exc.resumable else logging.ERROR, "%s", exc)
        return exc.exit_code
    except BaseException as exc:
        if not peer_lost(exc):  # this rank's own error: final, its type and message the reason
            own = f"{type(exc).__name__}: {exc}"
            _write_failed(output_uri, attempt, STAGE_TRAIN, own, resumable=False, exc=exc)
            raise
        # A peer box went away mid-collective: the relaunch restarts every box from the checkpoint.
        reason = f"a peer box was lost: {str(exc).splitlines()[0][:300]}"
        _write_failed(output_uri, attempt, STAGE_INTERRUPTED, reason, resumable=True, exc=exc)
        log.warning("%s", reason)
        return EXIT_INTERRUPTED


TRACEBACK_LINES = 12  # of a rank's traceback, kept in its own FAILED marker


def _write_failed(
    output_uri: str | None,
    attempt: int,
    stage: str,
    reason: str,
    *,
    resumable: bool,
    exc: BaseException | None = None,
) -> None:
    """Write the attempt's FAILED (the first rank) and, with several ranks, this rank's own: a
    rank's error (its traceback's last lines) stays its own, never taken for a peer it stopped."""
    if not output_uri:
        return
    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        lines = "".join(traceback.format_exception(exc)).splitlines() if exc else []
        marker = FailedMarker(
            stage=stage,
            reason=reason,
            resumable=resumable,
            attempt=attempt,
            at=lineage.utc_now_iso(),
            rank=rank,
            node=int(os.environ.get("GROUP_RANK", "0")),
            traceback=lines[-TRACEBACK_LINES:] or None,
        )
        try:
            write_rank_failed(output_uri, marker)
        # Broad on purpose: the attempt's own marker below must still be written.
        except Exception as write_error:
            log.error("rank %d: could not write its FAILED marker: %s", rank, write_error)
    if rank == 0:
        write_failed(output_uri, attempt, stage, reason, resumable=resumable)
