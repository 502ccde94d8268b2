"""Validate datasets end to end: each kind of fault fails the gate and names its files."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from burstcv.data.pack import pack_dataset
from burstcv.data.suite import add_rule_columns
from burstcv.data.validate import (
    SUMMARY_FILES_PER_CHECK,
    DatasetUnusableError,
    ValidationConfig,
    summary,
    validate_dataset,
)
from burstcv_spec.preprocess import PreprocessSpec

PETS = ["cat", "dog", "fox"]


def _validate(root: Path, out: Path, **overrides: Any) -> Any:
    config = ValidationConfig(expected_classes=PETS, **overrides)
    return validate_dataset(str(root), str(out), config)


def _assert_fails_naming(
    kit: Any, out: Path, report: Any, check: str, files: set[str]
) -> dict[str, Any]:
    """Assert the gate failed on exactly `check`, naming `files` in the JSON and the summary."""
    doc = kit.read_validation(out)
    assert report.success is False and doc["success"] is False
    assert kit.failed_names(doc) == {check}
    entry = kit.expectation(doc, check)
    assert set(entry["offending_files"]) == files
    assert f"- {check}:" in summary(report)
    for path in entry["offending_files"][:SUMMARY_FILES_PER_CHECK]:  # the first ones, named
        assert path in summary(report)
    return entry


def test_clean_dataset_passes_and_writes_the_evidence(
    dataset: Path, out_dir: Path, kit: Any
) -> None:
    report = _validate(dataset, out_dir)
    assert report.success, summary(report)
    doc = kit.read_validation(out_dir)
    assert doc["success"] is True and doc["fingerprint"] == report.fingerprint
    assert doc["counts"]["files"] == doc["counts"]["usable"] == 60
    assert doc["counts"]["per_split"]["val"] == {"cat": 10, "dog": 10, "fox": 10}
    names = [e["name"] for e in doc["expectations"]]
    assert {
        "every_file_decodes",
        "no_leakage_exact",
        "no_leakage_near",
        "class_imbalance",
        "min_images_per_class",
        "labels_expected",
        "min_total_images",
    } <= set(names)
    assert kit.expectation(doc, "min_total_images")["observed"] == 60  # GX's observed value
    assert kit.expectation(doc, "class_imbalance")["observed"] == 1.0
    assert all(e["expectation_type"].startswith("expect_") for e in doc["expectations"])
    manifest = pd.read_parquet(report.manifest_uri)
    assert len(manifest) == 60
    index = Path(report.data_docs_uri)
    assert index == out_dir / "data_docs" / "index.html"
    html = index.read_text()
    assert "<html" in html.lower() and "burstcv_dataset" in html
    assert list((out_dir / "data_docs" / "validations").rglob("*.html"))
    assert summary(report).startswith(f"dataset {dataset}: PASSED")


def test_fingerprint_follows_the_bytes(dataset: Path, tmp_path: Path, kit: Any) -> None:
    first = _validate(dataset, tmp_path / "a").fingerprint
    assert _validate(dataset, tmp_path / "b").fingerprint == first
    kit.smooth_image(4242).save(dataset / "train" / "cat" / "000.png")
    assert _validate(dataset, tmp_path / "c").fingerprint != first


def test_fingerprint_ignores_row_order_and_is_the_documented_digest(dataset: Path) -> None:
    import hashlib

    from burstcv.data.manifest import scan
    from burstcv.data.validate import dataset_fingerprint

    manifest = scan(str(dataset), workers=1).manifest
    manifest.loc[3, "sha256"] = None  # an unreadable file counts with an empty digest
    expected = hashlib.sha256(
        "".join(
            f"{path}\t{sha or ''}\n"
            for path, sha in sorted(zip(manifest["path"], manifest["sha256"], strict=True))
        ).encode()
    ).hexdigest()
    shuffled = manifest.sample(frac=1, random_state=0)
    doubled = pd.concat([manifest, manifest.iloc[:2]])  # a path twice: sorted with its digest
    assert dataset_fingerprint(manifest) == dataset_fingerprint(shuffled) == expected
    assert (
        dataset_fingerprint(doubled)
        == hashlib.sha256(
            "".join(
                f"{path}\t{sha or ''}\n"
                for path, sha in sorted(zip(doubled["path"], doubled["sha256"], strict=True))
            ).encode()
        ).hexdigest()
    )


def test_gx_gets_text_columns_as_arrow_strings() -> None:
    from burstcv.data.suite import _arrow_strings

    frame = pd.DataFrame(  # as the manifest holds them: Python objects
        {
            "path": pd.Series(["a/b/1.png", "a/b/2.png"], dtype=object),
            "dup_of": pd.Series([None, "a/b/1.png"], dtype=object),
            "odd": pd.Series([None, 3], dtype=object),  # not text: left to GX as it is
            "width": [32, 32],
        }
    )
    converted = _arrow_strings(frame)
    assert isinstance(converted["path"].dtype, pd.StringDtype)
    assert isinstance(converted["dup_of"].dtype, pd.StringDtype)
    assert converted["odd"].dtype == object and converted["width"].dtype == "int64"
    assert converted["dup_of"].isna().tolist() == [True, False]
    assert converted["path"].tolist() == frame["path"].tolist()


def test_truncated_png_is_named(dataset: Path, out_dir: Path, kit: Any) -> None:
    target = dataset / "val" / "dog" / "004.png"
    target.write_bytes(target.read_bytes()[:-40])
    report = _validate(dataset, out_dir)
    entry = _assert_fails_naming(kit, out_dir, report, "every_file_decodes", {"val/dog/004.png"})
    assert "truncated" in entry["reasons"]["val/dog/004.png"]
    (page,) = (out_dir / "data_docs" / "validations").rglob("*.html")
    assert "truncated" in page.read_text()  # Data Docs show the decoder's reason


def test_zero_byte_file_is_named(dataset: Path, out_dir: Path, kit: Any) -> None:
    (dataset / "train" / "fox" / "000.png").write_bytes(b"")
    report = _validate(dataset, out_dir)
    entry = _assert_fails_naming(kit, out_dir, report, "every_file_decodes", {"train/fox/000.png"})
    assert entry["reasons"]["train/fox/000.png"] == "empty file (0 bytes)"


def test_extension_that_lies_is_named(dataset: Path, out_dir: Path, kit: Any) -> None:
    buffer = io.BytesIO()
    kit.smooth_image(777).save(buffer, "JPEG", quality=90)
    (dataset / "train" / "cat" / "photo.png").write_bytes(buffer.getvalue())
    report = _validate(dataset, out_dir)
    entry = _assert_fails_naming(
        kit, out_dir, report, "every_file_decodes", {"train/cat/photo.png"}
    )
    assert "extension '.png' lies: the content is JPEG" in entry["reasons"]["train/cat/photo.png"]


def test_decompression_bomb_is_named(dataset: Path, out_dir: Path, kit: Any) -> None:
    (dataset / "train" / "dog" / "bomb.png").write_bytes(kit.png_header_only(30000, 30000))
    report = _validate(dataset, out_dir)
    entry = _assert_fails_naming(kit, out_dir, report, "every_file_decodes", {"train/dog/bomb.png"})
    reason = entry["reasons"]["train/dog/bomb.png"]
    assert "bomb" in reason or "pixels" in reason


def test_symlink_leaving_the_root_is_named(
    dataset: Path, out_dir: Path, tmp_path: Path, kit: Any
) -> None:
    secret = tmp_path / "elsewhere.png"
    kit.smooth_image(4321).save(secret)
    (dataset / "val" / "cat" / "link.png").symlink_to(secret)
    report = _validate(dataset, out_dir)
    entry = _assert_fails_naming(kit, out_dir, report, "every_file_decodes", {"val/cat/link.png"})
    assert "outside the dataset root" in entry["reasons"]["val/cat/link.png"]


def test_system_files_are_ignored_not_failed(dataset: Path, out_dir: Path, kit: Any) -> None:
    (dataset / "train" / "cat" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (dataset / "val" / "fox" / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
    (dataset / "desktop.ini").write_text("[.ShellClassInfo]")
    report = _validate(dataset, out_dir)
    assert report.success, summary(report)
    doc = kit.read_validation(out_dir)
    assert {item["path"] for item in doc["ignored"]} == {
        "train/cat/.DS_Store",
        "val/fox/Thumbs.db",
        "desktop.ini",
    }
    assert doc["counts"]["files"] == 60 and doc["counts"]["ignored"] == 3
    assert any("3 hidden/system file(s) ignored" in w for w in doc["warnings"])


def test_file_at_the_wrong_depth_is_named(dataset: Path, out_dir: Path, kit: Any) -> None:
    shutil.copy(dataset / "train" / "cat" / "000.png", dataset / "train" / "loose.png")
    report = _validate(dataset, out_dir)
    doc = kit.read_validation(out_dir)
    assert not report.success
    layout = kit.expectation(doc, "imagefolder_layout")
    assert layout["offending_files"] == ["train/loose.png"]
    assert "wrong depth" in layout["reasons"]["train/loose.png"]


def test_too_small_image_is_named(dataset: Path, out_dir: Path, kit: Any) -> None:
    kit.smooth_image(31, size=4).save(dataset / "train" / "dog" / "tiny.png")
    report = _validate(dataset, out_dir)
    doc = kit.read_validation(out_dir)
    assert kit.failed_names(doc) == {"width_in_bounds", "height_in_bounds"}
    assert kit.expectation(doc, "width_in_bounds")["offending_files"] == ["train/dog/tiny.png"]
    assert "train/dog/tiny.png: width 4" in summary(report)


def test_disallowed_format_is_named(dataset: Path, out_dir: Path, kit: Any) -> None:
    kit.smooth_image(55).save(dataset / "val" / "fox" / "anim.gif")
    report = _validate(dataset, out_dir)
    entry = _assert_fails_naming(kit, out_dir, report, "allowed_formats", {"val/fox/anim.gif"})
    assert entry["reasons"]["val/fox/anim.gif"] == "format GIF"


def test_camera_multi_picture_jpegs_pass_and_pack(
    dataset: Path, out_dir: Path, kit: Any, tmp_path: Path
) -> None:
    first, second = kit.smooth_image(77), kit.smooth_image(78)
    first.save(
        dataset / "train" / "cat" / "phone.jpg", "MPO", save_all=True, append_images=[second]
    )
    report = _validate(dataset, out_dir)
    assert report.success, summary(report)
    manifest = pd.read_parquet(out_dir / "manifest.parquet")
    row = manifest[manifest["path"] == "train/cat/phone.jpg"]
    assert row["format"].tolist() == ["MPO"]
    packed = pack_dataset(row, str(tmp_path / "shards"), PreprocessSpec())
    with np.load(packed.train_shards[0]) as npz:
        stored = npz["images"][0].astype(int)
    # The first picture is the one decoded (JPEG-close to it, far from the second).
    to_first = np.abs(stored - np.asarray(first)).mean()
    assert to_first < 12 and to_first * 3 < np.abs(stored - np.asarray(second)).mean()


def test_unexpected_class_is_named(dataset: Path, out_dir: Path, kit: Any) -> None:
    for split in ("train", "val"):
        (dataset / split / "wolf").mkdir()
        for i in range(6):
            kit.smooth_image(5000 + i + (100 if split == "val" else 0)).save(
                dataset / split / "wolf" / f"{i}.png"
            )
    report = _validate(dataset, out_dir)
    doc = kit.read_validation(out_dir)
    assert kit.failed_names(doc) == {"labels_expected"}
    entry = kit.expectation(doc, "labels_expected")
    assert len(entry["offending_files"]) == 12
    assert all("/wolf/" in path for path in entry["offending_files"])
    assert "unexpected class wolf" in summary(report)
    # One screen: the first five files are named, the rest counted.
    assert sum("/wolf/" in line for line in summary(report).splitlines()) == 5
    assert "    ... and 7 more (see validation.json and the manifest)" in summary(report)
    assert "  val: 36 images in 4 classes (cat 10, dog 10, fox 10, wolf 6)" in summary(report)


def test_missing_expected_class_fails(tmp_path: Path, out_dir: Path, kit: Any) -> None:
    root = kit.write_dataset(tmp_path / "pets", classes=("cat", "dog"))
    report = _validate(root, out_dir)
    doc = kit.read_validation(out_dir)
    assert kit.failed_names(doc) == {"expected_classes_present"}
    assert kit.expectation(doc, "expected_classes_present")["observed"] == {"missing": ["fox"]}
    assert not report.success


def test_class_with_too_few_images_is_named(dataset: Path, out_dir: Path, kit: Any) -> None:
    for i in range(3, 10):
        (dataset / "val" / "fox" / f"{i:03d}.png").unlink()
    report = _validate(dataset, out_dir)
    entry = _assert_fails_naming(
        kit,
        out_dir,
        report,
        "min_images_per_class",
        {f"train/fox/{i:03d}.png" for i in range(10)} | {f"val/fox/{i:03d}.png" for i in range(3)},
    )
    assert entry["details"]["class_counts"]["val"]["fox"] == 3


def test_class_imbalance_reports_the_ratio(tmp_path: Path, out_dir: Path, kit: Any) -> None:
    counts = {(s, c): 10 for s in ("train", "val") for c in PETS} | {("train", "cat"): 25}
    root = kit.write_dataset(tmp_path / "pets", per_class=counts)
    report = _validate(root, out_dir, max_imbalance_ratio=2.0)
    doc = kit.read_validation(out_dir)
    assert kit.failed_names(doc) == {"class_imbalance"}
    assert kit.expectation(doc, "class_imbalance")["observed"] == 2.5
    assert "class_imbalance" in summary(report)


def test_exact_duplicate_within_a_split_is_named(dataset: Path, out_dir: Path, kit: Any) -> None:
    shutil.copy(dataset / "train" / "cat" / "001.png", dataset / "train" / "cat" / "copy.png")
    report = _validate(dataset, out_dir)
    entry = _assert_fails_naming(
        kit,
        out_dir,
        report,
        "no_duplicates_within_split",
        {"train/cat/001.png", "train/cat/copy.png"},
    )
    assert entry["reasons"]["train/cat/copy.png"] == "same bytes as train/cat/001.png"


def test_exact_train_val_leak_is_named(dataset: Path, out_dir: Path, kit: Any) -> None:
    shutil.copy(dataset / "train" / "dog" / "003.png", dataset / "val" / "dog" / "leak.png")
    report = _validate(dataset, out_dir)
    entry = _assert_fails_naming(
        kit, out_dir, report, "no_leakage_exact", {"train/dog/003.png", "val/dog/leak.png"}
    )
    assert entry["reasons"]["val/dog/leak.png"] == "same bytes as train/dog/003.png"
    # The Data Docs page shows the matching files too, not only a count.
    (page,) = (out_dir / "data_docs" / "validations").rglob("*.html")
    html = page.read_text()
    assert "val/dog/leak.png" in html and "train/dog/003.png" in html


def test_near_leak_one_pixel_changed_is_named(dataset: Path, out_dir: Path, kit: Any) -> None:
    img = Image.open(dataset / "train" / "cat" / "000.png").convert("RGB")
    img.putpixel((5, 5), (255, 255, 255))
    img.save(dataset / "val" / "cat" / "edited.png")
    report = _validate(dataset, out_dir)
    entry = _assert_fails_naming(
        kit, out_dir, report, "no_leakage_near", {"train/cat/000.png", "val/cat/edited.png"}
    )
    assert entry["reasons"]["val/cat/edited.png"] == "looks like train/cat/000.png"


def test_near_leak_reencoded_as_jpeg_is_named(dataset: Path, out_dir: Path, kit: Any) -> None:
    Image.open(dataset / "train" / "cat" / "000.png").save(
        dataset / "val" / "cat" / "again.jpg", "JPEG", quality=90
    )
    report = _validate(dataset, out_dir)
    _assert_fails_naming(
        kit, out_dir, report, "no_leakage_near", {"train/cat/000.png", "val/cat/again.jpg"}
    )


def test_near_duplicate_distance_is_a_threshold(dataset: Path, tmp_path: Path, kit: Any) -> None:
    # This image's hash moves by 3 bits when re-encoded: missed at 0, caught at 4, off at None.
    Image.open(dataset / "train" / "dog" / "004.png").save(
        dataset / "val" / "dog" / "again.jpg", "JPEG", quality=90
    )
    assert _validate(dataset, tmp_path / "d0").success
    report = _validate(dataset, tmp_path / "d4", near_duplicate_max_distance=4)
    assert kit.failed_names(kit.read_validation(tmp_path / "d4")) == {"no_leakage_near"}
    assert "val/dog/again.jpg: looks like train/dog/004.png" in summary(report)
    off = _validate(dataset, tmp_path / "off", near_duplicate_max_distance=None)
    assert off.success
    assert "no_leakage_near" not in {c.name for c in off.expectations}
    assert pd.read_parquet(off.manifest_uri)["phash"].isna().all()  # not computed when unused


def test_too_few_images_in_total(tmp_path: Path, out_dir: Path, kit: Any) -> None:
    root = kit.write_dataset(tmp_path / "pets", per_class=3)
    report = _validate(root, out_dir, min_images_per_class=1)
    doc = kit.read_validation(out_dir)
    assert kit.failed_names(doc) == {"min_total_images"}
    assert kit.expectation(doc, "min_total_images")["observed"] == 18
    assert "min_total_images" in summary(report)


def test_drift_fails_or_warns_against_the_last_pass(tmp_path: Path, kit: Any) -> None:
    history = tmp_path / "history"
    first = kit.write_dataset(tmp_path / "v1" / "pets")
    baseline = validate_dataset(
        str(first), str(tmp_path / "o1"), ValidationConfig(), history_uri=str(history)
    )
    assert baseline.success and baseline.drift.status == "no_baseline"
    assert (history / "pets.json").is_file()

    # Same name, cats now 60% of the images instead of a third.
    shifted = {(s, c): 10 for s in ("train", "val") for c in PETS} | {
        ("train", "cat"): 30,
        ("val", "cat"): 30,
    }
    second = kit.write_dataset(tmp_path / "v2" / "pets", per_class=shifted, seed=1)
    strict = validate_dataset(
        str(second),
        str(tmp_path / "o2"),
        ValidationConfig(drift_max=0.2),
        history_uri=str(history),
    )
    assert not strict.success
    assert strict.drift.status == "failed"
    assert strict.drift.class_proportion_tvd == pytest.approx(0.6 - 1 / 3)
    assert "- drift:" in summary(strict) and "above drift_max" in summary(strict)
    assert all(check.success for check in strict.expectations)  # only drift failed
    assert kit.read_validation(tmp_path / "o2")["drift"]["status"] == "failed"

    # A failed run is no baseline: the comparison is still against v1.
    warned = validate_dataset(
        str(second), str(tmp_path / "o3"), ValidationConfig(), history_uri=str(history)
    )
    assert warned.success, summary(warned)
    assert warned.drift.status == "warning"
    assert warned.drift.baseline["fingerprint"] == baseline.fingerprint
    assert "warning: drift:" in summary(warned)
    assert kit.read_validation(tmp_path / "o3")["warnings"] == warned.warnings

    # That pass became the baseline: validating the same data again shows no drift.
    again = validate_dataset(
        str(second),
        str(tmp_path / "o4"),
        ValidationConfig(drift_max=0.2),
        history_uri=str(history),
    )
    assert again.success and again.drift.status == "ok" and again.drift.score == 0


def test_unusable_datasets_raise_one_line_reasons(tmp_path: Path, kit: Any) -> None:
    out = str(tmp_path / "out")
    with pytest.raises(DatasetUnusableError, match="does not exist"):
        validate_dataset(str(tmp_path / "nope"), out, ValidationConfig())
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetUnusableError, match="no files"):
        validate_dataset(str(tmp_path / "empty"), out, ValidationConfig())
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(5):
        kit.smooth_image(i).save(flat / f"{i}.png")
    with pytest.raises(DatasetUnusableError, match="not an ImageFolder") as info:
        validate_dataset(str(flat), out, ValidationConfig())
    assert "\n" not in str(info.value)


def test_config_refuses_impossible_thresholds() -> None:
    with pytest.raises(ValueError, match="0 < min <= max"):
        ValidationConfig(min_width=100, max_width=10)
    with pytest.raises(ValueError, match="near_duplicate_max_distance"):
        ValidationConfig(near_duplicate_max_distance=40)
    with pytest.raises(ValueError, match="max_imbalance_ratio"):
        ValidationConfig(max_imbalance_ratio=0.5)


def test_dataset_of_only_broken_files_fails_without_crashing(tmp_path: Path, kit: Any) -> None:
    root = tmp_path / "broken"
    for split in ("train", "val"):
        (root / split / "cat").mkdir(parents=True)
        for i in range(3):
            (root / split / "cat" / f"{i}.png").write_bytes(b"")
    report = validate_dataset(str(root), str(tmp_path / "out"), ValidationConfig())
    doc = kit.read_validation(tmp_path / "out")
    assert not report.success and doc["counts"]["usable"] == 0
    assert {"every_file_decodes", "min_images_per_class", "min_total_images"} <= kit.failed_names(
        doc
    )
    assert "nothing to measure" in summary(report)


def test_thousands_of_copies_are_flagged_in_linear_time() -> None:
    n = 20_000
    manifest = pd.DataFrame(
        {
            "path": [f"{'train' if i % 2 else 'val'}/cat/{i}.png" for i in range(n)],
            "split": ["train" if i % 2 else "val" for i in range(n)],
            "label": ["cat"] * n,
            "sha256": ["0" * 64] * n,
            "phash": ["0f0f0f0f0f0f0f0f"] * n,
            "decode_ok": [True] * n,
        }
    )
    started = time.perf_counter()
    flagged = add_rule_columns(manifest, ValidationConfig(near_duplicate_max_distance=4))
    assert time.perf_counter() - started < 10  # quadratic pairing would take minutes
    assert flagged["dup_within_split"].all() and flagged["leaks_exact"].all()
    assert not flagged["leaks_near"].any()  # exact leaks are reported once, as exact


def test_demo_digits_pass_without_false_near_duplicates(tmp_path: Path) -> None:
    # Handwritten digits share coarse shapes (150 of 1,797 share a difference hash across
    # splits); the thumbnail check keeps them from being reported as leaks.
    pytest.importorskip("sklearn")
    from burstcv.data.demo import write_demo_dataset

    write_demo_dataset(tmp_path / "digits")
    config = ValidationConfig(expected_classes=[str(d) for d in range(10)])
    report = validate_dataset(str(tmp_path / "digits"), str(tmp_path / "out"), config)
    assert report.success, summary(report)
    assert {c.name for c in report.expectations} >= {"no_leakage_near", "no_leakage_exact"}


def test_the_validate_stage_logs_one_summary_and_nothing_of_gx(dataset: Path) -> None:
    # A fresh interpreter, logging at INFO as an Airflow task does, so that what GX logs
    # while it is imported is seen too.
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout,\n"
        "                    format='%(name)s: %(message)s')\n"
        "from burstcv.stages import data as data_stage\n"
        "from burstcv.params import RunParams\n"
        "from burstcv_spec.contracts import RunRef\n"
        "data_stage.validate(\n"
        f"    RunRef.of('manual__log'), params=RunParams(dataset_uri={str(dataset)!r})\n"
        ")\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    log = done.stdout.splitlines()
    assert not [line for line in log if line.startswith("great_expectations")], log[:5]
    assert sum(": PASSED (" in line for line in log) == 1, log
    assert "  train: 30 images in 3 classes (cat 10, dog 10, fox 10)" in log
    assert len(log) < 15, log  # one screen
