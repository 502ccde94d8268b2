"""Define the run parameters: what one pipeline run may choose, with bounds and one default each.

``RunParams`` is the one definition behind the DAG's trigger form (``burstcv.airflow.form``),
the command line's options (``burstcv.cli``) and the params table of docs/airflow.md
(``params_table``). Each default is written once: a deployment fact comes from the settings
(``default_from``), a training choice from ``JobSpec``, a data check from ``ValidationConfig``;
the rest are written here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    field_validator,
    model_validator,
)

from burstcv.data.config import (
    DEFAULT_CHUNK_FILES,
    DEFAULT_CHUNK_MB,
    MAX_IMAGE_SIZE,
    MIN_IMAGE_SIZE,
    ValidationConfig,
)
from burstcv.settings import BackendName, Ec2Settings, Settings, get_settings
from burstcv.training import recipe as R
from burstcv.training.job import JobSpec
from burstcv.training.names import (
    ARCHITECTURE_NAMES,
    FREEZE_NEEDS_WEIGHTS,
    MODEL_AUTO,
    PRETRAINED_AUTO,
    check_architecture,
    pretrained_kind,
    pretrained_value,
)
from burstcv_spec.contracts import RunRecord, TrainingChoice

# Form sections (Airflow's ``section``): fields without one are on the first, open one.
SECTION_TRAINING = "Training details"
SECTION_DATA = "Data checks"
SECTION_GATE = "Gate details"
SECTION_SCALE = "Scale-out"
SECTION_SIZING = "Fleet sizing"


class Affects(StrEnum):
    """Say what a run param changes; every RunParams field declares one (a test checks).

    "Nothing new to train on" compares the MODEL and EXPORT params with production's.
    """

    MODEL = "model"  # what training makes of the same data
    EXPORT = "export"  # what export makes of the trained model (which file serves)
    RUN = "run"  # where and within which limits the run goes, what it checks and gates


_JOB_DEFAULTS: dict[str, Any] = {name: f.default for name, f in JobSpec.model_fields.items()}
_CHECK_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(ValidationConfig)}
_BACKEND: TypeAdapter[BackendName] = TypeAdapter(BackendName)
# JSON-schema bounds. The form keeps them under ``allOf``, where Airflow's validation applies
# them but the UI's number input, which would clamp a value instead of refusing it, does not.
BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _deployment_value(setting: str, settings: Settings | None = None) -> Any:
    """Return the value of a deployment setting named by its variable (``BURSTCV_...``)."""
    if setting.startswith("BURSTCV_EC2_"):
        value = getattr(Ec2Settings(), setting.removeprefix("BURSTCV_EC2_").lower())
        return list(value) if isinstance(value, tuple) else value
    return getattr(settings or get_settings(), setting.removeprefix("BURSTCV_").lower())


# The form's own keys, beside the standard ones, in a field's JSON schema (in this order).
_FORM_KEYS = ("default_from", "section", "auto", "maximum_from", "enum")


def _param(default: Any, title: str, description: str, **kwargs: Any) -> Any:
    """Return a RunParams field; its ``_FORM_KEYS`` go into its JSON schema for the form."""
    extra = {key: kwargs.pop(key) for key in _FORM_KEYS if key in kwargs}
    if "default_from" in extra:
        setting = extra["default_from"]
        kwargs["default_factory"] = lambda: _deployment_value(setting)
    else:
        kwargs["default"] = default
    return Field(title=title, description=description, json_schema_extra=extra or None, **kwargs)


def _from_deployment(setting: str, title: str, description: str, **kwargs: Any) -> Any:
    """Return a RunParams field whose default is the deployment's setting of that name."""
    return _param(None, title, description, default_from=setting, **kwargs)


def _data_check(name: str, title: str, description: str, **kwargs: Any) -> Any:
    """Return a data check's field: ValidationConfig's default of the same name."""
    return _param(_CHECK_DEFAULTS[name], title, description, section=SECTION_DATA, **kwargs)


