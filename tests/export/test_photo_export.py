"""Photo models export like digits: parity on real JPEGs (EXIF ones too), gates on margin shards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from burstcv.export.onnx_export import export_model
from burstcv.gate.accuracy import onnx_accuracy
from burstcv.training.train import load_shards
from burstcv_spec.preprocess import PreprocessSpec


def _val(trained: dict[str, Any]) -> tuple[np.ndarray, list[str]]:
    classes = trained["packed"].classes
    images, labels = load_shards(trained["packed"].val_shards, classes)
    return images, [classes[i] for i in labels]


@pytest.fixture(scope="module")
def photo_export(
    trained_photos: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Export the photo model with INT8 tried, calibrated and scored on the margin shards."""
    out = tmp_path_factory.mktemp("photo-export")
    classes = trained_photos["packed"].classes
    train_x, _ = load_shards(trained_photos["packed"].train_shards, classes)
    val_x, val_labels = _val(trained_photos)
    val_rows = [r for r in trained_photos["rows"] if r["split"] == "val"]
    model_json = export_model(
        checkpoint_uri=str(trained_photos["out"] / "model.pt"),
        out_uri=str(out),
        arch=trained_photos["job"].arch,
        classes=classes,
        spec=trained_photos["spec"],
        parity_images=[(r["path"], Path(r["uri"]).read_bytes()) for r in val_rows],
        name="photos",
        int8=True,
        calibration_images_u8=train_x,
        eval_images_u8=val_x,
        eval_labels=val_labels,
        max_accuracy_drop=1.0,  # the verdict is not under test here, only that it runs
    ).model_dump(mode="json")
    return {"out": out, "model_json": model_json}


def test_the_photo_transform_reaches_model_json_and_passes_parity(
    photo_export: dict[str, Any], trained_photos: dict[str, Any]
) -> None:
    meta = photo_export["model_json"]
    assert meta["preprocess"]["resize_short"] == 37
    assert PreprocessSpec.from_dict(meta["preprocess"]) == trained_photos["spec"]
    assert meta["input"]["shape"] == [None, 3, 32, 32]
    # Every val JPEG went through both sides, the EXIF-rotated ones included.
    val_rows = [r for r in trained_photos["rows"] if r["split"] == "val"]
    assert meta["parity"]["images"] == len(val_rows) == 24
    assert any(Image.open(r["uri"]).getexif().get(0x0112) == 6 for r in val_rows)


def test_the_gates_score_margin_shards_as_training_scored_them(
    photo_export: dict[str, Any], trained_photos: dict[str, Any]
) -> None:
    val_x, val_labels = _val(trained_photos)
    assert val_x.shape[1:3] == (37, 37)
    fp32 = onnx_accuracy(photo_export["out"], val_x, val_labels)
    # Training evaluated the same centre crops in torch: ONNX agrees up to one borderline image.
    assert abs(fp32 - trained_photos["metrics"]["val_accuracy"]) <= 1 / len(val_labels) + 1e-9
    block = photo_export["model_json"]["quantization"]
    assert block["eval_images"] == len(val_labels) and block["fp32"]["accuracy"] == pytest.approx(
        fp32
    )
