"""INT8 quantization: serves only when as accurate and faster, and model.json always says why."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from burstcv_testkit import demo_val_images, export_trained

from burstcv.export.quantize import (
    FP32_FILE,
    INT8_FILE,
    choose,
    evenly_spaced,
    quantize_in_folder,
    quantize_int8,
)
from burstcv.gate.accuracy import onnx_accuracy
from burstcv.training.train import load_shards
from burstcv_serving.model import load_model
from burstcv_serving.registry import ModelRef
from burstcv_spec.contracts import ModelCard, QuantizedFigures, read_artifact
from burstcv_spec.preprocess import PreprocessSpec, normalize
from burstcv_spec.storage import sha256_file

BLOCK_KEYS = {"int8_tried", "serving_file", "reason", "fp32", "int8", "max_accuracy_drop"}


@pytest.fixture(scope="module")
def splits(packed_demo: dict[str, Any]) -> dict[str, Any]:
    """Return the demo shards as arrays: training images, validation images and class names."""
    classes = packed_demo["classes"]
    train_x, _ = load_shards(packed_demo["train_shards"], classes)
    val_x, val_y = load_shards(packed_demo["val_shards"], classes)
    return {"train_x": train_x, "val_x": val_x, "val_labels": [classes[i] for i in val_y]}


@pytest.fixture(scope="module")
def int8_export(
    trained_demo: dict[str, Any],
    demo_dataset: Path,
    splits: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """Export the session's trained model with INT8 tried under the default 0.01 bound."""
    out = tmp_path_factory.mktemp("int8-export")
    model_json = export_trained(
        trained_demo,
        out,
        parity_images=demo_val_images(demo_dataset),
        run_id="run-q",
        int8=True,
        calibration_images_u8=splits["train_x"],
        eval_images_u8=splits["val_x"],
        eval_labels=splits["val_labels"],
    )
    return {"out": out, "model_json": model_json}


def test_model_json_names_the_chosen_file_and_its_hash(int8_export: dict[str, Any]) -> None:
    out: Path = int8_export["out"]
    meta = json.loads((out / "model.json").read_text())
    assert meta == int8_export["model_json"]
    block = meta["quantization"]
    assert set(block) >= BLOCK_KEYS and block["int8_tried"] is True
    assert meta["onnx_file"] == block["serving_file"] in (FP32_FILE, INT8_FILE)
    assert meta["sha256"] == sha256_file(out / meta["onnx_file"])
    # The parity-checked FP32 file always stays; the INT8 file is there only when it serves.
    assert block["fp32"]["sha256"] == sha256_file(out / FP32_FILE)
    expected = {"model.json", FP32_FILE} | (
        {INT8_FILE} if meta["onnx_file"] == INT8_FILE else set()
    )
    assert {p.name for p in out.iterdir()} == expected


def test_the_choice_follows_the_rule_it_states(int8_export: dict[str, Any]) -> None:
    block = int8_export["model_json"]["quantization"]
    fp32, int8 = block["fp32"], block["int8"]
    drop = fp32["accuracy"] - int8["accuracy"]
    assert block["max_accuracy_drop"] == 0.01
    within_bound = drop <= 0.01 + 1e-9
    faster = int8["p50_ms"] < fp32["p50_ms"]
    if block["serving_file"] == INT8_FILE:
        assert within_bound and faster and block["reason"].startswith("INT8 kept")
    else:
        assert block["reason"].startswith("FP32 kept")
        assert not within_bound or not faster
        if not within_bound:
            assert "accuracy drop exceeds the bound" in block["reason"]
        if not faster:
            assert "not faster" in block["reason"]
    # INT8 of a well-trained model disagrees with FP32 on only a few validation images.
    assert block["top1_agreement"] >= 0.95 and int8["accuracy"] >= 0.9


def test_recorded_accuracy_is_what_the_served_file_scores(
    int8_export: dict[str, Any], splits: dict[str, Any]
) -> None:
    block = int8_export["model_json"]["quantization"]
    served = "int8" if block["serving_file"] == INT8_FILE else "fp32"
    measured = onnx_accuracy(int8_export["out"], splits["val_x"], splits["val_labels"])
    assert measured == pytest.approx(block[served]["accuracy"], abs=1e-9)


def test_the_service_loads_the_chosen_file(
    int8_export: dict[str, Any], splits: dict[str, Any]
) -> None:
    meta = int8_export["model_json"]
    loaded = load_model(
        ModelRef(version="run-q", expected_sha256=meta["sha256"], location=str(int8_export["out"])),
        intra_op_threads=1,
        max_batch_size=32,
    )
    assert loaded.sha256 == meta["sha256"]
    probabilities = loaded.predict_proba(splits["val_x"][:40])
    predicted = [loaded.classes[i] for i in probabilities.argmax(1)]
    agree = np.mean([p == t for p, t in zip(predicted, splits["val_labels"][:40], strict=True)])
    assert agree >= 0.9