_training = functools.partial(_param, section=SECTION_TRAINING)
_scale_out = functools.partial(_param, section=SECTION_SCALE)
_gate = functools.partial(_param, section=SECTION_GATE)
_sizing = functools.partial(_param, section=SECTION_SIZING)
_TOO_SMALL = "smaller images carry no signal after resizing"
_TOO_LARGE = "the service refuses images over 4096x4096 pixels"
# Ranges that several fields share (a field's own range is written in its type).
Share = Annotated[float, Field(ge=0, le=1)]
ImageSide = Annotated[int, Field(ge=1, le=4096)]


# Boxes one run may train on together: a cluster placement group holds this many of one type.
MAX_NUM_NODES = 16


class RunParams(BaseModel):
    """Hold one run's choices; an unknown name is refused, never ignored."""

    model_config = ConfigDict(extra="forbid")

    # The form's first section: what most runs change.
    dataset_uri: Annotated[str, Affects.RUN, Field(min_length=1)] = _from_deployment(
        "BURSTCV_DATASET_URI",
        "Dataset URI",
        "ImageFolder root: <root>/{train,val}/<class>/<image>; a folder or s3://",
    )
    model: Annotated[str, Affects.MODEL] = _param(
        MODEL_AUTO,
        "Model",
        f"torchvision architecture to train; auto: {R.PHOTO_MODEL} for photos (it "
        f"has ImageNet weights), {R.SMALL_IMAGE_MODEL} for small images such as the digits",
        enum=[MODEL_AUTO, *ARCHITECTURE_NAMES],
    )
    pretrained: Annotated[str, Affects.MODEL, Field(min_length=1)] = _param(
        PRETRAINED_AUTO,
        "Pretrained weights",
        "auto: for photos, the model's ImageNet weights, fetched once into the "
        "artifact store at validate (from scratch, with a warning, where they cannot be "
        "fetched); none: train from scratch; a torchvision weights name of the model "
        "(DEFAULT, IMAGENET1K_V2, ...), kept in the artifact store by sha256 after the first "
        "download; or the URI of a state_dict (a path, file://, s3://), loaded weights-only",
    )
    image_size: Annotated[
        int | None, Affects.MODEL, Field(ge=MIN_IMAGE_SIZE, le=MAX_IMAGE_SIZE)
    ] = _param(
        None,
        "Image size (px)",
        "the square resolution the model trains and serves at; empty: chosen "
        "from the validated data (the median short side, at most 224, never upscaling)",
    )
    epochs: Annotated[int | None, Affects.MODEL, Field(ge=1, le=500)] = _param(
        None,
        "Epochs",
        "passes over the training split; empty: auto, enough that a small "
        f"training set is seen {R.IMAGES_SEEN:,} images' worth ({R.MIN_EPOCHS} to "
        f"{R.MAX_EPOCHS}); early stopping or the time budget may stop training earlier",
        auto=True,
    )
    compute_backend: Annotated[BackendName, Affects.RUN] = _from_deployment(
        "BURSTCV_COMPUTE_BACKEND",
        "Compute backend",
        "local: a process on the worker; ec2: ephemeral GPU instances",
    )
    instance_types: Annotated[list[str], Affects.RUN, Field(min_length=1)] = _from_deployment(
        "BURSTCV_EC2_INSTANCE_TYPES",
        "GPU instance types",
        "EC2 types in order of preference",
    )
    use_spot: Annotated[bool, Affects.RUN] = _from_deployment(
        "BURSTCV_EC2_USE_SPOT",
        "Use spot instances",
        "spot on every type first, then on-demand on every type",
    )
    # A run takes a slot of the GPU pool per box (burstcv.airflow.policy): more boxes than the
    # pool has slots would never be scheduled (maximum_from).
    num_nodes: Annotated[int, Affects.RUN, Field(ge=1, le=MAX_NUM_NODES)] = _from_deployment(
        "BURSTCV_NUM_NODES",
        "Training boxes",
        "boxes of one type that train together (ec2): one placement group, "
        "torchrun rendezvous on the first box, each box reading its own share of the "
        "training shards; rank 0 writes the checkpoints and markers, and losing one box "
        "relaunches them all. The budget, the GPU pool's slots and the bill count every box",
        maximum_from="BURSTCV_GPU_POOL_SLOTS",
    )
    max_cost_usd: Annotated[float, Affects.RUN, Field(gt=0, le=10_000)] = _param(
        5.0,
        "Max cost (USD)",
        "per-run budget, every box of every attempt (instance, root volume and "
        "public IPv4); bounds the deadline the boxes' watchdog is armed from",
    )
    latency_slo_ms: Annotated[float, Affects.RUN, Field(gt=0)] = _param(
        50.0, "Latency SLO (ms)", "p95 over HTTP, one image per request, the gate's limit"
    )
    target_rps: Annotated[float, Affects.RUN, Field(gt=0, le=1_000_000)] = _param(
        10.0,
        "Expected peak load (req/s)",
        "the load the CPU serving fleet is sized for: the benchmark measures the "
        "rate each CPU size sustains within the SLO, and the gate names the cheapest fleet",
    )
    serving_families: Annotated[list[str], Affects.RUN, Field(min_length=1)] = _param(
        ["c7i", "m7i"],
        "CPU instance families",
        "the EC2 families the serving fleet may use (x86_64: c7i compute, m7i general purpose; "
        "Graviton: c7g, m7g, c8g, measured on their own boxes when sized on ec2)",
    )
    accuracy_floor: Annotated[Share, Affects.RUN] = _param(
        0.9, "Accuracy floor", "validation top-1 the candidate must reach"
    )
    int8: Annotated[bool, Affects.EXPORT] = _param(
        True,
        "Try INT8",
        "also export a static INT8 model; it serves only if as accurate (within "
        "the INT8 accuracy drop) and faster",
    )
    promote: Annotated[bool, Affects.RUN] = _param(
        True, "Promote", "deploy the candidate if it passes the gate (off: gate and register only)"
    )
    force_train: Annotated[bool, Affects.RUN] = _param(
        False,
        "Force training",
        "train even when the dataset and training params are production's "
        "(otherwise such a run ends after validation, renting nothing)",
    )

    # Training details.
    batch_size: Annotated[int | None, Affects.MODEL, Field(ge=8, le=8192)] = _training(
        None,
        "Batch size",
        "images per optimizer step on each GPU (batch scaling per_gpu) or over "
        f"all of them (global); empty: auto, the largest power of two up to {R.MAX_BATCH} "
        f"that gives an epoch {R.MIN_STEPS_PER_EPOCH} steps",
        auto=True,
    )
    batch_scaling: Annotated[R.BatchScaling, Affects.MODEL] = _training(
        "per_gpu",
        "Batch scaling",
        "per_gpu: batch_size is each GPU's, so more GPUs (boxes, or GPUs a box) "
        "step over more images, fewer steps an epoch, at a learning rate scaled by the rule "
        "(linear for SGD, square root for AdamW; in metrics.json); global: batch_size is "
        "split between the GPUs, the rate as chosen",
    )
    learning_rate: Annotated[float | None, Affects.MODEL, Field(gt=0, le=10)] = _training(
        None,
        "Learning rate",
        "peak of the schedule (linear warm-up, cosine decay); empty: auto, scaled "
        f"with the batch (AdamW {R.ADAMW_LR_AT_32:g} x sqrt(batch/32), SGD "
        f"{R.SGD_LR_PER_256:g} x batch/256)",
        auto=True,
    )
    optimizer: Annotated[Literal["auto", "sgd", "adamw"], Affects.MODEL] = _training(
        "auto",
        "Optimizer",
        f"auto: AdamW for runs under {R.SGD_MIN_STEPS:,} steps, SGD with Nesterov "
        "momentum for longer ones",
    )
    warmup_steps: Annotated[int | None, Affects.MODEL, Field(ge=0, le=100_000)] = _training(
        None,
        "Warm-up steps",
        "optimizer steps of linear warm-up; empty: auto, a quarter of the run, at "
        f"most max(3 epochs, {R.MIN_WARMUP_CAP_STEPS} steps)",
        auto=True,
    )
    early_stop_patience: Annotated[int | None, Affects.MODEL, Field(ge=1, le=500)] = _training(
        None,
        "Early-stop patience (epochs)",
        "stop when validation accuracy has not improved for this many epochs "
        "(the best epoch is exported either way); empty: auto, a quarter of the epochs, at "
        f"least {R.MIN_PATIENCE}",
        auto=True,
    )
    lr_range_test: Annotated[bool, Affects.MODEL] = _training(
        _JOB_DEFAULTS["lr_range_test"],
        "Learning-rate range test",
        "sweep the rate over at most 100 steps on the training box before "
        "training, and train at the lower of a tenth of the lowest-loss rate and the rate of "
        "the steepest descent (its seconds are "
        "counted; the rate is in metrics.json and the report); learning_rate is the fallback",
    )
    freeze_backbone_epochs: Annotated[int, Affects.MODEL, Field(ge=0, le=500)] = _training(
        _JOB_DEFAULTS["freeze_backbone_epochs"],
        "Frozen-backbone epochs",
        "pretrained runs: first epochs that train the new head alone",
    )
    backbone_lr_scale: Annotated[float, Affects.MODEL, Field(gt=0, le=1)] = _training(
        _JOB_DEFAULTS["backbone_lr_scale"],
        "Backbone learning-rate scale",
        "pretrained runs: the backbone's learning rate over the head's",
    )
    seed: Annotated[int, Affects.MODEL, Field(ge=0)] = _training(
        _JOB_DEFAULTS["seed"],
        "Seed",
        "random seed of initialisation, shuffling and augmentation",
    )
    # The train task's timeout is set from the setting: a longer budget would be cut short.
    time_budget_s: Annotated[int, Affects.RUN, Field(ge=60, le=7 * 24 * 3600)] = _from_deployment(
        "BURSTCV_TRAIN_TIMEOUT_S",
        "Time budget (s)",
        "the run's training deadline, every attempt and the box's boot included "
        "(the max cost may lower it); at most the train task's timeout",
        section=SECTION_TRAINING,
        maximum_from="BURSTCV_TRAIN_TIMEOUT_S",
    )

    # Data checks (ValidationConfig's names and defaults).
    expected_classes: Annotated[list[str], Affects.MODEL] = _param(
        [],
        "Expected classes",
        "class folder names the dataset must have, exactly; empty: the class folders found",
        section=SECTION_DATA,
    )
    min_images_per_class: Annotated[int, Affects.RUN, Field(ge=1)] = _data_check(
        "min_images_per_class",
        "Min images per class",
        "in every split: fewer cannot train or measure a class",
    )
    min_total_images: Annotated[int, Affects.RUN, Field(ge=1)] = _data_check(
        "min_total_images", "Min total images", "usable images over all splits"
    )
    max_imbalance_ratio: Annotated[float, Affects.RUN, Field(ge=1)] = _data_check(
        "max_imbalance_ratio",
        "Max class imbalance",
        "largest class / smallest class, per split",
    )
    min_width: Annotated[ImageSide, Affects.RUN] = _data_check(
        "min_width", "Min image width (px)", _TOO_SMALL
    )
    max_width: Annotated[ImageSide, Affects.RUN] = _data_check(
        "max_width", "Max image width (px)", _TOO_LARGE
    )
    min_height: Annotated[ImageSide, Affects.RUN] = _data_check(
        "min_height", "Min image height (px)", _TOO_SMALL
    )
    max_height: Annotated[ImageSide, Affects.RUN] = _data_check(
        "max_height", "Max image height (px)", _TOO_LARGE
    )
    near_duplicate_max_distance: Annotated[int | None, Affects.RUN, Field(ge=0, le=16)] = (
        _data_check(
            "near_duplicate_max_distance",
            "Near-duplicate distance (bits)",
            "difference-hash bits within which an image in one split counts as a copy "
            "of one in another (0: the same hash); empty: no near-duplicate check",
        )
    )
    drift_max: Annotated[float | None, Affects.RUN, Field(ge=0)] = _data_check(
        "drift_max",
        "Max drift",
        "drift score (class proportions, image size) against the last dataset "
        "that passed, above which validation fails; empty: only warn",
    )

    # Scale-out: how validate and pack spread over Airflow's workers.
    chunk_files: Annotated[int, Affects.RUN, Field(ge=1, le=10_000_000)] = _scale_out(
        DEFAULT_CHUNK_FILES,
        "Files per chunk",
        "validate and pack split the dataset into chunks of at most this many "
        "files, one mapped task each (spread over the workers by a CeleryExecutor); a dataset "
        "under both limits is one chunk",
    )
    chunk_mb: Annotated[int, Affects.RUN, Field(ge=1, le=10_000_000)] = _scale_out(
        DEFAULT_CHUNK_MB,
        "MB per chunk",
        "and of at most this many MB of image files",
    )

    # Gate details.
    max_accuracy_drop: Annotated[Share, Affects.RUN] = _gate(
        0.02,
        "Max accuracy drop",
        "accuracy the candidate may lose against the production model",
    )
    int8_max_accuracy_drop: Annotated[Share, Affects.EXPORT] = _gate(
        0.01,
        "INT8 max accuracy drop",
        "accuracy the INT8 model may lose against the FP32 one and still serve",
    )

    # Fleet sizing.
    size_on: Annotated[Literal["auto", "host", "ec2"], Affects.RUN] = _sizing(
        "auto",
        "Size the fleet on",
        "host: the benchmark's worker measures the model, its figures stand for "
        "every CPU type; ec2: one short-lived box per candidate type (x86 or Graviton) "
        "measures it on its own CPUs, in the run's budget and bill; auto: ec2 when the run "
        "trains on ec2 (its artifacts in S3), else host",
    )
    sizing_boxes: Annotated[int, Affects.RUN, Field(ge=1, le=8)] = _sizing(
        3,
        "Types sized on boxes",
        "candidate CPU types measured on boxes of their own (size on ec2): the "
        "cheapest fleets the worker's figures say could serve the load",
    )
    sizing_max_s: Annotated[int, Affects.RUN, Field(ge=300, le=3600)] = _sizing(
        900,
        "Sizing time bound (s)",
        "how long the sizing boxes may take (size on ec2): no box outlives it by "
        "more than its watchdog's margin; a type without figures by then is skipped",
    )

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        return value if value == MODEL_AUTO else check_architecture(value)

    @field_validator("pretrained")
    @classmethod
    def _pretrained_form(cls, value: str) -> str:
        # The form of the value; check_weights vets the weights themselves.
        return pretrained_value(value, auto_allowed=True)

    @model_validator(mode="after")
    def _data_checks_make_sense(self) -> RunParams:
        self.validation_config()  # raises ValueError naming what cannot be met
        return self

    def check_compute(self) -> None:
        """Raise a one-line ValueError if the run's boxes cannot be had from its backend."""
        if self.num_nodes > 1 and self.compute_backend != "ec2":
            raise ValueError(
                f"num_nodes {self.num_nodes} needs the ec2 compute backend (the "
                f"{self.compute_backend} backend trains on this one machine); set num_nodes 1"
            )

    def sizes_on(self, artifact_root: str) -> Literal["host", "ec2"]:
        """Return where the serving fleet is measured: ``size_on``, auto resolved."""
        if self.size_on != "auto":
            return self.size_on
        on_ec2 = self.compute_backend == "ec2" and artifact_root.startswith("s3://")
        return "ec2" if on_ec2 else "host"

    def check_weights(self, model: str | None = None, pretrained: str | None = None) -> None:
        """Raise a one-line ValueError if the pretrained choice cannot seed the model; no GPU.

        A cross-field check the form cannot express, made before renting anything; ``model``
        and ``pretrained`` are the values chosen where the run left them on auto.
        """
        model = model or self.model
        pretrained = pretrained or self.pretrained
        kind = pretrained_kind(pretrained)
        if self.freeze_backbone_epochs and kind == "none":
            raise ValueError(
                FREEZE_NEEDS_WEIGHTS
                + (" (pretrained auto found none to use)" if self.pretrained != pretrained else "")
            )
        if kind not in ("none", "auto") and model != MODEL_AUTO:
            from burstcv.training.weights import check_pretrained

            check_pretrained(model, pretrained)

    def validation_config(self) -> ValidationConfig:
        """Return the dataset gate's thresholds for this run."""
        return ValidationConfig(
            expected_classes=self.expected_classes or None,
            **{name: getattr(self, name) for name in DATA_CHECKS},
        )

    @classmethod
    def defaults(cls, settings: Settings | None = None) -> dict[str, Any]:
        """Return every field's default (JSON-ready), deployment facts read from ``settings``."""
        return {
            name: _deployment_value(spec.default_from, settings)
            if spec.default_from
            else spec.default
            for name, spec in run_fields().items()
        }

    @classmethod
    def backend_of(cls, given: dict[str, Any], settings: Settings | None = None) -> BackendName:
        """Return a run's compute backend alone, whatever its other values.

        A failed provision's clean-up must run even when another field was refused.
        """
        value = given.get("compute_backend")
        if value is None:
            value = _deployment_value("BURSTCV_COMPUTE_BACKEND", settings)
        return _BACKEND.validate_python(value)

    @classmethod
    def resolve(
        cls, given: dict[str, Any] | None = None, settings: Settings | None = None
    ) -> RunParams:
        """Validate the given values over the defaults (a given None means none, not default)."""
        s = settings or get_settings()
        params = cls.model_validate({**cls.defaults(s), **(given or {})})
        for name, spec in run_fields().items():
            if spec.maximum_from:
                ceiling = _deployment_value(spec.maximum_from, s)
                if getattr(params, name) > ceiling:
                    raise ValueError(
                        f"{name} {getattr(params, name)} is over this deployment's "
                        f"{spec.maximum_from} {ceiling}; lower it, or raise the setting"
                    )
        return params


