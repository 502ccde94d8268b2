"""Quantize an exported model to INT8 and serve it only where it is as accurate and faster,
both scored through serving's preprocessing and timed with the service's session settings.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx.external_data_helper import uses_external_data
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quant_pre_process,
    quantize_static,
)

from burstcv_spec import storage
from burstcv_spec.contracts import ModelCard, QuantizationBlock, QuantizedFigures
from burstcv_spec.preprocess import PreprocessSpec, eval_view, normalize

log = logging.getLogger(__name__)

FP32_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"
CALIBRATION_IMAGES = 256  # training images the INT8 ranges are calibrated on
CALIBRATION_BATCH = 32  # images per calibration step: bounds the augmented model's memory
EVAL_BATCH = 256  # images per session.run when scoring the validation split
LATENCY_WARMUP_RUNS = 30  # per engine, not timed: allocator and thread pool settle first
LATENCY_ROUNDS = 6  # engines alternate round by round, so drift on the host hits both
LATENCY_RUNS_PER_ROUND = 50  # batch-1 runs per engine per round (300 samples each in all)
ACCURACY_TOLERANCE = 1e-9  # accuracies are k/N floats: a drop of exactly the bound must pass


class QuantizationError(RuntimeError):
    """Raise when INT8 quantization cannot produce a valid, self-contained model."""


def host_cores() -> int:
    """Return the cores this process may use: the service's default intra-op thread count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def serving_session(path: str | Path, *, threads: int | None = None) -> ort.InferenceSession:
    """Open a CPU session with the service's settings (sequential, ENABLE_ALL, no spinning)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or host_cores()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def evenly_spaced(images_u8: np.ndarray, count: int) -> np.ndarray:
    """Pick ``count`` images spread over the array (shards are sorted by class: all get some)."""
    if len(images_u8) == 0:
        raise ValueError("no images to pick from")
    if count <= 0:
        raise ValueError(f"count must be positive, got {count}")
    if count >= len(images_u8):
        return images_u8
    picks = np.linspace(0, len(images_u8) - 1, num=count).round().astype(np.int64)
    return images_u8[picks]


class ImageCalibrationReader(CalibrationDataReader):  # type: ignore[misc]  # ORT ships no types
    """Feed uint8 NHWC images to the calibrator in batches, normalised exactly as serving does."""

    def __init__(self, images_u8: np.ndarray, spec: PreprocessSpec, input_name: str) -> None:
        self._images = images_u8
        self._spec = spec
        self._input_name = input_name
        self._start = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        """Return the next batch as ``{input_name: float32 NCHW}``, or None when done."""
        if self._start >= len(self._images):
            return None
        chunk = self._images[self._start : self._start + CALIBRATION_BATCH]
        self._start += CALIBRATION_BATCH
        return {self._input_name: normalize(chunk, self._spec)}

    def rewind(self) -> None:
        """Start again from the first batch."""
        self._start = 0


def quantize_int8(
    fp32_path: Path,
    int8_path: Path,
    calibration_u8: np.ndarray,
    spec: PreprocessSpec,
    input_name: str,
) -> None:
    """Write a static QDQ INT8 model (per-channel weights) as one file that passes the checker."""
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        # onnxruntime's recommended preparation: every tensor gets a known type and rank.
        quant_pre_process(str(fp32_path), str(prepared), save_as_external_data=False)
        quantize_static(
            str(prepared),
            str(int8_path),
            ImageCalibrationReader(calibration_u8, spec, input_name),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            # U8S8: VNNI kernels multiply u8 by s8 natively (S8S8 measured ~3x slower on an
            # EPYC); without VNNI U8S8 can saturate, and the accuracy gate refuses such a model.
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            use_external_data_format=False,
        )
    model = onnx.load(str(int8_path), load_external_data=False)
    external = [t.name for t in model.graph.initializer if uses_external_data(t)]
    if external:
        raise QuantizationError(
            f"INT8 model keeps {len(external)} tensor(s) in external data ({external[:3]}); "
            "expected one self-contained file"
        )
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise QuantizationError(f"INT8 model fails onnx.checker: {exc}") from exc


def predict(
    session: ort.InferenceSession, images_u8: np.ndarray, spec: PreprocessSpec
) -> np.ndarray:
    """Return the top-1 class index of each uint8 NHWC image through serving's preprocessing."""
    name = session.get_inputs()[0].name
    out = []
    for start in range(0, len(images_u8), EVAL_BATCH):
        batch = normalize(images_u8[start : start + EVAL_BATCH], spec)
        out.append(session.run(None, {name: batch})[0].argmax(1))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def accuracy(predicted: np.ndarray, labels: Sequence[str], classes: Sequence[str]) -> float:
    """Return top-1 accuracy, comparing class names (labels are names, not indices)."""
    if len(predicted) != len(labels):
        raise ValueError(f"{len(predicted)} predictions for {len(labels)} labels")
    names = np.asarray(list(classes), dtype=object)[predicted]
    return float(np.mean(names == np.asarray(list(labels), dtype=object))) if len(labels) else 0.0


