"""The registry: immutable numbered versions and aliases that move atomically."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import pytest
from burstcv_testkit import make_model_dir
from localserver import use_moto

from burstcv.registry import registry as registry_module
from burstcv.registry.registry import (
    PREVIOUS,
    PRODUCTION,
    AliasConflictError,
    AliasWriter,
    Registry,
    RegistryError,
)
from burstcv_spec.contracts import AliasRecord, ModelCard, RegistryDecision


def test_versions_are_numbered_and_carry_lineage(tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"), "digits")
    v1 = reg.register(str(make_model_dir(tmp_path / "a", "a")), RegistryDecision(status="accepted"))
    v2 = reg.register(
        str(make_model_dir(tmp_path / "b", "b")), RegistryDecision(status="rejected", reason="slow")
    )
    assert (v1, v2) == (1, 2) and reg.versions() == [1, 2]
    entry = reg.entry(2)
    assert entry.status == "rejected" and entry.lineage.run_id == "run-b"
    assert reg.model_card(1).version == 1
    assert (tmp_path / "reg" / "digits" / "versions" / "1" / "model.onnx").read_bytes() == b"onnx-a"


def test_promote_moves_production_and_previous_and_rollback_swaps(tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"), "digits")
    for tag in "abc":
        reg.register(str(make_model_dir(tmp_path / tag, tag)), RegistryDecision(status="accepted"))
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
        str(make_model_dir(tmp_path / "a", "a")),
        RegistryDecision(status="rejected", reason="p95 too high"),
    )
    with pytest.raises(RegistryError, match="rejected by the gate: p95 too high"):
        reg.promote(1)
    assert reg.get_alias(PRODUCTION) is None
    reg.promote(1, force=True)
    assert reg.get_alias(PRODUCTION).version == 1


def test_the_promotable_check_hands_back_the_entry_and_refuses_a_rejected_one(
    tmp_path: Path,
) -> None:
    reg = Registry(str(tmp_path / "reg"), "digits")
    reg.register(str(make_model_dir(tmp_path / "a", "a")), RegistryDecision(status="accepted"))
    reg.register(
        str(make_model_dir(tmp_path / "b", "b")), RegistryDecision(status="rejected", reason="slow")
    )
    entry = reg.check_promotable(1)
    assert (entry.version, entry.status) == (1, "accepted")
    with pytest.raises(RegistryError, match="version 2 was rejected by the gate: slow"):
        reg.check_promotable(2)  # not forced unless asked
    assert reg.check_promotable(2, force=True).status == "rejected"


def test_rollback_without_previous_is_a_clear_error(tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"), "digits")
    reg.register(str(make_model_dir(tmp_path / "a", "a")), RegistryDecision(status="accepted"))
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
        last = reg.register(model_dir, RegistryDecision(status="accepted"))
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
        reg.register(str(make_model_dir(tmp_path / tag, tag)), RegistryDecision(status="accepted"))
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
        restored = writer.undo(
            2, production=AliasRecord(version=1, sha256=reg.model_card(1).sha256), previous=None
        )
    assert restored is False
    assert version_of(reg, PRODUCTION) == 3 and version_of(reg, PREVIOUS) == 2
    # Undoing its own, still current move puts both aliases back.
    with reg.aliases_locked("deploy-of-3") as writer:
        assert writer.undo(
            3, production=reg.get_alias(PREVIOUS), previous=AliasRecord(version=1, sha256="x")
        )
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


# -- names, listing and version numbers ---------------------------------------------------------


@pytest.mark.parametrize("name", ["", "team/digits"])
def test_a_model_name_that_is_empty_or_has_a_slash_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(RegistryError, match="invalid model name"):
        Registry(str(tmp_path / "reg"), name)


def test_unfinished_versions_and_stray_files_are_not_listed(tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"), "digits")
    reg.register(str(make_model_dir(tmp_path / "a", "a")), RegistryDecision(status="accepted"))
    versions = tmp_path / "reg" / "digits" / "versions"
    # A writer died after claiming 2 and copying the model, before entry.json.
    (versions / "2").mkdir()
    (versions / "2" / "model.onnx").write_bytes(b"half")
    (versions / "notes").mkdir()
    (versions / "notes" / "entry.json").write_text("{}")
    assert reg.versions() == [1]
    # The next registration does not reuse the dead writer's number.
    assert (
        reg.register(str(make_model_dir(tmp_path / "b", "b")), RegistryDecision(status="accepted"))
        == 3
    )
    assert reg.versions() == [1, 3]


@pytest.fixture
def s3_registry_root(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Return the root of an empty registry on S3 (moto)."""
    use_moto(moto_url, monkeypatch)
    boto3.client("s3").create_bucket(Bucket="models")
    return "s3://models/registry"


