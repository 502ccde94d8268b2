"""Check the preflight's rules: each problem named with what to set, nothing for a good box."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import pytest

from burstcv.training.preflight import (
    Findings,
    check_driver,
    check_gpu_arch,
    check_gpu_count,
    check_python,
    check_torch_version,
    native_bf16,
    nvidia_driver_version,
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


# -- versions, exactly at the edges of the supported ranges --------------------------------------


def test_a_version_has_at_most_three_numeric_parts() -> None:
    assert version_tuple("2.5.0.post1") == (2, 5, 0)
    assert version_tuple("12.8") == (12, 8)


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ((3, 9, 18), False),
        ((3, 10, 0), True),  # the minimum itself
        ((3, 13, 9), True),
        ((3, 14, 0), False),  # the first unsupported
        ((4, 10, 0), False),
    ],
)
def test_python_is_supported_from_3_10_up_to_but_not_3_14(
    version: tuple[int, ...], supported: bool
) -> None:
    assert (check_python(version) is None) is supported


def test_an_unsupported_python_names_the_supported_range() -> None:
    problem = check_python((3, 14, 1))
    assert problem is not None
    assert problem.startswith("Python 3.14.1 is outside 3.10-3.13 that burstcv training supports")


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("2.3.1", False),
        ("2.4.0", True),  # the minimum itself
        ("2.4.0+cu121", True),
        ("2.99.0", True),
        ("3.0.0", False),  # the first unsupported
        ("1.13.1", False),
    ],
)
def test_torch_is_supported_from_2_4_up_to_but_not_3_0(version: str, supported: bool) -> None:
    assert (check_torch_version(version) is None) is supported


def test_an_unsupported_torch_names_the_supported_range() -> None:
    problem = check_torch_version("3.0.0")
    assert problem is not None
    assert problem.startswith("torch 3.0.0 is outside 2.4 to <3.0 that burstcv training supports")


# -- the driver each CUDA major needs (NVIDIA's CUDA release notes, table 2) ---------------------


@pytest.mark.parametrize(
    ("cuda", "minimum", "just_older"),
    [
        ("11.8", "450.80.02", "450.80.01"),
        ("12.8", "525.60.13", "525.60.12"),
        ("12.0", "525.60.13", "520.61.05"),
        ("13.0", "580.65.06", "580.65.05"),
    ],
)
def test_a_driver_exactly_at_the_minimum_runs_the_cuda_build(
    cuda: str, minimum: str, just_older: str
) -> None:
    assert check_driver(minimum, "2.9.0", cuda) is None
    problem = check_driver(just_older, "2.9.0", cuda)
    assert problem is not None
    assert problem.startswith(f"NVIDIA driver {just_older} is older than ")
    assert f"which torch 2.9.0 (CUDA {cuda}) needs" in problem


def test_the_driver_problem_names_the_version_needed() -> None:
    problem = check_driver("470.256.02", "2.9.0", "12.8")
    assert problem is not None and "older than 525.60.13" in problem


def test_a_cuda_major_without_a_known_minimum_driver_is_not_judged() -> None:
    assert check_driver("400.0.0", "2.9.0", "14.0") is None


# -- GPUs per instance type (AWS's published figures) --------------------------------------------

AWS_GPUS = {
    **{
        f"{family}.{size}": 1
        for family in ("g4dn", "g5", "g6", "g6e")
        for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")
    },
    "g4dn.12xlarge": 4,
    "g4dn.metal": 8,
    "g5.12xlarge": 4,
    "g5.24xlarge": 4,
    "g5.48xlarge": 8,
    "g6.12xlarge": 4,
    "g6.24xlarge": 4,
    "g6.48xlarge": 8,
    "g6e.12xlarge": 4,
    "g6e.24xlarge": 4,
    "g6e.48xlarge": 8,
    "p3.2xlarge": 1,
    "p3.8xlarge": 4,
    "p3.16xlarge": 8,
    "p4d.24xlarge": 8,
    "p5.48xlarge": 8,
}


@pytest.mark.parametrize(("instance_type", "gpus"), sorted(AWS_GPUS.items()))
def test_every_gpu_the_instance_type_has_must_be_seen(instance_type: str, gpus: int) -> None:
    assert check_gpu_count(gpus, instance_type) is None
    short = check_gpu_count(gpus - 1, instance_type)
    assert short is not None
    assert short.startswith(f"{instance_type} has {gpus} GPU(s) but torch sees {gpus - 1}")


def test_more_gpus_than_the_type_has_is_not_a_problem() -> None:
    assert check_gpu_count(2, "g6.xlarge") is None
    assert check_gpu_count(1, None) is None


# -- CUDA's rules for which kernels a GPU runs ---------------------------------------------------


@pytest.mark.parametrize(
    ("capability", "arch_list", "runs"),
    [
        ((8, 6), ["sm_86"], True),  # a cubin runs on its own capability
        ((8, 9), ["sm_86"], True),  # ... and later minors of the same major
        ((8, 0), ["sm_86"], False),  # ... but never on an earlier minor
        ((9, 0), ["sm_86"], False),  # ... nor on another major
        ((12, 0), ["sm_120"], True),  # two-digit majors
        ((10, 0), ["sm_120"], False),
        ((8, 0), ["compute_80"], True),  # PTX is compiled for its own capability
        ((12, 0), ["compute_80"], True),  # ... and any later GPU
        ((8, 9), ["compute_90"], False),  # ... never an earlier one
        ((9, 0), ["sm_90a"], True),  # arch-specific: that exact capability only
        ((10, 0), ["sm_90a"], False),
        ((10, 3), ["sm_100f"], True),  # family-specific: later minors of the same major
        ((12, 0), ["sm_100f"], False),
        ((8, 6), ["gfx90a", "sm_80"], True),  # what is not a CUDA arch is skipped
        ((8, 6), ["gfx90a"], False),
    ],
)
def test_cuda_compatibility_rules(
    capability: tuple[int, int], arch_list: list[str], runs: bool
) -> None:
    assert runs_on(capability, arch_list) is runs


def test_an_empty_arch_list_is_named_as_such() -> None:
    problem = check_gpu_arch("A10G", (8, 6), [], "2.9.0", "13.0")
    assert problem is not None and "(no CUDA architecture)" in problem
    listed = check_gpu_arch("V100", (7, 0), ["sm_75", "sm_80"], "2.9.0", "13.0")
    assert listed is not None and "was built for (sm_75, sm_80)" in listed


def test_bf16_from_compute_capability_8_0() -> None:
    assert native_bf16((8, 0)) is True
    assert native_bf16((7, 5)) is False
    assert native_bf16((12, 0)) is True


# -- what the user reads -------------------------------------------------------------------------


def test_findings_read_as_one_line() -> None:
    bad = Findings(facts={"python": "3.12.3"}, problems=["first", "second"])
    assert not bad.ok and bad.summary() == "first; second"
    good = Findings(facts={"python": "3.12.3", "torch": "2.9.0"})
    assert good.ok and good.summary() == "preflight passed: python 3.12.3, torch 2.9.0"


def test_the_python_seen_is_this_interpreters_version() -> None:
    found = run_checks(require_cuda=False, instance_type=None)
    assert found.facts["python"] == platform.python_version()


def test_an_unsupported_python_stops_before_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "version_info", (3, 9, 18, "final", 0))
    found = run_checks(require_cuda=True, instance_type=None)
    assert found.facts == {"python": "3.9.18"}
    assert len(found.problems) == 1 and found.problems[0].startswith("Python 3.9.18 is outside")


def test_a_torch_that_does_not_import_is_the_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    found = run_checks(require_cuda=True, instance_type=None)
    assert len(found.problems) == 1
    assert found.problems[0].startswith(
        f"torch does not import on {sys.executable} (ModuleNotFoundError"
    )
    assert "torch" not in found.facts


def test_an_unsupported_torch_is_reported_and_the_gpu_still_checked(
    fake_gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch, "__version__", "2.3.1")
    fake_gpu.update(name="NVIDIA A10G", capability=(8, 6))
    found = run_checks(require_cuda=True, instance_type="g5.xlarge")
    assert len(found.problems) == 1 and found.problems[0].startswith("torch 2.3.1 is outside")
    assert found.facts["gpu"] == "NVIDIA A10G (compute capability 8.6)"
    cpu_only = run_checks(require_cuda=False, instance_type=None)
    assert len(cpu_only.problems) == 1 and "gpus" not in cpu_only.facts


def test_a_cpu_only_torch_build_cannot_train_on_a_gpu(
    fake_gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    relaxed = run_checks(require_cuda=False, instance_type=None)
    assert relaxed.ok and relaxed.facts["cuda_build"] == "cpu"
    strict = run_checks(require_cuda=True, instance_type="g6.xlarge")
    assert strict.problems == [
        f"torch {torch.__version__} is a CPU-only build; set BURSTCV_EC2_AMI to a PyTorch "
        "Deep Learning AMI (docs/aws.md)"
    ]
    assert "driver" not in strict.facts


def fake_nvidia_smi(tmp_path: Path, script: str) -> None:
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{script}\n")


def test_the_driver_is_the_first_line_nvidia_smi_prints(
    fake_gpu: dict[str, Any], tmp_path: Path
) -> None:
    fake_nvidia_smi(tmp_path, "echo; echo ' 580.95.05 '; echo 575.57.08")
    assert nvidia_driver_version() == "580.95.05"
    found = run_checks(require_cuda=True, instance_type="g6.xlarge")
    assert found.facts["driver"] == "580.95.05"


@pytest.mark.parametrize(
    "script",
    [
        "exit 9",
        "echo; exit 0",
        "sleep 0",
        # What nvidia-smi prints when it cannot reach the driver: not a version.
        "echo NVIDIA-SMI has failed because it could not communicate with the driver; exit 9",
    ],
)
def test_a_failing_or_silent_nvidia_smi_means_no_driver(
    fake_gpu: dict[str, Any], tmp_path: Path, script: str
) -> None:
    fake_nvidia_smi(tmp_path, script)
    assert nvidia_driver_version() is None
    found = run_checks(require_cuda=True, instance_type="g6.xlarge")
    assert found.facts["driver"] == "none"
    assert len(found.problems) == 1 and found.problems[0].startswith("no NVIDIA driver found")
    assert "gpus" not in found.facts


def test_no_nvidia_smi_on_path_means_no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    assert nvidia_driver_version() is None


def test_a_driver_too_old_for_the_build_stops_before_the_gpus(
    fake_gpu: dict[str, Any], tmp_path: Path
) -> None:
    fake_nvidia_smi(tmp_path, "echo 535.183.01")
    found = run_checks(require_cuda=True, instance_type="g6.xlarge")
    assert len(found.problems) == 1
    assert found.problems[0].startswith("NVIDIA driver 535.183.01 is older than 580.65.6")
    assert "gpus" not in found.facts


def test_cuda_unavailable_despite_a_driver_is_the_finding(
    fake_gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    found = run_checks(require_cuda=True, instance_type="g6.xlarge")
    assert len(found.problems) == 1
    assert found.problems[0].startswith("torch.cuda.is_available() is False with driver 580.95.05")
    assert "gpus" not in found.facts


def test_too_few_gpus_for_the_type_is_reported_with_what_was_seen(
    fake_gpu: dict[str, Any],
) -> None:
    fake_gpu.update(name="NVIDIA A10G", capability=(8, 6))
    found = run_checks(require_cuda=True, instance_type="g5.12xlarge")
    assert found.facts["gpus"] == 1
    assert len(found.problems) == 1
    assert found.problems[0].startswith("g5.12xlarge has 4 GPU(s) but torch sees 1")
    assert found.facts["precision"] == "bf16"


def test_every_gpu_is_checked_and_the_first_is_the_one_described(
    fake_gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    gpus = [("NVIDIA L4", (8, 9)), ("Tesla T4", (7, 5))]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: gpus[index][0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: gpus[index][1])
    found = run_checks(require_cuda=True, instance_type=None)
    assert found.ok, found.problems
    assert found.facts["gpus"] == 2
    assert found.facts["gpu"] == "NVIDIA L4 (compute capability 8.9)"
    assert found.facts["precision"] == "bf16"
    gpus[1] = ("Tesla V100-SXM2-16GB", (7, 0))  # the second one has no kernels in CU130
    found = run_checks(require_cuda=True, instance_type=None)
    assert len(found.problems) == 1
    assert found.problems[0].startswith("GPU Tesla V100-SXM2-16GB (compute capability 7.0)")