def interleaved_latency_ms(
    sessions: dict[str, ort.InferenceSession], batch: np.ndarray
) -> dict[str, dict[str, float]]:
    """Time ``session.run`` on one input for each session, alternating engines round by round."""
    samples: dict[str, list[float]] = {label: [] for label in sessions}
    feeds = {label: {s.get_inputs()[0].name: batch} for label, s in sessions.items()}
    for label, session in sessions.items():
        for _ in range(LATENCY_WARMUP_RUNS):
            session.run(None, feeds[label])
    for _ in range(LATENCY_ROUNDS):
        for label, session in sessions.items():
            feed = feeds[label]
            for _ in range(LATENCY_RUNS_PER_ROUND):
                t0 = time.perf_counter()
                session.run(None, feed)
                samples[label].append((time.perf_counter() - t0) * 1000.0)
    return {
        label: {
            "p50_ms": float(np.percentile(values, 50)),
            "mean_ms": float(np.mean(values)),
            "runs": len(values),
        }
        for label, values in samples.items()
    }


def choose(
    fp32: QuantizedFigures, int8: QuantizedFigures, max_accuracy_drop: float
) -> tuple[bool, str]:
    """Return (keep INT8?, why): kept only if accuracy drops ≤ the bound and p50 is lower."""
    drop = fp32.accuracy - int8.accuracy
    speedup = fp32.p50_ms / int8.p50_ms if int8.p50_ms > 0 else float("inf")
    accurate = drop <= max_accuracy_drop + ACCURACY_TOLERANCE
    faster = int8.p50_ms < fp32.p50_ms
    figures = (
        f"accuracy {fp32.accuracy:.4f} -> {int8.accuracy:.4f} (drop {drop:+.4f}, bound "
        f"{max_accuracy_drop:.4f}); batch-1 p50 {fp32.p50_ms:.3f} -> {int8.p50_ms:.3f} ms "
        f"({speedup:.2f}x)"
    )
    if accurate and faster:
        return True, f"INT8 kept: {figures}"
    why = []
    if not accurate:
        why.append("accuracy drop exceeds the bound")
    if not faster:
        why.append("INT8 is not faster")
    return False, f"FP32 kept ({' and '.join(why)}): {figures}"


