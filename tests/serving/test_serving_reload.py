"""Admin reload, alias polling, and versions that must never replace the serving one."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from servingkit import Registry, image_bytes, make_classifier_onnx, make_settings

from burstcv_serving.main import create_app

ADMIN = {"Authorization": "Bearer dev-token"}
PNG = {"file": ("x.png", image_bytes("PNG"), "image/png")}


def _served_version(client: TestClient) -> int:
    body = client.post("/v1/predict", files=PNG).json()
    assert body["predictions"][0]["index"] == body["version"] % 10  # computed by that version
    return int(body["version"])


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({}, "missing bearer token"),
        ({"Authorization": "Bearer wrong"}, "invalid admin token"),
        ({"Authorization": "Basic ZGV2LXRva2Vu"}, "missing bearer token"),
    ],
    ids=["no token", "wrong token", "not bearer"],
)
def test_reload_refuses_without_the_admin_token(
    client: TestClient, registry: Registry, headers: dict[str, str], reason: str
) -> None:
    registry.publish_and_promote(2)

    response = client.post("/v1/admin/reload", headers=headers)

    assert response.status_code == 401
    assert reason in response.json()["detail"]
    assert response.headers["www-authenticate"] == "Bearer"
    assert _served_version(client) == 1  # nothing was reloaded


def test_reload_with_the_token_swaps_to_the_alias_version(
    client: TestClient, registry: Registry
) -> None:
    assert client.post("/v1/admin/reload", headers=ADMIN).json()["changed"] is False
    registry.publish_and_promote(2)

    response = client.post("/v1/admin/reload", headers=ADMIN)

    assert response.status_code == 200
    assert response.json() == {"version": 2, "previous_version": 1, "changed": True}
    assert _served_version(client) == 2
    assert client.get("/v1/model").json()["version"] == 2


def test_reload_is_refused_with_a_placeholder_token_in_production(registry: Registry) -> None:
    with pytest.raises(ValueError, match="placeholder"):
        make_settings(registry, environment="production")
    settings = make_settings(registry, environment="production", admin_token="s3cret")
    with TestClient(create_app(settings)) as client:
        assert client.post("/v1/admin/reload", headers=ADMIN).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert client.post("/v1/admin/reload", headers=good).status_code == 200


def _sha_mismatch(registry: Registry, version: int) -> str:
    return registry.publish(version, claimed_sha256="ab" * 32)


def _garbage_onnx(registry: Registry, version: int) -> str:
    return registry.publish(version, onnx_bytes=b"this is not an onnx protobuf" * 10)


def _missing_onnx(registry: Registry, version: int) -> str:
    sha = registry.publish(version)
    (registry.version_dir(version) / "model.onnx").unlink()
    return sha


def _wrong_class_count(registry: Registry, version: int) -> str:
    return registry.publish(version, onnx_bytes=make_classifier_onnx(version, num_classes=4))


def _alias_sha_differs(registry: Registry, version: int) -> str:
    registry.publish(version)
    return "cd" * 32


@pytest.mark.parametrize(
    ("publish_bad", "reason"),
    [
        (_sha_mismatch, "model.json says"),
        (_garbage_onnx, "onnxruntime cannot load"),
        (_missing_onnx, "cannot read"),
        (_wrong_class_count, "for 10 classes"),
        (_alias_sha_differs, "the alias says"),
    ],
    ids=["sha mismatch", "garbage onnx", "missing onnx", "wrong output shape", "alias sha"],
)
def test_a_broken_version_never_replaces_the_serving_one(
    client: TestClient, registry: Registry, publish_bad: object, reason: str
) -> None:
    sha = publish_bad(registry, 2)  # type: ignore[operator]
    registry.move_alias(2, sha)

    response = client.post("/v1/admin/reload", headers=ADMIN)

    assert response.status_code == 409
    assert "version 2 failed to load" in response.json()["detail"]
    assert "still serving 1" in response.json()["detail"]
    assert _served_version(client) == 1
    info = client.get("/v1/model").json()
    assert info["version"] == 1
    assert info["last_error"]["version"] == 2
    assert reason in info["last_error"]["reason"]
    assert client.get("/readyz").status_code == 200


def test_polling_hot_swaps_and_does_not_retry_a_failed_version(registry: Registry) -> None:
    settings = make_settings(registry, poll_interval_s=0.02)
    with TestClient(create_app(settings)) as client:
        registry.move_alias(2, _garbage_onnx(registry, 2))
        time.sleep(0.4)  # ~20 polls

        assert _served_version(client) == 1
        assert client.get("/v1/model").json()["last_error"]["version"] == 2
        metrics = client.get("/metrics").text
        assert 'burstcv_serving_model_loads_total{outcome="failed"} 1.0' in metrics

        registry.publish_and_promote(3)
        deadline = time.monotonic() + 5
        while client.get("/v1/model").json()["version"] != 3 and time.monotonic() < deadline:
            time.sleep(0.02)

        assert _served_version(client) == 3
        assert client.get("/v1/model").json()["last_error"] is None
        assert 'version="3"} 1.0' in client.get("/metrics").text


def test_unreadable_alias_keeps_the_old_model(client: TestClient, registry: Registry) -> None:
    alias = registry.root / registry.name / "aliases" / "production.json"
    alias.write_text(json.dumps({"sha256": "ab" * 32}))

    response = client.post("/v1/admin/reload", headers=ADMIN)

    assert response.status_code == 409
    assert f"{alias}: field 'version': Field required" in response.json()["detail"]
    assert _served_version(client) == 1


def test_stage_loads_a_version_beside_the_serving_one_and_the_switch_uses_it(
    client: TestClient, registry: Registry
) -> None:
    sha = registry.publish(2)

    staged = client.post("/v1/admin/stage", headers=ADMIN, json={"version": 2, "sha256": sha})

    assert staged.status_code == 200
    assert staged.json() == {"version": 2, "sha256": sha, "loaded_now": True, "serving_version": 1}
    assert _served_version(client) == 1  # staged, not switched
    listed = client.get("/v1/admin/staged", headers=ADMIN).json()
    assert listed == {"staged": [2], "serving_version": 1}
    again = client.post("/v1/admin/stage", headers=ADMIN, json={"version": 2, "sha256": sha})
    assert again.json()["loaded_now"] is False  # a second deploy's stage costs nothing

    moved_at = datetime.now(UTC)
    registry.move_alias(2, sha)
    assert client.post("/v1/admin/reload", headers=ADMIN).json()["version"] == 2

    assert _served_version(client) == 2
    # The model serving was loaded and warmed before production moved: the switch loaded nothing.
    loaded_at = datetime.fromisoformat(client.get("/v1/model").json()["loaded_at"])
    assert loaded_at < moved_at
    assert client.get("/v1/admin/staged", headers=ADMIN).json()["staged"] == []


@pytest.mark.parametrize(
    ("publish_bad", "reason"),
    [
        (_sha_mismatch, "model.json says"),
        (_garbage_onnx, "onnxruntime cannot load"),
        (_wrong_class_count, "for 10 classes"),
        (_alias_sha_differs, "the alias says"),
    ],
    ids=["sha mismatch", "garbage onnx", "wrong output shape", "alias sha"],
)
def test_a_version_that_cannot_serve_is_refused_at_stage_in_the_services_words(
    client: TestClient, registry: Registry, publish_bad: object, reason: str
) -> None:
    sha = publish_bad(registry, 2)  # type: ignore[operator]

    response = client.post("/v1/admin/stage", headers=ADMIN, json={"version": 2, "sha256": sha})

    assert response.status_code == 409
    detail = response.json()["detail"]
    assert detail.startswith("version 2 failed to load: ") and reason in detail
    assert detail.endswith("; still serving 1")
    assert _served_version(client) == 1
    assert client.get("/v1/model").json()["last_error"] is None  # serving is not affected
    assert client.get("/v1/admin/staged", headers=ADMIN).json()["staged"] == []


def test_stage_refuses_without_the_token_and_with_a_bad_body(
    client: TestClient, registry: Registry
) -> None:
    registry.publish(2)
    assert client.post("/v1/admin/stage", json={"version": 2}).status_code == 401
    assert client.get("/v1/admin/staged").status_code == 401
    bad = client.post("/v1/admin/stage", headers=ADMIN, json={"version": 0})
    assert bad.status_code == 422 and "version" in bad.json()["detail"]
    bad_sha = client.post("/v1/admin/stage", headers=ADMIN, json={"version": 2, "sha256": "x"})
    assert bad_sha.status_code == 422 and "sha256" in bad_sha.json()["detail"]
    assert client.get("/v1/admin/staged", headers=ADMIN).json()["staged"] == []


def test_a_service_on_one_model_directory_cannot_stage(registry: Registry) -> None:
    settings = make_settings(registry, model_dir=str(registry.version_dir(1)))
    with TestClient(create_app(settings)) as client:
        response = client.post("/v1/admin/stage", headers=ADMIN, json={"version": 1})
    assert response.status_code == 409
    assert "not a registry alias; it cannot stage version 1" in response.json()["detail"]


def test_a_stage_for_another_model_or_registry_is_refused_and_nothing_loads(
    client: TestClient, registry: Registry, tmp_path: Path
) -> None:
    def stage(**whose: str) -> Any:
        return client.post("/v1/admin/stage", json={"version": 1, **whose}, headers=ADMIN)

    other_model = stage(model="cats")
    assert other_model.status_code == 409
    assert (
        f"this service serves model '{registry.name}', not 'cats'" in other_model.json()["detail"]
    )
    elsewhere = tmp_path / "another-checkout"
    elsewhere.mkdir()
    other_registry = stage(model=registry.name, registry=str(elsewhere))
    assert other_registry.status_code == 409
    assert f"not {elsewhere}" in other_registry.json()["detail"]
    assert stage(registry="s3://bucket/registry").status_code == 409
    assert client.get("/v1/admin/staged", headers=ADMIN).json()["staged"] == []
    # Its own registry, by any path to it; and a folder this host cannot see (the deploying
    # host's path, mounted elsewhere in a container): not judged, the sha256 check still is.
    same = stage(model=registry.name, registry=str(registry.root / "." / "."))
    assert same.status_code == 200, same.text
    assert stage(registry="/nowhere/on/this/host/registry").status_code == 200
    assert client.get("/v1/model").json()["registry"] == str(registry.root)


def test_the_queueing_target_follows_the_slo_recorded_with_the_serving_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A version judged against a 400 ms SLO is not shed at 100 ms: the service's queueing
    target is the SLO its entry records, and it follows each swap; none recorded: 100 ms."""
    registry = Registry(tmp_path / "registry")
    registry.publish_and_promote(1, latency_slo_ms=400.0)
    with TestClient(create_app(make_settings(registry))) as client:
        service = client.app.state.service  # type: ignore[attr-defined]

        def targets() -> tuple[float, float]:
            return service.gate.queue_delay_target_s, service.batcher.queue_delay_target_s

        assert targets() == (0.4, 0.4)
        registry.publish_and_promote(2, latency_slo_ms=50.0)
        with caplog.at_level("INFO", logger="burstcv_serving"):
            assert client.post("/v1/admin/reload", headers=ADMIN).json()["version"] == 2
        assert targets() == (0.05, 0.05)
        assert any("queueing-delay target 50 ms" in m for m in caplog.messages)
        registry.publish_and_promote(3)  # registered by hand: no gate, no SLO
        assert client.post("/v1/admin/reload", headers=ADMIN).json()["version"] == 3
        assert targets() == (0.1, 0.1)
        assert _served_version(client) == 3


def test_a_configured_queueing_target_holds_whatever_the_version_records(
    tmp_path: Path,
) -> None:
    registry = Registry(tmp_path / "registry")
    registry.publish_and_promote(1, latency_slo_ms=400.0)
    settings = make_settings(registry, queue_delay_target_ms=60)
    with TestClient(create_app(settings)) as client:
        service = client.app.state.service  # type: ignore[attr-defined]
        assert service.gate.queue_delay_target_s == service.batcher.queue_delay_target_s == 0.06
        registry.publish_and_promote(2, latency_slo_ms=2000.0)
        assert client.post("/v1/admin/reload", headers=ADMIN).json()["version"] == 2
        assert service.gate.queue_delay_target_s == 0.06
