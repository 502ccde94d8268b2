"""A photo model served: the service decodes a JPEG (EXIF-rotated too) as pack stored it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from servingkit import Registry, make_settings

# The photo model is exported and its shards read here: torch's venv, not the 3.12 one.
pytest.importorskip("torch")

from burstcv.export.onnx_export import export_model
from burstcv.training.train import load_shards
from burstcv_serving.main import create_app
from burstcv_spec.preprocess import PreprocessSpec, eval_view, normalize


@pytest.fixture(scope="module")
def photo_model(
    trained_photos: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Export the session's photo model (no INT8); return its folder and model.json."""
    out = tmp_path_factory.mktemp("photo-model")
    val_rows = [r for r in trained_photos["rows"] if r["split"] == "val"]
    meta = export_model(
        checkpoint_uri=str(trained_photos["out"] / "model.pt"),
        out_uri=str(out),
        arch=trained_photos["job"].arch,
        classes=trained_photos["packed"].classes,
        spec=trained_photos["spec"],
        parity_images=[(r["path"], Path(r["uri"]).read_bytes()) for r in val_rows[:4]],
        name="photos",
    ).model_dump(mode="json")
    return {"out": out, "meta": meta}


@pytest.fixture
def photo_client(photo_model: dict[str, Any], tmp_path: Path) -> Iterator[TestClient]:
    """Serve the exported photo model as production version 1 of a fresh registry."""
    registry = Registry(tmp_path / "registry", name="photos")
    sha = registry.publish(1, (photo_model["out"] / "model.onnx").read_bytes())
    meta = {**photo_model["meta"], "version": 1}
    (registry.version_dir(1) / "model.json").write_text(json.dumps(meta))
    registry.move_alias(1, sha)
    with TestClient(create_app(make_settings(registry, top_k=2))) as client:
        yield client


def test_served_scores_are_those_of_the_packed_centre_crop(
    photo_client: TestClient, photo_model: dict[str, Any], trained_photos: dict[str, Any]
) -> None:
    packed = trained_photos["packed"]
    classes = packed.classes
    stored, _ = load_shards(packed.val_shards, classes)
    val_rows = sorted(
        (r for r in trained_photos["rows"] if r["split"] == "val"),
        key=lambda r: (r["label"], r["path"]),  # the order pack stored them in
    )
    spec = PreprocessSpec.from_dict(photo_model["meta"]["preprocess"])
    session = ort.InferenceSession(
        str(photo_model["out"] / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    logits = session.run(None, {"input": normalize(eval_view(stored, spec), spec)})[0]
    expected = np.exp(logits - logits.max(1, keepdims=True))
    expected /= expected.sum(1, keepdims=True)

    rotated = 0
    for row, probabilities in zip(val_rows, expected, strict=True):
        data = Path(row["uri"]).read_bytes()
        rotated += Image.open(row["uri"]).getexif().get(0x0112) == 6
        response = photo_client.post(
            "/v1/predict", files={"file": (Path(row["uri"]).name, data, "image/jpeg")}
        )
        assert response.status_code == 200, response.text
        scores = {p["label"]: p["score"] for p in response.json()["predictions"]}
        assert scores == pytest.approx(
            {label: float(probabilities[classes.index(label)]) for label in scores}, abs=1e-5
        ), row["path"]
    assert rotated >= 2  # the EXIF-rotated files were among them


def test_an_exif_rotated_upload_is_scored_upright(
    photo_client: TestClient, trained_photos: dict[str, Any], tmp_path: Path
) -> None:
    row = next(r for r in trained_photos["rows"] if Image.open(r["uri"]).getexif().get(0x0112) == 6)
    tagged = Path(row["uri"]).read_bytes()
    # The same pixels without the tag: what a decoder that ignores EXIF would see.
    img = Image.open(row["uri"])
    img.getexif().pop(0x0112)
    untagged_path = tmp_path / "untagged.png"
    img.save(untagged_path, exif=img.getexif())
    upright_path = tmp_path / "upright.png"
    Image.open(row["uri"]).transpose(Image.Transpose.ROTATE_270).save(upright_path)

    def scores(data: bytes, name: str) -> list[float]:
        response = photo_client.post("/v1/predict", files={"file": (name, data, "image/png")})
        assert response.status_code == 200, response.text
        return [p["score"] for p in response.json()["predictions"]]

    tagged_scores = scores(tagged, "tagged.jpg")
    assert tagged_scores == pytest.approx(scores(upright_path.read_bytes(), "up.png"), abs=1e-6)
    assert tagged_scores != pytest.approx(
        scores(untagged_path.read_bytes(), "untagged.png"), abs=1e-6
    )
