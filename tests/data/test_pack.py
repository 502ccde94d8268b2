"""The pack stage: images decoded once into uint8 shards that match the serving decoder."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from burstcv.data.pack import class_list, pack_dataset
from burstcv_spec.preprocess import PreprocessSpec, decode_to_uint8


def test_shards_hold_every_image_decoded_like_serving(
    packed_demo: dict[str, Any], demo_dataset: Path
) -> None:
    assert packed_demo["classes"] == [str(d) for d in range(10)]
    assert packed_demo["counts"] == {"train": 1437, "val": 360}
    with np.load(packed_demo["val_shards"][0], allow_pickle=False) as npz:
        images, labels, classes = npz["images"], npz["labels"], list(npz["classes"])
    assert images.dtype == np.uint8 and images.shape == (360, 32, 32, 3)
    assert classes == packed_demo["classes"]
    # Rows are sorted by (split, label, path): the first val image is the first file of class 0.
    first = sorted((demo_dataset / "val" / "0").glob("*.png"))[0]
    expected = decode_to_uint8(first.read_bytes(), packed_demo["spec"])
    assert np.array_equal(images[0], expected)
    assert labels[0] == 0


def test_class_order_is_natural() -> None:
    assert class_list(["10", "2", "1"]) == ["1", "2", "10"]
    assert class_list(["dog", "cat"]) == ["cat", "dog"]


def test_labels_outside_the_expected_classes_are_refused(
    demo_dataset: Path, tmp_path: Path
) -> None:
    rows = [
        {"path": "x", "uri": str(p), "split": "train", "label": p.parts[-2], "decode_ok": True}
        for p in sorted((demo_dataset / "train").rglob("*.png"))[:5]
    ]
    with pytest.raises(ValueError, match="not among the classes"):
        pack_dataset(pd.DataFrame(rows), str(tmp_path), PreprocessSpec(), classes=["cat", "dog"])


def test_undecodable_rows_are_left_out(demo_dataset: Path, tmp_path: Path) -> None:
    files = sorted((demo_dataset / "train" / "1").glob("*.png"))[:3]
    rows = [
        {"path": p.name, "uri": str(p), "split": "train", "label": "1", "decode_ok": i != 1}
        for i, p in enumerate(files)
    ]
    rows.append(
        {"path": "v.png", "uri": str(files[0]), "split": "val", "label": "1", "decode_ok": True}
    )
    result = pack_dataset(pd.DataFrame(rows), str(tmp_path), PreprocessSpec())
    assert result.counts == {"train": 2, "val": 1}
    with np.load(io.BytesIO(Path(result.train_shards[0]).read_bytes())) as npz:
        assert npz["images"].shape[0] == 2


def test_channel_statistics_come_from_every_train_shard_and_no_val_image(
    demo_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from burstcv.data import pack

    monkeypatch.setattr(pack, "SHARD_IMAGES", 4)  # several train shards
    rows = [
        {"path": p.name, "uri": str(p), "split": split, "label": p.parent.name, "decode_ok": True}
        for split in ("train", "val")
        for p in sorted((demo_dataset / split).rglob("*.png"))[:10]
    ]
    result = pack_dataset(pd.DataFrame(rows), str(tmp_path), PreprocessSpec())
    assert len(result.train_shards) == 3
    images = []
    for uri in result.train_shards:
        with np.load(io.BytesIO(Path(uri).read_bytes())) as npz:
            images.append(npz["images"])
    pixels = np.concatenate(images).reshape(-1, 3).astype(np.float64) / 255.0

    np.testing.assert_allclose(result.preprocess.mean, pixels.mean(axis=0), rtol=1e-9)
    np.testing.assert_allclose(result.preprocess.std, pixels.std(axis=0), rtol=1e-9)
