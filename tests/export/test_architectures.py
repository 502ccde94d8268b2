"""Every architecture exports through the parity-checked path and quantizes to INT8.

Random weights at 64 px (the photo layout: torchvision's stem, as pretrained weights need),
so each case costs seconds on a 2-core CPU; the trained-model export is tested in
test_export.py and test_quantize.py.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from burstcv_testkit import gratings
from PIL import Image

from burstcv.export.onnx_export import export_model
from burstcv.export.quantize import INT8_FILE, quantize_int8
from burstcv.training.models import build_model
from burstcv_spec.preprocess import PreprocessSpec, decode_to_uint8, normalize

SIZE_PX = 64
CLASSES = ["a", "b", "c"]
SPEC = PreprocessSpec(height=SIZE_PX, width=SIZE_PX)  # ImageNet mean/std, as pretrained nets
# (arch, pretrained): the architectures users pick for photos, in the pretrained layout, and
# convnext_tiny's small-input stem. resnet10/34 and mobilenet_v3_small are resnet18 and
# mobilenet_v3_large with fewer blocks (the same operators): each export costs 5-40 s here,
# most of it torch.export tracing, so they are not exported again.
PHOTO_ARCHITECTURES = (
    "resnet18",
    "resnet50",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "convnext_tiny",
)
CASES = [(arch, "DEFAULT") for arch in PHOTO_ARCHITECTURES] + [("convnext_tiny", "none")]


def _png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def images() -> list[tuple[str, bytes]]:
    """Return 8 photo-sized PNGs (gratings at 80 px, resized to 64 by the preprocessing)."""
    pixels, _ = gratings(8, [0.0, 45.0, 90.0, 135.0], size_px=80, seed=5)
    return [(f"val/{i}.png", _png(img)) for i, img in enumerate(pixels)]


@pytest.mark.parametrize(("arch", "pretrained"), CASES, ids=[f"{a}-{p}" for a, p in CASES])
def test_architecture_exports_with_parity_and_quantizes(
    arch: str, pretrained: str, images: list[tuple[str, bytes]], tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = build_model(arch, len(CLASSES), SIZE_PX, pretrained=pretrained != "none")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    out = tmp_path / "model"
    meta = export_model(
        checkpoint_uri=str(tmp_path / "model.pt"),
        out_uri=str(out),
        arch=arch,
        classes=CLASSES,
        spec=SPEC,
        parity_images=images,  # export_model raises ParityError if ORT and torch disagree
        name=arch,
        pretrained=pretrained,
    ).model_dump(mode="json")
    assert meta["parity"]["images"] == len(images) and meta["parity"]["top1_mismatches"] == []
    assert meta["input"]["shape"] == [None, 3, SIZE_PX, SIZE_PX]

    batch = np.stack([decode_to_uint8(data, SPEC) for _, data in images])
    fp32 = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ref = fp32.run(None, {"input": normalize(batch, SPEC)})[0]
    quantize_int8(out / "model.onnx", tmp_path / INT8_FILE, batch, SPEC, "input")
    graph = onnx.load(str(tmp_path / INT8_FILE))
    assert {"QuantizeLinear", "DequantizeLinear"} <= {node.op_type for node in graph.graph.node}
    int8 = ort.InferenceSession(str(tmp_path / INT8_FILE), providers=["CPUExecutionProvider"])
    assert int8.run(None, {"input": normalize(batch[:1], SPEC)})[0].shape == (1, len(CLASSES))
    logits = int8.run(None, {"input": normalize(batch, SPEC)})[0]
    # Quantized logits follow the FP32 ones (random weights: no accuracy to compare).
    assert np.corrcoef(logits.ravel(), ref.ravel())[0, 1] > 0.9
