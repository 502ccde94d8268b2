"""Build the training wheel a GPU box installs, and stage it in the artifact store by sha256.

The wheel holds exactly the modules training imports and never declares torch, so installing
it cannot re-resolve the AMI's. It is byte-for-byte reproducible, so its sha256 names it: a
run uploads it only when that build is not in the store yet. A sizing box installs a
``burstcv-size`` wheel built the same way.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path

import burstcv_spec
from burstcv import __version__
from burstcv_spec import storage

log = logging.getLogger(__name__)

# The modules a training box imports, and nothing else (tests/compute/test_runtime.py proves
# that `burstcv train` runs from them alone).
MODULES = (
    "burstcv/__init__.py",
    "burstcv/lineage.py",
    "burstcv/training/__init__.py",
    "burstcv/training/entry.py",
    "burstcv/training/job.py",
    "burstcv/training/models.py",
    "burstcv/training/names.py",
    "burstcv/training/preflight.py",
    "burstcv/training/recipe.py",
    "burstcv/training/stream.py",
    "burstcv/training/train.py",
    "burstcv/training/transforms.py",
    "burstcv/training/weights.py",
    "burstcv_spec/__init__.py",
    "burstcv_spec/contracts.py",
    "burstcv_spec/layout.py",
    "burstcv_spec/preprocess.py",
    "burstcv_spec/storage.py",
)
# A sizing box: the search, the load generator, the staging service and the box's entry; the
# whole of burstcv_spec and burstcv_serving come with them (sizing_files).
SIZING_MODULES = (
    "burstcv/__init__.py",
    "burstcv/lineage.py",
    "burstcv/cost/__init__.py",
    "burstcv/cost/model.py",
    "burstcv/cost/pricing.py",
    "burstcv/cost/prices.json",
    "burstcv/gate/__init__.py",
    "burstcv/gate/interference.py",
    "burstcv/gate/latency.py",
    "burstcv/gate/loadgen.py",
    "burstcv/gate/sizebox.py",
    "burstcv/gate/sizing.py",
)
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest zip timestamp: a fixed one makes builds equal
_WHEEL = b"Wheel-Version: 1.0\nGenerator: burstcv\nRoot-Is-Purelib: true\nTag: py3-none-any\n"

# The folder holding each top-level package (src/ and spec/ in a checkout).
_PACKAGE_ROOTS = {
    "burstcv": Path(__file__).resolve().parents[2],
    "burstcv_spec": Path(burstcv_spec.__file__).resolve().parents[1],
}
# The service: serving/burstcv_serving in a checkout.
SERVING_PACKAGE = ("burstcv_serving", Path(__file__).resolve().parents[3] / "serving")
SERVING_REQUIREMENTS = SERVING_PACKAGE[1] / "requirements.txt"


def module_path(name: str) -> Path:
    """Return the source file of one of MODULES (``burstcv/lineage.py`` and the like)."""
    return _PACKAGE_ROOTS[name.split("/", 1)[0]] / name


@dataclass(frozen=True)
class TrainingWheel:
    """Name one built training wheel: its file name, bytes and sha256."""

    filename: str
    data: bytes
    sha256: str

    @property
    def size_bytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class StagedRuntime:
    """Say where the training wheel lies in the artifact store (what user-data downloads)."""

    uri: str
    sha256: str
    size_bytes: int
    uploaded: bool  # False when this exact build was already there


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def build_training_wheel(version: str = __version__) -> TrainingWheel:
    """Return the ``burstcv-train`` wheel built from this checkout's training modules."""
    return _build_wheel(
        "burstcv_train",
        version,
        "burstcv's training job, as a GPU box installs it",
        [(name, module_path(name).read_bytes()) for name in MODULES],
        ">=3.10",  # burstcv.training.preflight.SUPPORTED_PYTHON checks the upper end
        # Present in the DLAMI PyTorch environments; pip fetches only what an AMI lacks.
        ("numpy", "boto3", "pydantic>=2,<3"),
        "burstcv = burstcv.training.entry:main",
    )


