"""List the model architectures by name, without importing torch (DAG files and forms use it)."""

from __future__ import annotations

ARCHITECTURE_NAMES: tuple[str, ...] = (
    "resnet10",
    "resnet18",
    "resnet34",
    "mobilenet_v3_small",
    "efficientnet_b0",
)
