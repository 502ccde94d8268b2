"""Name the folders and files of one run and of the model registry, for every reader and writer.

The pipeline writes these paths, the report, the Airflow plugin and the prediction service
read them; each side asks this module rather than joining names of its own
(docs/contracts.md lists them).
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
# The training box's files, in the job folder (progress, metrics) and in an attempt's folder
# (the markers: exactly one of them ends an attempt).
MANIFEST = "manifest.parquet"  # in dataset/: one row per file
VALIDATION_RECORD = "validation.json"  # in dataset/, beside the manifest
JOB_SPEC = "job.json"  # in the job folder: what the training box runs (JobSpec)
PROGRESS = "progress.json"
METRICS = "metrics.json"
DONE_MARKER = "DONE"
FAILED_MARKER = "FAILED"
RANK_MARKERS = "ranks"  # in an attempt's folder: ranks/<rank>/FAILED, each rank's own
REGISTRY_ENTRY = "entry.json"
PRODUCTION = "production"
PREVIOUS = "previous"


@dataclass(frozen=True)
class RunLayout:
    """Name every folder and file one run writes under ``<artifact root>/runs/<run_key>/``."""

    root: str

    @classmethod
    def of(cls, artifact_root: str, run_id: str) -> RunLayout:
        """Return the layout of a run (its Airflow run id or run key) under an artifact root."""
        return cls(storage.join(artifact_root, "runs", storage.safe_run_id(run_id)))

    @property
    def record(self) -> str:
        """Return run.json: the Airflow run id (the folder name is path-safe)."""
        return storage.join(self.root, RUN_RECORD)

    @property
    def skip(self) -> str:
        """Return skip.json: written when the run had nothing new to train on."""
        return storage.join(self.root, SKIP_RECORD)

    @property
    def dataset(self) -> str:
        """Return dataset/: manifest, validation.json, Data Docs, shards."""
        return storage.join(self.root, "dataset")

    @property
    def manifest(self) -> str:
        """Return dataset/manifest.parquet."""
        return storage.join(self.dataset, MANIFEST)

    @property
    def validation(self) -> str:
        """Return dataset/validation.json."""
        return storage.join(self.dataset, VALIDATION_RECORD)

    @property
    def shards(self) -> str:
        """Return dataset/shards."""
        return storage.join(self.dataset, "shards")

    @property
    def scan(self) -> str:
        """Return dataset/scan/: the listing, the refused rows and each chunk's manifest part."""
        return storage.join(self.dataset, "scan")

    @property
    def scan_plan(self) -> str:
        """Return dataset/scan/plan.json: the scan's chunks."""
        return storage.join(self.scan, "plan.json")

    @property
    def pack_plan(self) -> str:
        """Return dataset/shards/plan.json: the pack's chunks."""
        return storage.join(self.shards, "plan.json")

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

    @property
    def job(self) -> str:
        """Return job/: the training box's inputs and results."""
        return storage.join(self.root, "job")

    @property
    def job_spec(self) -> str:
        """Return job/job.json."""
        return storage.join(self.job, JOB_SPEC)

    @property
    def metrics(self) -> str:
        """Return job/metrics.json."""
        return storage.join(self.job, METRICS)

    @property
    def progress(self) -> str:
        """Return job/progress.json: the epochs so far, rewritten at each epoch's end."""
        return storage.join(self.job, PROGRESS)

    @property
    def weights(self) -> str:
        """Return job/model.pt: the trained state dict."""
        return storage.join(self.job, "model.pt")

    @property
    def attempt(self) -> str:
        """Return job/attempt.json: the training attempt the run waits for."""
        return storage.join(self.job, ATTEMPT_RECORD)

    @property
    def billing(self) -> str:
        """Return job/billing.json."""
        return storage.join(self.job, "billing.json")

    @property
    def model(self) -> str:
        """Return model/: model.onnx, [model.int8.onnx], model.json."""
        return storage.join(self.root, "model")

    @property
    def model_card(self) -> str:
        """Return model/model.json."""
        return storage.join(self.model, MODEL_CARD)

    @property
    def bench(self) -> str:
        """Return bench/."""
        return storage.join(self.root, "bench")

    @property
    def latency(self) -> str:
        """Return bench/latency.json."""
        return storage.join(self.bench, "latency.json")

    @property
    def sizing(self) -> str:
        """Return bench/sizing.json."""
        return storage.join(self.bench, "sizing.json")

    @property
    def sizing_boxes(self) -> str:
        """Return bench/sizing/: what the sizing boxes read and write (size_on ec2)."""
        return storage.join(self.bench, "sizing")

    def box_sizing(self, instance_type: str) -> str:
        """Return bench/sizing/boxes/<type>.json: one instance type's BoxSizing."""
        return storage.join(self.sizing_boxes, "boxes", f"{instance_type}.json")

    def sizing_bill(self, instance_type: str) -> str:
        """Return bench/sizing/bills/<type>/: its box's launch and end records, as a training
        job folder holds its attempts' (attempts/1/{launch,end}.json)."""
        return storage.join(self.sizing_boxes, "bills", instance_type)

    @property
    def sizing_requests(self) -> str:
        """Return bench/sizing/requests/: the images a sizing box sends its service."""
        return storage.join(self.sizing_boxes, "requests")

    @property
    def verdict(self) -> str:
        """Return bench/verdict.json."""
        return storage.join(self.bench, "verdict.json")

    @property
    def report(self) -> str:
        """Return report/."""
        return storage.join(self.root, "report")


@dataclass(frozen=True)
class RegistryLayout:
    """Name the folders of one model in a registry: versions, aliases and history."""

    registry_uri: str
    model_name: str

    @property
    def root(self) -> str:
        """Return <registry>/<model>."""
        return storage.join(self.registry_uri, self.model_name)

    @property
    def versions(self) -> str:
        """Return versions/: one folder per version number."""
        return storage.join(self.root, "versions")

    def version(self, version: int, *parts: str) -> str:
        """Return versions/<n> or a file inside it."""
        return storage.join(self.versions, str(version), *parts)

    def model_card(self, version: int) -> str:
        """Return versions/<n>/model.json."""
        return self.version(version, MODEL_CARD)

    def entry(self, version: int) -> str:
        """Return versions/<n>/entry.json."""
        return self.version(version, REGISTRY_ENTRY)

    @property
    def aliases(self) -> str:
        """Return aliases/."""
        return storage.join(self.root, "aliases")

    def alias(self, name: str) -> str:
        """Return aliases/<name>.json."""
        return storage.join(self.aliases, f"{name}.json")

    @property
    def alias_lock(self) -> str:
        """Return aliases/.lock: held while an alias moves."""
        return storage.join(self.aliases, ".lock")

    @property
    def history(self) -> str:
        """Return history/: one JSON file per alias event."""
        return storage.join(self.root, "history")
