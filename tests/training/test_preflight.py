"""Check the preflight's rules: each problem named with what to set, nothing for a good box."""

from __future__ import annotations

from burstcv.training.preflight import (
    check_driver,
    check_gpu_count,
    check_python,
    check_torch_version,
    run_checks,
    version_tuple,
)


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
