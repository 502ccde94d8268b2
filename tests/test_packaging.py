"""Packaging: every package is installed, the service stays torch-free, the lock is exact."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        ".".join(p.parent.relative_to(root).parts)
        for root in (REPO / "src", REPO / "serving", REPO / "spec")
        for p in root.rglob("__init__.py")
    }
    assert found == listed


def _files_in(folder: str) -> list[PurePosixPath]:
    """Return the files git knows under a folder (tracked, or new and not ignored), relative."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", folder],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [PurePosixPath(name).relative_to(folder) for name in listed]


def _shipped(rel: PurePosixPath, pattern: str) -> bool:
    """Match as setuptools does: a glob relative to the package folder, "*" within a folder."""
    return len(rel.parts) == len(PurePosixPath(pattern).parts) and rel.match(pattern)


def test_every_data_file_in_a_package_is_shipped_as_package_data() -> None:
    """A template or price table missing from package-data works here and fails installed."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_data = config.get("package-data", {})
    unshipped = [
        f"{folder}/{rel}"
        for package, folder in config["package-dir"].items()
        for rel in _files_in(folder)
        if rel.suffix != ".py" and not any(_shipped(rel, p) for p in package_data.get(package, []))
    ]
    assert unshipped == []
    assert PurePosixPath("report/report.html.j2") in _files_in("src/burstcv")


def _imported_packages(root: Path) -> dict[str, set[str]]:
    """Return, per source file under root, the top-level packages it imports."""
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(REPO))] = names
    return found


def test_the_pipeline_and_the_service_share_only_burstcv_spec() -> None:
    pipeline = _imported_packages(REPO / "src")
    assert not {f for f, names in pipeline.items() if "burstcv_serving" in names}
    service = _imported_packages(REPO / "serving")
    assert not {f for f, names in service.items() if names & {"burstcv", "torch", "airflow"}}
    shared = _imported_packages(REPO / "spec")
    assert not {f for f, names in shared.items() if names & {"burstcv", "burstcv_serving", "torch"}}


def test_requirements_are_pinned_exactly_and_serving_has_no_torch() -> None:
    for name in ("requirements.txt", "serving/requirements.txt"):
        lines = [
            ln for ln in (REPO / name).read_text().splitlines() if ln and not ln.startswith("#")
        ]
        loose = [ln for ln in lines if not re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[^=\s]+", ln)]
        assert loose == [], f"{name}: not pinned exactly: {loose}"
    serving = (REPO / "serving/requirements.txt").read_text().lower().splitlines()
    assert not [ln for ln in serving if ln.startswith(("torch", "torchvision")) and "==" in ln]
    main = (REPO / "requirements.txt").read_text()
    assert "torch==2.14.1" in main and "torchvision==0.29.1" in main


def test_the_service_never_imports_torch() -> None:
    code = (
        "import sys, burstcv_serving.main, burstcv_spec.preprocess; "
        "app = burstcv_serving.main.create_app(); "
        "print('torch' in sys.modules, 'burstcv' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


def test_the_service_starts_without_boto3() -> None:
    """boto3 is optional in the service image: only an s3:// registry imports it."""
    code = (
        "import sys; sys.modules['boto3'] = None; "  # as if not installed
        "import burstcv_serving.main; burstcv_serving.main.create_app(); "
        "from burstcv_spec import storage; "
        "print(storage.join('s3://bucket/registry', 'digits', 'aliases'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "s3://bucket/registry/digits/aliases"
