"""Build the training wheel a GPU box installs, and stage it in the artifact store by sha256.

The wheel holds exactly the modules training imports and never declares torch, so installing
it cannot re-resolve the AMI's. It is byte-for-byte reproducible, so its sha256 names it: a
run uploads it only when that build is not in the store yet. A sizing box installs a
``burstcv-size`` wheel built the same way.

Beside the wheel lies its wheelhouse: for each box Python and machine (a tag such as
``cp311-x86_64``), one tar of every wheel its requirements resolve to, with their
``SHA256SUMS``. A box installs from it with no package index. The tars are downloaded once
per machine (``BURSTCV_WHEELHOUSE_CACHE``) and uploaded once per build.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import burstcv_spec
from burstcv import __version__
from burstcv.training.preflight import SUPPORTED_PYTHON
from burstcv_spec import storage

log = logging.getLogger(__name__)

# The modules a training box imports, and nothing else (tests/compute/test_runtime.py proves
# that `burstcv train` runs from them alone).
MODULES = (
    "burstcv/__init__.py",
    "burstcv/lineage.py",
    "burstcv/training/__init__.py",
    "burstcv/training/checkpoint.py",
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
    "burstcv/training/world.py",
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
# Present in the DLAMI PyTorch environments; the wheelhouse holds them for an AMI that lacks one.
TRAINING_REQUIRES = ("numpy", "boto3", "pydantic>=2,<3")
# The Pythons the sizing wheel runs on ([min, max)); Amazon Linux 2023's dnf has 3.11.
SIZING_SUPPORTED = ((3, 11), (3, 14))
# The oldest glibc of the boxes' images (Amazon Linux 2023): wheels up to its manylinux tag.
_GLIBC_MINOR = 34


def module_path(name: str) -> Path:
    """Return the source file of one of MODULES (``burstcv/lineage.py`` and the like)."""
    return _PACKAGE_ROOTS[name.split("/", 1)[0]] / name


@dataclass(frozen=True)
class TrainingWheel:
    """Name one built training wheel: its file name, bytes and sha256."""

    filename: str
    data: bytes
    sha256: str


@dataclass(frozen=True)
class StagedRuntime:
    """Say where the training wheel lies in the artifact store (what user-data downloads)."""

    uri: str
    sha256: str
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
        TRAINING_REQUIRES,
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
        sizing_requires(),
        "burstcv-size = burstcv.gate.sizebox:main",
    )


def sizing_requires() -> tuple[str, ...]:
    """Return the sizing wheel's requirements: the serving pins, and the search's own."""
    return (*_serving_pins(), "psutil", "httpx", "boto3")


def machine_of(instance_type: str) -> str:
    """Return ``platform.machine()`` of an instance type's box: Graviton types (a ``g`` among
    the letters after the generation, as in c7g, m6gd, im4gn) are aarch64."""
    found = re.match(r"[a-z]+\d+([a-z-]*)\.", instance_type)
    return "aarch64" if found and "g" in found.group(1) else "x86_64"


def wheelhouse_tags(
    python: str, machines: Iterable[str], supported: tuple[tuple[int, int], tuple[int, int]]
) -> tuple[str, ...]:
    """Return the wheelhouse tags of boxes running ``python`` on ``machines``: the version
    its name says (``python3.11``), else every version in ``supported`` ([min, max))."""
    named = re.search(r"python(\d)\.(\d+)$", python)
    (low_major, low), (_, high) = supported
    versions = (
        [(int(named[1]), int(named[2]))] if named else [(low_major, m) for m in range(low, high)]
    )
    return tuple(f"cp{a}{b}-{m}" for m in dict.fromkeys(machines) for a, b in versions)


def training_tags(python: str, instance_types: Iterable[str]) -> tuple[str, ...]:
    """Return the wheelhouse tags a run's training boxes need."""
    return wheelhouse_tags(python, map(machine_of, instance_types), SUPPORTED_PYTHON)


def sizing_tags(python: str, instance_types: Iterable[str]) -> tuple[str, ...]:
    """Return the wheelhouse tags of sizing boxes of ``instance_types`` running ``python``."""
    return wheelhouse_tags(python, map(machine_of, instance_types), SIZING_SUPPORTED)


