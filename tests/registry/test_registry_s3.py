"""The registry on S3 (moto in server mode): numbered versions and aliases stay consistent."""

from __future__ import annotations

import threading
from pathlib import Path

import boto3
import pytest
from burstcv_testkit import make_model_dir
from localserver import use_moto
from test_registry import check_compare_and_swap, registry_with_three, version_of

from burstcv.registry.registry import PREVIOUS, PRODUCTION, Registry, _conditional_write
from burstcv_spec.contracts import AliasRecord, RegistryDecision


@pytest.fixture
def s3_root(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    use_moto(moto_url, monkeypatch)
    boto3.client("s3").create_bucket(Bucket="models")
    return "s3://models/registry"


def test_concurrent_promotions_on_s3_leave_a_consistent_registry(
    s3_root: str, tmp_path: Path
) -> None:
    dirs = [str(make_model_dir(tmp_path / f"m{i}", str(i))) for i in range(4)]
    errors: list[BaseException] = []

    def worker(model_dir: str) -> None:
        try:
            reg = Registry(s3_root, "digits")
            for _ in range(3):
                reg.promote(reg.register(model_dir, RegistryDecision(status="accepted")))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(d,)) for d in dirs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    reg = Registry(s3_root, "digits")
    assert reg.versions() == list(range(1, 13))  # no number lost or shared
    prod, prev = reg.get_alias(PRODUCTION), reg.get_alias(PREVIOUS)
    assert prod is not None and prev is not None and prod.version != prev.version
    assert prod.sha256 == reg.model_card(prod.version).sha256
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="models")["Contents"]]
    assert "registry/digits/aliases/.lock" not in keys  # the lease was released
    assert reg.rollback() == (prod.version, prev.version)


def test_alias_writes_on_s3_are_conditional_and_recorded(s3_root: str, tmp_path: Path) -> None:
    check_compare_and_swap(registry_with_three(f"{s3_root}-cas", tmp_path))


def test_a_writer_whose_lease_was_taken_over_cannot_overwrite_a_newer_alias(
    s3_root: str, tmp_path: Path
) -> None:
    reg = registry_with_three(f"{s3_root}-lease", tmp_path)
    s3 = boto3.client("s3")
    bucket, _, key = reg.alias_uri(PRODUCTION)[5:].partition("/")
    stale_etag = s3.head_object(Bucket=bucket, Key=key)["ETag"]
    # Another writer moves production after this one read it (its lease had expired).
    reg.promote(2, actor="newer")
    value = AliasRecord(
        version=3, sha256=reg.model_card(3).sha256, updated_at="now", updated_by="stale"
    )
    assert _conditional_write(reg.alias_uri(PRODUCTION), value, stale_etag) is False
    assert _conditional_write(reg.alias_uri("candidate"), value, None) is True
    assert _conditional_write(reg.alias_uri("candidate"), value, None) is False  # exists now
    assert version_of(reg, PRODUCTION) == 2
