"""Convert a trained checkpoint to ONNX and prove the final file equals it on real images, fed
to onnxruntime through serving's preprocessing and to torch through training's.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

from burstcv import lineage
from burstcv.training.models import build_model
from burstcv.training.names import PRETRAINED_NONE, is_pretrained
from burstcv.training.train import normalize as torch_normalize
from burstcv.training.weights import PretrainedError, read_state_dict
from burstcv_spec import storage
from burstcv_spec.contracts import (
    ModelCard,
    ParityBlock,
    PreprocessBlock,
    TensorInput,
    TensorOutput,
    write_artifact,
)
from burstcv_spec.layout import MODEL_CARD
from burstcv_spec.preprocess import PreprocessSpec, decode_to_uint8
from burstcv_spec.preprocess import normalize as numpy_normalize

log = logging.getLogger(__name__)

INPUT_NAME = "input"
OUTPUT_NAME = "logits"
PARITY_IMAGES = 256  # enough to exercise every class; cheap on CPU
MODEL_JSON_FORMAT = 1


class CheckpointError(ValueError):
    """Raise when a checkpoint is not a plain state dict of tensors (never unpickle objects)."""


class ParityError(AssertionError):
    """Raise when onnxruntime and torch disagree on a real image."""


def load_state_dict(data: bytes) -> dict[str, torch.Tensor]:
    """Load a checkpoint with ``weights_only=True`` and refuse anything but name→tensor."""
    try:
        return read_state_dict(data, "checkpoint")
    except PretrainedError as exc:
        raise CheckpointError(str(exc)) from exc


def export_onnx(model: torch.nn.Module, spec: PreprocessSpec, out_path: Path, opset: int) -> None:
    """Export with the dynamo exporter: dynamic batch axis, fixed opset, one self-contained file."""
    model.eval()
    example = torch.zeros(2, 3, spec.height, spec.width)
    batch = torch.export.Dim("batch", min=1, max=65536)
    program = torch.onnx.export(
        model,
        (example,),
        dynamo=True,
        input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME],
        dynamic_shapes=({0: batch},),
        opset_version=opset,
        optimize=True,
        external_data=False,
        verbose=False,
    )
    if program is None:
        raise RuntimeError("torch.onnx.export returned no program")
    program.save(str(out_path), external_data=False)
    onnx.checker.check_model(onnx.load(str(out_path)), full_check=True)


def optimize_offline(src: Path, dst: Path) -> None:
    """Save onnxruntime's basic graph optimisations (portable across CPUs): fast service start."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])
    onnx.checker.check_model(onnx.load(str(dst)), full_check=True)


