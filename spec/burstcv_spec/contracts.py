"""Define, once, every value that crosses a stage boundary: stage results and JSON artifacts.

Stage results travel through XCom as ``model_dump(mode="json")``; artifacts are JSON files,
validated once where they are read (``read_artifact``); a newer ``schema_version`` than this
code knows is refused rather than half understood. Torch-free and Airflow-free (the service
and the training box import it); docs/contracts.md is generated from these models.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from burstcv_spec import storage

if TYPE_CHECKING:  # imported when used: readers of other contracts need no numpy or Pillow
    from burstcv_spec.preprocess import PreprocessSpec

SCHEMA_VERSION = 1  # of every artifact below; raise it when a reader must change


def _optional(description: str, **constraints: Any) -> Any:
    """Return a field that defaults to None (left out of the JSON, see ``omit_when_none``)."""
    return Field(default=None, description=description, **constraints)


class ArtifactError(ValueError):
    """Raise when an artifact file is missing its fields or holds bad values (names both)."""


class SchemaVersionError(ArtifactError):
    """Raise when an artifact was written by a newer schema than this code reads."""


class Contract(BaseModel):
    """Hold what every contract shares: immutable, unknown keys refused.

    ``omit_when_none`` fields are left out of the JSON when None, as the files always did:
    unless a class names its own (empty: every null written), each field whose default is None.
    """

    # NaN and Infinity (a loss that blew up) are written as json.dumps does, and read back.
    model_config = ConfigDict(
        frozen=True, extra="forbid", populate_by_name=True, ser_json_inf_nan="constants"
    )
    omit_when_none: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if "omit_when_none" not in cls.__dict__:
            fields = cls.model_fields.items()
            cls.omit_when_none = frozenset(
                name for name, f in fields if f.default is None and not f.is_required()
            )

    @model_serializer(mode="wrap")
    def _omit_nones(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Keyed by field name: no field left out when None has an alias.
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in self.omit_when_none}


class Artifact(Contract):
    """Add the schema version every artifact file carries."""

    schema_version: int = Field(
        default=SCHEMA_VERSION,
        description=f"version of this file's schema (current {SCHEMA_VERSION}; a file without "
        "it is version 1; a newer one is refused)",
    )

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if not 1 <= value <= SCHEMA_VERSION:
            raise ValueError(f"schema_version {value} is not 1..{SCHEMA_VERSION}")
        return value


# ---------------------------------------------------------------------------------------------
# Shared blocks


class RunRef(Contract):
    """Name one pipeline run both ways: as Airflow knows it and as folders and tags do."""

    airflow_run_id: str = Field(description="the Airflow run id (links to the run's page)")
    run_key: str = Field(
        description="the path-safe run id (`[A-Za-z0-9._-]`): `runs/<run_key>/`, instance tags"
    )

    @classmethod
    def of(cls, airflow_run_id: str) -> RunRef:
        """Return the reference of a run from its Airflow run id."""
        return cls(airflow_run_id=airflow_run_id, run_key=storage.safe_run_id(airflow_run_id))


class PreprocessBlock(Contract):
    """Describe the eval transform as model.json and job.json carry it (PreprocessSpec)."""

    height: int = Field(gt=0, description="input height in pixels")
    width: int = Field(gt=0, description="input width in pixels")
    mean: tuple[float, float, float] = Field(description="per-channel mean (R, G, B), 0..1 scale")
    std: tuple[float, float, float] = Field(description="per-channel std (R, G, B), 0..1 scale")
    interpolation: str = Field(description="Pillow resample filter when the size differs")
    color_mode: str = Field(description="colour mode images are converted to (RGB)")
    layout: str = Field(description="tensor layout (NCHW)")
    scale: float = Field(description="multiplier from uint8 to 0..1 before normalising")
    formats: list[str] = Field(description="image formats accepted (Pillow names)")
    resize_short: int | None = _optional(
        "short side (px) before the centre crop (photos); absent: straight to height x width"
    )

    @model_validator(mode="after")
    def _usable(self) -> PreprocessBlock:
        self.to_spec()  # refuses unknown transforms, naming them
        return self

    @classmethod
    def of(cls, spec: PreprocessSpec) -> PreprocessBlock:
        """Return the block of a spec."""
        return cls.model_validate(spec.to_dict())

    def to_spec(self) -> PreprocessSpec:
        """Return the spec this block describes."""
        from burstcv_spec.preprocess import PreprocessSpec

        return PreprocessSpec.from_dict(self.model_dump(mode="json"))


class HostInfo(Contract):
    """Describe the machine a measurement ran on."""

    machine: str = Field(description="CPU architecture (platform.machine)")
    processor: str = Field(description="processor name, or the architecture")
    cpu_count: int = Field(description="logical CPUs")
    python: str = Field(description="Python version")
    platform: str = Field(description="operating system, terse")


class HostLoad(Contract):
    """Say how busy the host was while a measurement ran, beside the figures it produced.

    It is *busy* when other processes' share of its CPUs (``/proc/stat``), the calibration
    kernel's slowdown or its cgroup's throttling passes its limit: its figures then measure
    the neighbours, not the model.
    """

    cpus: list[int] = Field(description="the CPUs watched (those the measurement could run on)")
    wall_s: float = Field(ge=0, description="seconds the window lasted")
    others_share: float = Field(
        ge=0, description="share of the watched CPUs' time that other processes took"
    )
    own_cpu_s: float = Field(ge=0, description="CPU seconds the measurement's processes took")
    psi_some_share: float | None = _optional(
        "share of the window some task waited for a CPU (/proc/pressure/cpu, "
        "the measurement's own tasks included); null where the kernel has no PSI"
    )
    throttled_s: float | None = _optional(
        "seconds the measurement's cgroup was throttled by its CPU quota "
        "(cpu.stat); null outside a cgroup v2 with a quota"
    )
    calibration_ms: float | None = _optional(
        "the fixed calibration kernel's time, the slower of before and after, ms"
    )
    calibration_quiet_ms: float | None = _optional("the kernel's fastest time on this host, ms")
    busy: bool = Field(description="the host was too busy for the figures to be trusted")
    reason: str | None = _optional("why it was busy, with the figures")


class CalibrationRecord(Artifact):
    """`<BURSTCV_HOME>/bench/calibration.json`: the calibration kernel's quiet time per host.

    A later run much slower than it was measured on a busy host (``HostLoad``).
    """

    quiet_ms: dict[str, float] = Field(
        default_factory=dict,
        description="fastest kernel time (ms) by host: node name, processor, numpy version",
    )


class BenchFigures(Contract):
    """Say what one load run over HTTP measured, and the model's accuracy."""

    label: str = Field(description="candidate or production")
    requests: int = Field(description="requests sent after the warm-up")
    concurrency: int = Field(
        description="requests in flight at once: the clients of a closed-loop run, the most "
        "that were in flight during an open-loop one"
    )
    offered_rps: float | None = _optional(
        "the rate an open-loop run sent its requests at (each latency counts from "
        "when its request was due); absent for a closed-loop run"
    )
    errors: int = Field(
        description="requests that failed: neither a 200 nor a 503 the service shed on purpose"
    )
    shed: int = Field(
        default=0,
        ge=0,
        description="requests the service shed on purpose (503 with Retry-After: queued past "
        "its queueing-delay target); not errors, but their latencies count in the percentiles",
    )
    p50_ms: float = Field(description="median latency, ms")
    p95_ms: float = Field(description="95th percentile latency, ms")
    p99_ms: float = Field(description="99th percentile latency, ms")
    mean_ms: float = Field(description="mean latency, ms")
    throughput_rps: float = Field(description="answered requests per second")
    wall_s: float = Field(description="seconds the load run took")
    status_counts: dict[str, int] = Field(description="responses by HTTP status")
    error_rate: float = Field(description="errors / requests")
    latencies_ms: list[float] | None = _optional("every request's latency, ms (latency.json only)")
    accuracy: float | None = Field(description="validation top-1; null when not comparable")
    accuracy_note: str | None = _optional("why accuracy is null")
    version: int | None = _optional("registry version (production only)")
    bare_onnxruntime_p50_ms: float | None = _optional(
        "median of onnxruntime alone, no HTTP (candidate only)"
    )
    host_load: HostLoad | None = _optional("how busy the host was while the figures were measured")

    def summary(self) -> BenchFigures:
        """Return the figures without the raw samples (what XCom and the registry hold)."""
        return self.model_copy(update={"latencies_ms": None})


