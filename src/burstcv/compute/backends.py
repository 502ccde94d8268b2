"""Choose a compute backend by name: the one module that knows every backend (above ``base``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from burstcv.compute.base import ComputeBackend

if TYPE_CHECKING:
    from burstcv.settings import Settings


class UnknownBackendError(ValueError):
    """Raise for a backend name that does not exist."""


def get_backend(name: str, settings: Settings | None = None) -> ComputeBackend:
    """Return the backend called ``name`` (local or ec2), set up from ``settings``."""
    from burstcv.settings import get_settings

    s = settings or get_settings()
    # Each backend is imported only when chosen: the EC2 one pulls in botocore, which a
    # local run does not need.
    if name == "local":
        from burstcv.compute.local import LocalBackend

        return LocalBackend(s.compute_state_dir)
    if name == "ec2":
        from burstcv.compute.ec2 import Ec2Backend

        return Ec2Backend(s.ec2)
    raise UnknownBackendError(f"unknown compute backend {name!r}; choose local, ec2")
