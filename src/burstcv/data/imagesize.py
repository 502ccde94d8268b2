"""Choose the resolution a run trains and serves at, from its request and the validated data.

A run may name an ``image_size``; left empty, it is taken from the data: the median short
side of the usable images, at most ``DEFAULT_MAX_IMAGE_SIZE`` (the size ImageNet-pretrained
networks are made for, and where CPU serving cost is still modest), and never more than the
images hold (upscaling adds pixels, not signal). Either way it is bounded by what the run
parameters accept.

The size also decides the eval transform. Images at least as large as the margin square
(``resize_short_for(px)``, 256 for 224) are photos: their short side is resized, keeping the
aspect, and the centre is cropped (training draws random crops from the margin). Smaller
ones (the digits) are resized straight to the size, as they always were.
"""

from __future__ import annotations

import pandas as pd

from burstcv.data.config import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE
from burstcv_spec.contracts import ImageSizeChoice
from burstcv_spec.preprocess import resize_short_for

DEFAULT_MAX_IMAGE_SIZE = 224


def choose_image_size(manifest: pd.DataFrame, requested: int | None) -> ImageSizeChoice:
    """Return the square training/serving size for a validated manifest.

    Raises ValueError when the request is out of bounds or no image is usable.
    """
    if requested is not None and not MIN_IMAGE_SIZE <= requested <= MAX_IMAGE_SIZE:
        raise ValueError(f"image_size {requested} is outside {MIN_IMAGE_SIZE}..{MAX_IMAGE_SIZE} px")
    usable = manifest[manifest["decode_ok"].astype(bool)]
    if usable.empty:
        raise ValueError("no usable image to choose an image size from")
    short = usable[["width", "height"]].min(axis=1)
    median = int(short.median())
    if requested is not None:
        return _with_transform(ImageSizeChoice(px=requested, reason="the run's image_size"), median)
    px = max(MIN_IMAGE_SIZE, min(DEFAULT_MAX_IMAGE_SIZE, median))
    why = (
        f"the median short side of {len(usable)} images is {median} px"
        + (f", capped at {DEFAULT_MAX_IMAGE_SIZE}" if median > DEFAULT_MAX_IMAGE_SIZE else "")
        + (f", raised to the {MIN_IMAGE_SIZE} px minimum" if median < MIN_IMAGE_SIZE else "")
    )
    return _with_transform(ImageSizeChoice(px=px, reason=why), median)


def _with_transform(size: ImageSizeChoice, median_short: int) -> ImageSizeChoice:
    margin = resize_short_for(size.px)
    if median_short < margin:
        return size
    return size.model_copy(
        update={
            "reason": f"{size.reason}; photos: short side to {margin}, centre crop",
            "resize_short": margin,
        }
    )