def test_int8_is_one_self_contained_quantized_file_with_a_dynamic_batch(
    int8_export: dict[str, Any], splits: dict[str, Any], tmp_path: Path
) -> None:
    spec = PreprocessSpec.from_dict(int8_export["model_json"]["preprocess"])
    fp32_path = int8_export["out"] / FP32_FILE
    int8_path = tmp_path / INT8_FILE
    quantize_int8(fp32_path, int8_path, evenly_spaced(splits["train_x"], 64), spec, "input")
    assert [p.name for p in tmp_path.iterdir()] == [INT8_FILE]  # no external data beside it
    model = onnx.load(str(int8_path))
    onnx.checker.check_model(model, full_check=True)
    ops = {node.op_type for node in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert any(init.data_type == onnx.TensorProto.INT8 for init in model.graph.initializer)
    assert int8_path.stat().st_size < fp32_path.stat().st_size / 2  # int8 weights: ~4x smaller
    session = ort.InferenceSession(str(int8_path), providers=["CPUExecutionProvider"])
    for size in (1, 7):
        logits = session.run(None, {"input": normalize(splits["val_x"][:size], spec)})[0]
        assert logits.shape == (size, 10)


def test_an_impossible_bound_never_keeps_int8(
    int8_export: dict[str, Any], splits: dict[str, Any], tmp_path: Path
) -> None:
    # Whatever the first choice was, it is redone here.
    shutil.copy(int8_export["out"] / FP32_FILE, tmp_path / FP32_FILE)
    before = read_artifact(str(int8_export["out"] / "model.json"), ModelCard)
    card = quantize_in_folder(
        tmp_path,
        before,
        splits["train_x"],
        splits["val_x"],
        splits["val_labels"],
        max_accuracy_drop=-1.0,
        calibration_images=64,
    )
    block = card.quantization
    assert block is not None
    assert block.serving_file == card.onnx_file == FP32_FILE
    assert card.sha256 == sha256_file(tmp_path / FP32_FILE) == block.fp32.sha256
    assert block.reason.startswith("FP32 kept (accuracy drop exceeds the bound")
    assert block.max_accuracy_drop == -1.0 and block.calibration_images == 64
    # Everything but the quantization verdict is as the export wrote it.
    verdict = {"onnx_file", "sha256", "quantization"}
    assert card.model_dump(exclude=verdict) == before.model_dump(exclude=verdict)


def test_the_quantization_block_round_trips(int8_export: dict[str, Any]) -> None:
    block = int8_export["model_json"]["quantization"]
    assert json.loads(json.dumps(block)) == block
    assert json.loads((int8_export["out"] / "model.json").read_text())["quantization"] == block
    for side in ("fp32", "int8"):
        assert 0.0 <= block[side]["accuracy"] <= 1.0
        assert math.isfinite(block[side]["p50_ms"]) and block[side]["p50_ms"] > 0
        assert len(block[side]["sha256"]) == 64


@pytest.mark.parametrize(
    ("int8_accuracy", "int8_p50_ms", "kept", "why"),
    [
        (0.95, 1.0, True, "INT8 kept"),
        (0.94, 1.0, True, "INT8 kept"),  # a drop exactly at the bound is allowed
        (0.93, 1.0, False, "accuracy drop exceeds the bound"),
        (0.95, 2.0, False, "INT8 is not faster"),
        (0.90, 3.0, False, "accuracy drop exceeds the bound and INT8 is not faster"),
    ],
)
def test_choose_keeps_int8_only_when_accurate_and_faster(
    int8_accuracy: float, int8_p50_ms: float, kept: bool, why: str
) -> None:
    def figures(accuracy: float, p50_ms: float, file: str) -> QuantizedFigures:
        return QuantizedFigures(
            accuracy=accuracy, p50_ms=p50_ms, mean_ms=p50_ms, file=file, sha256="0" * 64
        )

    fp32 = figures(0.95, 2.0, FP32_FILE)
    keep, reason = choose(fp32, figures(int8_accuracy, int8_p50_ms, INT8_FILE), 0.01)
    assert keep is kept and why in reason


def test_int8_without_its_images_is_refused_before_anything_is_written(
    trained_demo: dict[str, Any], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="int8=True needs calibration_images_u8"):
        export_trained(trained_demo, tmp_path, parity_images=[], int8=True)
    assert list(tmp_path.iterdir()) == []


def test_quantize_imports_without_the_torch_exporter() -> None:
    # onnx_export imports quantize for INT8; quantize importing onnx_export back was a cycle
    # that also loaded torch wherever only an ONNX file is quantized.
    code = (
        "import sys, burstcv.export.quantize; "
        "print(sorted({'burstcv.export.onnx_export', 'torch'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