# The data checks a run may set: ValidationConfig's own names and defaults, in form order.
DATA_CHECKS = tuple(
    n for n in RunParams.model_fields if n in _CHECK_DEFAULTS and n != "expected_classes"
)


def params_that(affect: Affects) -> tuple[str, ...]:
    """Return the RunParams fields that declare ``affect``, in the form's order."""
    return tuple(name for name, f in RunParams.model_fields.items() if affect in f.metadata)


# The params that change what training produces: same data + same values = same model. The
# image size is compared as the model was made (model.json): empty means "from the data".
TRAINING_PARAMS = tuple(name for name in params_that(Affects.MODEL) if name != "image_size")
# ...and those that change what export makes of it (the `export` verb's options).
EXPORT_PARAMS = params_that(Affects.EXPORT)
# Model params that reach job.json under another name or shape; every other one is a JobSpec
# field of its own name (``job_values``; tests/test_params.py checks that none is dropped).
JOB_SHAPED = {"model": "arch", "image_size": "preprocess", "expected_classes": "classes"}

# The run, resolved (run.json): what every task after the first reads.
ResolvedRun = RunRecord[RunParams]


def job_values(params: RunParams, training: TrainingChoice) -> dict[str, Any]:
    """Return the JobSpec fields of the run's model params: validate's choices where it made
    them (the auto values resolved), the run's own values for the rest."""
    chosen = {
        **params.model_dump(include=set(params_that(Affects.MODEL))),
        **training.model_dump(
            include=set(TrainingChoice.model_fields) & set(RunParams.model_fields)
        ),
    }
    return {
        JOB_SHAPED.get(name, name): value
        for name, value in chosen.items()
        if JOB_SHAPED.get(name) not in ("preprocess", "classes")
    }


