"""Check a training box before it trains: Python, torch, CUDA, the driver, the GPUs.

A failed check is final (a relaunch on the same AMI fails the same way). Imports only the
standard library at import time, so a broken torch is reported, not raised.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

# Python: the DLAMIs' (3.10 on Ubuntu 22.04, 3.12 on 24.04) up to the orchestrator's lock.
# torch: the oldest with every API train.py uses (torch.amp.GradScaler("cuda"), weights_only).
SUPPORTED_PYTHON = ((3, 10), (3, 14))  # [min, max)
SUPPORTED_TORCH = ((2, 4), (3, 0))  # [min, max)

# The oldest Linux driver that runs a CUDA major release (minor-version compatibility), from
# NVIDIA's CUDA release notes, table 2.
MIN_DRIVER_FOR_CUDA: dict[int, tuple[int, ...]] = {
    11: (450, 80, 2),
    12: (525, 60, 13),
    13: (580, 65, 6),
}

# GPUs an instance type has, for the types burstcv suggests; others are not checked.
_G_SIZES = {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 1, "12xlarge": 4}
_G_BIG_SIZES = {"24xlarge": 4, "48xlarge": 8}  # no g4dn of these sizes
GPUS_PER_INSTANCE_TYPE: dict[str, int] = {
    **{f"{kind}.{size}": n for kind in ("g4dn", "g5", "g6", "g6e") for size, n in _G_SIZES.items()},
    **{f"{kind}.{size}": n for kind in ("g5", "g6", "g6e") for size, n in _G_BIG_SIZES.items()},
    "g4dn.metal": 8,
    "p3.2xlarge": 1,
    "p3.8xlarge": 4,
    "p3.16xlarge": 8,
    "p4d.24xlarge": 8,
    "p5.48xlarge": 8,
}

AMI_HINT = "set BURSTCV_EC2_AMI to a PyTorch Deep Learning AMI (docs/aws.md)"

NATIVE_BF16_FROM = (8, 0)  # Ampere: bf16 tensor cores; below, bf16 is emulated
_ARCH = re.compile(r"(sm|compute)_(\d+)(\d)([af]?)")  # sm_86, compute_90, sm_90a, sm_100f


@dataclass
class Findings:
    """Hold what the preflight saw and the problems it found (empty: ready to train)."""

    facts: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Return True when nothing stands in the way of training."""
        return not self.problems

    def summary(self) -> str:
        """Return the one line a user reads: what is wrong and what to set, or what was seen."""
        if self.problems:
            return "; ".join(self.problems)
        return "preflight passed: " + ", ".join(f"{k} {v}" for k, v in self.facts.items())


def version_tuple(text: str) -> tuple[int, ...]:
    """Return the leading numeric parts of a version (``2.14.1+cu130`` -> (2, 14, 1))."""
    parts = re.findall(r"\d+", text.split("+")[0])
    return tuple(int(p) for p in parts[:3])


def dotted(version: tuple[int, ...]) -> str:
    """Return a version, or a compute capability, as written (``3.12.1``, ``8.6``)."""
    return ".".join(str(p) for p in version)


def check_python(version: tuple[int, ...]) -> str | None:
    """Return a problem if the interpreter is outside the supported range."""
    low, high = SUPPORTED_PYTHON
    if low <= version[:2] < high:
        return None
    return (
        f"Python {dotted(version)} is outside {dotted(low)}-{high[0]}.{high[1] - 1} that burstcv "
        f"training supports; set BURSTCV_EC2_PYTHON to a supported interpreter or {AMI_HINT}"
    )


def check_torch_version(version: str) -> str | None:
    """Return a problem if torch is outside the supported range."""
    low, high = SUPPORTED_TORCH
    if low <= version_tuple(version)[:2] < high:
        return None
    return (
        f"torch {version} is outside {dotted(low)} to <{dotted(high)} that burstcv training "
        f"supports; {AMI_HINT} with a supported PyTorch"
    )


def check_driver(driver: str | None, torch_version: str, torch_cuda: str) -> str | None:
    """Return a problem if the NVIDIA driver cannot run torch's CUDA build."""
    needed = MIN_DRIVER_FOR_CUDA.get(version_tuple(torch_cuda)[0])
    if driver is None:
        return (
            f"no NVIDIA driver found (nvidia-smi is missing or failed); torch {torch_version} "
            f"needs one for CUDA {torch_cuda}; {AMI_HINT} (they ship the driver)"
        )
    if needed is not None and version_tuple(driver) < needed:
        return (
            f"NVIDIA driver {driver} is older than {dotted(needed)}, which torch {torch_version} "
            f"(CUDA {torch_cuda}) needs; use a newer AMI release (BURSTCV_EC2_AMI) or an AMI "
            f"whose PyTorch is built for an older CUDA"
        )
    return None


