"""The photo dataset made from shipped photos passes validation, odd files and all."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from burstcv.data.config import ValidationConfig
from burstcv.data.photos import EXIF_ORIENTATION, PHOTO_CLASSES, ROTATED_90_CW, write_photo_dataset
from burstcv.data.validate import summary, validate_dataset


def test_photos_are_varied_jpegs_with_the_files_photo_folders_hold(tmp_path: Path) -> None:
    written = write_photo_dataset(tmp_path / "photos", per_class=(6, 5))
    assert written.counts == {"train": 6 * len(PHOTO_CLASSES), "val": 5 * len(PHOTO_CLASSES)}
    files = sorted((tmp_path / "photos").rglob("*.*"))
    assert len({f.read_bytes() for f in files}) == len(files)
    for path in files:
        with Image.open(path) as img:
            assert 200 <= min(img.size) <= 800, path
    for path in written.exif_rotated:
        with Image.open(path) as img:
            assert img.getexif()[EXIF_ORIENTATION] == ROTATED_90_CW
    for path in written.cmyk:
        with Image.open(path) as img:
            assert img.mode == "CMYK"
    for path in written.sixteen_bit:
        with Image.open(path) as img:
            assert img.mode == "I;16"

    report = validate_dataset(str(tmp_path / "photos"), str(tmp_path / "out"), ValidationConfig())
    assert report.success, summary(report)