@dataclass(frozen=True)
class RunField:
    """Describe one run parameter as every surface shows it: form, command line, docs."""

    name: str
    title: str
    description: str
    # JSON schema: type (["null", T] when it may be empty), enum, items, bounds under allOf, ...
    schema: dict[str, Any]
    default: Any  # None when default_from names the setting it comes from
    default_from: str | None = None
    maximum_from: str | None = None  # the setting that also bounds the value from above
    # Empty (JSON null) means auto: validate derives the value from the data and the model.
    auto: bool = False

    def deployment_schema(self, settings: Settings | None = None) -> dict[str, Any]:
        """Return the schema with this deployment's bounds (``maximum_from``) applied."""
        if not self.maximum_from:
            return self.schema
        ceiling = _deployment_value(self.maximum_from, settings)
        bounds = dict(self.bounds)
        bounds["maximum"] = min(bounds.get("maximum", ceiling), ceiling)
        return {**self.schema, "allOf": [bounds]}

    @property
    def section(self) -> str | None:
        """Return the form section, or None for the first one."""
        section = self.schema.get("section")
        return str(section) if section is not None else None

    @property
    def nullable(self) -> bool:
        """Return whether the field may be empty (JSON null)."""
        return isinstance(self.schema.get("type"), list)

    @property
    def value_type(self) -> str:
        """Return the JSON type of a value (``integer``, ``array``, ...)."""
        kind = self.schema["type"]
        return str(next(t for t in kind if t != "null") if isinstance(kind, list) else kind)

    @property
    def bounds(self) -> dict[str, float]:
        """Return the numeric bounds (JSON-schema keywords)."""
        merged: dict[str, float] = {}
        for clause in self.schema.get("allOf", []):
            merged.update({k: v for k, v in clause.items() if k in BOUND_KEYWORDS})
        return merged


