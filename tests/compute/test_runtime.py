"""Check the training wheel: small, reproducible, only the training modules, no torch pin."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from burstcv.compute.runtime import (
    MODULES,
    build_training_wheel,
    module_path,
    stage_training_wheel,
)
from burstcv_spec import storage

PYENV = Path.home() / ".pyenv" / "versions"


def test_the_wheel_is_small_reproducible_and_holds_only_the_training_code() -> None:
    wheel = build_training_wheel()
    assert wheel.sha256 == build_training_wheel().sha256  # same bytes, build after build
    assert len(wheel.data) < 100_000
    with zipfile.ZipFile(io.BytesIO(wheel.data)) as zf:
        names = zf.namelist()
        metadata = zf.read("burstcv_train-0.1.0.dist-info/METADATA").decode()
        entry = zf.read("burstcv_train-0.1.0.dist-info/entry_points.txt").decode()
        record = zf.read("burstcv_train-0.1.0.dist-info/RECORD").decode()
    code = sorted(n for n in names if not n.startswith("burstcv_train-"))
    assert code == sorted(MODULES)
    assert not any("airflow" in n or "serving" in n or "/data/" in n for n in names)
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist")]
    assert requires and not any("torch" in line for line in requires)
    assert "Requires-Python: >=3.10" in metadata
    assert "burstcv = burstcv.training.entry:main" in entry
    assert all(name in record for name in names)


def test_the_training_modules_import_nothing_the_box_lacks() -> None:
    # Everything the wheel's modules import from burstcv must be in the wheel itself.
    code = "\n".join(
        [
            "import json, sys",
            "import burstcv.training.entry, burstcv.training.train, burstcv.training.preflight",
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('airflow', 'great_expectations', 'fastapi', 'burstcv_serving', 'pydantic_settings'))",
            "own = sorted(m.replace('.', '/') for m in sys.modules"
            " if m.startswith(('burstcv.', 'burstcv_spec')))",
            "print(json.dumps(bad)); print(json.dumps(own))",
        ]
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert json.loads(out[0]) == []
    shipped = {m.removesuffix(".py").removesuffix("/__init__") for m in MODULES}
    assert set(json.loads(out[1])) <= shipped


@pytest.mark.parametrize("version", ["3.10", "3.12", "3.13"])
def test_the_training_modules_compile_on_the_ami_pythons(version: str, tmp_path: Path) -> None:
    found = sorted(PYENV.glob(f"{version}.*/bin/python{version}")) or [
        Path(p) for p in [shutil.which(f"python{version}")] if p
    ]
    if not found:
        pytest.skip(f"no Python {version} on this machine")
    package_root = Path(__file__).resolve().parents[2] / "src"
    sources = [str(module_path(name)) for name in MODULES]
    result = subprocess.run(
        [str(found[0]), "-m", "py_compile", *sources], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    # The stdlib-only preflight runs there too and reports on that interpreter.
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from burstcv.training import preflight as p;"
        "print(p.check_python(tuple(sys.version_info[:3])))"
    )
    out = subprocess.run(
        [str(found[0]), "-c", probe, str(package_root)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"


def test_staging_uploads_once_per_build(tmp_path: Path) -> None:
    first = stage_training_wheel(str(tmp_path))
    second = stage_training_wheel(str(tmp_path))
    assert first.uploaded and not second.uploaded
    assert first.uri == second.uri and first.sha256 in first.uri
    assert storage.read_bytes(first.uri) == build_training_wheel().data
