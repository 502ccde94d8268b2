"""Fixtures for the serving tests: a registry with version 1 promoted, and a client on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from servingkit import PROTOCOLS, Registry, make_settings

from burstcv_serving.main import create_app


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    """Return a registry whose production alias points at a valid version 1."""
    reg = Registry(tmp_path / "registry")
    reg.publish_and_promote(1)
    return reg


@pytest.fixture
def client(registry: Registry) -> Iterator[TestClient]:
    """Return a TestClient on the real app (lifespan run) serving version 1."""
    with TestClient(create_app(make_settings(registry))) as test_client:
        yield test_client


@pytest.fixture(params=PROTOCOLS)
def protocol(request: pytest.FixtureRequest) -> str:
    """Run the test once per HTTP protocol of the service (pass it to running_server)."""
    return str(request.param)
