"""Write a small dataset of real photos, as a user's product-photo folder would look.

Three classes of random crops of scikit-learn's two sample photographs, resized, mirrored and
colour-shifted so no two files are the same image, with what photo folders hold and the digits
do not: EXIF-rotated JPEGs, CMYK JPEGs and 16-bit greyscale PNGs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

PHOTO_CLASSES = ("china_upper", "china_lower", "flower")
# Crop regions (left, top, right, bottom) as fractions of each source photo.
_REGIONS = {
    "china_upper": ("china.jpg", (0.0, 0.0, 1.0, 0.5)),
    "china_lower": ("china.jpg", (0.0, 0.5, 1.0, 1.0)),
    "flower": ("flower.jpg", (0.15, 0.1, 0.85, 0.9)),
}
EXIF_ORIENTATION = 0x0112
ROTATED_90_CW = 6  # EXIF: the stored pixels must be turned 90 degrees clockwise to be upright


@dataclass(frozen=True)
class PhotoSet:
    """Say what was written: counts per split, and the special files by kind."""

    counts: dict[str, int]
    exif_rotated: list[Path]
    cmyk: list[Path]
    sixteen_bit: list[Path]


def _sources() -> dict[str, Image.Image]:
    from sklearn.datasets import load_sample_images

    data = load_sample_images()
    return {
        Path(name).name: Image.fromarray(np.asarray(img))
        for name, img in zip(data.filenames, data.images, strict=True)
    }


def _crop(src: Image.Image, region: tuple[float, ...], rng: np.random.Generator) -> Image.Image:
    w, h = src.size
    left, top, right, bottom = region[0] * w, region[1] * h, region[2] * w, region[3] * h
    side = rng.uniform(0.45, 0.95) * min(right - left, bottom - top)
    aspect = rng.uniform(0.75, 1.33)
    cw, ch = min(side * aspect, right - left), min(side / aspect, bottom - top)
    x = rng.uniform(left, max(left, right - cw))
    y = rng.uniform(top, max(top, bottom - ch))
    return src.crop((round(x), round(y), round(x + cw), round(y + ch)))


def _photo(src: Image.Image, region: tuple[float, ...], rng: np.random.Generator) -> Image.Image:
    img = _crop(src, region, rng)
    short = int(rng.integers(200, 801))
    scale = short / min(img.size)
    img = img.resize(
        (max(1, round(img.width * scale)), max(1, round(img.height * scale))),
        Image.Resampling.BICUBIC,
    )
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    img = ImageEnhance.Brightness(img).enhance(rng.uniform(0.75, 1.25))
    img = ImageEnhance.Color(img).enhance(rng.uniform(0.7, 1.3))
    return img


def write_photo_dataset(
    root: str | Path, *, per_class: tuple[int, int] = (24, 8), seed: int = 0
) -> PhotoSet:
    """Write ``root/{train,val}/<class>/<n>.jpg|png`` (``per_class``: train and val images per
    class; the first three EXIF-rotated, CMYK and 16-bit) and return what was written."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    sources = _sources()
    written = PhotoSet(counts={}, exif_rotated=[], cmyk=[], sixteen_bit=[])
    for split, n in zip(("train", "val"), per_class, strict=True):
        written.counts[split] = 0
        for label in PHOTO_CLASSES:
            folder = root / split / label
            folder.mkdir(parents=True, exist_ok=True)
            source, region = _REGIONS[label]
            for i in range(n):
                img = _photo(sources[source], region, rng)
                quality = int(rng.integers(85, 96))
                path = folder / f"{i:04d}.{'png' if i == 2 else 'jpg'}"
                if i == 0:
                    exif = Image.Exif()
                    exif[EXIF_ORIENTATION] = ROTATED_90_CW
                    # Stored turned 90 degrees counter-clockwise: the tag turns it back.
                    img.transpose(Image.Transpose.ROTATE_90).save(
                        path, quality=quality, exif=exif.tobytes()
                    )
                    written.exif_rotated.append(path)
                elif i == 1:
                    img.convert("CMYK").save(path, quality=quality)
                    written.cmyk.append(path)
                elif i == 2:
                    grey16 = np.asarray(img.convert("L"), dtype=np.uint16) * 257
                    Image.fromarray(grey16).save(path)  # uint16: mode I;16
                    written.sixteen_bit.append(path)
                else:
                    img.save(path, quality=quality)
                written.counts[split] += 1
    return written
