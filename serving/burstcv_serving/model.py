"""Load one verified, warmed model version into an immutable object that requests share.

A ``LoadedModel`` is never changed after it is built: swapping versions replaces the one
reference the service holds, so a batch that took the old reference finishes on it.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from burstcv_serving.registry import ModelRef, read_or_raise
from burstcv_spec.contracts import ModelCard
from burstcv_spec.layout import MODEL_CARD
from burstcv_spec.preprocess import PreprocessSpec, normalize
from burstcv_spec.storage import join, read_bytes

logger = logging.getLogger(__name__)

# onnxruntime raises its own exception classes (all direct Exception subclasses) for a model
# it cannot load or run; name them so that nothing else is swallowed with them.
ORT_ERRORS: tuple[type[BaseException], ...] = tuple(
    cls for cls in vars(ort_state).values() if inspect.isclass(cls) and issubclass(cls, Exception)
)


class ModelLoadError(RuntimeError):
    """Raise when a model version cannot serve; the message says what is wrong with it."""


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """Hold a ready session with the metadata and preprocessing it was exported with."""

    name: str
    version: int | str
    sha256: str
    classes: tuple[str, ...]
    metrics: Mapping[str, Any]
    spec: PreprocessSpec
    session: ort.InferenceSession = field(repr=False)
    input_name: str
    output_name: str
    outputs_logits: bool  # True: apply softmax; False: the graph already outputs probabilities
    max_batch_size: int
    loaded_at: datetime
    # Median seconds of one single-image session.run, measured while warming up: tells the
    # batcher whether a lone request may run on the event loop (see MicroBatcher.submit).
    single_latency_s: float = float("inf")
    # The latency SLO the gate held this version to (its registry entry), ms; None: none
    # recorded (a model directory, a version registered outside the pipeline).
    latency_slo_ms: float | None = None

    def predict_proba(self, images: np.ndarray) -> np.ndarray:
        """Return class probabilities (N, K) for uint8 NHWC images already at the spec's size."""
        chunks = []
        for start in range(0, len(images), self.max_batch_size):
            x = normalize(images[start : start + self.max_batch_size], self.spec)
            (out,) = self.session.run([self.output_name], {self.input_name: x})
            chunks.append(np.asarray(out, dtype=np.float32))
        scores = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
        return softmax(scores) if self.outputs_logits else scores

    def top_k(self, probabilities: np.ndarray, k: int) -> list[dict[str, Any]]:
        """Return the k most probable classes of one row, best first, as the API answers them."""
        best = np.argsort(-probabilities, kind="stable")[: min(k, len(self.classes))]
        return [
            {"label": self.classes[i], "index": int(i), "score": float(probabilities[i])}
            for i in best
        ]


def softmax(logits: np.ndarray) -> np.ndarray:
    """Return row-wise softmax, stable for large logits."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    result: np.ndarray = exp / exp.sum(axis=1, keepdims=True)
    return result


def load_model(
    ref: ModelRef,
    *,
    intra_op_threads: int,
    max_batch_size: int,
    spinning: bool = False,
) -> LoadedModel:
    """Read, verify, open and warm one model version; raise ModelLoadError saying why not."""
    meta_uri = join(ref.location, MODEL_CARD)
    card = read_or_raise(meta_uri, ModelCard, ModelLoadError)
    if isinstance(ref.version, int) and card.version not in (None, ref.version):
        raise ModelLoadError(
            f"{meta_uri} says version {card.version!r} but the alias points at {ref.version}"
        )
    onnx_uri = join(ref.location, card.onnx_file)
    try:
        onnx_bytes = read_bytes(onnx_uri)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {onnx_uri}: {exc}") from exc
    actual_sha = hashlib.sha256(onnx_bytes).hexdigest()
    for expected, says in ((card.sha256, "model.json"), (ref.expected_sha256, "the alias")):
        if expected and actual_sha != expected:
            raise ModelLoadError(
                f"sha256 mismatch for {onnx_uri}: file is {actual_sha[:12]}…, "
                f"{says} says {expected[:12]}…"
            )
    session = _open_session(onnx_bytes, onnx_uri, intra_op_threads, spinning)
    input_name, output_name = card.input.name, card.output.name
    if input_name not in {i.name for i in session.get_inputs()}:
        raise ModelLoadError(f"{onnx_uri} has no input named {input_name!r}")
    if output_name not in {o.name for o in session.get_outputs()}:
        raise ModelLoadError(f"{onnx_uri} has no output named {output_name!r}")
    model = LoadedModel(
        name=card.name,
        version=ref.version,
        sha256=actual_sha,
        classes=tuple(card.classes),
        metrics=MappingProxyType(dict(card.metrics)),
        spec=card.preprocess.to_spec(),  # checked when model.json was read
        session=session,
        input_name=input_name,
        output_name=output_name,
        outputs_logits=card.output.kind == "logits",
        max_batch_size=max_batch_size,
        loaded_at=datetime.now(UTC),
    )
    return replace(model, single_latency_s=_warm(model, onnx_uri))


def _open_session(
    onnx_bytes: bytes, onnx_uri: str, intra_op_threads: int, spinning: bool
) -> ort.InferenceSession:
    """Open a CPU session on the verified bytes, so the file cannot change after hashing."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    try:
        return ort.InferenceSession(
            onnx_bytes, sess_options=options, providers=["CPUExecutionProvider"]
        )
    except ORT_ERRORS as exc:
        raise ModelLoadError(f"onnxruntime cannot load {onnx_uri}: {exc}") from exc


def _warm(model: LoadedModel, onnx_uri: str) -> float:
    """Run a batch of one and a full batch, check one score per class; return the median
    seconds of a few single-image runs after them."""
    spec = model.spec
    for n in sorted({1, model.max_batch_size}):
        dummy = np.zeros((n, spec.height, spec.width, 3), dtype=np.uint8)
        try:
            probabilities = model.predict_proba(dummy)
        except ORT_ERRORS as exc:
            raise ModelLoadError(f"{onnx_uri} fails on a warm-up batch of {n}: {exc}") from exc
        if probabilities.shape != (n, len(model.classes)):
            raise ModelLoadError(
                f"{onnx_uri} returns shape {probabilities.shape} for a batch of {n}; expected "
                f"({n}, {len(model.classes)}) for {len(model.classes)} classes"
            )
        if not all(math.isfinite(v) for v in probabilities.ravel().tolist()):
            raise ModelLoadError(f"{onnx_uri} returns non-finite scores on a warm-up batch")
    one = np.zeros((1, spec.height, spec.width, 3), dtype=np.uint8)
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        model.predict_proba(one)
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)
