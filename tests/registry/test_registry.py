"""The registry: immutable numbered versions and aliases that move atomically."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from pathlib import Path

import pytest

from burstcv.registry.registry import PREVIOUS, PRODUCTION, Registry, RegistryError


def make_model_dir(root: Path, tag: str) -> Path:
    """Write a model folder (model.onnx bytes + model.json) as the export stage does."""
    root.mkdir(parents=True, exist_ok=True)
    data = f"onnx-{tag}".encode()
    (root / "model.onnx").write_bytes(data)
    (root / "model.json").write_text(
        json.dumps(
            {
                "name": "digits",
                "onnx_file": "model.onnx",
                "sha256": hashlib.sha256(data).hexdigest(),
                "run_id": f"run-{tag}",
                "dataset_fingerprint": "fp",
                "source_commit": "abc",
            }
        )
    )
    return root


def test_versions_are_numbered_and_carry_lineage(tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"), "digits")
    v1 = reg.register(str(make_model_dir(tmp_path / "a", "a")), {"status": "accepted"})
    v2 = reg.register(
        str(make_model_dir(tmp_path / "b", "b")), {"status": "rejected", "reason": "slow"}
    )
    assert (v1, v2) == (1, 2) and reg.versions() == [1, 2]
    entry = reg.entry(2)
    assert entry["status"] == "rejected" and entry["lineage"]["run_id"] == "run-b"
    assert reg.model_json(1)["version"] == 1
    assert (tmp_path / "reg" / "digits" / "versions" / "1" / "model.onnx").read_bytes() == b"onnx-a"


def test_promote_moves_production_and_previous_and_rollback_swaps(tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"), "digits")
    for tag in "abc":
        reg.register(str(make_model_dir(tmp_path / tag, tag)), {"status": "accepted"})
    assert reg.promote(1) is None
    old = reg.promote(2)
    assert old is not None and old.version == 1
    assert reg.get_alias(PRODUCTION).version == 2 and reg.get_alias(PREVIOUS).version == 1
    assert reg.get_alias(PRODUCTION).sha256 == reg.model_json(2)["sha256"]
    assert reg.rollback() == (2, 1)
    assert reg.get_alias(PRODUCTION).version == 1 and reg.get_alias(PREVIOUS).version == 2


def test_rejected_version_is_never_aliased_without_force(tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"), "digits")
    reg.register(
        str(make_model_dir(tmp_path / "a", "a")), {"status": "rejected", "reason": "p95 too high"}
    )
    with pytest.raises(RegistryError, match="rejected by the gate: p95 too high"):
        reg.promote(1)
    assert reg.get_alias(PRODUCTION) is None
    reg.promote(1, force=True)
    assert reg.get_alias(PRODUCTION).version == 1


def test_rollback_without_previous_is_a_clear_error(tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"), "digits")
    reg.register(str(make_model_dir(tmp_path / "a", "a")), {"status": "accepted"})
    reg.promote(1)
    with pytest.raises(RegistryError, match="no previous version"):
        reg.rollback()
    with pytest.raises(RegistryError, match="no version 9"):
        reg.promote(9)


def _register_and_promote(args: tuple[str, str, int]) -> int:
    root, model_dir, rounds = args
    reg = Registry(root, "digits")
    last = 0
    for _ in range(rounds):
        last = reg.register(model_dir, {"status": "accepted"})
        reg.promote(last)
    return last


def test_concurrent_registrations_and_promotions_stay_consistent(tmp_path: Path) -> None:
    root = str(tmp_path / "reg")
    dirs = [str(make_model_dir(tmp_path / f"m{i}", str(i))) for i in range(4)]
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_register_and_promote, [(root, d, 5) for d in dirs])
    reg = Registry(root, "digits")
    assert reg.versions() == list(range(1, 21))  # no number lost or shared
    for v in reg.versions():
        assert reg.entry(v)["sha256"] == reg.model_json(v)["sha256"] == reg.entry(v)["sha256"]
    prod, prev = reg.get_alias(PRODUCTION), reg.get_alias(PREVIOUS)
    assert prod is not None and prev is not None and prod.version != prev.version
    assert prod.sha256 == reg.model_json(prod.version)["sha256"]
    aliases = tmp_path / "reg" / "digits" / "aliases"
    assert sorted(p.name for p in aliases.iterdir() if not p.name.startswith(".")) == [
        "previous.json",
        "production.json",
    ]  # no temp files left behind
