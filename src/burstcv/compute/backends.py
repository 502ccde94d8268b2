"""Choose a compute backend by name: the one module that knows every backend.

``base`` defines what a backend offers and each backend imports it; choosing one by name
needs every backend, so it lives here, above them, and ``base`` imports none of them.
"""

from __future__ import annotations

from burstcv.compute.base import ComputeBackend


class UnknownBackendError(ValueError):
    """Raise for a backend name that does not exist."""


def get_backend(name: str) -> ComputeBackend:
    """Return the backend called ``name``: local or ec2."""
    # Each backend is imported only when chosen: the EC2 one pulls in botocore, which a
    # local run does not need.
    if name == "local":
        from burstcv.compute.local import LocalBackend

        return LocalBackend()
    if name == "ec2":
        from burstcv.compute.ec2 import Ec2Backend

        return Ec2Backend()
    raise UnknownBackendError(f"unknown compute backend {name!r}; choose local, ec2")
