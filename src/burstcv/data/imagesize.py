"""Choose the resolution a run trains and serves at, from its request and the validated data.

Unless the run names an ``image_size``: the median short side of the usable images (upscaling
adds pixels, not signal), at most ``DEFAULT_MAX_IMAGE_SIZE`` (what ImageNet-pretrained networks
are made for, and cheap enough to serve on CPU). Images at least as large as the margin square
are photos: short side resized, centre cropped.
"""

from __future__ import annotations

import pandas as pd

from burstcv.data.config import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE
from burstcv_spec.contracts import ImageSizeChoice
from burstcv_spec.preprocess import resize_short_for

DEFAULT_MAX_IMAGE_SIZE = 224


def choose_image_size(manifest: pd.DataFrame, requested: int | None) -> ImageSizeChoice:
    """Return the square training/serving size for a validated manifest (ValueError: the
    request is out of bounds, or no image is usable)."""
    if requested is not None and not MIN_IMAGE_SIZE <= requested <= MAX_IMAGE_SIZE:
        raise ValueError(f"image_size {requested} is outside {MIN_IMAGE_SIZE}..{MAX_IMAGE_SIZE} px")
    usable = manifest[manifest["decode_ok"].astype(bool)]
    if usable.empty:
        raise ValueError("no usable image to choose an image size from")
    short = usable[["width", "height"]].min(axis=1)
    median = int(short.median())
    if requested is not None:
        px, why = requested, "the run's image_size"
    else:
        px = max(MIN_IMAGE_SIZE, min(DEFAULT_MAX_IMAGE_SIZE, median))
        why = (
            f"the median short side of {len(usable)} images is {median} px"
            + (f", capped at {DEFAULT_MAX_IMAGE_SIZE}" if median > DEFAULT_MAX_IMAGE_SIZE else "")
            + (f", raised to the {MIN_IMAGE_SIZE} px minimum" if median < MIN_IMAGE_SIZE else "")
        )
    margin = resize_short_for(px)
    if median < margin:
        return ImageSizeChoice(px=px, reason=why)
    why += f"; photos: short side to {margin}, centre crop"
    return ImageSizeChoice(px=px, reason=why, resize_short=margin)