@pytest.fixture(params=["local", "s3"])
def registry_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Return the root of an empty registry in a local folder or on S3 (moto)."""
    if request.param == "s3":
        return str(request.getfixturevalue("s3_registry_root"))
    return str(tmp_path / "reg")


def test_a_registration_that_loses_the_race_for_a_number_takes_the_next(
    registry_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg, other = Registry(registry_root, "digits"), Registry(registry_root, "digits")
    listed = reg._claimed_numbers
    raced: list[int] = []

    def list_then_lose_the_race() -> list[int]:
        numbers = listed()
        if not raced:  # another writer claims the same number between listing and claiming
            raced.append(
                other.register(
                    str(make_model_dir(tmp_path / "o", "o")), RegistryDecision(status="accepted")
                )
            )
        return numbers

    monkeypatch.setattr(reg, "_claimed_numbers", list_then_lose_the_race)
    mine = reg.register(
        str(make_model_dir(tmp_path / "m", "m")), RegistryDecision(status="accepted")
    )
    assert (raced, mine) == ([1], 2)
    assert reg.versions() == [1, 2]
    assert (reg.entry(1).lineage.run_id, reg.entry(2).lineage.run_id) == ("run-o", "run-m")
    assert (
        reg.register(str(make_model_dir(tmp_path / "n", "n")), RegistryDecision(status="accepted"))
        == 3
    )


# -- promote, undo and the aliases they leave ---------------------------------------------------


def test_promoting_the_version_already_in_production_moves_nothing(tmp_path: Path) -> None:
    reg = registry_with_three(str(tmp_path / "reg"), tmp_path)
    before = reg.history()
    again = reg.promote(1, actor="op")
    assert again is not None and again.version == 1
    assert again.sha256 == reg.model_card(1).sha256
    assert version_of(reg, PRODUCTION) == 1 and version_of(reg, PREVIOUS) is None
    assert reg.history() == before  # no move, so nothing recorded


def test_a_fresh_registry_has_nothing_to_roll_back(tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "nothing-here-yet"), "digits")
    assert reg.get_alias(PRODUCTION) is None
    with pytest.raises(RegistryError, match="digits has no previous version to roll back to"):
        reg.rollback()
    assert reg.history() == []


def test_undoing_a_promotion_made_while_production_was_unset_removes_it_again(
    registry_root: str, tmp_path: Path
) -> None:
    reg = registry_with_three(registry_root, tmp_path)
    reg.promote(2, actor="op")
    with reg.aliases_locked("op") as writer:  # an operator took production down
        assert writer.swap(PRODUCTION, expect=2, version=None, action="remove") is None
    assert (version_of(reg, PRODUCTION), version_of(reg, PREVIOUS)) == (None, 1)
    with reg.aliases_locked("deploy-of-3") as writer:
        assert writer.promote(3) is None  # nothing was in production
        assert (version_of(reg, PRODUCTION), version_of(reg, PREVIOUS)) == (3, 1)
        assert writer.undo(3, production=None, previous=reg.get_alias(PREVIOUS)) is True
    # Production is unset again; previous never named what production was, so it stays.
    assert (version_of(reg, PRODUCTION), version_of(reg, PREVIOUS)) == (None, 1)
    assert _events(reg)[-2:] == [
        ("deploy-of-3", PRODUCTION, None, 3, "moved"),
        ("deploy-of-3", PRODUCTION, 3, None, "moved"),
    ]


def test_an_undo_leaves_a_production_removed_meanwhile_removed(tmp_path: Path) -> None:
    reg = registry_with_three(str(tmp_path / "reg"), tmp_path)
    one = reg.get_alias(PRODUCTION)
    with reg.aliases_locked("deploy-of-2") as writer:
        writer.promote(2)
        writer.swap(PRODUCTION, expect=2, version=None, action="remove")
        assert writer.undo(2, production=one, previous=None) is False
    assert (version_of(reg, PRODUCTION), version_of(reg, PREVIOUS)) == (None, 1)
    left = reg.history()[-1]
    assert (left.action, left.from_version, left.to_version, left.result) == (
        "restore",
        2,
        1,
        "left",
    )
    assert left.detail == "production holds nothing, not 2: a newer move was left alone"


def test_a_swap_returns_what_the_alias_now_names(tmp_path: Path) -> None:
    reg = registry_with_three(str(tmp_path / "reg"), tmp_path)
    with reg.aliases_locked("op") as writer:
        canary = writer.swap("canary", expect=None, version=3, action="setup")
    assert canary is not None and (canary.version, canary.updated_by) == (3, "op")
    assert canary == reg.get_alias("canary")


# -- history ------------------------------------------------------------------------------------


def test_history_limit_keeps_the_newest_events(tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "reg"), "digits")
    recorded = [
        reg.record(
            actor=f"op-{i}",
            action="promote",
            alias=PRODUCTION,
            from_version=i,
            to_version=i + 1,
            result="moved",
            detail=" two\n  lines ",
        )
        for i in range(1, 4)
    ]
    assert reg.history() == recorded and recorded[0].detail == "two lines"
    assert reg.history(limit=2) == recorded[1:]
    assert reg.history(limit=1) == recorded[2:]
    assert reg.history(limit=0) == []
    assert reg.history(limit=10) == recorded


def test_history_keeps_recording_order_under_a_coarse_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = Registry(str(tmp_path / "reg"), "digits")
    frozen = time.time_ns()
    monkeypatch.setattr(time, "time_ns", lambda: frozen)  # every reading the same tick
    for i in range(12):
        reg.record(
            actor=f"op-{i}",
            action="promote",
            alias=PRODUCTION,
            from_version=None,
            to_version=1,
            result="moved",
        )
    assert [e.actor for e in reg.history()] == [f"op-{i}" for i in range(12)]


def test_history_interleaves_events_from_several_processes_in_time_order(tmp_path: Path) -> None:
    root = str(tmp_path / "reg")
    reg = Registry(root, "digits")

    def record(actor: str) -> None:
        reg.record(
            actor=actor,
            action="promote",
            alias=PRODUCTION,
            from_version=None,
            to_version=1,
            result="moved",
        )

    record("this-process-first")
    src = Path(__file__).resolve().parents[2] / "src"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from burstcv.registry.registry import Registry; "
            "Registry(sys.argv[1], 'digits').record(actor='other-process', action='promote', "
            "alias='production', from_version=None, to_version=1, result='moved')",
            root,
        ],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{src}:{src.parent / 'spec'}"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    record("this-process-last")
    assert [e.actor for e in reg.history()] == [
        "this-process-first",
        "other-process",
        "this-process-last",
    ]


# -- S3: the lease and conditional writes -------------------------------------------------------


def _lease_key(reg: Registry) -> tuple[str, str]:
    bucket, _, key = reg.layout.alias_lock[5:].partition("/")
    return bucket, key


def test_on_s3_a_live_writers_lease_is_waited_for(s3_registry_root: str, tmp_path: Path) -> None:
    reg = registry_with_three(s3_registry_root, tmp_path)
    bucket, key = _lease_key(reg)
    s3 = boto3.client("s3")
    body = json.dumps({"owner": "other-writer", "at": time.time()}).encode()
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    release = threading.Timer(0.8, lambda: s3.delete_object(Bucket=bucket, Key=key))
    started = time.monotonic()
    release.start()
    try:
        reg.promote(2, actor="op")
    finally:
        release.join()
    assert time.monotonic() - started >= 0.7  # it moved only once the other writer let go
    assert (version_of(reg, PRODUCTION), version_of(reg, PREVIOUS)) == (2, 1)
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix=key)  # released


@pytest.mark.parametrize("lease", [b"", b'{"owner": "dead-writer", "at": 1}'])
def test_on_s3_a_dead_writers_lease_is_taken_over(
    s3_registry_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lease: bytes
) -> None:
    reg = registry_with_three(s3_registry_root, tmp_path)
    bucket, key = _lease_key(reg)
    s3 = boto3.client("s3")
    s3.put_object(Bucket=bucket, Key=key, Body=lease)
    monkeypatch.setattr(registry_module, "S3_LOCK_WAIT_S", 5.0)
    reg.promote(2, actor="op")
    assert (version_of(reg, PRODUCTION), version_of(reg, PREVIOUS)) == (2, 1)
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix=key)


def test_on_s3_a_lease_that_is_never_released_fails_the_move(
    s3_registry_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = registry_with_three(s3_registry_root, tmp_path)
    bucket, key = _lease_key(reg)
    s3 = boto3.client("s3")
    body = json.dumps({"owner": "slow-writer", "at": time.time()}).encode()
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    monkeypatch.setattr(registry_module, "S3_LOCK_WAIT_S", 0.5)
    with pytest.raises(RegistryError, match=r"stayed locked for 0\.5s"):
        reg.promote(2, actor="op")
    assert version_of(reg, PRODUCTION) == 1
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == body  # still the other's


def test_on_s3_a_move_that_loses_to_a_stale_writer_is_a_conflict(
    s3_registry_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = registry_with_three(s3_registry_root, tmp_path)
    stale = AliasWriter(Registry(s3_registry_root, "digits"), "stale")  # its lease expired
    card = reg.model_card
    wrote: list[int] = []

    def card_while_a_stale_writer_moves_production(version: int) -> ModelCard:
        if not wrote:  # between this writer's read of production and its write
            wrote.append(3)
            stale.swap(PRODUCTION, expect=1, version=3, action="promote")
        return card(version)

    monkeypatch.setattr(reg, "model_card", card_while_a_stale_writer_moves_production)
    with pytest.raises(AliasConflictError, match="production holds version 3, not version 1"):
        reg.promote(2, actor="op")
    assert (version_of(reg, PRODUCTION), version_of(reg, PREVIOUS)) == (3, None)
    assert _events(reg)[-2:] == [
        ("stale", PRODUCTION, 1, 3, "moved"),
        ("op", PRODUCTION, 1, 2, "conflict"),
    ]
