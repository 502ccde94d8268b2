"""Name the folders and files of one run and of the model registry, for every reader and writer.

The pipeline writes these paths; the report, the Airflow plugin and the service read them,
asking this module rather than joining names of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from burstcv_spec import storage

RUN_RECORD = "run.json"
SKIP_RECORD = "skip.json"
ATTEMPT_RECORD = "attempt.json"
TRIGGER_HEARTBEAT = "trigger.json"  # in an attempt's folder: when its trigger last polled
TRAINING_BEAT = "beat.json"  # in an attempt's folder: the training loop's progress heartbeat
LAUNCH_RECORD = "launch.json"  # in an attempt's folder: its boxes as launched (AttemptBill)
END_RECORD = "end.json"  # in an attempt's folder: its boxes as ended (AttemptBill)
MODEL_CARD = "model.json"
MANIFEST = "manifest.parquet"  # in dataset/: one row per file
VALIDATION_RECORD = "validation.json"  # in dataset/, beside the manifest
JOB_SPEC = "job.json"  # in the job folder: what the training box runs (JobSpec)
PROGRESS = "progress.json"
METRICS = "metrics.json"
# An attempt's markers: exactly one of them ends it.
DONE_MARKER = "DONE"
FAILED_MARKER = "FAILED"
RANK_MARKERS = "ranks"  # in an attempt's folder: ranks/<rank>/FAILED, each rank's own
REGISTRY_ENTRY = "entry.json"
PRODUCTION = "production"
PREVIOUS = "previous"


class _Path:
    """Name a path of a layout: ``name`` inside another of its paths (the attribute ``under``)."""

    def __init__(self, under: str, name: str) -> None:
        self.under, self.name = under, name

    def __get__(self, layout: object, owner: type | None = None) -> str:
        return storage.join(getattr(layout, self.under), self.name)


@dataclass(frozen=True)
class RunLayout:
    """Name every folder and file one run writes under ``<artifact root>/runs/<run_key>/``."""

    root: str

    record = _Path("root", RUN_RECORD)
    skip = _Path("root", SKIP_RECORD)  # written when the run had nothing new to train on
    dataset = _Path("root", "dataset")  # manifest, validation.json, Data Docs, shards
    manifest = _Path("dataset", MANIFEST)
    validation = _Path("dataset", VALIDATION_RECORD)
    shards = _Path("dataset", "shards")
    scan = _Path("dataset", "scan")  # the listing, the refused rows and each chunk's manifest part
    scan_plan = _Path("scan", "plan.json")  # the scan's chunks
    pack_plan = _Path("shards", "plan.json")  # the pack's chunks
    job = _Path("root", "job")  # the training box's inputs and results
    job_spec = _Path("job", JOB_SPEC)
    metrics = _Path("job", METRICS)
    progress = _Path("job", PROGRESS)  # the epochs so far, rewritten at each epoch's end
    weights = _Path("job", "model.pt")  # the trained state dict
    attempt = _Path("job", ATTEMPT_RECORD)  # the training attempt the run waits for
    billing = _Path("job", "billing.json")
    model = _Path("root", "model")  # model.onnx, [model.int8.onnx], model.json
    model_card = _Path("model", MODEL_CARD)
    bench = _Path("root", "bench")
    latency = _Path("bench", "latency.json")
    sizing = _Path("bench", "sizing.json")
    sizing_boxes = _Path("bench", "sizing")  # what the sizing boxes read and write (size_on ec2)
    sizing_requests = _Path("sizing_boxes", "requests")  # the images a sizing box sends
    verdict = _Path("bench", "verdict.json")
    report = _Path("root", "report")

    @classmethod
    def of(cls, artifact_root: str, run_id: str) -> RunLayout:
        """Return the layout of a run (its Airflow run id or run key) under an artifact root."""
        return cls(storage.join(artifact_root, "runs", storage.safe_run_id(run_id)))

    def scan_part(self, index: int) -> str:
        """Return dataset/scan/part-NNNNN.parquet: the manifest rows of scan chunk ``index``."""
        return storage.join(self.scan, f"part-{index:05d}.parquet")

    def pack_rows(self, index: int) -> str:
        """Return dataset/shards/rows/rows-NNNNN.parquet: the images of pack chunk ``index``'s
        shards, in order (what its task reads instead of the whole manifest)."""
        return storage.join(self.shards, "rows", f"rows-{index:05d}.parquet")

    def pack_part(self, index: int) -> str:
        """Return dataset/shards/parts/part-NNNNN.json: what pack chunk ``index`` wrote."""
        return storage.join(self.shards, "parts", f"part-{index:05d}.json")

    def box_sizing(self, instance_type: str) -> str:
        """Return bench/sizing/boxes/<type>.json: one instance type's BoxSizing."""
        return storage.join(self.sizing_boxes, "boxes", f"{instance_type}.json")

    def sizing_bill(self, instance_type: str) -> str:
        """Return bench/sizing/bills/<type>/: its box's launch and end records, as a training
        job folder holds its attempts' (attempts/1/{launch,end}.json)."""
        return storage.join(self.sizing_boxes, "bills", instance_type)


@dataclass(frozen=True)
class RegistryLayout:
    """Name the folders of one model in a registry: versions, aliases and history."""

    registry_uri: str
    model_name: str

    versions = _Path("root", "versions")  # one folder per version number
    aliases = _Path("root", "aliases")
    alias_lock = _Path("aliases", ".lock")  # held while an alias moves
    history = _Path("root", "history")  # one JSON file per alias event

    @property
    def root(self) -> str:
        """Return <registry>/<model>."""
        return storage.join(self.registry_uri, self.model_name)

    def version(self, version: int, *parts: str) -> str:
        """Return versions/<n> or a file inside it."""
        return storage.join(self.versions, str(version), *parts)

    def model_card(self, version: int) -> str:
        """Return versions/<n>/model.json."""
        return self.version(version, MODEL_CARD)

    def entry(self, version: int) -> str:
        """Return versions/<n>/entry.json."""
        return self.version(version, REGISTRY_ENTRY)

    def alias(self, name: str) -> str:
        """Return aliases/<name>.json."""
        return storage.join(self.aliases, f"{name}.json")
