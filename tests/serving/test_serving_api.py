"""Exercise every endpoint of the real app through TestClient (the lifespan runs)."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient
from servingkit import NUM_CLASSES, Registry, image_bytes, make_settings

from burstcv_serving.main import create_app


def test_predict_returns_top_k_from_the_alias_version(client: TestClient) -> None:
    response = client.post(
        "/v1/predict", files={"file": ("x.png", image_bytes("PNG"), "image/png")}
    )

    assert response.status_code == 200, response.text
    body = response.json()
    assert body["version"] == 1
    assert body["model"] == "digits"
    assert body["predictions"][0]["index"] == 1  # version 1's bias wins
    assert len(body["predictions"]) == 3
    scores = [p["score"] for p in body["predictions"]]
    assert scores == sorted(scores, reverse=True) and 0 < scores[0] <= 1
    assert body["predictions"][0]["label"] == "1"
    assert body["server_time_ms"] >= 0


def test_predict_accepts_jpeg_and_webp(client: TestClient) -> None:
    for fmt, ctype in (("JPEG", "image/jpeg"), ("WEBP", "image/webp")):
        response = client.post("/v1/predict", files={"file": ("x", image_bytes(fmt), ctype)})
        assert response.status_code == 200, (fmt, response.text)
        assert response.json()["predictions"][0]["index"] == 1


def test_predict_accepts_octet_stream_parts(client: TestClient) -> None:
    """curl -F file=@img sends unknown extensions as application/octet-stream."""
    data = image_bytes("PNG", size=(300, 200))
    response = client.post("/v1/predict", files={"file": ("x", data, "application/octet-stream")})
    assert response.status_code == 200, response.text


def test_batch_answers_every_file_in_order_with_one_version(client: TestClient) -> None:
    files = [
        ("files", (f"{i}.png", image_bytes("PNG", color=40 * i), "image/png")) for i in range(5)
    ]

    response = client.post("/v1/predict/batch", files=files)

    assert response.status_code == 200, response.text
    body = response.json()
    assert body["version"] == 1
    assert [r["filename"] for r in body["results"]] == [f"{i}.png" for i in range(5)]
    assert all(r["predictions"][0]["index"] == 1 for r in body["results"])


def test_batch_names_the_bad_file(client: TestClient) -> None:
    files = [
        ("files", ("good.png", image_bytes("PNG"), "image/png")),
        ("files", ("bad.gif", image_bytes("GIF"), "image/gif")),
    ]
    response = client.post("/v1/predict/batch", files=files)
    assert response.status_code == 415
    assert "file 1" in response.json()["detail"] and "bad.gif" in response.json()["detail"]


def test_batch_refuses_more_files_than_allowed(registry: Registry) -> None:
    with TestClient(create_app(make_settings(registry, max_batch_files=2))) as client:
        files = [("files", (f"{i}.png", image_bytes("PNG"), "image/png")) for i in range(3)]
        response = client.post("/v1/predict/batch", files=files)
    assert response.status_code == 413
    assert "limit is 2" in response.json()["detail"]


def test_model_info_describes_the_serving_version(client: TestClient, registry: Registry) -> None:
    response = client.get("/v1/model")

    assert response.status_code == 200
    body = response.json()
    assert body["name"] == "digits"
    assert body["version"] == 1
    assert body["classes"] == [str(i) for i in range(NUM_CLASSES)]
    onnx_sha = (registry.version_dir(1) / "model.json").read_text()
    assert body["sha256"] in onnx_sha
    assert body["metrics"]["val_accuracy"] > 0.9
    assert body["loaded_at"]
    assert body["last_error"] is None


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["version"] == 1


def test_without_a_model_the_service_is_alive_but_not_ready(registry: Registry) -> None:
    settings = make_settings(registry, alias="staging")  # no such alias yet
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").status_code == 200
        not_ready = client.get("/readyz")
        assert not_ready.status_code == 503
        assert "staging.json does not exist" in not_ready.json()["detail"]
        png = {"file": ("x.png", image_bytes("PNG"), "image/png")}
        predict = client.post("/v1/predict", files=png)
        assert predict.status_code == 503 and predict.headers["retry-after"] == "1"
        assert client.get("/v1/model").status_code == 503

        registry.move_alias(1, registry.publish(1), alias="staging")
        reload = client.post("/v1/admin/reload", headers={"Authorization": "Bearer dev-token"})
        assert reload.status_code == 200, reload.text
        assert reload.json() == {"version": 1, "previous_version": None, "changed": True}
        assert client.get("/readyz").status_code == 200
        assert client.post("/v1/predict", files=png).json()["version"] == 1


def test_an_alias_file_that_is_not_a_json_object_keeps_the_service_unready(
    registry: Registry,
) -> None:
    alias = registry.root / registry.name / "aliases" / "production.json"
    alias.write_text("[1]")
    with TestClient(create_app(make_settings(registry))) as client:
        not_ready = client.get("/readyz")
    assert not_ready.status_code == 503
    detail = not_ready.json()["detail"]
    assert f"cannot read alias file {alias}" in detail
    assert "holds list, expected a JSON object" in detail


def test_model_dir_serves_a_candidate_without_a_registry(registry: Registry) -> None:
    directory = registry.version_dir(1)
    meta_path = directory / "model.json"
    meta = json.loads(meta_path.read_text())
    del meta["version"]  # runs/<id>/model/ has no registry version yet
    meta_path.write_text(json.dumps(meta))
    settings = make_settings(registry, model_dir=str(directory), registry_uri="/nonexistent")
    with TestClient(create_app(settings)) as client:
        response = client.post(
            "/v1/predict", files={"file": ("x.png", image_bytes("PNG"), "image/png")}
        )
        assert response.status_code == 200, response.text
        assert response.json()["version"] == "candidate"


def test_metrics_expose_counts_latency_batches_version_and_queue(client: TestClient) -> None:
    png = {"file": ("x.png", image_bytes("PNG"), "image/png")}
    for _ in range(3):
        client.post("/v1/predict", files=png)
    client.post("/v1/predict", files={"file": ("x.gif", image_bytes("GIF"), "image/gif")})

    text = client.get("/metrics").text

    assert (
        'burstcv_serving_requests_total{method="POST",path="/v1/predict",status="200"} 3.0' in text
    )
    assert (
        'burstcv_serving_requests_total{method="POST",path="/v1/predict",status="415"} 1.0' in text
    )
    assert 'burstcv_serving_request_duration_seconds_count{path="/v1/predict"} 4.0' in text
    assert "burstcv_serving_batch_size_count 3.0" in text
    assert 'burstcv_serving_model_info{name="digits",sha256=' in text and 'version="1"} 1.0' in text
    assert "burstcv_serving_queue_depth 0.0" in text


def test_openapi_documents_error_responses(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    predict = spec["paths"]["/v1/predict"]["post"]["responses"]
    assert {"200", "413", "415", "422", "503"} <= set(predict)
    assert predict["415"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorOut")
    reload = spec["paths"]["/v1/admin/reload"]["post"]["responses"]
    assert {"200", "401", "409"} <= set(reload)
    for path in ("/v1/model", "/readyz", "/healthz", "/metrics", "/v1/predict/batch"):
        assert path in spec["paths"]


def test_prediction_requests_take_the_fast_lane_past_the_router(registry: Registry) -> None:
    """POST /v1/predict is answered by the fast lane: it works with its route taken out."""
    app = create_app(make_settings(registry))
    app.router.routes[:] = [
        route for route in app.router.routes if getattr(route, "path", "") != "/v1/predict"
    ]
    with TestClient(app) as client:
        ok = client.post("/v1/predict", files={"file": ("x.png", image_bytes("PNG"), "image/png")})
        refused = client.post("/v1/predict", files={"file": ("a.gif", image_bytes("GIF"))})
        other_method = client.get("/v1/predict")

    assert ok.status_code == 200 and ok.json()["version"] == 1
    assert refused.status_code == 415 and "GIF" in refused.json()["detail"]
    assert other_method.status_code == 404  # no route left for anything but the fast lane
