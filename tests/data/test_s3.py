"""Scan and validate a dataset that lives under an s3:// prefix (moto in server mode)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from burstcv.data.manifest import DatasetUnusableError, scan
from burstcv.data.validate import ValidationConfig, summary, validate_dataset
from burstcv_spec import storage

pytest.importorskip("moto.server")


def _upload(client: Any, root: Path, prefix: str) -> None:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(root).as_posix()}"
        client.put_object(Bucket="datasets", Key=key, Body=path.read_bytes())


def test_s3_dataset_scans_and_validates_like_a_local_one(
    s3: Any, dataset: Path, tmp_path: Path, kit: Any
) -> None:
    target = dataset / "val" / "dog" / "004.png"
    target.write_bytes(target.read_bytes()[:-40])  # one truncated file
    (dataset / "train" / "cat" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    shutil.copy(dataset / "train" / "cat" / "000.png", dataset / "train" / "odd.png")
    _upload(s3, dataset, "pets/v1")
    s3.put_object(Bucket="datasets", Key="pets/v1/train/", Body=b"")  # a console folder marker

    remote = scan("s3://datasets/pets/v1")
    local = scan(str(dataset))
    assert remote.manifest["path"].tolist() == local.manifest["path"].tolist()
    columns = ["sha256", "phash", "decode_ok", "width", "format", "bytes"]
    assert remote.manifest[columns].equals(local.manifest[columns])
    assert remote.manifest["uri"].iloc[0].startswith("s3://datasets/pets/v1/")
    assert [item["path"] for item in remote.ignored] == ["train/cat/.DS_Store"]

    report = validate_dataset(
        "s3://datasets/pets/v1",
        "s3://artifacts/runs/r1/dataset",
        ValidationConfig(expected_classes=["cat", "dog", "fox"]),
        history_uri="s3://artifacts/history",
    )
    assert not report.success
    doc = json.loads(storage.read_bytes("s3://artifacts/runs/r1/dataset/validation.json"))
    assert kit.failed_names(doc) == {"every_file_decodes", "imagefolder_layout"}
    assert kit.expectation(doc, "every_file_decodes")["offending_files"] == [
        "train/odd.png",
        "val/dog/004.png",
    ]
    assert report.fingerprint == doc["fingerprint"]
    assert storage.exists("s3://artifacts/runs/r1/dataset/manifest.parquet")
    assert report.data_docs_uri == "s3://artifacts/runs/r1/dataset/data_docs/index.html"
    assert b"<html" in storage.read_bytes(report.data_docs_uri).lower()
    assert not storage.exists("s3://artifacts/history/v1.json")  # a failed run sets no baseline


def test_s3_pass_records_the_drift_baseline(s3: Any, dataset: Path) -> None:
    _upload(s3, dataset, "pets")
    report = validate_dataset(
        "s3://datasets/pets/",
        "s3://artifacts/runs/r2/dataset",
        ValidationConfig(),
        history_uri="s3://artifacts/history",
    )
    assert report.success, summary(report)
    baseline = storage.read_json("s3://artifacts/history/pets.json")
    assert baseline["fingerprint"] == report.fingerprint


def test_missing_s3_prefix_is_unusable(s3: Any) -> None:
    with pytest.raises(DatasetUnusableError, match="nothing under"):
        scan("s3://datasets/absent")
    with pytest.raises(DatasetUnusableError, match="does not exist"):
        scan("s3://no-such-bucket/x")


def test_s3_object_over_the_size_limit_is_refused_unread(s3: Any, dataset: Path) -> None:
    _upload(s3, dataset, "pets")
    sizes = {p.relative_to(dataset).as_posix(): p.stat().st_size for p in dataset.rglob("*.png")}
    limit = sorted(sizes.values())[len(sizes) // 2]
    manifest = scan("s3://datasets/pets", max_file_bytes=limit).manifest.set_index("path")
    for path, size in sizes.items():
        row = manifest.loc[path]
        assert row["bytes"] == size
        if size > limit:  # the listing's size: refused before any GET (the message says so)
            assert row["error"] == f"file is {size} bytes; the limit is {limit}", path
        else:
            assert row["decode_ok"], path
    assert min(sizes.values()) <= limit < max(sizes.values())
