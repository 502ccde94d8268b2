"""The registry: immutable numbered versions and aliases that move atomically."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
from burstcv_testkit import make_model_dir

from burstcv.registry.registry import (
    PREVIOUS,
    PRODUCTION,
    Alias,
    AliasConflictError,
    Registry,
    RegistryError,
)


def test_versions_are_numbered_and_carry_lineage(tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"), "digits")
    v1 = reg.register(str(make_model_dir(tmp_path / "a", "a")), {"status": "accepted"})
    v2 = reg.register(
        str(make_model_dir(tmp_path / "b", "b")), {"status": "rejected", "reason": "slow"}
    )
    assert (v1, v2) == (1, 2) and reg.versions() == [1, 2]
    entry = reg.entry(2)
    assert entry.status == "rejected" and entry.lineage.run_id == "run-b"
    assert reg.model_card(1).version == 1
    assert (tmp_path / "reg" / "digits" / "versions" / "1" / "model.onnx").read_bytes() == b"onnx-a"


def test_promote_moves_production_and_previous_and_rollback_swaps(tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"), "digits")
    for tag in "abc":
        reg.register(str(make_model_dir(tmp_path / tag, tag)), {"status": "accepted"})
    assert reg.promote(1) is None
    old = reg.promote(2)
    assert old is not None and old.version == 1
    assert reg.get_alias(PRODUCTION).version == 2 and reg.get_alias(PREVIOUS).version == 1
    assert reg.get_alias(PRODUCTION).sha256 == reg.model_card(2).sha256
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
        assert reg.entry(v).sha256 == reg.model_card(v).sha256 == reg.entry(v).sha256
    prod, prev = reg.get_alias(PRODUCTION), reg.get_alias(PREVIOUS)
    assert prod is not None and prev is not None and prod.version != prev.version
    assert prod.sha256 == reg.model_card(prod.version).sha256
    aliases = tmp_path / "reg" / "digits" / "aliases"
    assert sorted(p.name for p in aliases.iterdir() if not p.name.startswith(".")) == [
        "previous.json",
        "production.json",
    ]  # no temp files left behind


def version_of(reg: Registry, alias: str) -> int | None:
    """Return the version an alias names, or None."""
    value = reg.get_alias(alias)
    return value.version if value else None


def _events(reg: Registry) -> list[tuple[object, ...]]:
    return [(e.actor, e.alias, e.from_version, e.to_version, e.result) for e in reg.history()]


def registry_with_three(root: str, tmp_path: Path) -> Registry:
    """Return a registry (local folder or S3) with versions 1-3 and production on 1."""
    reg = Registry(root, "digits")
    for tag in "abc":
        reg.register(str(make_model_dir(tmp_path / tag, tag)), {"status": "accepted"})
    reg.promote(1, actor="setup")
    return reg


def check_compare_and_swap(reg: Registry) -> None:
    """Assert every alias write names what it replaces, and a stale undo leaves newer moves."""
    # A write that expects what production no longer holds is refused, and says so.
    reg.promote(2, expect=1, actor="op-a")
    with pytest.raises(AliasConflictError, match="production holds version 2, not version 1"):
        reg.promote(3, expect=1, actor="op-b")
    assert version_of(reg, PRODUCTION) == 2 and version_of(reg, PREVIOUS) == 1
    # A deploy that wrote 2 and must undo it finds 3 there (a newer move): it leaves it.
    reg.promote(3, actor="op-c")
    with reg.aliases_locked("deploy-of-2") as writer:
        restored = writer.undo(2, production=Alias(1, reg.model_card(1).sha256), previous=None)
    assert restored is False
    assert version_of(reg, PRODUCTION) == 3 and version_of(reg, PREVIOUS) == 2
    # Undoing its own, still current move puts both aliases back.
    with reg.aliases_locked("deploy-of-3") as writer:
        assert writer.undo(3, production=reg.get_alias(PREVIOUS), previous=Alias(1, "x"))
    assert version_of(reg, PRODUCTION) == 2 and version_of(reg, PREVIOUS) == 1
    # Rollback is a compare-and-swap as well.
    with pytest.raises(AliasConflictError):
        reg.rollback(expect=3, actor="op-d")
    assert reg.rollback(expect=2, actor="op-d") == (2, 1)
    assert _events(reg) == [
        ("setup", PRODUCTION, None, 1, "moved"),
        ("op-a", PRODUCTION, 1, 2, "moved"),
        ("op-a", PREVIOUS, None, 1, "moved"),
        ("op-b", PRODUCTION, 1, 3, "conflict"),
        ("op-c", PRODUCTION, 2, 3, "moved"),
        ("op-c", PREVIOUS, 1, 2, "moved"),
        ("deploy-of-2", PRODUCTION, 2, 1, "left"),
        ("deploy-of-3", PRODUCTION, 3, 2, "moved"),
        ("deploy-of-3", PREVIOUS, 2, 1, "moved"),
        ("op-d", PRODUCTION, 3, 1, "conflict"),
        ("op-d", PRODUCTION, 2, 1, "moved"),
        ("op-d", PREVIOUS, 1, 2, "moved"),
    ]
    left = reg.history()[6]
    assert left.action == "restore" and "newer move was left alone" in left.detail


def test_alias_writes_are_compare_and_swap_and_recorded(tmp_path: Path) -> None:
    check_compare_and_swap(registry_with_three(str(tmp_path / "reg"), tmp_path))


def test_models_history_prints_every_move(tmp_path: Path) -> None:
    import subprocess
    import sys

    reg = registry_with_three(str(tmp_path / "reg"), tmp_path)
    reg.promote(2, actor="run:manual__1")
    with pytest.raises(AliasConflictError):
        reg.promote(3, expect=1, actor="cli:bob@box:7")
    src = Path(__file__).resolve().parents[2] / "src"
    done = subprocess.run(
        [sys.executable, "-c", "from burstcv.cli import app; app()", "models", "--history"],
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": f"{src}:{src.parent / 'spec'}",  # this checkout's, not an install's
            "BURSTCV_REGISTRY_URI": str(tmp_path / "reg"),
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:4] == ["at", "actor", "action", "alias"] and len(lines) == 5
    assert lines[1].split()[1:] == ["setup", "promote", "production", "-", "1", "moved"]
    assert lines[2].split()[1:] == ["run:manual__1", "promote", "production", "1", "2", "moved"]
    assert lines[3].split()[1:] == ["run:manual__1", "promote", "previous", "-", "1", "moved"]
    assert lines[4].split()[1:7] == ["cli:bob@box:7", "promote", "production", "1", "3", "conflict"]
    assert lines[4].endswith("production holds version 2, not version 1")