class LoadStep(Contract):
    """Say how the service answered one open-loop rate during a sizing search."""

    rate_rps: float = Field(description="the rate the requests were sent at, req/s")
    p95_ms: float = Field(description="p95 latency at that rate, counted from when each was due")
    errors: int = Field(description="requests that did not get a 200")
    held: bool = Field(description="p95 within the SLO, no error, requests sent on time")
    requests: int = Field(default=0, ge=0, description="requests sent at that rate")
    seconds: float | None = _optional("how long the rate was sent for", gt=0)
    scouting: bool = Field(
        default=False,
        description="a short step that only brackets the limit before the measuring steps; "
        "no size's figures are read from one",
    )


class SizePoint(Contract):
    """Say how fast the service answered at one CPU size under an open-loop load.

    Sizes beyond the measuring host's cores are extrapolated from the measured scaling.
    """

    vcpus: int = Field(ge=1, description="CPUs the service could use (affinity)")
    measured: bool = Field(description="measured here; false: extrapolated")
    sustainable_rps: float = Field(ge=0, description="highest rate meeting the SLO, req/s")
    p50_ms: float | None = _optional("median latency at that rate, ms")
    p95_ms: float | None = _optional("p95 latency at that rate, ms")
    p99_ms: float | None = _optional("p99 latency at that rate, ms")
    cpu_s_per_request: float | None = _optional(
        "the service's CPU seconds per request: its CPU time over the whole "
        "search, over every request the search sent"
    )
    rss_mb: float | None = _optional("the service's resident memory, MB")
    steps: list[LoadStep] = Field(
        default_factory=list, description="every rate tried, in order (measured sizes only)"
    )
    send_lag_p95_ms: float | None = _optional(
        "how late the load generator sent the requests at that rate, p95, ms"
    )
    generator_rps: float | None = _optional(
        "the rate the load generator sent on time to a trivial endpoint on this "
        "size's CPUs (tried at 2x, then 1.25x, the size's rate), or, when neither held, the "
        "rate it reached: its ceiling there, or at least that"
    )
    generator_processes: int | None = _optional(
        "load generator processes that sent the size's final search"
    )
    generator_bound: bool = Field(
        default=False,
        description="the generator could not send 1.25x the size's rate on time: the rate is "
        "the generator's ceiling, a lower bound of the service's, never priced as its rate",
    )
    generator_shares_cpus: bool = Field(
        default=False,
        description="the load generator ran on CPUs of the service's (the host had no spare)",
    )
    anomaly: str | None = _optional(
        "why this size's figure is a measurement error (a rate below a smaller "
        "size's); it is priced at the smaller size's rate"
    )


class FleetOption(Contract):
    """Say what serving the target load on one instance type takes and costs."""

    omit_when_none = frozenset()  # its nulls are written

    instance_type: str = Field(description="EC2 instance type")
    vcpus: int = Field(description="its vCPUs")
    memory_gib: float = Field(description="its memory, GiB")
    replicas: int = Field(ge=1, description="service replicas the target load needs")
    rps_per_replica: float = Field(description="sustainable req/s of one replica at the SLO")
    extrapolated: bool = Field(description="its rate is extrapolated, not measured")
    generator_bound: bool = Field(
        default=False,
        description="its rate rests on a size the load generator could not outrun: the "
        "service may do more, so the fleet may be larger than it needs",
    )
    usd_per_hour: float | None = Field(
        description="the fleet's on-demand price per hour (null: no price for the type)"
    )
    usd_per_month: float | None = Field(description="the fleet's price per month (730 hours)")
    usd_per_million: float | None = Field(description="USD per 1M predictions at the target load")
    measured_on: str | None = _optional(
        "the instance type whose own box measured this rate (a sizing box of "
        "this type); null: the rate rests on the benchmark host's sizes"
    )


class BoxSizing(Artifact):
    """`runs/<run_key>/bench/sizing/boxes/<type>.json`: one instance type's sizes, or why none.

    Written by the box that measured them, or by the orchestrator when the type could not be
    launched or its box ended without figures (``skipped``).
    """

    instance_type: str = Field(description="the EC2 type measured")
    instance_id: str | None = _optional("the box that measured it")
    region: str = Field(description="the box's region")
    zone: str | None = _optional("its Availability Zone")
    host: HostInfo | None = _optional("the box's CPU, as it reported it")
    sizes: list[SizePoint] = Field(
        default_factory=list,
        description="the sustainable rate per CPU size on the box, 1 .. its vCPUs (empty: skipped)",
    )
    measured_at: str | None = _optional("when (UTC, ISO 8601)")
    seconds: float | None = _optional("how long the sizing took on it")
    skipped: str | None = _optional(
        "why the type has no figures (quota, capacity, a box that failed); null: measured"
    )
    speed_key: str | None = _optional(
        "digest of what sets the figures (architecture, input, preprocessing, "
        "quantization, the type, SLO, step length, versions): equal keys measure alike"
    )
    measured_in: str | None = _optional(
        "the run whose box measured the figures: another run's when reused (same speed_key)"
    )


class SizingReport(Artifact):
    """`burstcv size` output: the right-sized CPU fleet for a model at the expected load."""

    latency_slo_ms: float = Field(
        validation_alias=AliasChoices("latency_slo_ms", "slo_p95_ms"),
        description="the latency SLO (p95) each size was held to, ms",
    )
    target_rps: float = Field(gt=0, description="the expected peak load, req/s")
    headroom: float = Field(description="share of a replica's sustainable rate kept spare")
    region: str = Field(description="where the fleet is priced")
    host_cores: int = Field(description="the measuring host's CPUs")
    sizes: list[SizePoint] = Field(description="the sustainable rate per CPU size")
    options: list[FleetOption] = Field(description="fleets meeting the target, cheapest first")
    chosen: FleetOption | None = Field(description="the cheapest fleet; null when none meets")
    reason: str = Field(description="why this fleet, or why none")
    families: list[str] = Field(
        default_factory=list, description="the instance families allowed (empty: every one)"
    )
    price_source: dict[str, str] = Field(description="where the prices come from, and when")
    unpriced: str | None = _optional("why the fleets carry no price and what to set (null: priced)")
    host_load: HostLoad | None = _optional("how busy the host was while the sizes were measured")
    speed_key: str | None = _optional(
        "digest of what sets the sizes (architecture, input, preprocessing, "
        "quantization, host, SLO, sizing settings): equal keys measure alike"
    )
    measured_in: str | None = _optional(
        "the run whose staging services measured the sizes: another's when reused (same speed_key)"
    )
    boxes: list[BoxSizing] = Field(
        default_factory=list,
        description="the types sized on boxes of their own (size_on ec2), measured or "
        "skipped; their fleets rest on their own figures (FleetOption.measured_on)",
    )


class GateCheck(Contract):
    """Say how one gate check went: the figure observed, the limit, and why it failed."""

    name: str = Field(
        description="latency_p95, error_rate, accuracy_floor, no_regression, "
        "no_latency_regression or serving_fleet"
    )
    passed: bool = Field(description="the observed figure is within the limit")
    observed: float = Field(description="the candidate's figure")
    limit: float = Field(description="the limit it was held to")
    reason: str | None = _optional("one line, when the check failed")


SuggestionAction = Literal["int8", "smaller_model", "larger_instance", "gpu_serving"]


