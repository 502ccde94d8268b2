"""Build the container images of the stack test with podman, public base images included.

Public base images cannot be pulled on these machines, so their stand-ins are built here from
Debian's packages: a debootstrapped bookworm imported as ``localhost/burstcv-standin/debian``,
then ``python:3.11-slim-bookworm`` and ``apache/airflow:3.3.2-python3.11`` (tagged with the names
the Dockerfiles use), and PostgreSQL and Redis (swapped in by tests/stack/compose.standins.yaml).
On top of them the project's own Dockerfiles build unchanged: the airflow and worker targets of
docker/airflow.Dockerfile and serving/Dockerfile.

Every build keeps podman's layer cache, so a second run rebuilds only what changed. Where the
machine has local package indexes (/opt/pypi*), builds read them through a pip.conf mounted at
build time; PyTorch's CPU index, which cannot be reached here, is replaced by the local index
(which holds the CUDA build of torch 2.14.1: the worker image here is larger than a real build).

    python tests/stack/standins.py            # install what is missing, build every image
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CONTAINERS_CONF = HERE / "containers.conf"
STANDINS = HERE / "standins"
DEBIAN = "localhost/burstcv-standin/debian:bookworm"
PYTHON = "docker.io/library/python:3.11-slim-bookworm"
AIRFLOW = "docker.io/apache/airflow:3.3.2-python3.11"
POSTGRES = "localhost/burstcv-standin/postgres:15"
REDIS = "localhost/burstcv-standin/redis:7.0"
AIRFLOW_IMAGE = "localhost/burstcv-airflow:latest"
WORKER_IMAGE = "localhost/burstcv-worker:latest"
SERVING_IMAGE = "localhost/burstcv-serving:latest"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# Debian packages the test needs on the host: podman (with runc, netavark and iptables for
# bridge networks between containers) and debootstrap for the base root.
HOST_PACKAGES = {
    "podman": "podman",
    "runc": "runc",
    "debootstrap": "debootstrap",
    "iptables": "iptables",
    "/usr/lib/podman/netavark": "netavark",
    "/usr/lib/podman/aardvark-dns": "aardvark-dns",
}
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
LOCAL_INDEXES = [Path("/opt/pypi/simple"), Path("/opt/pypi-more/simple")]


def env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(*args: str, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["podman", *args], env=env(), check=check, text=True, capture_output=capture
    )


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False).returncode == 0


def say(message: str) -> None:
    print(f">> {message}", flush=True)


def install_host_tools() -> None:
    """Install podman and friends from Debian's packages when missing (as root, with apt)."""
    missing = sorted(
        {
            package
            for tool, package in HOST_PACKAGES.items()
            if not (Path(tool).exists() if tool.startswith("/") else shutil.which(tool))
        }
    )
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SystemExit(f"the stack test needs {', '.join(missing)}: install them (Debian)")
    say(f"installing {' '.join(missing)} (Debian packages)")
    apt = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]
    apt_env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "env": apt_env}
    if subprocess.run(apt, **quiet).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], check=True, **quiet)
        subprocess.run(apt, check=True, **quiet)


def debian_base() -> None:
    """Import a debootstrapped Debian bookworm (minbase) as the stand-ins' common base."""
    if image_exists(DEBIAN):
        return
    say(f"debootstrapping Debian bookworm into {DEBIAN}")
    with tempfile.TemporaryDirectory(prefix="burstcv-rootfs-") as tmp:
        root = Path(tmp) / "root"
        subprocess.run(
            ["debootstrap", "--variant=minbase", "bookworm", str(root), DEBIAN_MIRROR],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        (root / "etc/apt/apt.conf.d/docker-clean").write_text('APT::Install-Recommends "false";\n')
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(
            ["podman", "import", "--change", 'CMD ["bash"]', "-", DEBIAN],
            stdin=tar.stdout,
            env=env(),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        tar.wait()


def build_args() -> list[str]:
    """Mount this machine's local package indexes (and CA bundle) into RUN steps: a pip.conf."""
    indexes = [p for p in LOCAL_INDEXES if p.is_dir()]
    if not indexes:
        return []
    conf = REPO / "var" / "stack" / "pip.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    urls = " ".join(f"file://{p}" for p in indexes)
    lines = ["[global]", f"extra-index-url = {urls}"]
    args = ["--volume", f"{conf}:/etc/pip.conf:ro"]
    if HOST_CA.is_file():  # the host's CA bundle: it trusts whatever proxy reaches PyPI here
        lines.append("cert = /run/burstcv-host-ca.crt")
        args += ["--volume", f"{HOST_CA}:/run/burstcv-host-ca.crt:ro"]
    conf.write_text("\n".join(lines) + "\n")
    for p in indexes:
        args += ["--volume", f"{p.parent}:{p.parent}:ro"]
    return args


def build(tag: str, containerfile: Path, *extra: str) -> None:
    started = time.monotonic()
    say(f"building {tag} ({containerfile.relative_to(REPO)})")
    podman(
        "build",
        "--layers",
        "--pull=never",
        "--format=docker",  # keeps HEALTHCHECK (the OCI format drops it)
        "--quiet",
        "--file",
        str(containerfile),
        "--tag",
        tag,
        *build_args(),
        *extra,
        str(REPO),
    )
    say(f"built {tag} in {time.monotonic() - started:.0f} s")


def torch_index() -> str:
    """PyTorch's CPU index cannot be reached here: the local indexes stand in for it."""
    indexes = [p for p in LOCAL_INDEXES if p.is_dir()]
    return " ".join(f"file://{p}" for p in indexes) or "https://download.pytorch.org/whl/cpu"


def build_all() -> None:
    install_host_tools()
    debian_base()
    host_python = Path(sys.base_prefix)  # the interpreter the stand-in copies (see its file)
    mount = f"{host_python}:/opt/host-python:ro"
    build(PYTHON, STANDINS / "python.Containerfile", "--volume", mount)
    build(POSTGRES, STANDINS / "postgres.Containerfile")
    build(REDIS, STANDINS / "redis.Containerfile")
    build(AIRFLOW, STANDINS / "airflow.Containerfile")
    dockerfile = REPO / "docker" / "airflow.Dockerfile"
    build(AIRFLOW_IMAGE, dockerfile, "--target", "airflow")
    torch = f"TORCH_INDEX_URL={torch_index()}"
    build(WORKER_IMAGE, dockerfile, "--target", "worker", "--build-arg", torch)
    build(SERVING_IMAGE, REPO / "serving" / "Dockerfile")
    # What earlier builds left untagged (the cache keeps what the current images use).
    podman("image", "prune", "--force", capture=True)


if __name__ == "__main__":
    build_all()
    sys.exit(0)
