"""Measure a served ONNX model's top-1 accuracy on a validation split, the way serving runs it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from burstcv_spec.contracts import ModelCard, read_artifact
from burstcv_spec.layout import MODEL_CARD
from burstcv_spec.preprocess import eval_view, normalize

EVAL_BATCH = 256


def onnx_accuracy(model_dir: str | Path, images_u8: np.ndarray, labels: list[str]) -> float:
    """Return top-1 accuracy of the ONNX model in ``model_dir`` on uint8 NHWC images (the
    run's shards, centre-cropped as serving does); ``labels`` are class names, scored by name."""
    card = read_artifact(str(Path(model_dir) / MODEL_CARD), ModelCard)
    spec = card.preprocess.to_spec()
    images_u8 = eval_view(images_u8, spec)
    session = ort.InferenceSession(
        str(Path(model_dir) / card.onnx_file), providers=["CPUExecutionProvider"]
    )
    name = session.get_inputs()[0].name
    correct = 0
    for start in range(0, len(images_u8), EVAL_BATCH):
        batch = slice(start, start + EVAL_BATCH)
        logits = session.run(None, {name: normalize(images_u8[batch], spec)})[0]
        predicted = [card.classes[i] for i in logits.argmax(1)]
        correct += sum(p == t for p, t in zip(predicted, labels[batch], strict=True))
    return correct / max(1, len(labels))
