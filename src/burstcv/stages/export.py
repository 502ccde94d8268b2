"""Export a run's trained weights to ONNX, proven equal to torch on real validation images."""

from __future__ import annotations

from typing import Any

from burstcv.params import RunParams
from burstcv.settings import Settings, get_settings
from burstcv.stages.data import val_arrays, val_rows
from burstcv.stages.resolve import resolved_run, run_layout
from burstcv_spec import storage
from burstcv_spec.contracts import Exported, RunRef, TrainingMetrics, read_artifact
from burstcv_spec.preprocess import PreprocessSpec

PARITY_IMAGES = 256


def export(
    run: RunRef, settings: Settings | None = None, *, overrides: dict[str, Any] | None = None
) -> Exported:
    """Export the run's trained weights to ONNX, proven equal to torch on real validation images.

    ``overrides`` are export params to use instead of the run's (``burstcv export``)."""
    from burstcv.export.onnx_export import export_model
    from burstcv.training.job import load_job

    s = settings or get_settings()
    paths = run_layout(run, s)
    params = resolved_run(run, s).params
    if overrides:
        params = RunParams.model_validate({**params.model_dump(), **overrides})
    job = load_job(paths.job_spec)
    images = [
        (path, storage.read_bytes(uri)) for path, uri, _ in val_rows(paths.manifest, PARITY_IMAGES)
    ]
    metrics = read_artifact(paths.metrics, TrainingMetrics)
    int8_inputs: dict[str, Any] = {}
    if params.int8:
        from burstcv.export.quantize import CALIBRATION_IMAGES
        from burstcv.training.stream import sample_split

        train_x, _ = sample_split(job.train_shards, job.classes, CALIBRATION_IMAGES)
        val_x, val_labels = val_arrays(job.val_shards, job.classes, s.eval_max_images)
        int8_inputs = {
            "int8": True,
            "calibration_images_u8": train_x,
            "eval_images_u8": val_x,
            "eval_labels": val_labels,
            "max_accuracy_drop": params.int8_max_accuracy_drop,
        }
    card = export_model(
        checkpoint_uri=paths.weights,
        out_uri=paths.model,
        arch=metrics.arch,  # as trained (auto resolved)
        classes=job.classes,
        spec=PreprocessSpec.from_dict(job.preprocess),
        parity_images=images,
        name=s.model_name,
        opset=s.onnx_opset,
        max_abs_diff=s.parity_max_abs_diff,
        metrics={"val_accuracy": metrics.val_accuracy, "val_loss": metrics.val_loss},
        dataset_fingerprint=job.dataset_fingerprint,
        run_id=run.airflow_run_id,
        pretrained=metrics.pretrained,  # as trained: the stem depends on it
        **int8_inputs,
    )
    assert card.parity is not None  # export_model always checks parity
    return Exported(
        model_dir=paths.model,
        sha256=card.sha256,
        parity_max_abs_diff=card.parity.max_abs_diff,
        onnx_file=card.onnx_file,
        quantization=card.quantization,
    )