class Suggestion(Contract):
    """Say one priced way to bring p95 under the SLO (an estimate for the next run)."""

    action: SuggestionAction = Field(description="what to change")
    title: str = Field(description="the change, in a line")
    estimated_p95_ms: float = Field(description="p95 expected after the change, ms")
    meets_slo: bool = Field(description="the estimate is within the SLO")
    gap_ms: float = Field(description="how far the measured p95 is over the SLO, ms")
    instance_type: str = Field(description="the CPU or GPU type it would serve on")
    region: str = Field(description="the region priced")
    estimated_throughput_rps: float | None = Field(
        description="requests per second expected on one replica; null: not measured"
    )
    cost_per_million_usd: float | None = Field(
        description="USD per 1M predictions at that throughput; null: not priceable"
    )
    price_note: str = Field(description="how it was priced, or why it could not be")
    assumption: str = Field(description="what the estimate assumes")
    measured: bool = Field(
        default=False,
        description="the estimate rests on a CPU cost measured for the option itself "
        "(onnxruntime's time per image of each architecture, bench/arch_cpu.py); false: on an "
        "assumed factor (INT8's speed-up, linear vCPU scaling, a GPU's compute time)",
    )
    detail: str = Field(description="the change with its figures, in a line")


class GateVerdict(Contract):
    """Say whether the gate promotes a version, every reason why not, and what would fix it."""

    promote: bool = Field(description="true: every check passed")
    reasons: list[str] = Field(description="one per failed check")
    checks: list[GateCheck] = Field(description="every check made, in order")
    suggestions: list[Suggestion] = Field(
        description="priced fixes when the SLO was missed, those that meet it first"
    )
    summary: str = Field(description="'promote' or 'not promoted: <reasons>'")
    failed_figures: list[str] = Field(description="each failed check as observed vs limit")


class ParityBlock(Contract):
    """Say how close ONNX and torch were on real validation images."""

    images: int = Field(description="images compared")
    max_abs_diff: float = Field(description="largest absolute difference of a logit")
    worst_input: str = Field(description="the image with that difference")
    top1_mismatches: list[str] = Field(description="images whose top-1 class differs")


class QuantizedFigures(Contract):
    """Say how one of the two files (fp32, int8) did."""

    accuracy: float = Field(description="top-1 on the validation split")
    p50_ms: float = Field(description="median single-image latency, ms, in-process")
    mean_ms: float = Field(description="mean single-image latency, ms, in-process")
    file: str = Field(description="the ONNX file measured")
    sha256: str = Field(description="its sha256")


class QuantizationBlock(Contract):
    """Say whether INT8 was tried, which file serves and why (present when INT8 was tried)."""

    int8_tried: bool = Field(description="an INT8 file was made and measured")
    serving_file: str = Field(description="the file that serves: model.onnx or model.int8.onnx")
    reason: str = Field(description="one line: why that file serves")
    fp32: QuantizedFigures = Field(description="the FP32 file's figures")
    int8: QuantizedFigures = Field(description="the INT8 file's figures")
    max_accuracy_drop: float = Field(description="accuracy INT8 may lose and still serve")
    top1_agreement: float = Field(description="fraction of images where both agree")
    eval_images: int = Field(description="validation images measured")
    calibration_images: int = Field(description="training images used to calibrate")
    method: dict[str, str] = Field(description="format, weights, activations, calibration")
    latency: dict[str, int | str] = Field(description="batch, threads, runs, where measured")


class TensorInput(Contract):
    """Name the ONNX input."""

    name: str = Field(description="input name in the graph")
    shape: list[int | None] = Field(description="[batch (null: any), 3, height, width]")
    dtype: str = Field(description="element type (float32)")


class TensorOutput(Contract):
    """Name the ONNX output."""

    name: str = Field(description="output name in the graph")
    kind: str = Field(description="'logits' (softmax applied by the service) or probabilities")


class Lineage(Contract):
    """Say what made a registered version."""

    run_id: str = Field(description="the run that exported it")
    dataset_fingerprint: str = Field(description="sha256 over the validated dataset")
    source_commit: str = Field(description="git commit of the code, or 'unknown'")
    dataset_uri: str = Field(default="", description="its training dataset, as the run resolved it")


class InstanceRecord(Contract):
    """Describe one training instance (or local process) at teardown."""

    omit_when_none = frozenset()  # its nulls are written

    instance_id: str = Field(description="EC2 instance id or local process id")
    run_id: str = Field(description="the run key it is tagged with")
    dag_id: str = Field(description="the DAG it is tagged with")
    state: str = Field(description="state at the last look")
    expires_at: str | None = _optional("ISO 8601 expiry tag")
    instance_type: str = Field(default="", description="EC2 instance type")
    lifecycle: str = Field(default="", description="spot, on-demand or local")
    launched_at: str | None = _optional("ISO 8601 launch time")
    stopped_at: str | None = _optional("ISO 8601 stop time")
    airflow_run_id: str = Field(default="", description="the Airflow run id tag")
    image_id: str = Field(default="", description="the AMI it booted (ec2)")
    zone: str = Field(default="", description="its Availability Zone (ec2)")
    usd_per_hour: float | None = _optional("the price it was billed at, USD per hour")
    cost_usd: float | None = _optional("what it cost, USD")


class TrainingChoice(Contract):
    """Say how the run will train: each value the run's own or derived from the data, and why."""

    model: str = Field(description="architecture to train")
    pretrained: str = Field(description="'none', a torchvision weights name, or a state_dict URI")
    batch_size: int = Field(
        gt=0,
        description="images per optimizer step: on each GPU (the run's batch_scaling "
        "per_gpu) or over all of them (global)",
    )
    learning_rate: float = Field(
        gt=0, description="peak rate, after the warm-up (per_gpu: for one GPU, scaled by the GPUs)"
    )
    epochs: int = Field(gt=0, description="passes over the training split asked for")
    optimizer: Literal["sgd", "adamw"] = Field(description="SGD (Nesterov) or AdamW")
    warmup_steps: int = Field(ge=0, description="optimizer steps of linear warm-up")
    early_stop_patience: int = Field(
        gt=0, description="epochs without a better validation accuracy before stopping"
    )
    derived: list[str] = Field(description="the values chosen from the data (auto), by name")
    reason: str = Field(description="one line: what was chosen and why")
    warning: str | None = _optional("a line when an auto choice fell back (no pretrained weights)")


# ---------------------------------------------------------------------------------------------
# What validate writes


class DatasetCounts(Contract):
    """Count a dataset's files: all of them, the usable ones, and per split and class."""

    files: int = Field(description="image files found (hidden and system files excluded)")
    usable: int = Field(description="files that decode")
    errors: int = Field(description="files that do not decode")
    ignored: int = Field(description="hidden and system files skipped")
    per_split: dict[str, dict[str, int]] = Field(description="usable images per split and class")


class ExpectationResult(Contract):
    """Say how one Great Expectations check went, naming the files that broke it."""

    name: str = Field(description="the check's name (decodable, min_images_per_class, ...)")
    description: str = Field(description="what it expects, in words")
    expectation_type: str = Field(description="the Great Expectations expectation run")
    success: bool = Field(description="the check passed")
    observed: Any = Field(description="what the check saw (counts, a value, a list)")
    offending_files: list[str] = Field(description="files that broke it, relative to the root")
    reasons: dict[str, str] = Field(default_factory=dict, description="why, per offending file")
    details: dict[str, Any] = Field(default_factory=dict, description="the check's own figures")


class DriftBlock(Contract):
    """Say how far the dataset moved from the last one of its name that passed."""

    status: Literal["no_baseline", "ok", "warning", "failed"] = Field(
        description="no_baseline, ok, warning (above drift_warn) or failed (above drift_max)"
    )
    message: str = Field(description="the movement in a line")
    score: float | None = _optional("the larger of the two movements")
    class_proportion_tvd: float | None = _optional("total variation distance of class proportions")
    median_size_change: float | None = _optional("relative change of the median width or height")
    drift_warn: float | None = _optional("the warning threshold")
    drift_max: float | None = _optional("the failing threshold (null: none)")
    baseline: dict[str, Any] | None = _optional("its fingerprint, date, proportions and sizes")
    current: dict[str, Any] | None = _optional("this dataset's proportions and sizes")


