"""On-device training transforms: random-resized crops of the pack margin, shifts for digits."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from burstcv.training.job import AugmentSpec
from burstcv.training.train import JobSpecError, augment, eval_images
from burstcv.training.transforms import (
    center_crop,
    random_resized_crop,
    rrc_boxes,
    shift,
    train_transform,
)
from burstcv_spec.preprocess import PreprocessSpec, decode_to_uint8


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _stored(n: int = 8, side: int = 37, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, side, side), generator=_gen(seed), dtype=torch.uint8)


def test_random_resized_crops_have_the_input_size_and_stay_in_range() -> None:
    out = random_resized_crop(_stored(), (32, 32), (0.35, 1.0), (3 / 4, 4 / 3), _gen())
    assert out.shape == (8, 3, 32, 32) and out.dtype == torch.float32
    assert out.min() >= 0 and out.max() <= 255


def test_random_resized_crops_repeat_for_the_same_generator_and_differ_otherwise() -> None:
    batch = _stored()
    first = random_resized_crop(batch, (32, 32), (0.35, 1.0), (3 / 4, 4 / 3), _gen(1))
    again = random_resized_crop(batch, (32, 32), (0.35, 1.0), (3 / 4, 4 / 3), _gen(1))
    other = random_resized_crop(batch, (32, 32), (0.35, 1.0), (3 / 4, 4 / 3), _gen(2))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_a_box_of_the_whole_image_is_the_image_itself() -> None:
    batch = _stored(side=32)
    out = random_resized_crop(batch, (32, 32), (1.0, 1.0), (1.0, 1.0), _gen())
    assert torch.equal(out, batch.float())


def test_a_half_size_box_is_averaged_not_aliased() -> None:
    # Alternate columns of 0 and 255: a point-sampled downscale would give all 0 or all 255.
    stripes = torch.zeros(1, 3, 32, 32, dtype=torch.uint8)
    stripes[..., 1::2] = 255
    out = random_resized_crop(stripes, (16, 16), (1.0, 1.0), (1.0, 1.0), _gen())
    assert torch.allclose(out, torch.full_like(out, 127.5))


def test_boxes_lie_inside_the_image_with_the_asked_area_and_aspect() -> None:
    boxes = rrc_boxes(2000, 64, 64, (0.35, 1.0), (3 / 4, 4 / 3), _gen())
    x0, y0, x1, y1 = boxes.unbind(1)
    width, height = x1 - x0, y1 - y0
    assert (x0 >= 0).all() and (y0 >= 0).all() and (x1 <= 64).all() and (y1 <= 64).all()
    assert (boxes == boxes.round()).all()  # whole pixels
    area = width * height / 64**2
    assert area.min() >= 0.33 and area.max() <= 1.0
    aspect = width / height
    assert aspect.min() >= 3 / 4 - 0.05 and aspect.max() <= 4 / 3 + 0.05
    assert area.std() > 0.1 and len(set(x0.tolist())) > 10  # spread, not stuck on one box


def test_an_image_too_narrow_for_any_box_falls_back_to_its_centre() -> None:
    # 1 px wide: no candidate fits, so the box is the whole width at the widest allowed aspect.
    boxes = rrc_boxes(4, 40, 1, (0.9, 1.0), (3 / 4, 4 / 3), _gen())
    assert boxes.tolist() == [[0.0, 19.0, 1.0, 20.0]] * 4


def test_digits_keep_the_shift_of_today_bit_for_bit() -> None:
    batch = _stored(side=32)
    out = train_transform(batch, AugmentSpec(), (32, 32), _gen(5))
    assert out.dtype == torch.uint8  # shift mode, no flip: as before photos existed
    assert torch.equal(out, shift(batch, 2, _gen(5)))


def test_auto_mode_takes_random_resized_crops_and_flips_from_a_margin() -> None:
    batch = _stored(side=37)
    out = train_transform(batch, AugmentSpec(), (32, 32), _gen(3))
    expected = random_resized_crop(batch, (32, 32), (0.35, 1.0), (3 / 4, 4 / 3), _gen(3))
    assert out.shape == (8, 3, 32, 32) and out.dtype == torch.float32
    mirrored = [
        torch.equal(o, e.flip(2)) and not torch.equal(o, e)
        for o, e in zip(out, expected, strict=True)
    ]
    kept = [torch.equal(o, e) for o, e in zip(out, expected, strict=True)]
    assert all(m or k for m, k in zip(mirrored, kept, strict=True)) and any(mirrored) and any(kept)


def test_shift_mode_on_a_margin_shifts_the_centre_crop() -> None:
    batch = _stored(side=37)
    aug = AugmentSpec(mode="shift", crop_padding_px=0)
    assert torch.equal(train_transform(batch, aug, (32, 32), _gen()), center_crop(batch, 32, 32))


def test_old_job_json_augment_blocks_stay_valid() -> None:
    old = AugmentSpec.model_validate({"crop_padding_px": 2, "hflip": False})
    assert old.mode == "auto" and old.hflip is False
    with pytest.raises(ValidationError, match="rrc_scale must be"):
        AugmentSpec(rrc_scale=(0.5, 1.5))
    with pytest.raises(ValidationError, match="rrc_ratio must be"):
        AugmentSpec(rrc_ratio=(2.0, 1.0))
    with pytest.raises(ValidationError):
        AugmentSpec(mode="mixup")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# A photo run end to end: margin shards, random-resized crops, centre-crop evaluation


def test_a_photo_run_trains_on_margin_shards_and_evaluates_their_centre(
    trained_photos: dict[str, Any],
) -> None:
    metrics, packed = trained_photos["metrics"], trained_photos["packed"]
    with np.load(io.BytesIO(Path(packed.train_shards[0]).read_bytes())) as shard:
        assert shard["images"].shape[1:3] == (37, 37)  # the resize_short square: the margin
    assert metrics["train_images"] == 72 and metrics["val_images"] == 24
    assert len(metrics["epochs"]) == 3
    assert metrics["val_accuracy"] >= 0.9  # warm vs cool survives any crop and flip
    assert (trained_photos["out"] / "attempts" / "1" / "DONE").exists()


def test_training_sees_random_crops_and_evaluation_sees_what_serving_sees(
    trained_photos: dict[str, Any],
) -> None:
    job, packed = trained_photos["job"], trained_photos["packed"]
    with np.load(packed.val_shards[0], allow_pickle=False) as npz:
        stored = npz["images"]
    spec = PreprocessSpec.from_dict(job.preprocess)
    val_rows = sorted(
        (r for r in trained_photos["rows"] if r["split"] == "val"),
        key=lambda r: (r["label"], r["path"]),
    )
    served = np.stack([decode_to_uint8(Path(r["uri"]).read_bytes(), spec) for r in val_rows])
    assert np.array_equal(eval_images(stored, job), served)

    batch = torch.from_numpy(stored).permute(0, 3, 1, 2)
    x = augment(batch, job, _gen())
    assert x.shape == (len(stored), 3, 32, 32)
    assert not torch.equal(x, torch.from_numpy(served).permute(0, 3, 1, 2).float())


def test_shards_of_another_size_are_refused_naming_both(trained_photos: dict[str, Any]) -> None:
    job = trained_photos["job"]
    with pytest.raises(JobSpecError, match=r"images are 30x30; .* needs 32x32 or 37x37"):
        eval_images(np.zeros((2, 30, 30, 3), np.uint8), job)
