"""Where a rank stands in a run and how the job follows the ranks it trains on: the
distributed place read from torchrun's environment, the batch and rate scaled to the world, and
whether a failed collective means another box went away.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from burstcv.training.job import JobSpec
from burstcv.training.recipe import world_lr_factor

log = logging.getLogger(__name__)


@dataclass
class Dist:
    """Describe this process's place in a (possibly single-process) distributed run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node: int = 0  # this box's place among the run's boxes (torchrun's GROUP_RANK)
    nodes: int = 1  # the run's boxes (GROUP_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        """Return True on the process that writes artifacts."""
        return self.rank == 0


def dist_from_env() -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    return Dist(
        int(os.environ["RANK"]),
        world,
        int(os.environ.get("LOCAL_RANK", "0")),
        node=int(os.environ.get("GROUP_RANK", "0")),
        nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
    )


@dataclass(frozen=True)
class WorldScale:
    """How the job's batch and rate follow the ranks it trains on (``batch_scaling``)."""

    per_rank: int  # one rank's batch
    world: int  # the ranks the global batch was sized for (the run's first attempt's)
    lr_factor: float  # the rate over the job's (per_gpu: the rule's; global: 1)

    def sweep_job(self, job: JobSpec) -> JobSpec:
        """Return the job the range test sweeps: one rank's batch at one rank's rate (per_gpu)."""
        if job.batch_scaling == "global":
            return job
        rate = job.learning_rate / self.lr_factor
        return job.model_copy(update={"batch_size": self.per_rank, "learning_rate": rate})


def scale_to_world(
    job: JobSpec, d: Dist, ckpt: dict[str, Any] | None = None
) -> tuple[JobSpec, WorldScale]:
    """Return the job as its ranks train it: the global batch, the peak rate, the warm-up. With
    per_gpu the warm-up (counted one rank a box) shrinks by the GPUs a box has, to cover the same
    images; a resume keeps its first attempt's world, so its schedule holds on other boxes."""
    if job.batch_scaling == "global":
        return job, WorldScale(max(1, job.batch_size // d.world_size), d.world_size, 1.0)
    world = int(ckpt.get("batch_world", d.world_size)) if ckpt is not None else d.world_size
    factor = world_lr_factor(job.optimizer, world)
    gpus_a_box = max(1, world // max(1, d.nodes))
    warmup = job.warmup_steps
    if warmup is not None and gpus_a_box > 1:
        warmup = round(warmup / gpus_a_box)
    if world != d.world_size:
        log.warning(
            "resuming a run sized for %d ranks on %d: its global batch of %d images holds "
            "(%d a rank)",
            world,
            d.world_size,
            job.batch_size * world,
            max(1, job.batch_size * world // d.world_size),
        )
    scaled = job.model_copy(
        update={
            "batch_size": job.batch_size * world,
            "learning_rate": job.learning_rate * factor,
            "warmup_steps": warmup,
        }
    )
    if world > 1:
        log.info(
            "batch %d a rank x %d ranks = %d a step; rate %.3g x %.3g (%s rule) = %.3g",
            job.batch_size,
            world,
            scaled.batch_size,
            job.learning_rate,
            factor,
            "linear" if job.optimizer == "sgd" else "square-root",
            scaled.learning_rate,
        )
    return scaled, WorldScale(job.batch_size, world, factor)


# What gloo's transport says (a plain RuntimeError) when a peer vanished; NCCL and the store
# raise DistError. A box that lost power sends nothing: the collective times out.
_PEER_GONE = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Connection refused",
    "Timed out waiting",
)


def peer_lost(exc: BaseException) -> bool:
    """Return True when a multi-box run's collective failed because another box went away (on
    one box a rank that dies takes the job with it: its own error is the reason)."""
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) <= 1:
        return False
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _PEER_GONE)
