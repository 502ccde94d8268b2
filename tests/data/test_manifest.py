"""Scan ImageFolder datasets, including hostile files, into a manifest."""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from PIL import Image

from burstcv.data.manifest import COLUMNS, DatasetUnusableError, read_manifest, scan, write_manifest
from burstcv_spec.preprocess import ImageDecodeError, open_image


def _row(manifest: pd.DataFrame, path: str) -> dict[str, Any]:
    rows = manifest[manifest["path"] == path]
    assert len(rows) == 1, f"{path} not in manifest: {manifest['path'].tolist()}"
    return rows.iloc[0].to_dict()


@pytest.fixture
def hostile(tmp_path: Path, kit: Any) -> Path:
    """Return a dataset salted with one file of every kind of trouble."""
    root = kit.write_dataset(tmp_path / "hostile", per_class=3)
    cat = root / "train" / "cat"
    good = (cat / "000.png").read_bytes()
    (cat / "truncated.png").write_bytes(good[: len(good) // 2])
    (cat / "empty.png").write_bytes(b"")
    buffer = io.BytesIO()
    kit.smooth_image(999).save(buffer, "JPEG")
    (cat / "liar.png").write_bytes(buffer.getvalue())
    (cat / "bomb.png").write_bytes(kit.png_header_only(30000, 30000))
    (cat / "notes.txt").write_text("not an image")
    outside = tmp_path / "secret.png"
    kit.smooth_image(998).save(outside)
    (cat / "escape.png").symlink_to(outside)
    (cat / "inside.png").symlink_to(cat / "000.png")
    (root / "train" / "stray.png").write_bytes(good)
    (cat / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (root / "val" / "dog" / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
    (cat / "._000.png").write_bytes(b"\x00\x05\x16\x07")
    (root / ".cache").mkdir()
    (root / ".cache" / "x.png").write_bytes(good)
    return root


def test_clean_dataset_gives_one_decoded_row_per_image(dataset: Path) -> None:
    result = scan(str(dataset))
    df = result.manifest
    assert list(df.columns) == list(COLUMNS)
    assert len(df) == 60 and df["decode_ok"].all() and df["error"].isna().all()
    first = _row(df, "train/cat/000.png")
    assert (first["split"], first["label"], first["format"], first["ext"]) == (
        "train",
        "cat",
        "PNG",
        ".png",
    )
    assert (first["width"], first["height"], first["channels"], first["mode"]) == (32, 32, 3, "RGB")
    assert first["bytes"] == (dataset / "train/cat/000.png").stat().st_size
    assert len(first["sha256"]) == 64 and len(first["phash"]) == 16
    assert first["uri"] == str(dataset / "train" / "cat" / "000.png")
    assert df["sha256"].nunique() == 60
    assert result.ignored == []


def test_hostile_files_become_error_rows_with_a_reason(hostile: Path) -> None:
    df = scan(str(hostile)).manifest
    errors = {row["path"]: row["error"] for row in df[~df["decode_ok"]].to_dict("records")}
    assert "truncated" in errors["train/cat/truncated.png"]
    assert errors["train/cat/empty.png"] == "empty file (0 bytes)"
    assert "lies" in errors["train/cat/liar.png"] and "JPEG" in errors["train/cat/liar.png"]
    assert _row(df, "train/cat/liar.png")["format"] == "JPEG"  # the real format is recorded
    assert "bomb" in errors["train/cat/bomb.png"] or "pixels" in errors["train/cat/bomb.png"]
    assert "not an image" in errors["train/cat/notes.txt"]
    assert "outside the dataset root" in errors["train/cat/escape.png"]
    assert "wrong depth" in errors["train/stray.png"]
    assert set(errors) == {
        "train/cat/truncated.png",
        "train/cat/empty.png",
        "train/cat/liar.png",
        "train/cat/bomb.png",
        "train/cat/notes.txt",
        "train/cat/escape.png",
        "train/stray.png",
    }
    # A symlink to a file inside the root is an ordinary image.
    assert _row(df, "train/cat/inside.png")["decode_ok"]


def test_system_and_hidden_files_are_ignored_with_a_note(hostile: Path) -> None:
    result = scan(str(hostile))
    ignored = {item["path"]: item["note"] for item in result.ignored}
    assert set(ignored) == {
        "train/cat/.DS_Store",
        "val/dog/Thumbs.db",
        "train/cat/._000.png",
        ".cache",
    }
    assert "folder" in ignored[".cache"]
    assert not result.manifest["path"].str.contains("DS_Store|Thumbs|/\\._|\\.cache").any()


def test_bomb_is_refused_from_the_header_without_decoding(tmp_path: Path, kit: Any) -> None:
    root = kit.write_dataset(tmp_path / "d", per_class=1)
    kit.smooth_image(5, size=64).save(root / "train" / "cat" / "big.png")
    (root / "train" / "cat" / "huge.png").write_bytes(kit.png_header_only(60000, 60000))
    started = time.perf_counter()
    df = scan(str(root), max_pixels=32 * 32).manifest
    assert time.perf_counter() - started < 5  # decoding 3.6e9 pixels would take far longer
    big = _row(df, "train/cat/big.png")
    assert not big["decode_ok"] and "64x64 = 4096 pixels; the limit is 1024" in big["error"]
    assert (big["width"], big["height"]) == (64, 64)
    assert not _row(df, "train/cat/huge.png")["decode_ok"]
    assert _row(df, "train/cat/000.png")["decode_ok"]


def test_gate_and_service_agree_on_every_fault(hostile: Path) -> None:
    df = scan(str(hostile)).manifest
    checked = 0
    for row in df.to_dict("records"):
        if row["label"] is None or "symlink" in (row["error"] or "") or row["ext"] != ".png":
            continue  # layout and link problems are the dataset's, not the decoder's
        if "lies" in (row["error"] or ""):
            continue  # the service has no file name: a JPEG is a JPEG there
        try:
            open_image(Path(row["uri"]).read_bytes())
            service_ok = True
        except ImageDecodeError:
            service_ok = False
        assert service_ok == row["decode_ok"], row
        checked += 1
    assert checked >= 8


def test_process_pool_gives_the_same_manifest(hostile: Path) -> None:
    serial = scan(str(hostile), workers=1)
    pooled = scan(str(hostile), workers=2)
    assert pooled.workers == 2
    pd.testing.assert_frame_equal(serial.manifest, pooled.manifest)


def test_pool_in_a_threaded_host_gives_the_same_manifest(hostile: Path) -> None:
    # Another live thread (as in an Airflow worker) makes the pool start workers with spawn.
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, daemon=True)
    helper.start()
    try:
        pooled = scan(str(hostile), workers=2)
    finally:
        stop.set()
        helper.join()
    pd.testing.assert_frame_equal(scan(str(hostile), workers=1).manifest, pooled.manifest)


def test_manifest_round_trips_through_parquet(dataset: Path, tmp_path: Path) -> None:
    df = scan(str(dataset)).manifest
    uri = write_manifest(df, str(tmp_path / "m" / "manifest.parquet"))
    back = read_manifest(uri)
    assert back["path"].tolist() == df["path"].tolist()
    assert back["width"].tolist() == df["width"].tolist()
    assert back["decode_ok"].all()


def test_unusable_inputs_raise_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(DatasetUnusableError, match="does not exist"):
        scan(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetUnusableError, match="no files"):
        scan(str(tmp_path / "empty"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / ".DS_Store").write_bytes(b"x")
    with pytest.raises(DatasetUnusableError, match="1 hidden/system"):
        scan(str(tmp_path / "junk"))
    (tmp_path / "file.png").write_bytes(b"x")
    with pytest.raises(DatasetUnusableError, match="not a directory"):
        scan(str(tmp_path / "file.png"))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_special_files_are_not_read(tmp_path: Path, kit: Any) -> None:
    root = kit.write_dataset(tmp_path / "d", per_class=1)
    os.mkfifo(root / "train" / "cat" / "pipe.png")  # reading it would block forever
    df = scan(str(root)).manifest
    assert _row(df, "train/cat/pipe.png")["error"] == "not a regular file"


def test_non_rgb_modes_are_recorded_before_conversion(tmp_path: Path, kit: Any) -> None:
    root = kit.write_dataset(tmp_path / "d", per_class=1)
    kit.smooth_image(7).convert("L").save(root / "train" / "cat" / "gray.png")
    kit.smooth_image(8).convert("RGBA").save(root / "train" / "cat" / "alpha.png")
    Image.new("LA", (16, 16)).save(root / "train" / "cat" / "la.png")
    df = scan(str(root)).manifest
    assert _row(df, "train/cat/gray.png")["channels"] == 1
    assert _row(df, "train/cat/alpha.png")["mode"] == "RGBA"
    assert _row(df, "train/cat/la.png")["channels"] == 2


def test_a_decoder_failing_oddly_gives_an_error_row_and_a_decode_error(
    tmp_path: Path, kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crafted file can make a Pillow plugin raise anything; it must never stop the scan."""
    from PIL import ImageFile

    root = kit.write_dataset(tmp_path / "ds", per_class=3)
    buffer = io.BytesIO()
    kit.smooth_image(5).save(buffer, "JPEG")
    (root / "train" / "cat" / "odd.jpg").write_bytes(buffer.getvalue())
    original = ImageFile.ImageFile.load

    def load(self: Any) -> Any:
        if self.format == "JPEG":
            raise IndexError("crafted table index")
        return original(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    manifest = scan(str(root), workers=1).manifest  # in this process, where the patch is
    row = _row(manifest, "train/cat/odd.jpg")
    assert not row["decode_ok"] and "crafted table index" in row["error"]
    assert manifest["decode_ok"].sum() == len(manifest) - 1
    with pytest.raises(ImageDecodeError, match="crafted table index"):
        open_image(buffer.getvalue())


def test_pool_starts_on_the_first_folders_while_listing_goes_on(
    tmp_path: Path, kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from burstcv.data.scanner import dispatch

    root = kit.write_dataset(tmp_path / "ds", per_class=6)  # 2 splits x 3 classes x 6 files
    total = sum(1 for path in root.rglob("*") if path.is_file())
    serial = scan(str(root), workers=1)
    monkeypatch.setattr(dispatch, "POOL_MIN_FILES", 6)
    monkeypatch.setattr(dispatch, "CHUNK_FILES", 4)
    listed_at_submit: list[int] = []
    real_submit = dispatch.Dispatcher._submit

    def spy(self: Any, chunk: list[Any]) -> None:
        listed_at_submit.append(self.listed)
        real_submit(self, chunk)

    monkeypatch.setattr(dispatch.Dispatcher, "_submit", spy)
    pooled = scan(str(root))
    assert pooled.workers == (os.cpu_count() or 1) > 1
    # Chunks went out before the last folder was listed, and every file came back once.
    assert listed_at_submit and min(listed_at_submit) < total
    pd.testing.assert_frame_equal(serial.manifest, pooled.manifest)


def test_a_listing_that_fails_after_the_pool_started_leaves_no_worker(
    tmp_path: Path, kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import multiprocessing

    from burstcv.data.scanner import dispatch

    root = kit.write_dataset(tmp_path / "ds", per_class=6)
    monkeypatch.setattr(dispatch, "POOL_MIN_FILES", 6)
    monkeypatch.setattr(dispatch, "CHUNK_FILES", 4)
    real_scandir = os.scandir
    opened: list[str] = []

    def scandir(path: Any) -> Any:
        opened.append(str(path))
        if len(opened) > 4:  # the root, a split and two class folders are listed by now
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    started: list[int] = []
    real_start = dispatch.Dispatcher._start_if_it_pays

    def start(self: Any) -> None:
        real_start(self)
        started.append(self.workers)

    monkeypatch.setattr(dispatch.Dispatcher, "_start_if_it_pays", start)
    with pytest.raises(PermissionError, match="Permission denied"):
        scan(str(root), workers=2)
    assert started == [2]
    assert multiprocessing.active_children() == []


def test_rows_are_sorted_by_path_whatever_the_listing_order(tmp_path: Path, kit: Any) -> None:
    # Files are inspected folder by folder, and refused files (here one at the wrong depth)
    # become rows before any of them: the manifest is still in path order.
    root = kit.write_dataset(tmp_path / "ds", per_class=2)
    kit.write_dataset(tmp_path / "ds", classes=("cat-2",), per_class=2)
    (root / "zz-stray.png").write_bytes(b"not at <split>/<class>/<file>")
    for workers in (1, 2):
        paths = scan(str(root), workers=workers).manifest["path"].tolist()
        assert paths == sorted(paths)
        assert paths[-1] == "zz-stray.png" and any("/cat-2/" in path for path in paths)
