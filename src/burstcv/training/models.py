"""Build torchvision classifiers by name: torchvision's layout for pretrained weights, a finer stem
for small inputs trained from scratch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from torch import nn
from torchvision import models as tvm
from torchvision.models.resnet import BasicBlock, ResNet

from burstcv.training.names import ARCHITECTURE_NAMES

# At or below this input size the ImageNet stem throws away most of the image: scratch models
# get one that keeps 2x more resolution (pretrained ones keep torchvision's, to fit the weights).
SMALL_INPUT_PX = 64


def _resnet_small_stem(model: nn.Module) -> None:
    assert isinstance(model, ResNet)
    # A 3x3/2 conv without the max-pool instead of 7x7/2 + 3x3/2.
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=2, padding=1, bias=False)
    model.maxpool = nn.Identity()


def _first_conv(model: nn.Module) -> nn.Conv2d:
    conv = model.get_submodule("features.0.0")
    assert isinstance(conv, nn.Conv2d), f"features.0.0 is a {type(conv).__name__}"
    return conv


def _first_conv_stride_1(model: nn.Module) -> None:
    # mobilenet_v3, efficientnet: keep 2x more resolution through the stride-2 stages.
    _first_conv(model).stride = (1, 1)


def _convnext_small_stem(model: nn.Module) -> None:
    # The 4x4/4 patchify conv becomes 4x4/2 (same weights shape): 16x downsampling in all.
    stem = _first_conv(model)
    stem.stride, stem.padding = (2, 2), (1, 1)


@dataclass(frozen=True)
class Architecture:
    """Describe one architecture: how to build it and which layer is the classifier head."""

    build: Callable[..., nn.Module]  # (num_classes=) -> torchvision's layout, random weights
    small_stem: Callable[[nn.Module], None]  # adapts the stem in place for small inputs
    head: str  # the final Linear, rebuilt for the dataset's class count (never pretrained)
    torchvision_name: str | None  # for torchvision.models.get_model_weights; None: no weights


def _torchvision(name: str, small_stem: Callable[[nn.Module], None], head: str) -> Architecture:
    return Architecture(partial(tvm.get_model, name, weights=None), small_stem, head, name)


# resnet10 (resnet18 with one block a stage, no weights) reaches >95% on the demo digits in
# seconds on a laptop CPU; the others are for photos, with torchvision's ImageNet weights.
ARCHITECTURES: dict[str, Architecture] = {
    "resnet10": Architecture(
        partial(ResNet, BasicBlock, [1, 1, 1, 1]), _resnet_small_stem, "fc", None
    ),
    "resnet18": _torchvision("resnet18", _resnet_small_stem, "fc"),
    "resnet34": _torchvision("resnet34", _resnet_small_stem, "fc"),
    "resnet50": _torchvision("resnet50", _resnet_small_stem, "fc"),
    "mobilenet_v3_small": _torchvision("mobilenet_v3_small", _first_conv_stride_1, "classifier.3"),
    "mobilenet_v3_large": _torchvision("mobilenet_v3_large", _first_conv_stride_1, "classifier.3"),
    "efficientnet_b0": _torchvision("efficientnet_b0", _first_conv_stride_1, "classifier.1"),
    "convnext_tiny": _torchvision("convnext_tiny", _convnext_small_stem, "classifier.2"),
}


assert tuple(ARCHITECTURES) == ARCHITECTURE_NAMES, "keep names.py in step with ARCHITECTURES"


class UnknownArchitectureError(ValueError):
    """Raise for an architecture name that is not in ARCHITECTURES."""


def architecture(arch: str) -> Architecture:
    """Return the description of ``arch``, or raise naming the choices."""
    if arch not in ARCHITECTURES:
        raise UnknownArchitectureError(
            f"unknown model {arch!r}; choose {', '.join(ARCHITECTURE_NAMES)}"
        )
    return ARCHITECTURES[arch]


def build_model(
    arch: str, num_classes: int, input_px: int, *, pretrained: bool = False
) -> nn.Module:
    """Return a classifier with random weights; never downloads or loads anything. ``pretrained``
    builds the layout pretrained weights fit (training and export must agree)."""
    spec = architecture(arch)
    if num_classes < 2:
        raise ValueError(f"a classifier needs at least 2 classes, got {num_classes}")
    model = spec.build(num_classes=num_classes)
    if not pretrained and input_px <= SMALL_INPUT_PX:
        spec.small_stem(model)
    return model


def head_prefix(arch: str) -> str:
    """Return the state_dict prefix of ``arch``'s classifier head (``"fc."``, ...)."""
    return architecture(arch).head + "."


def split_head(model: nn.Module, arch: str) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Return (backbone, head) parameters: the head is the final Linear, the rest the backbone."""
    prefix = head_prefix(arch)
    backbone: list[nn.Parameter] = []
    head: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        (head if name.startswith(prefix) else backbone).append(param)
    if not head:
        raise ValueError(f"{arch} has no parameters under {prefix!r}: the head table is wrong")
    return backbone, head
