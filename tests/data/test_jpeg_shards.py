"""JPEG training shards: a tenth of the bytes at photo sizes, decoded on the box to the pixels.

Pack stores the training shards of photo-sized images as JPEG files (quality 90) and keeps the
validation shards raw; the box's reader decodes them to the uint8 arrays training takes. The
figures behind the choice are bench/shards.py's.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from burstcv_testkit import make_job, write_photo_dataset

from burstcv.data.pack import JPEG_MIN_SIDE, choose_format, pack_dataset
from burstcv.training.job import write_job
from burstcv.training.stream import JobSpecError, load_shard, read_shard_info, sample_split
from burstcv.training.train import run_job
from burstcv_spec.preprocess import PreprocessSpec

PHOTO_SIZE = PreprocessSpec(height=144, width=144, resize_short=160)


def _pack(tmp_path: Path, shard_format: str) -> dict[str, object]:
    rows = write_photo_dataset(tmp_path / "photos", count=48)
    packed = pack_dataset(
        pd.DataFrame(rows),
        str(tmp_path / shard_format),
        PHOTO_SIZE,
        margin=True,
        shard_format=shard_format,  # type: ignore[arg-type]
    )
    return {**packed.model_dump(), "spec": PHOTO_SIZE}


def test_auto_picks_jpeg_for_photo_sizes_and_raw_for_small_images() -> None:
    assert choose_format("auto", PreprocessSpec(height=224, width=224)) == "jpeg"
    assert (
        choose_format("auto", PreprocessSpec(height=JPEG_MIN_SIDE, width=JPEG_MIN_SIDE)) == "jpeg"
    )
    assert choose_format("auto", PreprocessSpec(height=32, width=32)) == "raw"
    assert choose_format("raw", PreprocessSpec(height=224, width=224)) == "raw"
    assert choose_format("jpeg", PreprocessSpec(height=32, width=32)) == "jpeg"
    with pytest.raises(ValueError, match="not auto, raw or jpeg"):
        choose_format("png", PreprocessSpec())


def test_jpeg_training_shards_are_smaller_and_decode_to_nearly_the_raw_pixels(
    tmp_path: Path,
) -> None:
    raw, jpeg = _pack(tmp_path, "raw"), _pack(tmp_path, "jpeg")
    assert raw["shard_format"] == "raw" and jpeg["shard_format"] == "jpeg"
    assert raw["counts"] == jpeg["counts"] == {"train": 36, "val": 12}
    assert raw["preprocess"] == jpeg["preprocess"]  # the statistics of the decoded pixels
    (raw_train,), (jpeg_train,) = raw["train_shards"], jpeg["train_shards"]  # type: ignore[misc]
    assert Path(jpeg_train).stat().st_size * 3 < Path(raw_train).stat().st_size
    classes = list(raw["classes"])  # type: ignore[call-overload]
    exact, exact_labels = load_shard(raw_train, classes)
    decoded, labels = load_shard(jpeg_train, classes)
    assert decoded.shape == exact.shape == (36, 160, 160, 3) and decoded.dtype == np.uint8
    assert np.array_equal(labels, exact_labels)
    error = decoded.astype(np.float64) - exact.astype(np.float64)
    psnr = 10 * np.log10(255**2 / float(np.mean(error**2)))
    assert psnr > 30, psnr
    info = read_shard_info(jpeg_train, classes)
    assert (info.count, info.height, info.width) == (36, 160, 160)
    # Validation shards stay raw: the gate's accuracy is measured on exact pixels.
    for mine, theirs in zip(jpeg["val_shards"], raw["val_shards"], strict=True):  # type: ignore[call-overload]
        assert Path(mine).read_bytes() == Path(theirs).read_bytes()
    sample, _ = sample_split([jpeg_train], classes, 8)
    assert sample.shape == (8, 160, 160, 3)


def test_a_corrupt_jpeg_in_a_shard_names_the_shard_and_the_image(tmp_path: Path) -> None:
    jpeg = _pack(tmp_path, "jpeg")
    (shard,) = jpeg["train_shards"]  # type: ignore[misc]
    with np.load(shard) as npz:
        arrays = {name: npz[name] for name in npz.files}
    start, stop = int(arrays["offsets"][3]), int(arrays["offsets"][4])
    arrays["jpeg"][start:stop] = 0  # image 3's bytes wiped
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    Path(shard).write_bytes(buffer.getvalue())
    assert zipfile.is_zipfile(shard)
    with pytest.raises(JobSpecError, match=r"image 3 is not a decodable JPEG"):
        load_shard(shard, list(jpeg["classes"]))  # type: ignore[call-overload]


def test_training_runs_on_jpeg_shards(tmp_path: Path) -> None:
    jpeg = _pack(tmp_path, "jpeg")
    out = tmp_path / "out"
    job = make_job(jpeg, out, epochs=1, batch_size=16)
    assert run_job(write_job(job, str(tmp_path / "job.json"))) == 0
    assert (out / "attempts" / "1" / "DONE").exists()