class DatasetProfile(Artifact):
    """`<history>/<dataset name>.json`: the last dataset of that name that passed, for drift."""

    format_version: int = Field(default=1, description="the profile's original format marker")
    dataset_uri: str = Field(description="the dataset validated")
    fingerprint: str = Field(description="sha256 over its validated files")
    validated_at: str = Field(description="ISO 8601 UTC")
    images: int = Field(description="usable images")
    class_proportions: dict[str, float] = Field(description="share of the images per class")
    median_width: float | None = Field(description="median width, px (null: no images)")
    median_height: float | None = Field(description="median height, px (null: no images)")


class ImageSizeChoice(Contract):
    """Say which square size the model trains and serves at, and why."""

    omit_when_none = frozenset()  # its nulls are written

    px: int = Field(gt=0, description="height and width, px")
    reason: str = Field(description="the run's image_size, or what the data's sizes gave")
    resize_short: int | None = _optional("photos: the short side resized to before the centre crop")

    def spec(self) -> PreprocessSpec:
        """Return the eval transform of this size (normalisation left at its defaults)."""
        from burstcv_spec.preprocess import PreprocessSpec

        return PreprocessSpec(height=self.px, width=self.px, resize_short=self.resize_short)


class ValidationRecord(Artifact):
    """`runs/<run_key>/dataset/validation.json`: every check, its files, the drift."""

    success: bool = Field(description="every check passed and drift stayed under drift_max")
    dataset_uri: str = Field(description="the dataset validated")
    fingerprint: str = Field(description="sha256 over the validated files")
    counts: DatasetCounts = Field(description="files, usable, errors, per split and class")
    expectations: list[ExpectationResult] = Field(description="every check, in order")
    ignored: list[dict[str, str]] = Field(description="hidden and system files skipped")
    drift: DriftBlock = Field(description="movement against the last dataset that passed")
    warnings: list[str] = Field(description="one line each: what passed but deserves a look")
    config: dict[str, Any] = Field(description="the thresholds the checks used")
    manifest_uri: str = Field(description="dataset/manifest.parquet")
    data_docs_uri: str = Field(description="the Great Expectations Data Docs page")
    validated_at: str = Field(description="ISO 8601 UTC")
    versions: dict[str, str] = Field(description="Great Expectations and Pillow versions")


# ---------------------------------------------------------------------------------------------
# What the training box writes


class EpochRecord(Contract):
    """Say how one epoch of training went (progress.json and metrics.json, one each)."""

    epoch: int = Field(ge=1, description="1-based epoch number")
    train_loss: float = Field(description="mean training loss over the epoch")
    images_per_s: float = Field(description="training images per second, all GPUs")
    val_loss: float = Field(description="validation loss after the epoch")
    val_accuracy: float = Field(description="validation top-1 after the epoch")
    lr: float = Field(description="learning rate at the epoch's end")
    elapsed_s: float = Field(description="seconds since this attempt started training")
    attempt: int = Field(default=1, ge=1, description="the training attempt that ran it")
    backbone_frozen: bool | None = _optional("pretrained: backbone frozen (head-only warm-up)")
    gpu_max_memory_mb: float | None = _optional("peak GPU memory allocated, MiB (CUDA only)")


class Recovery(Contract):
    """Say where training diverged and how it recovered (back to the last good checkpoint)."""

    epoch: int = Field(description="the epoch it diverged in")
    step: int = Field(description="the step of that epoch it resumed from")
    reason: str = Field(description="what diverged (a loss not finite, or far above chance)")
    lr_scale: float = Field(description="the learning rate's scale from then on")


class RangeTest(Contract):
    """Say what the learning-rate range test swept and the rate it chose."""

    chosen_lr: float = Field(description="the peak rate the run trained at")
    min_loss_lr: float = Field(description="the rate at the lowest smoothed loss")
    steepest_lr: float = Field(description="the rate where the loss fell fastest")
    fallback_lr: float = Field(description="the rate the job asked for")
    steps: int = Field(description="optimizer steps swept")
    seconds: float = Field(description="seconds the sweep took")
    lrs: list[float] = Field(description="the rate at each step")
    losses: list[float] = Field(description="the smoothed loss at each step (NaN: not finite)")


class OptimizerBlock(Contract):
    """Say how the weights were optimised."""

    omit_when_none = frozenset()  # its nulls are written

    name: str = Field(description="sgd or adamw")
    learning_rate: float = Field(description="peak rate, after the warm-up")
    lr_scale: float = Field(description="the rate's scale after recoveries (1: none)")
    weight_decay: float = Field(description="decay on weights (not norms or biases)")
    batch_size: int = Field(description="images per optimizer step, over all GPUs")
    batch_scaling: Literal["per_gpu", "global"] = Field(
        default="global",
        description="per_gpu: the run's batch size was each GPU's, and the step's batch and "
        "rate grew with the GPUs; global: it was all GPUs' together",
    )
    batch_per_rank: int | None = _optional("images per optimizer step on each GPU (rank)")
    lr_world_factor: float = Field(
        default=1.0,
        description="the rate over the one-GPU rate the run chose: the GPUs (per_gpu: linear "
        "for SGD, square root for AdamW); 1 for global",
    )
    warmup_steps: int = Field(description="optimizer steps of linear warm-up")
    steps_per_epoch: int = Field(description="optimizer steps per epoch")
    total_steps: int = Field(description="optimizer steps over the epochs asked for")
    schedule: str = Field(description="the rate's schedule, in words")


class WallSeconds(Contract):
    """Say where training's time went, seconds."""

    setup: float = Field(description="model, data and checkpoint set-up")
    data: float = Field(description="waiting for batches")
    compute: float = Field(description="forward, backward and optimizer steps")
    eval: float = Field(description="validation passes")


class PretrainedLoad(Contract):
    """Say what loading pretrained weights did to the model."""

    source: str = Field(description="the URI the tensors came from")
    loaded: int = Field(description="tensors copied from the weights")
    head: int = Field(description="tensors of the classifier head, left freshly initialised")
    unused: int = Field(description="tensors of the weights with no place in the model")


class TrainingProgress(Artifact):
    """`runs/<run_key>/job/progress.json`: the epochs so far, rewritten at each epoch's end."""

    attempt: int = Field(ge=1, description="the attempt that last wrote it")
    epochs_total: int = Field(description="epochs the job asks for")
    epochs: list[EpochRecord] = Field(description="every epoch so far, all attempts")


class TrainingMetrics(Artifact):
    """`runs/<run_key>/job/metrics.json`: what training made, on the best validation epoch."""

    val_accuracy: float = Field(description="validation top-1 of the model kept")
    val_loss: float = Field(description="its validation loss")
    confusion: list[list[int]] = Field(description="rows: true class, columns: predicted")
    classes: list[str] = Field(description="class names; label i is classes[i]")
    arch: str = Field(description="the architecture trained")
    epochs: list[EpochRecord] = Field(description="every epoch, all attempts")
    best_epoch: int = Field(description="the epoch whose weights were kept")
    epochs_asked: int = Field(description="epochs the job asked for")
    epochs_run: int = Field(description="epochs run (fewer when stopped early)")
    seconds_saved: float = Field(description="estimated seconds an early stop saved")
    stop_reason: str = Field(description="why training stopped, in a line")
    recoveries: list[Recovery] = Field(description="each divergence recovered from")
    lr_range_test: RangeTest | None = _optional("the range test, when the job asked for it")
    optimizer: OptimizerBlock = Field(description="how the weights were optimised")
    wall_s: WallSeconds = Field(description="where the time went")
    device: str = Field(description="cuda:<n> or cpu")
    device_name: str = Field(description="the GPU's name, or cpu")
    world_size: int = Field(description="processes (GPUs) that trained")
    pretrained: str = Field(description="'none', a torchvision weights name, or a state_dict URI")
    pretrained_loaded: PretrainedLoad | None = _optional(
        "what loading the weights did; absent from scratch"
    )
    amp_dtype: str = Field(description="autocast dtype, or float32")
    precision: str = Field(description="bf16, fp16 (with a gradient scaler) or fp32")
    versions: dict[str, str] = Field(description="torch's version")
    host: HostInfo = Field(description="the machine that trained")
    train_images: int = Field(description="training images")
    val_images: int = Field(description="validation images")
    source_commit: str = Field(description="git commit of the code, or 'unknown'")
    dataset_fingerprint: str = Field(description="sha256 over the validated dataset")
    finished_at: str = Field(description="ISO 8601 UTC")
    attempt: int = Field(ge=1, description="the attempt that finished")

    @property
    def train_wall_s(self) -> float:
        """Return the seconds of training, all phases."""
        w = self.wall_s
        return w.setup + w.data + w.compute + w.eval


