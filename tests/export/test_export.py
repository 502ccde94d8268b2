"""ONNX export: the file that serves is proven equal to the trained model on real images."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from burstcv_testkit import demo_val_images, export_trained

from burstcv.export.onnx_export import (
    CheckpointError,
    ParityError,
    check_parity,
    export_onnx,
    load_state_dict,
)
from burstcv.training.models import build_model
from burstcv.training.train import normalize as torch_normalize
from burstcv_spec.preprocess import PreprocessSpec, decode_to_uint8
from burstcv_spec.preprocess import normalize as numpy_normalize
from burstcv_spec.storage import sha256_file


@pytest.fixture(scope="module")
def exported(
    trained_demo: dict[str, Any], demo_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("export")
    model_json = export_trained(
        trained_demo,
        out,
        parity_images=demo_val_images(demo_dataset),
        metrics={"val_accuracy": 0.99},
        dataset_fingerprint="fp",
        run_id="run-1",
    )
    return {"out": out, "model_json": model_json}


def test_export_writes_a_self_describing_single_file_model(exported: dict[str, Any]) -> None:
    out: Path = exported["out"]
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.onnx"]  # no external data
    meta = json.loads((out / "model.json").read_text())
    assert meta == exported["model_json"]
    assert meta["sha256"] == sha256_file(out / "model.onnx")
    assert meta["classes"] == [str(d) for d in range(10)]
    assert meta["opset"] == 18 and meta["input"]["shape"] == [None, 3, 32, 32]
    assert meta["dataset_fingerprint"] == "fp" and meta["source_commit"] == "test"
    assert meta["parity"]["max_abs_diff"] < 1e-3 and meta["parity"]["top1_mismatches"] == []
    onnx.checker.check_model(onnx.load(str(out / "model.onnx")), full_check=True)


def test_model_json_preprocess_round_trips(exported: dict[str, Any]) -> None:
    spec = PreprocessSpec.from_dict(exported["model_json"]["preprocess"])
    assert PreprocessSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_onnx_has_a_dynamic_batch_axis_and_matches_torch(
    exported: dict[str, Any], trained_demo: dict[str, Any], demo_dataset: Path
) -> None:
    session = ort.InferenceSession(
        str(exported["out"] / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    spec = PreprocessSpec.from_dict(exported["model_json"]["preprocess"])
    images = demo_val_images(demo_dataset, 40)
    batch = np.stack([decode_to_uint8(b, spec) for _, b in images])
    model = build_model("resnet10", 10, 32)
    model.load_state_dict(torch.load(trained_demo["out"] / "model.pt", weights_only=True))
    model.eval()
    for size in (1, 7, 40):
        logits = session.run(None, {"input": numpy_normalize(batch[:size], spec)})[0]
        assert logits.shape == (size, 10)
        with torch.no_grad():
            ref = model(torch.from_numpy(numpy_normalize(batch[:size], spec))).numpy()
        assert np.abs(logits - ref).max() < 1e-3


def test_serving_preprocessing_equals_the_training_transform(
    trained_demo: dict[str, Any], demo_dataset: Path
) -> None:
    spec = PreprocessSpec.from_dict(trained_demo["job"].preprocess)
    raw = (sorted((demo_dataset / "val").rglob("*.png"))[0]).read_bytes()
    u8 = decode_to_uint8(raw, spec)
    served = numpy_normalize(u8, spec)
    mean = torch.tensor(spec.mean).view(1, 3, 1, 1)
    std = torch.tensor(spec.std).view(1, 3, 1, 1)
    trained = torch_normalize(
        torch.from_numpy(u8[None].copy()).permute(0, 3, 1, 2), mean, std, spec.scale
    ).numpy()
    assert served.shape == trained.shape == (1, 3, 32, 32)
    np.testing.assert_allclose(served, trained, rtol=0, atol=1e-6)


def test_wrong_normalisation_in_model_json_fails_parity(
    exported: dict[str, Any], trained_demo: dict[str, Any], demo_dataset: Path
) -> None:
    training_spec = PreprocessSpec.from_dict(trained_demo["job"].preprocess)
    broken = replace(training_spec, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    model = build_model("resnet10", 10, 32)
    model.load_state_dict(torch.load(trained_demo["out"] / "model.pt", weights_only=True))
    with pytest.raises(ParityError, match="worst on val/"):
        check_parity(
            model,
            exported["out"] / "model.onnx",
            broken,
            training_spec,
            demo_val_images(demo_dataset),
            max_abs_diff=1e-3,
        )


def test_parity_is_relative_for_large_logits_and_still_catches_a_wrong_transform(
    trained_demo: dict[str, Any], demo_dataset: Path, tmp_path: Path
) -> None:
    """fp32 rounding grows with the logits: logits of ~1e6 differ by more than 1e-3 between two
    correct runtimes, yet a wrong normalisation still fails at that size."""
    spec = PreprocessSpec.from_dict(trained_demo["job"].preprocess)
    model = build_model("resnet10", 10, 32)
    model.load_state_dict(torch.load(trained_demo["out"] / "model.pt", weights_only=True))
    with torch.no_grad():  # the same classifier, its logits 1e5 times larger
        model.fc.weight.mul_(1e5)
        model.fc.bias.mul_(1e5)
    path = tmp_path / "large.onnx"
    export_onnx(model.eval(), spec, path, 18)
    images = demo_val_images(demo_dataset)
    report = check_parity(model, path, spec, spec, images, max_abs_diff=1e-3)
    assert report.top1_mismatches == []
    print("max |Δlogit| at logits x1e5:", report.max_abs_diff)
    assert report.max_abs_diff > 1e-3  # an absolute bound would refuse a correct export
    broken = replace(spec, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    with pytest.raises(ParityError, match=r"x \|logit\|"):
        check_parity(model, path, broken, spec, images, max_abs_diff=1e-3)


def test_wrong_input_size_in_model_json_fails_parity(
    exported: dict[str, Any], trained_demo: dict[str, Any], demo_dataset: Path
) -> None:
    training_spec = PreprocessSpec.from_dict(trained_demo["job"].preprocess)
    model = build_model("resnet10", 10, 32)
    model.load_state_dict(torch.load(trained_demo["out"] / "model.pt", weights_only=True))
    with pytest.raises(ParityError):
        check_parity(
            model,
            exported["out"] / "model.onnx",
            replace(training_spec, height=24, width=24),
            training_spec,
            demo_val_images(demo_dataset),
            max_abs_diff=1e-3,
        )


class Payload:
    """A picklable object that is not a state dict."""

    def __init__(self) -> None:
        self.weights = torch.zeros(3)


def test_a_pickled_object_is_refused_not_unpickled(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save(Payload(), path)
    with pytest.raises(CheckpointError, match="not a plain state dict"):
        load_state_dict(path.read_bytes())
    torch.save(build_model("resnet10", 10, 32), tmp_path / "module.pt")  # a whole nn.Module
    with pytest.raises(CheckpointError):
        load_state_dict((tmp_path / "module.pt").read_bytes())
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="name -> tensor"):
        load_state_dict((tmp_path / "list.pt").read_bytes())


def test_weights_for_another_class_count_are_refused(
    trained_demo: dict[str, Any], tmp_path: Path, demo_dataset: Path
) -> None:
    with pytest.raises(CheckpointError, match="does not fit resnet10 with 3 classes"):
        export_trained(
            trained_demo,
            tmp_path,
            arch="resnet10",
            classes=["a", "b", "c"],
            parity_images=demo_val_images(demo_dataset, 4),
        )
    assert not (tmp_path / "model.onnx").exists()
