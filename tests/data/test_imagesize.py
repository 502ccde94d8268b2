"""The image size a run trains at: the request, or the data's median short side, bounded."""

from __future__ import annotations

import pandas as pd
import pytest

from burstcv.data.imagesize import choose_image_size


def _manifest(sizes: list[tuple[int, int]], broken: int = 0) -> pd.DataFrame:
    rows = [{"width": w, "height": h, "decode_ok": True} for w, h in sizes]
    rows += [{"width": 9000, "height": 9000, "decode_ok": False}] * broken
    return pd.DataFrame(rows)


def test_a_requested_size_is_taken_as_given() -> None:
    assert choose_image_size(_manifest([(32, 32)]), 96).px == 96


@pytest.mark.parametrize("bad", [0, 15, 641, 5000])
def test_a_requested_size_out_of_bounds_is_one_clear_error(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"^image_size {bad} is outside 16\.\.640 px$"):
        choose_image_size(_manifest([(32, 32)]), bad)


def test_the_default_is_the_median_short_side_of_usable_images() -> None:
    # Short sides 100, 120, 150 (portrait and landscape); broken files do not count.
    size = choose_image_size(_manifest([(100, 300), (400, 120), (150, 150)], broken=5), None)
    assert size.px == 120
    assert "median short side of 3 images is 120 px" in size.reason


def test_the_default_is_capped_at_224_and_never_upscales_tiny_images() -> None:
    assert choose_image_size(_manifest([(3000, 4000)] * 3), None).px == 224
    assert choose_image_size(_manifest([(32, 32)] * 3), None).px == 32
    assert choose_image_size(_manifest([(8, 8)] * 3), None).px == 16


def test_no_usable_image_is_an_error() -> None:
    with pytest.raises(ValueError, match="no usable image"):
        choose_image_size(_manifest([], broken=2), None)


def test_photos_larger_than_the_margin_get_the_resize_and_centre_crop_transform() -> None:
    photos = choose_image_size(_manifest([(640, 427)] * 3), None)
    assert (photos.px, photos.resize_short) == (224, 256)
    assert choose_image_size(_manifest([(640, 427)] * 3), 64).resize_short == 73
    # The digits (32 px at 32 px) and images just over the size keep the plain resize.
    assert choose_image_size(_manifest([(32, 32)] * 3), None).resize_short is None
    assert choose_image_size(_manifest([(250, 250)] * 3), 224).resize_short is None
