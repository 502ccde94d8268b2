"""List the model architectures and read a ``pretrained`` choice, without importing torch."""

from __future__ import annotations

import re
from typing import Literal

ARCHITECTURE_NAMES: tuple[str, ...] = (
    "resnet10",
    "resnet18",
    "resnet34",
    "resnet50",
    "mobilenet_v3_small",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "convnext_tiny",
)

# "none": from scratch; a torchvision weights name ("DEFAULT", "ResNet50_Weights.IMAGENET1K_V2");
# anything like a path or URI (a '/', a scheme, a .pt file name): a state_dict to load.
PRETRAINED_NONE = "none"
# "auto": a run parameter only, resolved at validate; never in job.json.
PRETRAINED_AUTO = "auto"
MODEL_AUTO = "auto"  # a run parameter only: the model validate chooses for the data
PretrainedKind = Literal["none", "auto", "torchvision", "uri"]
_WEIGHTS_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z][A-Za-z0-9_]*)?$")
_WEIGHTS_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def check_architecture(name: str) -> str:
    """Return ``name`` if it is a known architecture, else raise naming the choices."""
    if name not in ARCHITECTURE_NAMES:
        raise ValueError(f"unknown model {name!r}; choose {', '.join(ARCHITECTURE_NAMES)}")
    return name


def pretrained_kind(pretrained: str) -> PretrainedKind:
    """Say what a ``pretrained`` value names: nothing, torchvision weights, or a weights file."""
    value = pretrained.strip()
    if value.lower() == PRETRAINED_NONE:
        return "none"
    if value.lower() == PRETRAINED_AUTO:
        return "auto"
    if "://" in value or "/" in value or "\\" in value or value.endswith(_WEIGHTS_FILE_SUFFIXES):
        return "uri"
    if _WEIGHTS_NAME.match(value):
        return "torchvision"
    raise ValueError(
        f"pretrained {pretrained!r} is neither 'none', a torchvision weights name "
        "(DEFAULT, IMAGENET1K_V1, ...) nor a state_dict URI (a path, file://, s3://)"
    )


def pretrained_value(pretrained: str, *, auto_allowed: bool) -> str:
    """Return a ``pretrained`` value, stripped; raise ValueError for one of no known form."""
    if pretrained_kind(pretrained) == "auto" and not auto_allowed:
        raise ValueError("pretrained 'auto' is resolved at validate; name the weights")
    return pretrained.strip()


FREEZE_NEEDS_WEIGHTS = (
    "freeze_backbone_epochs needs pretrained weights: a backbone trained from scratch has "
    "nothing worth freezing"
)


def is_pretrained(pretrained: str) -> bool:
    """Return True unless ``pretrained`` is "none"; raise for "auto" (resolved at validate)."""
    kind = pretrained_kind(pretrained)
    if kind == "auto":
        raise ValueError("pretrained 'auto' is resolved at validate; a job names its weights")
    return kind != "none"