def check_gpu_count(found: int, instance_type: str | None) -> str | None:
    """Return a problem if the box shows fewer GPUs than its instance type has."""
    expected = GPUS_PER_INSTANCE_TYPE.get(instance_type or "")
    if expected is None or found >= expected:
        return None
    return (
        f"{instance_type} has {expected} GPU(s) but torch sees {found}; the driver or the AMI "
        f"is broken for this type ({AMI_HINT})"
    )


def runs_on(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Return True when a build for ``arch_list`` has kernels a GPU of ``capability`` runs: a
    cubin (``sm_XY``) runs on the same major at minor Y or later, PTX (``compute_XY``) on any
    later GPU, an arch-specific cubin (``sm_90a``) on that capability only."""
    for arch in arch_list:
        match = _ARCH.fullmatch(arch)
        if match is None:
            continue
        kind, suffix = match.group(1), match.group(4)
        built = (int(match.group(2)), int(match.group(3)))
        if suffix == "a":
            runs = built == capability
        elif kind == "sm":
            runs = built[0] == capability[0] and built[1] <= capability[1]
        else:
            runs = built <= capability
        if runs:
            return True
    return False


def check_gpu_arch(
    name: str,
    capability: tuple[int, int],
    arch_list: list[str],
    torch_version: str,
    torch_cuda: str,
) -> str | None:
    """Return a problem if torch's build has no kernels for this GPU's compute capability."""
    if runs_on(capability, arch_list):
        return None
    built = ", ".join(arch_list) or "no CUDA architecture"
    return (
        f"GPU {name} (compute capability {dotted(capability)}) is not among the "
        f"architectures torch {torch_version} (CUDA {torch_cuda}) was built for ({built}): it "
        f"would fail at its first kernel; choose a newer GPU type (instance_types, e.g. "
        f"g6.xlarge) or an AMI whose PyTorch still builds for it ({AMI_HINT})"
    )


def native_bf16(capability: tuple[int, int]) -> bool:
    """Return True when the GPU computes bf16 in hardware (compute capability 8.0 and later)."""
    return tuple(capability) >= NATIVE_BF16_FROM


def precision_for(capability: tuple[int, int]) -> str:
    """Return the mixed precision training uses on this GPU: ``bf16``, or ``fp16`` below 8.0."""
    return "bf16" if native_bf16(capability) else "fp16"


def nvidia_driver_version() -> str | None:
    """Return the driver version nvidia-smi reports, or None without a working driver."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[0] if lines else None


def run_checks(require_cuda: bool, instance_type: str | None) -> Findings:
    """Check this interpreter, its torch and the GPUs; return what was seen and found wrong."""
    found = Findings()
    found.facts["python"] = dotted(tuple(sys.version_info[:3]))
    if problem := check_python(tuple(sys.version_info[:3])):
        found.problems.append(problem)
        return found
    try:
        import torch
    except Exception as exc:  # any import failure is the finding; its text is the reason
        found.problems.append(
            f"torch does not import on {sys.executable} ({type(exc).__name__}: {exc}); "
            f"{AMI_HINT}, or set BURSTCV_EC2_PYTHON to the AMI's PyTorch interpreter"
        )
        return found
    torch_version = str(torch.__version__)
    torch_cuda = torch.version.cuda
    found.facts["torch"] = torch_version
    found.facts["cuda_build"] = torch_cuda or "cpu"
    if problem := check_torch_version(torch_version):
        found.problems.append(problem)
    if not require_cuda:
        return found
    if not torch_cuda:
        found.problems.append(f"torch {torch_version} is a CPU-only build; {AMI_HINT}")
        return found
    driver = nvidia_driver_version()
    found.facts["driver"] = driver or "none"
    if problem := check_driver(driver, torch_version, torch_cuda):
        found.problems.append(problem)
        return found
    if not torch.cuda.is_available():
        found.problems.append(
            f"torch.cuda.is_available() is False with driver {driver} and torch "
            f"{torch_version} (CUDA {torch_cuda}); {AMI_HINT}"
        )
        return found
    gpus = torch.cuda.device_count()
    found.facts["gpus"] = gpus
    if problem := check_gpu_count(gpus, instance_type):
        found.problems.append(problem)
    arch_list = list(torch.cuda.get_arch_list())
    for index in range(gpus):
        major, minor = torch.cuda.get_device_capability(index)
        capability = (int(major), int(minor))
        name = torch.cuda.get_device_name(index)
        if problem := check_gpu_arch(name, capability, arch_list, torch_version, torch_cuda):
            found.problems.append(problem)
            return found
        if index == 0:
            found.facts["gpu"] = f"{name} (compute capability {dotted(capability)})"
            found.facts["precision"] = precision_for(capability)
    return found