class DoneMarker(Artifact):
    """`runs/<run_key>/job/attempts/<n>/DONE`: the attempt finished; metrics.json is written."""

    val_accuracy: float = Field(description="validation top-1 of the model kept")
    finished_at: str = Field(description="ISO 8601 UTC")
    attempt: int = Field(ge=1, description="the attempt")


class FailedMarker(Artifact):
    """`runs/<run_key>/job/attempts/<n>/FAILED`: where the attempt stopped and why.

    Written by training or, when it could not, by the boot script; each rank of a run of
    several also writes `ranks/<rank>/FAILED`, telling the error apart from the peers it stopped.
    """

    stage: str = Field(
        description="bootstrap, preflight, train, budget, interrupted, or stalled (written by "
        "the train task's trigger: the trainer stopped beating)"
    )
    reason: str = Field(description="one line: why")
    resumable: bool = Field(description="a relaunch resumes from the checkpoint")
    attempt: int = Field(ge=1, description="the attempt")
    at: str | None = _optional("ISO 8601 UTC (training's markers)")
    exit_code: int | None = _optional("the stage's exit code (boot script)")
    instance_id: str | None = _optional("the box (boot script)")
    rank: int | None = _optional("the rank that wrote it (ranks/)", ge=0)
    node: int | None = _optional("its box's place in the rendezvous (torchrun's GROUP_RANK)", ge=0)
    traceback: list[str] | None = _optional("the last lines of the rank's traceback (ranks/)")


class TrainingOutcome(Contract):
    """Say how a training attempt stands: what the trigger hands the train task."""

    status: Literal["done", "failed", "lost", "running"] = Field(
        description="done (DONE marker), failed (FAILED marker), lost (every box gone "
        "without a marker) or running"
    )
    attempt: int = Field(ge=1, description="the attempt")
    stage: str | None = _optional("failed: where it stopped")
    reason: str = Field(default="", description="failed or lost: why, in a line")
    resumable: bool = Field(
        default=False, description="a relaunch may resume it (interrupted, or lost)"
    )

    def line(self) -> str:
        """Return the one line a user reads about an attempt that did not finish."""
        stage = f" at {self.stage}" if self.stage else ""
        return (
            f"training {self.status}{stage} (attempt {self.attempt}): "
            f"{self.reason or 'no reason given'}"
        )


# ---------------------------------------------------------------------------------------------
# Stage results (XCom)


class Validated(Contract):
    """Say where validate put the evidence of a dataset that passed."""

    fingerprint: str = Field(description="sha256 over the validated files")
    manifest_uri: str = Field(description="dataset/manifest.parquet: one row per file")
    validation_uri: str = Field(description="dataset/validation.json")
    data_docs_uri: str = Field(description="the Great Expectations Data Docs page")


class DataChunk(Contract):
    """Name one mapped task's share of a dataset: listed files to scan, or shards to pack."""

    index: int = Field(ge=0, description="the chunk's number, from 0 (its map index)")
    start: int = Field(ge=0, description="first item: a row of the listing, or a shard number")
    stop: int = Field(ge=0, description="one past the last item")
    files: int = Field(ge=0, description="source image files in the chunk")
    bytes: int = Field(ge=0, description="their size on the store, bytes")
    part_uri: str = Field(description="where the chunk's task writes its part")
    listing_uri: str | None = _optional(
        "the chunk's own rows, so that its task reads no more: a scan chunk's "
        "rows of the listing (dataset/scan/listing/<index>.parquet), a pack chunk's images of "
        "its shards (dataset/shards/rows/rows-<index>.parquet); none (a plan from before "
        "them): the task reads the whole listing or manifest"
    )


class ScanPlan(Artifact):
    """`runs/<run_key>/dataset/scan/plan.json`: the listing, and the chunks tasks scan."""

    dataset_uri: str = Field(description="the dataset listed")
    listing_uri: str = Field(
        description="dataset/scan/listing.parquet: path, uri and bytes of each file to inspect"
    )
    refused_uri: str = Field(
        description="dataset/scan/refused.parquet: manifest rows of the files refused unread "
        "(wrong depth, symlinks out of the root)"
    )
    ignored: list[dict[str, str]] = Field(description="hidden, system files skipped: {path, note}")
    files: int = Field(ge=0, description="files to inspect")
    bytes: int = Field(ge=0, description="their size, bytes")
    chunks: list[DataChunk] = Field(description="the scan's chunks, in listing order")


class PackPlan(Artifact):
    """`runs/<run_key>/dataset/shards/plan.json`: the shards each chunk writes, in order."""

    shards: int = Field(ge=0, description="shards in all: the training ones, then validation")
    images_per_shard: int = Field(ge=1, description="images per shard (the last may hold fewer)")
    shard_format: Literal["raw", "jpeg"] = Field(
        default="raw", description="the training shards' format (Packed.shard_format)"
    )
    classes: list[str] = Field(description="class names; label i is classes[i]")
    chunks: list[DataChunk] = Field(description="consecutive runs of shards, one per task")


class Packed(Contract):
    """Say where pack put the decoded shards and which preprocessing they fix."""

    classes: list[str] = Field(description="class names; label i is classes[i]")
    train_shards: list[str] = Field(description="URIs of the training .npz shards")
    val_shards: list[str] = Field(description="URIs of the validation .npz shards")
    counts: dict[str, int] = Field(description="images per split")
    preprocess: PreprocessBlock = Field(description="the eval transform, with training stats")
    fingerprint: str = Field(description="the validated dataset's fingerprint")
    shard_format: Literal["raw", "jpeg"] = Field(
        default="raw",
        description="how the training shards store images: raw uint8, or JPEG files (quality "
        "90; the validation shards stay raw); chosen by the shard_format setting",
    )


class BoxRate(Contract):
    """Say what one box costs an hour, part by part: the instance, its root volume, its IPv4.

    EC2 bills the instance per second from ``running`` (60 s minimum), the volume from launch
    to termination, the IPv4 while attached; ``burstcv.cost.model`` prices from these alone.
    """

    instance_type: str = Field(default="", description="EC2 instance type")
    market: str = Field(description="spot, on-demand or local")
    usd_per_hour: float = Field(ge=0, description="the instance's price, USD per hour")
    price_source: str = Field(description="where that price came from, and its date")
    volume_gb: int = Field(default=0, ge=0, description="its root volume, GB (0: none billed)")
    ebs_usd_per_gb_month: float = Field(
        default=0.0, ge=0, description="the volume's price, USD per GB-month"
    )
    public_ipv4_usd_per_hour: float = Field(
        default=0.0, ge=0, description="its public IPv4 address, USD per hour (0: none)"
    )


class Launch(Contract):
    """Say everything a (re)launch of the run's training box needs."""

    omit_when_none = frozenset()  # its nulls are written

    run: RunRef = Field(description="the run the boxes are tagged with")
    dag_id: str = Field(description="the DAG the boxes are tagged with")
    job_uri: str = Field(description="job/job.json")
    time_budget_s: int = Field(description="the run's time budget, seconds")
    instance_types: list[str] = Field(
        description="EC2 types in order of preference; empty: the backend's default"
    )
    use_spot: bool | None = Field(description="spot first; null: the backend's default")
    count: int = Field(
        default=1,
        ge=1,
        description="boxes per attempt (the run's num_nodes), started all or none; several "
        "train as one torchrun job in one placement group",
    )
    deadline_at: datetime = Field(description="the run's absolute deadline (every attempt)")
    wheel_uri: str = Field(description="the staged training wheel (ec2), else empty")
    wheel_sha256: str = Field(description="its sha256, else empty")
    bound_rate: BoxRate | None = _optional(
        "the run's priciest box (RunCosts.box_rate): the rate a box is billed at "
        "when its own price cannot be quoted"
    )