def check_parity(
    model: torch.nn.Module,
    onnx_path: Path,
    serving_spec: PreprocessSpec,
    training_spec: PreprocessSpec,
    images: list[tuple[str, bytes]],
    *,
    max_abs_diff: float,
) -> ParityBlock:
    """Compare torch and onnxruntime logits image by image; raise ParityError on a mismatch."""
    if not images:
        raise ParityError("no validation images to check parity on")
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    names = [name for name, _ in images]
    serve_u8 = np.stack([decode_to_uint8(data, serving_spec) for _, data in images])
    try:
        onnx_logits = session.run(
            [OUTPUT_NAME], {INPUT_NAME: numpy_normalize(serve_u8, serving_spec)}
        )[0]
    except InvalidArgument as exc:  # e.g. model.json's size is not the graph's input size
        raise ParityError(
            f"onnxruntime refused the batch that model.json's preprocessing makes "
            f"({serve_u8.shape[1]}x{serve_u8.shape[2]} from {names[0]}): {exc}"
        ) from exc
    train_u8 = np.stack([decode_to_uint8(data, training_spec) for _, data in images])
    mean = torch.tensor(training_spec.mean, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(training_spec.std, dtype=torch.float32).view(1, 3, 1, 1)
    with torch.no_grad():
        x = torch_normalize(
            torch.from_numpy(train_u8).permute(0, 3, 1, 2), mean, std, training_spec.scale
        )
        torch_logits = model.eval()(x).numpy()
    diff = np.abs(onnx_logits - torch_logits).max(axis=1)
    # fp32 rounding grows with the logits' magnitude: the bound is absolute up to |logit| 1 and
    # relative beyond (a preprocessing mistake moves logits by far more than 1e-3 of their size).
    scale = np.maximum(1.0, np.abs(torch_logits).max(axis=1))
    worst = int((diff / scale).argmax())
    mismatches = [names[i] for i in np.flatnonzero(onnx_logits.argmax(1) != torch_logits.argmax(1))]
    report = ParityBlock(
        images=len(images),
        max_abs_diff=float(diff.max()),
        worst_input=names[worst],
        top1_mismatches=mismatches,
    )
    if diff[worst] > max_abs_diff * scale[worst] or mismatches:
        bound = f"{max_abs_diff:.3g}" + (
            f" x |logit| {scale[worst]:.3g}" if scale[worst] > 1 else ""
        )
        raise ParityError(
            f"ONNX differs from torch: |Δlogit| {diff[worst]:.3g} (bound {bound}) worst on "
            f"{report.worst_input}; top-1 differs on {len(mismatches)} image(s) {mismatches[:5]}"
        )
    return report


def _load_model(
    checkpoint_uri: str, arch: str, classes: list[str], height: int, pretrained: str
) -> torch.nn.Module:
    """Return the checkpoint's model in eval mode, built as training built it."""
    state = load_state_dict(storage.read_bytes(checkpoint_uri))
    model = build_model(arch, len(classes), height, pretrained=is_pretrained(pretrained))
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(
            f"checkpoint does not fit {arch} with {len(classes)} classes: {exc}"
        ) from exc
    return model.eval()


def _model_card(
    onnx_path: Path,
    name: str,
    arch: str,
    classes: list[str],
    spec: PreprocessSpec,
    opset: int,
    metrics: dict[str, Any] | None,
    dataset_fingerprint: str,
    run_id: str,
) -> ModelCard:
    """Return model.json for the ONNX file at ``onnx_path``, before its parity check."""
    return ModelCard(
        format_version=MODEL_JSON_FORMAT,
        name=name,
        arch=arch,
        classes=list(classes),
        onnx_file="model.onnx",
        sha256=storage.sha256_file(onnx_path),
        opset=opset,
        input=TensorInput(
            name=INPUT_NAME, shape=[None, 3, spec.height, spec.width], dtype="float32"
        ),
        output=TensorOutput(name=OUTPUT_NAME, kind="logits"),
        preprocess=PreprocessBlock.of(spec),
        metrics={k: v for k, v in (metrics or {}).items() if isinstance(v, int | float)},
        dataset_fingerprint=dataset_fingerprint,
        source_commit=lineage.source_commit(),
        run_id=run_id,
        created_at=lineage.utc_now_iso(),
        versions={
            "torch": torch.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": ort.__version__,
        },
    )


def export_model(
    *,
    checkpoint_uri: str,
    out_uri: str,
    arch: str,
    classes: list[str],
    spec: PreprocessSpec,
    parity_images: list[tuple[str, bytes]],
    name: str,
    opset: int = 18,
    max_abs_diff: float = 1e-3,
    metrics: dict[str, Any] | None = None,
    dataset_fingerprint: str = "",
    run_id: str = "",
    int8: bool = False,
    calibration_images_u8: np.ndarray | None = None,
    eval_images_u8: np.ndarray | None = None,
    eval_labels: list[str] | None = None,
    max_accuracy_drop: float = 0.01,
    calibration_images: int = 256,
    pretrained: str = PRETRAINED_NONE,
) -> ModelCard:
    """Export a checkpoint to ``<out_uri>/model.onnx`` + model.json after the parity gate passes."""
    if int8 and (calibration_images_u8 is None or eval_images_u8 is None or eval_labels is None):
        raise ValueError(
            "int8=True needs calibration_images_u8 (training images), eval_images_u8 and "
            "eval_labels (validation images and their class names)"
        )
    model = _load_model(checkpoint_uri, arch, classes, spec.height, pretrained)
    with tempfile.TemporaryDirectory() as tmp:
        raw, final = Path(tmp) / "raw.onnx", Path(tmp) / "model.onnx"
        export_onnx(model, spec, raw, opset)
        optimize_offline(raw, final)
        card = _model_card(
            final, name, arch, classes, spec, opset, metrics, dataset_fingerprint, run_id
        )
        # Parity reads the spec back from model.json as serving will, not from memory.
        serving_spec = ModelCard.model_validate_json(card.model_dump_json()).preprocess.to_spec()
        parity = check_parity(
            model, final, serving_spec, spec, parity_images, max_abs_diff=max_abs_diff
        )
        card = card.model_copy(update={"parity": parity})
        if int8:
            # Imported here: onnxruntime.quantization is only needed when INT8 is asked for.
            from burstcv.export.quantize import quantize_in_folder

            assert calibration_images_u8 is not None and eval_images_u8 is not None
            assert eval_labels is not None
            card = quantize_in_folder(
                final.parent,
                card,
                calibration_images_u8,
                eval_images_u8,
                eval_labels,
                max_accuracy_drop=max_accuracy_drop,
                calibration_images=calibration_images,
            )
        for file in dict.fromkeys(("model.onnx", card.onnx_file)):  # and the INT8 one serving
            storage.upload_file(final.parent / file, storage.join(out_uri, file))
    write_artifact(storage.join(out_uri, MODEL_CARD), card)
    log.info(
        "exported %s (sha256 %s…): parity max |Δ| %.2g on %d images",
        storage.join(out_uri, card.onnx_file),
        card.sha256[:12],
        parity.max_abs_diff,
        parity.images,
    )
    return card