def _build_wheel(
    dist_name: str,
    version: str,
    summary: str,
    files: list[tuple[str, bytes]],
    requires_python: str,
    requires: tuple[str, ...],
    console_script: str,
) -> TrainingWheel:
    """Return a reproducible pure-Python wheel of ``files`` (path in the wheel, bytes)."""
    dist_info = f"{dist_name}-{version}.dist-info"
    metadata = "\n".join(
        [
            "Metadata-Version: 2.1",
            f"Name: {dist_name.replace('_', '-')}",
            f"Version: {version}",
            f"Summary: {summary}",
            f"Requires-Python: {requires_python}",
            *(f"Requires-Dist: {req}" for req in requires),
            "",
        ]
    )
    files = list(files)
    files += [
        (f"{dist_info}/METADATA", metadata.encode()),
        (f"{dist_info}/WHEEL", _WHEEL),
        (f"{dist_info}/entry_points.txt", f"[console_scripts]\n{console_script}\n".encode()),
    ]
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files)
    files.append((f"{dist_info}/RECORD", (record + f"{dist_info}/RECORD,,\n").encode()))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in files:
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, data)
    data = buffer.getvalue()
    filename = f"{dist_name}-{version}-py3-none-any.whl"
    return TrainingWheel(filename, data, hashlib.sha256(data).hexdigest())


def _serving_pins() -> tuple[str, ...]:
    """Return the serving image's exact pins (serving/requirements.txt): a sizing box runs
    the service as the image would."""
    text = SERVING_REQUIREMENTS.read_text()
    pins = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return tuple(pin for pin in pins if pin)


def sizing_files() -> list[tuple[str, bytes]]:
    """Return (path in the wheel, bytes) of everything a sizing box runs."""
    files = [(name, module_path(name).read_bytes()) for name in SIZING_MODULES]
    for package, root in (("burstcv_spec", _PACKAGE_ROOTS["burstcv_spec"]), SERVING_PACKAGE):
        for path in sorted((root / package).rglob("*.py")):
            files.append((path.relative_to(root).as_posix(), path.read_bytes()))
    return files


def build_sizing_wheel(version: str = __version__) -> TrainingWheel:
    """Return the ``burstcv-size`` wheel a sizing box installs (no torch, no Airflow)."""
    return _build_wheel(
        "burstcv_size",
        version,
        "burstcv's fleet sizing, as a CPU sizing box installs it",
        sizing_files(),
        ">=3.11",  # numpy 2.4 (the serving pin) needs 3.11
        (*_serving_pins(), "psutil", "httpx", "boto3"),  # psutil and httpx: the search's own
        "burstcv-size = burstcv.gate.sizebox:main",
    )


def stage_training_wheel(artifact_root: str) -> StagedRuntime:
    """Upload the training wheel to ``<root>/runtime/<sha256>/`` unless it is there already."""
    return _stage(artifact_root, build_training_wheel(), "training")


def stage_sizing_wheel(artifact_root: str) -> StagedRuntime:
    """Upload the sizing wheel to ``<root>/runtime/<sha256>/`` unless it is there already."""
    return _stage(artifact_root, build_sizing_wheel(), "sizing")


def _stage(artifact_root: str, wheel: TrainingWheel, what: str) -> StagedRuntime:
    uri = storage.join(artifact_root, "runtime", wheel.sha256, wheel.filename)
    uploaded = not storage.exists(uri)
    if uploaded:
        storage.write_bytes(uri, wheel.data)
    state = "uploaded" if uploaded else "already staged"
    size, sha = wheel.size_bytes, wheel.sha256[:12]
    log.info("%s wheel %s (%d bytes, sha256 %s) %s", what, uri, size, sha, state)
    return StagedRuntime(uri, wheel.sha256, wheel.size_bytes, uploaded)