class Provisioned(Contract):
    """Say which boxes provision started for the run, and how to start another."""

    run: RunRef = Field(description="the run")
    job_uri: str = Field(description="job/job.json")
    output_uri: str = Field(description="job/: where the box writes its results")
    instance_ids: list[str] = Field(description="the boxes of the first attempt")
    backend: str = Field(description="compute backend: local or ec2")
    launch: Launch = Field(description="what a retry of the train task relaunches")

    @model_validator(mode="before")
    @classmethod
    def _budget_moved_to_run_json(cls, value: Any) -> Any:
        # A run provisioned before the budget moved to run.json still tears down.
        if isinstance(value, dict) and "max_cost_usd" in value:
            value = {k: v for k, v in value.items() if k != "max_cost_usd"}
        return value


class Trained(Contract):
    """Say where the trained weights are and how training went."""

    model_uri: str = Field(description="job/model.pt: a plain state dict")
    metrics_uri: str = Field(description="job/metrics.json")
    val_accuracy: float = Field(description="final validation top-1")
    epochs: int = Field(description="epochs trained")
    train_wall_s: float = Field(description="seconds of training, all phases")
    device: str = Field(description="cuda or cpu")


class Exported(Contract):
    """Say where export wrote the ONNX model and how it compares with torch."""

    model_dir: str = Field(description="`runs/<run_key>/model/`")
    sha256: str = Field(description="sha256 of the file that serves")
    parity_max_abs_diff: float = Field(description="largest ONNX vs torch logit difference")
    onnx_file: str = Field(description="the file that serves, beside model.json")
    quantization: QuantizationBlock | None = _optional("present when INT8 tried")


class Benchmarked(Contract):
    """Say what the benchmark measured for the candidate and production (no raw samples)."""

    latency_uri: str = Field(description="bench/latency.json: the full figures and samples")
    host: HostInfo = Field(description="the machine measured on")
    candidate: BenchFigures = Field(description="the candidate's figures")
    production: BenchFigures | None = _optional("production's; absent if none")
    sizing: SizingReport | None = _optional(
        "bench/sizing.json: the candidate's fleet at the expected load"
    )


class Deployed(Contract):
    """Say what deploy moved production to and what each service reported."""

    version: int = Field(description="the version production now holds")
    previous_version: int | None = Field(description="what production held before")
    services: dict[str, Any] = Field(description="each service's answer after the switch")
    staged: dict[str, Any] = Field(description="each service's answer to the stage call")


class ReapDecision(Contract):
    """One box the reaper terminated (or, on a dry run, would), and why."""

    instance_id: str = Field(description="the EC2 instance id or local process id")
    run_key: str = Field(description="the box's run key tag ('' without one)")
    dag_id: str = Field(description="the box's DAG tag ('' without one)")
    reason: Literal["expired", "run-not-active", "missing-run-tags"] = Field(
        description="past its expiry, its DAG run over, or no run tags at all"
    )
    detail: str = Field(description="one line for a person")


class ReapError(Contract):
    """Something that went wrong in a reaper pass; the box was left as it was, the pass went on."""

    instance_id: str = Field(description="'' when the error was about listing the boxes")
    run_key: str = Field(default="", description="the box's run key tag")
    step: Literal["list", "check-run", "terminate", "groups"] = Field(
        description="listing the boxes, asking Airflow about a run, terminating a box, or "
        "removing the groups of an expired run of several boxes"
    )
    error: str = Field(description="the exception's type and message")


class ReaperReport(Contract):
    """What one reaper pass over one backend (and EC2 region) terminated, kept and failed on."""

    backend: str = Field(default="", description="local or ec2")
    region: str = Field(default="", description="the EC2 region swept; '' for local")
    checked_at: datetime = Field(description="when the pass looked (expiry is against it)")
    dry_run: bool = Field(description="true: decisions are what would have been terminated")
    decisions: list[ReapDecision] = Field(
        default_factory=list, description="the boxes terminated (or that would be), and why"
    )
    kept: list[str] = Field(default_factory=list, description="ids of managed boxes kept")
    errors: list[ReapError] = Field(default_factory=list, description="what went wrong")
    warnings: list[str] = Field(
        default_factory=list, description="runs whose state could not be classified (kept)"
    )

    @property
    def instance_ids(self) -> list[str]:
        """Return the ids terminated (or, on a dry run, that would be)."""
        return [d.instance_id for d in self.decisions]

    def summary(self) -> str:
        """Return one line for logs and the CLI."""
        verb = "would terminate" if self.dry_run else "terminated"
        where = f"{self.backend} {self.region}".strip()
        head = f"reaper ({where})" if where else "reaper"
        notes = f"; {len(self.errors)} error(s)" if self.errors else ""
        notes += f"; {len(self.warnings)} warning(s)" if self.warnings else ""
        if not self.decisions:
            return (
                f"{head}: nothing to terminate ({len(self.kept)} managed instance(s) kept){notes}"
            )
        listed = ", ".join(f"{d.instance_id} ({d.reason})" for d in self.decisions)
        return f"{head}: {verb} {listed}; kept {len(self.kept)}{notes}"


STAGE_RESULTS: tuple[type[Contract], ...] = (
    RunRef,
    Validated,
    Packed,
    Launch,
    Provisioned,
    Trained,
    TrainingOutcome,
    Exported,
    Benchmarked,
    Deployed,
    ReaperReport,
)


# ---------------------------------------------------------------------------------------------
# Artifacts (JSON files)


class SkipRecord(Artifact):
    """`runs/<run_key>/skip.json`: why the run had nothing new to train on."""

    reason: str = Field(description="the line logged and shown in the report")
    production_version: int = Field(description="the production version it would remake")
    fingerprint: str = Field(description="the validated dataset's fingerprint")
    decided_at: str = Field(description="ISO 8601 UTC")


class PackedPart(Artifact):
    """`runs/<run_key>/dataset/shards/parts/part-NNNNN.json`: the shards one pack chunk wrote."""

    index: int = Field(ge=0, description="the chunk's number (PackPlan.chunks)")
    train_shards: list[str] = Field(description="URIs of its training shards, in order")
    val_shards: list[str] = Field(description="URIs of its validation shards, in order")
    counts: dict[str, int] = Field(description="images per split in its shards")
    train_histogram: list[list[int]] = Field(
        description="3 x 256 counts of each channel's values over its training images (the "
        "run's mean and std are computed from the sum over every part)"
    )


class AttemptRecord(Artifact):
    """`runs/<run_key>/job/attempt.json`: the training attempt the run now waits for."""

    attempt: int = Field(ge=1, description="1 for provision, +1 per relaunch")
    instance_ids: list[str] = Field(description="the boxes of that attempt")
    launched_at: str = Field(description="ISO 8601 UTC")


class LocalProcessRecord(Artifact):
    """`<compute state dir>/<run_key>/local-<id>.json`: a training process of the local backend."""

    instance_id: str = Field(description="local-<12 hex>: the box's id")
    pid: int = Field(description="the wrapper's pid, which leads the process group")
    host: str = Field(
        default="",
        description="the launching host, `<hostname>/<pid namespace inode>`: pid and start_ticks "
        "mean something only there; elsewhere liveness is read from the wrapper's files "
        "(empty in older records: read as this host)",
    )
    start_ticks: int | None = _optional("the wrapper's start time, clock ticks (guards pid reuse)")
    # Records written before the field was named run_key say run_id.
    run_key: str = Field(
        validation_alias=AliasChoices("run_key", "run_id"), description="the run key"
    )
    dag_id: str = Field(description="the DAG that launched it")
    job_uri: str = Field(description="the job.json it trains")
    airflow_run_id: str = Field(default="", description="the raw Airflow run id")
    launched_at: str = Field(description="ISO 8601 UTC")
    attempt: int = Field(ge=1, description="the training attempt")
    expires_at: str = Field(description="ISO 8601 UTC: the reaper stops it after this")
    log: str = Field(description="path of its log file")
    stopped_at: str | None = _optional("ISO 8601 UTC, once stopped")


