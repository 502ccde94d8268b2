"""List the model architectures by name, without importing torch (DAG files and forms use it)."""

from __future__ import annotations

ARCHITECTURE_NAMES: tuple[str, ...] = (
    "resnet10",
    "resnet18",
    "resnet34",
    "mobilenet_v3_small",
    "efficientnet_b0",
)


def check_architecture(name: str) -> str:
    """Return ``name`` if it is a known architecture, else raise naming the choices."""
    if name not in ARCHITECTURE_NAMES:
        raise ValueError(f"unknown model {name!r}; choose {', '.join(ARCHITECTURE_NAMES)}")
    return name
