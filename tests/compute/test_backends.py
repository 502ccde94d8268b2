"""Choosing a compute backend by name."""

from __future__ import annotations

import pytest

from burstcv.compute.backends import UnknownBackendError, get_backend
from burstcv.compute.ec2 import Ec2Backend
from burstcv.compute.local import LocalBackend


def test_each_name_gives_its_backend() -> None:
    """Constructing either backend touches nothing: no process, no AWS call."""
    assert isinstance(get_backend("local"), LocalBackend)
    ec2 = get_backend("ec2")
    assert isinstance(ec2, Ec2Backend)
    assert ec2.name == "ec2"


def test_an_unknown_name_is_refused_naming_the_choices() -> None:
    with pytest.raises(
        UnknownBackendError, match=r"unknown compute backend 'gce'; choose local, ec2"
    ):
        get_backend("gce")
