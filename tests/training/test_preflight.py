"""Check the preflight's rules: each problem named with what to set, nothing for a good box."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from burstcv.training.preflight import (
    check_driver,
    check_gpu_arch,
    check_gpu_count,
    check_python,
    check_torch_version,
    precision_for,
    run_checks,
    runs_on,
    version_tuple,
)

# What torch 2.9's CUDA 13.0 wheels were built for, and an older CUDA 12.x build's list.
CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
CU118 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_37", "sm_90"]


def test_versions_parse_with_local_tags() -> None:
    assert version_tuple("2.14.1+cu130") == (2, 14, 1)
    assert version_tuple("580.65.06") == (580, 65, 6)


def test_python_range() -> None:
    assert check_python((3, 10, 13)) is None
    assert check_python((3, 13, 0)) is None
    too_old = check_python((3, 9, 18))
    assert too_old and "3.9.18" in too_old and "BURSTCV_EC2_PYTHON" in too_old
    assert check_python((3, 14, 0)) is not None


def test_torch_range() -> None:
    assert check_torch_version("2.9.0+cu128") is None
    old = check_torch_version("2.3.1")
    assert old and "2.3.1" in old and "BURSTCV_EC2_AMI" in old


def test_driver_must_run_torchs_cuda_build() -> None:
    assert check_driver("580.105.08", "2.14.1", "13.0") is None
    assert check_driver("535.183.01", "2.9.0", "12.8") is None  # minor-version compatibility
    old = check_driver("535.183.01", "2.14.1", "13.0")
    assert old and "535.183.01" in old and "580.65.6" in old and "CUDA 13.0" in old
    missing = check_driver(None, "2.9.0", "12.8")
    assert missing and "no NVIDIA driver" in missing


def test_gpu_count_follows_the_instance_type() -> None:
    assert check_gpu_count(1, "g6.xlarge") is None
    assert check_gpu_count(4, "g5.12xlarge") is None
    short = check_gpu_count(2, "g5.12xlarge")
    assert short and "4 GPU" in short and "sees 2" in short
    assert check_gpu_count(0, "x1.unknown") is None  # unknown types are not judged


def test_this_machine_passes_without_cuda_and_fails_with_it_required() -> None:
    relaxed = run_checks(require_cuda=False, instance_type=None)
    assert relaxed.ok, relaxed.problems
    assert relaxed.summary().startswith("preflight passed: python ")
    strict = run_checks(require_cuda=True, instance_type="g6.xlarge")
    assert not strict.ok  # no GPU here: CPU build, no driver, or CUDA unavailable
    assert "BURSTCV_EC2_AMI" in strict.summary() and "\n" not in strict.summary()


@pytest.mark.parametrize(
    ("gpu", "capability", "arch_list", "runs"),
    [
        ("V100 (p3)", (7, 0), CU130, False),  # sm_70 dropped: fails at its first kernel
        ("V100 (p3)", (7, 0), CU118, True),
        ("T4 (g4dn)", (7, 5), CU130, True),
        ("A10G (g5)", (8, 6), CU130, True),
        ("L4 (g6)", (8, 9), CU130, True),  # sm_86 cubins run on 8.9 (same major, later minor)
        ("L40S (g6e)", (8, 9), ["sm_80"], True),
        ("H100 (p5)", (9, 0), CU130, True),
        ("H100 (p5)", (9, 0), ["sm_80", "sm_86"], False),  # another major: no cubin runs
        ("H100 (p5)", (9, 0), ["sm_80", "compute_80"], True),  # PTX is compiled for it
        ("H100 (p5)", (9, 0), ["sm_90a"], True),
        ("a 9.1 GPU", (9, 1), ["sm_90a"], False),  # arch-specific cubins: that exact GPU
        ("B200", (10, 0), CU130, True),
        ("any", (8, 0), [], False),
    ],
)
def test_the_gpu_must_be_an_architecture_torch_was_built_for(
    gpu: str, capability: tuple[int, int], arch_list: list[str], runs: bool
) -> None:
    assert runs_on(capability, arch_list) is runs
    problem = check_gpu_arch(gpu, capability, arch_list, "2.9.0+cu130", "13.0")
    assert (problem is None) is runs
    if problem:
        assert f"compute capability {capability[0]}.{capability[1]}" in problem
        assert "torch 2.9.0+cu130 (CUDA 13.0)" in problem and "instance_types" in problem


def test_bf16_only_where_the_gpu_computes_it() -> None:
    assert precision_for((7, 5)) == "fp16"  # T4: bf16 would be emulated
    assert precision_for((7, 0)) == "fp16"
    assert [precision_for(c) for c in ((8, 0), (8, 6), (8, 9), (9, 0))] == ["bf16"] * 4


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """Dress this machine as a GPU box: what cannot exist here, at torch's device queries.

    A CUDA 13.0 build of the installed torch, a driver that runs it (an nvidia-smi on PATH)
    and one GPU whose name and compute capability the test sets.
    """
    import torch

    gpu: dict[str, Any] = {"name": "Tesla V100-SXM2-16GB", "capability": (7, 0)}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 580.95.05\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(CU130))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: gpu["name"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: gpu["capability"])
    return gpu


def test_a_gpu_too_old_for_the_torch_build_ends_the_attempt_at_preflight(
    fake_gpu: dict[str, Any], tmp_path: Path, packed_demo: dict[str, Any]
) -> None:
    from burstcv_testkit import make_job

    from burstcv.training.entry import EXIT_PREFLIGHT_FAILED, preflight
    from burstcv.training.job import write_job

    out = tmp_path / "out"
    job = make_job(packed_demo, out, require_cuda=True)
    job_uri = write_job(job, str(tmp_path / "job.json"))

    assert preflight(job_uri, 1, "p3.2xlarge") == EXIT_PREFLIGHT_FAILED
    failed = json.loads((out / "attempts" / "1" / "FAILED").read_text())
    assert failed["stage"] == "preflight" and failed["resumable"] is False
    assert "GPU Tesla V100-SXM2-16GB (compute capability 7.0)" in failed["reason"]
    assert "sm_75" in failed["reason"] and "\n" not in failed["reason"]

    # The same box with a T4: it trains, in fp16 (its bf16 would be emulated).
    fake_gpu.update(name="Tesla T4", capability=(7, 5))
    found = run_checks(require_cuda=True, instance_type="g4dn.xlarge")
    assert found.ok, found.problems
    assert found.facts["gpu"] == "Tesla T4 (compute capability 7.5)"
    assert found.facts["precision"] == "fp16"
    fake_gpu.update(name="NVIDIA L4", capability=(8, 9))
    assert run_checks(require_cuda=True, instance_type="g6.xlarge").facts["precision"] == "bf16"


def test_training_autocasts_to_the_precision_the_preflight_names(
    fake_gpu: dict[str, Any],
) -> None:
    import torch

    from burstcv.training.train import _amp_dtype

    cuda = torch.device("cuda", 0)
    fake_gpu["capability"] = (7, 5)
    assert _amp_dtype(cuda) == torch.float16  # with a gradient scaler (see run)
    fake_gpu["capability"] = (8, 6)
    assert _amp_dtype(cuda) == torch.bfloat16
    assert _amp_dtype(torch.device("cpu")) is None