def _centre_if_margin(images_u8: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    if images_u8.ndim == 4 and images_u8.shape[1:3] == spec.stored_size:
        return np.ascontiguousarray(eval_view(images_u8, spec))
    return images_u8


def _checked_images(
    spec: PreprocessSpec,
    classes: list[str],
    train_images_u8: np.ndarray,
    val_images_u8: np.ndarray,
    val_labels: Sequence[str],
) -> tuple[np.ndarray, np.ndarray]:
    """Return the training and validation images as serving sees them; raise if they do not fit."""
    if spec.resize_short is not None:  # shards packed with the margin: serving sees the centre
        train_images_u8 = _centre_if_margin(train_images_u8, spec)
        val_images_u8 = _centre_if_margin(val_images_u8, spec)
    for what, images in (("training", train_images_u8), ("validation", val_images_u8)):
        if images.dtype != np.uint8 or images.shape[1:] != (spec.height, spec.width, 3):
            raise ValueError(
                f"{what} images are {images.dtype} {images.shape}; expected uint8 "
                f"N x {spec.height} x {spec.width} x 3"
            )
    if len(val_images_u8) != len(val_labels) or not len(val_labels):
        raise ValueError(f"{len(val_images_u8)} validation images for {len(val_labels)} labels")
    unknown = sorted(set(map(str, val_labels)) - set(classes))
    if unknown:
        raise ValueError(f"validation labels {unknown[:5]} are not among the classes {classes}")
    return train_images_u8, val_images_u8


def quantize_in_folder(
    folder: Path,
    card: ModelCard,
    train_images_u8: np.ndarray,
    val_images_u8: np.ndarray,
    val_labels: Sequence[str],
    *,
    max_accuracy_drop: float = 0.01,
    calibration_images: int = CALIBRATION_IMAGES,
) -> ModelCard:
    """Try INT8 beside ``folder/model.onnx``; return the card with the file that serves (writes
    ``folder/model.int8.onnx`` whatever the verdict: the caller decides what to keep)."""
    spec, classes = card.preprocess.to_spec(), card.classes
    train_images_u8, val_images_u8 = _checked_images(
        spec, classes, train_images_u8, val_images_u8, val_labels
    )
    fp32_path, int8_path = folder / FP32_FILE, folder / INT8_FILE
    calibration = evenly_spaced(train_images_u8, calibration_images)
    started = time.perf_counter()
    quantize_int8(fp32_path, int8_path, calibration, spec, card.input.name)
    log.info(
        "quantized %s to INT8 (QDQ, per-channel) with %d calibration images in %.1fs",
        fp32_path.name,
        len(calibration),
        time.perf_counter() - started,
    )
    sessions = {"fp32": serving_session(fp32_path), "int8": serving_session(int8_path)}
    predicted = {label: predict(s, val_images_u8, spec) for label, s in sessions.items()}
    latency = interleaved_latency_ms(sessions, normalize(val_images_u8[:1], spec))
    figures = {
        label: QuantizedFigures(
            accuracy=accuracy(predicted[label], val_labels, classes),
            p50_ms=latency[label]["p50_ms"],
            mean_ms=latency[label]["mean_ms"],
            file=path.name,
            sha256=storage.sha256_file(path),
        )
        for label, path in (("fp32", fp32_path), ("int8", int8_path))
    }
    keep, reason = choose(figures["fp32"], figures["int8"], max_accuracy_drop)
    serving = figures["int8" if keep else "fp32"]
    block = QuantizationBlock(
        int8_tried=True,
        serving_file=serving.file,
        reason=reason,
        fp32=figures["fp32"],
        int8=figures["int8"],
        max_accuracy_drop=max_accuracy_drop,
        top1_agreement=float(np.mean(predicted["fp32"] == predicted["int8"])),
        eval_images=len(val_labels),
        calibration_images=len(calibration),
        method={
            "format": "QDQ",
            "weights": "int8 per-channel",
            "activations": "uint8 per-tensor",
            "calibration": "MinMax",
        },
        latency={
            "batch": 1,
            "threads": host_cores(),
            "runs": int(latency["fp32"]["runs"]),
            "where": "in-process onnxruntime, the service's session settings",
        },
    )
    log.info("%s", reason)
    return card.model_copy(
        update={"onnx_file": serving.file, "sha256": serving.sha256, "quantization": block}
    )
