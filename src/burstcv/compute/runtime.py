"""Build the training wheel a GPU box installs, and stage it in the artifact store by sha256.

A box boots on a Deep Learning AMI whose Python already has CUDA torch and torchvision, so the
only code it downloads is burstcv's own training code: a ``burstcv-train`` wheel of a few
tens of KB, built here from the running source, holding exactly the modules training imports
(no Airflow, Great Expectations or service). It declares numpy, boto3 and pydantic, never
torch, so installing it cannot re-resolve the AMI's torch. The wheel is byte-for-byte
reproducible (fixed timestamps and order), so its sha256 names it: a run uploads it only
when that exact build is not in the store yet, and job.json records the hash the box checks.
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

DIST_NAME = "burstcv_train"
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
REQUIRES_PYTHON = ">=3.10"  # burstcv.training.preflight.SUPPORTED_PYTHON checks the upper end
# Present in the DLAMI PyTorch environments; pip fetches only what an AMI lacks.
REQUIRES = ("numpy", "boto3", "pydantic>=2,<3")
CONSOLE_SCRIPT = "burstcv = burstcv.training.entry:main"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest zip timestamp: a fixed one makes builds equal

# The folder holding each top-level package (src/ and spec/ in a checkout).
_PACKAGE_ROOTS = {
    "burstcv": Path(__file__).resolve().parents[2],
    "burstcv_spec": Path(burstcv_spec.__file__).resolve().parents[1],
}


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
        """Return the wheel's size."""
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
    dist_info = f"{DIST_NAME}-{version}.dist-info"
    metadata = "\n".join(
        [
            "Metadata-Version: 2.1",
            "Name: burstcv-train",
            f"Version: {version}",
            "Summary: burstcv's training job, as a GPU box installs it",
            f"Requires-Python: {REQUIRES_PYTHON}",
            *(f"Requires-Dist: {req}" for req in REQUIRES),
            "",
        ]
    )
    files: list[tuple[str, bytes]] = [(name, module_path(name).read_bytes()) for name in MODULES]
    files += [
        (f"{dist_info}/METADATA", metadata.encode()),
        (
            f"{dist_info}/WHEEL",
            b"Wheel-Version: 1.0\nGenerator: burstcv\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        ),
        (f"{dist_info}/entry_points.txt", f"[console_scripts]\n{CONSOLE_SCRIPT}\n".encode()),
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
    filename = f"{DIST_NAME}-{version}-py3-none-any.whl"
    return TrainingWheel(filename, data, hashlib.sha256(data).hexdigest())


def stage_training_wheel(artifact_root: str) -> StagedRuntime:
    """Upload the training wheel to ``<root>/runtime/<sha256>/`` unless it is there already."""
    wheel = build_training_wheel()
    uri = storage.join(artifact_root, "runtime", wheel.sha256, wheel.filename)
    uploaded = not storage.exists(uri)
    if uploaded:
        storage.write_bytes(uri, wheel.data)
    log.info(
        "training wheel %s (%d bytes, sha256 %s) %s",
        uri,
        wheel.size_bytes,
        wheel.sha256[:12],
        "uploaded" if uploaded else "already staged",
    )
    return StagedRuntime(uri, wheel.sha256, wheel.size_bytes, uploaded)
