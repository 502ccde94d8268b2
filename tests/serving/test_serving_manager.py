"""The model manager's decisions: what serves after a failure, what staging loads and keeps,
and how often a failure is logged."""

from __future__ import annotations

import asyncio
import logging

import pytest
from fastapi.testclient import TestClient
from servingkit import Registry, make_settings

from burstcv_serving.manager import MAX_STAGED, ModelManager
from burstcv_serving.metrics import ServiceMetrics
from burstcv_serving.model import LoadedModel
from burstcv_serving.registry import RegistrySource

ADMIN = {"Authorization": "Bearer dev-token"}
BROKEN_ONNX = b"this is not an onnx protobuf" * 10


def _manager(registry: Registry) -> tuple[ModelManager, ServiceMetrics]:
    settings = make_settings(registry)
    source = RegistrySource(settings.registry_uri, settings.model_name, settings.alias)
    metrics = ServiceMetrics()
    return ModelManager(source, settings, metrics), metrics


def _loads(metrics: ServiceMetrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "burstcv_serving_model_loads_total", {"outcome": outcome}
    )
    return float(value or 0.0)


def _stage(client: TestClient, version: int, sha256: str | None = None) -> dict:
    body: dict[str, object] = {"version": version}
    if sha256 is not None:
        body["sha256"] = sha256
    response = client.post("/v1/admin/stage", headers=ADMIN, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _staged(client: TestClient) -> list[int]:
    return client.get("/v1/admin/staged", headers=ADMIN).json()["staged"]


@pytest.mark.parametrize("with_sha", [True, False], ids=["with sha256", "without sha256"])
def test_staging_the_version_already_serving_loads_nothing(
    client: TestClient, registry: Registry, with_sha: bool
) -> None:
    sha = registry.publish(1)  # the same bytes: the same sha256 as the serving version
    loaded_at = client.get("/v1/model").json()["loaded_at"]

    staged = _stage(client, 1, sha if with_sha else None)

    assert staged == {"version": 1, "sha256": sha, "loaded_now": False, "serving_version": 1}
    assert _staged(client) == []  # nothing held beside the serving model
    assert client.get("/v1/model").json()["loaded_at"] == loaded_at


def test_staging_another_version_without_a_sha256_loads_that_version(
    client: TestClient, registry: Registry
) -> None:
    sha = registry.publish(2)

    staged = _stage(client, 2)

    assert staged == {"version": 2, "sha256": sha, "loaded_now": True, "serving_version": 1}
    assert _staged(client) == [2]


def test_two_deploys_stay_staged_and_a_third_drops_the_oldest(
    client: TestClient, registry: Registry
) -> None:
    assert MAX_STAGED == 2
    shas = {version: registry.publish(version) for version in (2, 3, 4)}

    assert _stage(client, 2, shas[2])["loaded_now"] is True
    assert _stage(client, 3, shas[3])["loaded_now"] is True
    assert _staged(client) == [2, 3]  # two overlapping deploys both keep their stage
    assert _stage(client, 2, shas[2])["loaded_now"] is False

    assert _stage(client, 4, shas[4])["loaded_now"] is True
    assert _staged(client) == [3, 4]  # the oldest made room
    assert _stage(client, 2, shas[2])["loaded_now"] is True  # loaded again
    assert _staged(client) == [4, 2]


def test_polling_a_version_that_failed_keeps_the_old_model_and_does_not_reload_it(
    registry: Registry,
) -> None:
    async def scenario() -> None:
        manager, metrics = _manager(registry)
        serving = await manager.refresh()
        assert isinstance(serving, LoadedModel) and serving.version == 1
        registry.move_alias(2, registry.publish(2, onnx_bytes=BROKEN_ONNX))

        for _ in range(3):  # polls
            assert await manager.refresh() is serving
        assert manager.current is serving
        assert manager.target_version == 2
        assert manager.last_error is not None and manager.last_error.version == 2
        assert _loads(metrics, "failed") == 1  # tried once, not on every poll

        assert await manager.refresh(force=True) is serving  # an admin reload tries again
        assert _loads(metrics, "failed") == 2

    asyncio.run(scenario())


def test_a_failure_is_logged_once_not_on_every_poll(
    registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        manager, _ = _manager(registry)
        await manager.refresh()
        registry.move_alias(2, registry.publish(2, onnx_bytes=BROKEN_ONNX))
        for _ in range(3):
            await manager.refresh(force=True)  # the same failure each time
        registry.move_alias(3, registry.publish(3, onnx_bytes=BROKEN_ONNX))
        for _ in range(2):
            await manager.refresh(force=True)

    caplog.set_level(logging.ERROR, logger="burstcv_serving.manager")
    asyncio.run(scenario())

    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, errors
    assert errors[0].startswith("version 2 failed to load: ")
    assert errors[1].startswith("version 3 failed to load: ")
    assert all(message.endswith("; still serving 1") for message in errors)