@functools.cache
def run_fields() -> Mapping[str, RunField]:
    """Return every run parameter in form order, as the form, the CLI and the docs show it."""
    properties = RunParams.model_json_schema()["properties"]
    fields: dict[str, RunField] = {}
    for name in RunParams.model_fields:
        prop = dict(properties[name])
        default = prop.pop("default", None)  # JSON-ready; absent when default_from names it
        description = str(prop.pop("description"))
        default_from = prop.pop("default_from", None)
        maximum_from = prop.pop("maximum_from", None)
        auto = bool(prop.pop("auto", False))
        if "anyOf" in prop:  # T | None: one branch carries the type and its bounds
            (branch,) = [b for b in prop.pop("anyOf") if b.get("type") != "null"]
            prop.update(branch)
            prop["type"] = ["null", branch["type"]]
        bounds = {key: prop.pop(key) for key in BOUND_KEYWORDS if key in prop}
        if bounds:
            prop["allOf"] = [bounds]
        fields[name] = RunField(
            name=name,
            title=str(prop["title"]),
            description=description,
            schema=prop,
            default=default,
            default_from=default_from,
            maximum_from=maximum_from,
            auto=auto,
        )
    return MappingProxyType(fields)


def describe_values(spec: RunField) -> str:
    """Return a field's type and bounds in words (``integer 1–500``, ``one of a, b``)."""
    schema, kind = spec.schema, spec.value_type
    if "enum" in schema:
        text = "one of " + ", ".join(f"`{v}`" for v in schema["enum"])
    elif kind == "array":
        text = "list of strings"
        if schema.get("minItems"):
            text += f", ≥ {schema['minItems']}"
    else:
        text = {"string": "string", "boolean": "boolean"}.get(kind, kind)
        if schema.get("minLength"):
            text += ", non-empty"
        b = spec.bounds
        if "minimum" in b and "maximum" in b:
            text += f" {_number(b['minimum'])}–{_number(b['maximum'])}"
        else:
            parts = [f"{op} {_number(b[key])}" for key, op in _BOUND_WORDS.items() if key in b]
            text += (", " if parts else "") + ", ".join(parts)
    if spec.maximum_from:
        text += f", ≤ `{spec.maximum_from}`"
    if spec.nullable:
        text += "; or empty (auto)" if spec.auto else "; or empty"
    return text