class TriggerHeartbeat(Artifact):
    """`runs/<run_key>/job/attempts/<n>/trigger.json`: when the attempt's trigger last polled."""

    attempt: int = Field(ge=1, description="the training attempt the trigger waits on")
    polled_at: str = Field(description="ISO 8601 UTC of the last poll that wrote it")
    every_s: float = Field(gt=0, description="seconds between two writes while it runs")


class ProcessGroup(Contract):
    """One process group a supervisor started: its id and when its leader started."""

    pgid: int = Field(description="the process group id (its leader's pid)")
    started: float = Field(description="when the leader started (epoch seconds, as ps says)")


class SupervisorState(Artifact):
    """`var/run/{airflow,serve}.state.json`: what `make airflow` / `make serve` supervise.

    Read by ``burstcv.airflow.health --state`` so that a dead process is unhealthy at once, and
    by ``burstcv.supervisor stop``, which ends the groups whether or not the supervisor lives.
    """

    supervisor: int = Field(description="the supervisor's pid")
    components: dict[str, int | Literal["starting", "restarting"]] = Field(
        description="each component's pid, or starting (not yet up) or restarting (ended, or "
        "started again and not yet answering)"
    )
    groups: list[ProcessGroup] = Field(
        default_factory=list,
        description="the process groups started and not yet found empty, orphans included",
    )


class TrainingBeat(Artifact):
    """`runs/<run_key>/job/attempts/<n>/beat.json`: the training loop's own heartbeat.

    Written only as steps complete, never by a watchdog, so a trainer alive but stuck (hung in
    a collective, say) stops beating, and ``burstcv.compute.liveness`` ends it.
    """

    attempt: int = Field(ge=1, description="the attempt")
    beats: int = Field(ge=1, description="writes so far: a new value is progress")
    epoch: int = Field(ge=0, description="the epoch under way (0: the first)")
    step: int = Field(ge=0, description="optimizer steps done in the epoch")
    phase: Literal["train", "validate"] = Field(description="what the loop was doing")
    step_s: float | None = _optional("median seconds of a training step so far; absent before one")
    written_at: str = Field(description="ISO 8601 UTC, the box's clock")


class PriceQuote(Artifact):
    """`prices/<region>/<type>/<market>.json`: one hourly price, where and when it came from."""

    instance_type: str = Field(description="EC2 instance type")
    region: str = Field(description="AWS region")
    market: str = Field(description="on-demand or spot")
    zone: str = Field(default="", description="the Availability Zone (spot), else empty")
    usd_per_hour: float = Field(ge=0, description="USD per instance-hour, Linux")
    source: str = Field(description="which API (or the bundled table) gave it")
    as_of: str = Field(description="ISO 8601 UTC of the price itself (the table's date)")
    fetched_at: str = Field(description="ISO 8601 UTC of when it was read")


class BootTimes(Artifact):
    """`boots/<instance_type>.json`: how long the type's training boxes took to boot here."""

    instance_type: str = Field(description="EC2 instance type")
    measured_s: list[float] = Field(
        description="seconds from a box's launch to its passed preflight, the latest few, "
        "most recent last"
    )


class BoxBill(BoxRate):
    """Say where one box of one attempt ran, at what rate, and from when to when."""

    omit_when_none = frozenset()  # its nulls are written

    instance_id: str = Field(description="EC2 instance id or local process id")
    zone: str = Field(default="", description="its Availability Zone (ec2)")
    image_id: str = Field(default="", description="the AMI it booted (ec2)")
    launched_at: str = Field(description="ISO 8601 UTC launch time (the volume and IPv4 bill)")
    running_at: str | None = _optional(
        "ISO 8601 UTC when first seen running (the instance bills from then; null: from launch)"
    )
    ended_at: str | None = _optional("ISO 8601 UTC end; null: running")


class SizingBudget(Contract):
    """Say what a run sets aside for its sizing boxes (size_on ec2), out of its budget."""

    boxes: int = Field(ge=1, description="CPU types sized on boxes of their own, at most")
    max_s: int = Field(gt=0, description="the sizing's time bound, seconds")
    margin_s: int = Field(ge=0, description="seconds a sizing box may outlive that bound")
    box_rate: BoxRate = Field(
        description="the priciest sizing box (on-demand on the priciest allowed serving type, "
        "its root volume and public IPv4)"
    )
    reserve_usd: float = Field(
        ge=0,
        description="boxes x that rate x (max_s + margin_s): kept out of the training budget",
    )


class RunCosts(Contract):
    """Say what the run may spend and what its compute costs where it runs, priced once."""

    omit_when_none = frozenset({"sizing"})

    region: str = Field(description="the AWS region prices are for")
    boxes: int = Field(ge=1, description="training boxes a launch starts (num_nodes)")
    max_cost_usd: float = Field(gt=0, description="the budget, USD, every box of every attempt")
    box_rate: BoxRate = Field(
        description="the priciest box the run may rent (on-demand on its priciest type; "
        "spot falls back to it): what bounds the budget"
    )
    time_budget_s: int = Field(
        gt=0,
        description="seconds from provision to the run's deadline: the time_budget_s param, "
        "lowered so boxes x the box rate x (budget + the watchdog's margin) stays within "
        "max_cost_usd",
    )
    margin_s: int = Field(
        ge=0, description="seconds a box may outlive the deadline (the watchdog's margin)"
    )
    budget_reason: str = Field(description="one line: what bounds the time budget")
    serving: list[PriceQuote] = Field(
        description="on-demand prices of the CPU types the serving fleet may use, and of the "
        "GPU types the gate's advice may name, where known"
    )
    serving_unpriced: str | None = _optional(
        "why some or all serving types have no price, and what to set (null: all)"
    )
    sizing: SizingBudget | None = _optional(
        "the sizing boxes' share of the budget when the run sizes its fleet on "
        "ec2 (resolved from size_on); null: sized on the benchmark's host"
    )

    @property
    def training_usd(self) -> float:
        """Return what the training boxes may spend: the budget less the sizing's reserve."""
        return self.max_cost_usd - (self.sizing.reserve_usd if self.sizing else 0.0)


P = TypeVar("P", bound=BaseModel)


class RunRecord(Artifact, Generic[P]):
    """`runs/<run_key>/run.json`: the run, resolved once; every later task reads it.

    ``params`` is ``burstcv.params.RunParams`` (``RunRecord[RunParams]``), which this
    torch-free module does not import.
    """

    run_id: str = Field(description="the Airflow run id (the folder name is path-safe)")
    trigger: str = Field(
        description="what started the run: manual, scheduled, asset_triggered, backfill or cli"
    )
    started_at: str = Field(description="ISO 8601 UTC, when the run was resolved")
    params: P = Field(
        description="every run parameter, resolved: the trigger's values over the defaults, "
        "an asset event's dataset applied"
    )
    costs: RunCosts = Field(description="the prices and the budget, as resolved")
    image_size: ImageSizeChoice | None = _optional("the size validate chose (null until it passed)")
    training: TrainingChoice | None = _optional(
        "how the run trains, as validate chose (null until then)"
    )


class AttemptBill(Artifact):
    """`runs/<run_key>/job/attempts/<n>/{launch,end}.json`: one attempt's boxes, as billed.

    Bills are read from these, never from the cloud's memory (EC2 lists ended boxes an hour).
    """

    attempt: int = Field(ge=1, description="1 for provision, +1 per relaunch")
    run_key: str = Field(description="the run key the boxes are tagged with")
    dag_id: str = Field(description="the DAG the boxes are tagged with")
    backend: str = Field(description="compute backend: local or ec2")
    region: str = Field(default="", description="AWS region (ec2)")
    boxes: list[BoxBill] = Field(description="every box of the attempt")


