"""Build torchvision classifiers by name, adapted to the small inputs vision datasets often have."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torchvision import models as tvm
from torchvision.models.resnet import BasicBlock, ResNet

from burstcv.training.names import ARCHITECTURE_NAMES

log = logging.getLogger(__name__)

# Below this input size the ImageNet stem (7x7/2 conv + 3x3/2 max-pool, 4x downsampling) throws
# away most of the image; a 3x3/2 conv without the pool keeps 2x more resolution.
SMALL_INPUT_PX = 64


def _resnet(layers: list[int]) -> Callable[[int, int], nn.Module]:
    def build(num_classes: int, input_px: int) -> nn.Module:
        model = ResNet(BasicBlock, layers, num_classes=num_classes)
        if input_px <= SMALL_INPUT_PX:
            model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=2, padding=1, bias=False)
            model.maxpool = nn.Identity()  # type: ignore[assignment]
        return model

    return build


def _mobilenet_v3_small(num_classes: int, input_px: int) -> nn.Module:
    model = tvm.mobilenet_v3_small(num_classes=num_classes)
    if input_px <= SMALL_INPUT_PX:
        first = model.features[0][0]
        first.stride = (1, 1)  # keep 2x more resolution through the 5 stride-2 stages
    return model


def _efficientnet_b0(num_classes: int, input_px: int) -> nn.Module:
    model = tvm.efficientnet_b0(num_classes=num_classes)
    if input_px <= SMALL_INPUT_PX:
        model.features[0][0].stride = (1, 1)
    return model


# name -> builder(num_classes, input_px). resnet10 is resnet18 with one block per stage:
# the default, because it reaches >95% on the demo digits in seconds on a laptop CPU.
ARCHITECTURES: dict[str, Callable[[int, int], nn.Module]] = {
    "resnet10": _resnet([1, 1, 1, 1]),
    "resnet18": _resnet([2, 2, 2, 2]),
    "resnet34": _resnet([3, 4, 6, 3]),
    "mobilenet_v3_small": _mobilenet_v3_small,
    "efficientnet_b0": _efficientnet_b0,
}


assert tuple(ARCHITECTURES) == ARCHITECTURE_NAMES, "keep names.py in step with ARCHITECTURES"


class UnknownArchitectureError(ValueError):
    """Raise for an architecture name that is not in ARCHITECTURES."""


def build_model(
    arch: str, num_classes: int, input_px: int, pretrained_path: str | None = None
) -> nn.Module:
    """Return an untrained (or locally pretrained) classifier; never downloads weights."""
    if arch not in ARCHITECTURES:
        raise UnknownArchitectureError(
            f"unknown model {arch!r}; choose {', '.join(sorted(ARCHITECTURES))}"
        )
    if num_classes < 2:
        raise ValueError(f"a classifier needs at least 2 classes, got {num_classes}")
    model = ARCHITECTURES[arch](num_classes, input_px)
    if pretrained_path:
        state = torch.load(Path(pretrained_path), map_location="cpu", weights_only=True)
        # The classifier head has this dataset's class count: keep only matching tensors.
        own = model.state_dict()
        usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
        skipped = sorted(set(own) - set(usable))
        model.load_state_dict(usable, strict=False)
        log.info(
            "loaded %d tensors from %s; left %d untouched (%s)",
            len(usable),
            pretrained_path,
            len(skipped),
            ", ".join(skipped[:4]),
        )
    return model