_BOUND_WORDS = {"minimum": "≥", "exclusiveMinimum": ">", "maximum": "≤", "exclusiveMaximum": "<"}


def _number(value: float) -> str:
    return f"{value:,}".replace(",", " ") if isinstance(value, int) else f"{value:g}"


def describe_default(spec: RunField) -> str:
    """Return a field's default as the docs show it (a setting's name, not its value here)."""
    if spec.default_from:
        return f"`{spec.default_from}`"
    if spec.auto and spec.default is None:
        return "auto"
    if spec.default in (None, []):
        return "empty"
    return f"`{json.dumps(spec.default)}`"


def _markdown_text(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def params_table() -> str:
    """Return the Markdown tables of the run parameters, one per form section (the docs')."""
    sections: dict[str | None, list[RunField]] = {}
    for spec in run_fields().values():
        sections.setdefault(spec.section, []).append(spec)
    out: list[str] = []
    for section, specs in sections.items():
        out.append(f"**{section or 'Run Parameters'}**")
        out.append("")
        out.append("| field (`conf` key) | type, bounds | default | meaning |")
        out.append("|---|---|---|---|")
        for spec in specs:
            out.append(
                f"| {spec.title} (`{spec.name}`) | {describe_values(spec)} | "
                f"{describe_default(spec)} | {_markdown_text(spec.description)} |"
            )
        out.append("")
    return "\n".join(out).rstrip() + "\n"