class Billing(Artifact):
    """`runs/<run_key>/job/billing.json`: what teardown terminated and what it cost."""

    instance_ids: list[str] = Field(description="instances terminated (or billed so far)")
    billed_seconds: dict[str, float] = Field(description="billed seconds per instance")
    cost_usd: float = Field(description="cost of the run's boxes, USD")
    backend: str = Field(description="compute backend: local or ec2")
    instances: list[InstanceRecord] = Field(description="every instance of the run")
    terminated_at: str | None = _optional("ISO 8601 UTC; null: a bill so far, the boxes may be up")


class LatencyRecord(Artifact):
    """`runs/<run_key>/bench/latency.json`: the benchmark's full figures and samples."""

    measured_at: str = Field(description="ISO 8601 UTC")
    host: HostInfo = Field(description="the machine measured on")
    requests: int = Field(description="requests per model")
    concurrency: int = Field(
        description="requests in flight at once (closed loop); the most in flight for any "
        "model (open loop)"
    )
    offered_rps: float | None = _optional("the open-loop rate every model was driven at, req/s")
    load_note: str | None = _optional("where the rate comes from: the sizing, or a setting")
    candidate: BenchFigures | None = _optional(
        "the candidate's figures, with samples; absent only when the fleet sizing "
        "before them was inconclusive (nothing was measured)"
    )
    production: BenchFigures | None = _optional("production's; absent if none")
    inconclusive: str | None = _optional(
        "why nothing was judged: the host stayed busy through every attempt"
    )
    bench_s: float | None = _optional("seconds the latency benchmark took, repeats included")
    sizing_s: float | None = _optional("seconds the fleet sizing took")


class VerdictRecord(GateVerdict, Artifact):
    """`runs/<run_key>/bench/verdict.json`: the gate's verdict on the version it registered."""

    version: int = Field(description="the registry version, accepted or rejected")


class ModelCard(Artifact):
    """model.json: makes the ONNX file self-describing; serving reads it and never imports torch."""

    format_version: int = Field(default=1, description="model.json's original format marker (1)")
    name: str = Field(description="the model's name (BURSTCV_MODEL_NAME)")
    version: int | None = _optional("registry version; absent in `runs/<run_key>/model/`")
    arch: str = Field(description="architecture, e.g. resnet10")
    classes: list[str] = Field(min_length=1, description="index i of the logits is classes[i]")
    onnx_file: str = Field(description="the file beside model.json that serves")
    sha256: str = Field(description="hex sha256 of onnx_file")
    opset: int = Field(description="ONNX opset")
    input: TensorInput = Field(description="the graph's input")
    output: TensorOutput = Field(description="the graph's output")
    preprocess: PreprocessBlock = Field(description="the eval transform (PreprocessSpec)")
    metrics: dict[str, float] = Field(description="validation figures, e.g. val_accuracy")
    parity: ParityBlock | None = _optional("ONNX vs torch on real images")
    quantization: QuantizationBlock | None = _optional("present when INT8 tried")
    dataset_fingerprint: str = Field(description="sha256 over the validated dataset")
    source_commit: str = Field(description="git commit of the code, or 'unknown'")
    run_id: str = Field(description="the run that exported it")
    created_at: str = Field(description="ISO 8601 UTC")
    versions: dict[str, str] | None = _optional("versions of torch, onnx and onnxruntime at export")

    @field_validator("onnx_file")
    @classmethod
    def _beside(cls, value: str) -> str:
        if value in ("", ".", "..") or "/" in value or "\\" in value:
            raise ValueError("must name a file beside model.json")
        return value

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        if len(value) != 64 or any(c not in "0123456789abcdefABCDEF" for c in value):
            raise ValueError("must be the 64 hex digits of a sha256")
        return value.lower()


class RegistryDecision(Contract):
    """The gate's part of a registry entry: what it decided, and on which figures and params."""

    status: Literal["accepted", "rejected"] = Field(
        description="what the gate decided: accepted (promotable) or rejected"
    )
    reason: str = Field(default="", description="the gate's one-line summary")
    gate: GateVerdict | None = _optional("the gate's full verdict")
    benchmark: dict[str, BenchFigures] | None = _optional(
        "candidate (and production) figures, no samples"
    )
    params: dict[str, Any] | None = _optional(
        "the run's parameters; absent when registered outside the pipeline"
    )
    fleet: FleetOption | None = _optional(
        "the cheapest CPU fleet serving the run's expected load within the SLO"
    )
    fleet_measured_in: str | None = _optional(
        "the Airflow run whose staging services measured the sizes the fleet rests "
        "on: an earlier version's run when this one reused them (the same speed key)"
    )


class RegistryEntry(RegistryDecision, Artifact):
    """`<registry>/<model>/versions/<n>/entry.json`: the gate's verdict, figures and lineage."""

    version: int = Field(description="the version number")
    model: str = Field(description="the model's name")
    sha256: str = Field(description="sha256 of the version's serving file")
    registered_at: str = Field(description="ISO 8601 UTC")
    lineage: Lineage = Field(description="what made it")


class AliasRecord(Artifact):
    """`<registry>/<model>/aliases/<alias>.json`: the version an alias points at."""

    version: int = Field(gt=0, description="the version the alias points at")
    sha256: str = Field(description="sha256 of that version's serving file")
    updated_at: str = Field(default="", description="ISO 8601 UTC of the move")
    updated_by: str = Field(default="", description="who moved it (cli:..., run:..., api)")


class HistoryEvent(Artifact):
    """`<registry>/<model>/history/<ns>-<id>.json`: one alias move, refusal or conflict."""

    at: str = Field(description="ISO 8601 UTC")
    actor: str = Field(description="cli:<user>@<host>:<pid> | run:<run id> | api")
    action: str = Field(description="promote | rollback | restore")
    alias: str = Field(description="the alias, e.g. production")
    from_version: int | None = Field(
        validation_alias=AliasChoices("from", "from_version"),
        serialization_alias="from",
        description="the version it held (expected)",
    )
    to_version: int | None = Field(
        validation_alias=AliasChoices("to", "to_version"),
        serialization_alias="to",
        description="the version asked for",
    )
    result: str = Field(description="moved | refused | conflict | left")
    detail: str = Field(default="", description="one line: why, when not moved")


ARTIFACTS: tuple[type[Artifact], ...] = (
    RunRecord,
    ValidationRecord,
    DatasetProfile,
    SkipRecord,
    ScanPlan,
    PackPlan,
    PackedPart,
    AttemptRecord,
    LocalProcessRecord,
    TriggerHeartbeat,
    TrainingBeat,
    SupervisorState,
    PriceQuote,
    BootTimes,
    AttemptBill,
    TrainingProgress,
    TrainingMetrics,
    DoneMarker,
    FailedMarker,
    Billing,
    LatencyRecord,
    CalibrationRecord,
    VerdictRecord,
    SizingReport,
    BoxSizing,
    ModelCard,
    RegistryEntry,
    AliasRecord,
    HistoryEvent,
)

A = TypeVar("A", bound=Artifact)


def parse_artifact(data: Any, model: type[A], source: str) -> A:
    """Validate a parsed JSON document as ``model``; errors name ``source`` and the field."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{source}: holds {type(data).__name__}, expected a JSON object")
    version = data.get("schema_version", 1)
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{source}: schema_version {version} is newer than this code reads "
            f"({SCHEMA_VERSION}); upgrade burstcv to read it"
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(document)"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ArtifactError(f"{source}: field '{where}': {first['msg']}{more}") from None


def read_artifact(uri: str, model: type[A]) -> A:
    """Read and validate one artifact file (local path or s3:// URI), once, at the boundary.

    Raise ``storage.ArtifactNotFoundError`` when it is missing, else ``ArtifactError`` (or
    ``SchemaVersionError``) naming the file and the field.
    """
    raw = storage.read_bytes(uri)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ArtifactError(f"{uri}: not JSON: {exc}") from None
    return parse_artifact(data, model, uri)


def write_artifact(uri: str, artifact: Artifact) -> str:
    """Write an artifact as JSON (indented, keys sorted) atomically; return its URI."""
    return storage.write_json(uri, artifact.model_dump(mode="json", by_alias=True))