def wheelhouse_uri(wheel_uri: str, tag: str) -> str:
    """Return where the wheelhouse of ``tag`` lies: beside the wheel (the box derives it)."""
    return f"{wheel_uri.rsplit('/', 1)[0]}/wheelhouse/{tag}.tar"


def stage_training_wheel(artifact_root: str, tags: Sequence[str] = ()) -> StagedRuntime:
    """Upload the training wheel to ``<root>/runtime/<sha256>/`` unless it is there already,
    and the wheelhouse of each tag beside it."""
    return _stage(artifact_root, build_training_wheel(), "training", TRAINING_REQUIRES, tags)


def stage_sizing_wheel(artifact_root: str, tags: Sequence[str]) -> StagedRuntime:
    """Upload the sizing wheel to ``<root>/runtime/<sha256>/`` unless it is there already,
    and the wheelhouse of each tag beside it."""
    return _stage(artifact_root, build_sizing_wheel(), "sizing", sizing_requires(), tags)


def _stage(
    artifact_root: str,
    wheel: TrainingWheel,
    what: str,
    requires: Sequence[str],
    tags: Sequence[str],
) -> StagedRuntime:
    uri = storage.join(artifact_root, "runtime", wheel.sha256, wheel.filename)
    uploaded = not storage.exists(uri)
    if uploaded:
        storage.write_bytes(uri, wheel.data)
    state = "uploaded" if uploaded else "already staged"
    size, sha = len(wheel.data), wheel.sha256[:12]
    log.info("%s wheel %s (%d bytes, sha256 %s) %s", what, uri, size, sha, state)
    for tag in dict.fromkeys(tags):
        _stage_wheelhouse(uri, requires, tag)
    return StagedRuntime(uri, wheel.sha256, uploaded)


def _stage_wheelhouse(wheel_uri: str, requires: Sequence[str], tag: str) -> None:
    """Upload the wheelhouse of ``tag`` beside the wheel unless it is there, or the package
    index could not give it (the box then installs from the index)."""
    uri = wheelhouse_uri(wheel_uri, tag)
    if storage.exists(uri) or (data := wheelhouse_tar(requires, tag)) is None:
        return
    storage.write_bytes(uri, data)
    log.info("wheelhouse %s (%d bytes) uploaded", uri, len(data))


def wheelhouse_cache() -> Path:
    """Return the folder that keeps downloaded wheelhouses (one tar per requirements and tag)."""
    found = os.environ.get("BURSTCV_WHEELHOUSE_CACHE")
    return Path(found) if found else Path.home() / ".cache" / "burstcv" / "wheelhouse"


def wheelhouse_tar(requires: Sequence[str], tag: str) -> bytes | None:
    """Return the tar of every wheel ``requires`` resolves to for ``tag`` (cached), or None
    when pip cannot download them."""
    key = hashlib.sha256("\n".join(sorted(requires)).encode()).hexdigest()[:16]
    cached = wheelhouse_cache() / f"{key}-{tag}.tar"
    if cached.exists():
        return cached.read_bytes()
    python, machine = tag.split("-", 1)
    platforms = [f"manylinux_2_{n}_{machine}" for n in range(_GLIBC_MINOR, 4, -1)]
    platforms += [f"manylinux{year}_{machine}" for year in ("2014", "2010", "1")]
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-input"]
        command += ["--disable-pip-version-check", "--only-binary=:all:", "--implementation"]
        command += ["cp", "--python-version", f"{python[2]}.{python[3:]}", "-d", folder]
        command += [arg for platform in platforms for arg in ("--platform", platform)]
        done = subprocess.run([*command, *requires], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or ["no output"])[-1]
            log.warning("no wheelhouse for %s: pip download failed: %s", tag, why)
            return None
        data = _tar_of(sorted(Path(folder).glob("*.whl")))
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.part")
    partial.write_bytes(data)
    partial.replace(cached)
    return data


def _tar_of(wheels: list[Path]) -> bytes:
    """Return a reproducible tar of ``wheels`` and their SHA256SUMS (sha256sum -c reads it)."""
    sums = "".join(f"{hashlib.sha256(w.read_bytes()).hexdigest()}  {w.name}\n" for w in wheels)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [
            ("SHA256SUMS", sums.encode()),
            *((w.name, w.read_bytes()) for w in wheels),
        ]:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
