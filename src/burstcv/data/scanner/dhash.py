"""Compute an image's 64-bit difference hash and the 9x8 grayscale thumbnail it comes from.

Bit = is a pixel brighter than its right neighbour. The hash finds candidate pairs fast; the
thumbnail (72 bytes) then tells a re-encoded or retouched copy (a few grey levels apart) from
a different image that merely has the same coarse shape, such as two handwritten zeros.
"""

from __future__ import annotations

import logging

from PIL import Image

logger = logging.getLogger(__name__)

THUMB_SIZE = (9, 8)
# The comparisons run on all 72 thumbnail bytes at once as 8-bit lanes of one integer.
_LANES_ALL = (1 << 576) - 1
_LANES_HIGH = int.from_bytes(b"\x80" * 72, "big")
_LANES_LOW = _LANES_HIGH ^ _LANES_ALL
# Lane i compares byte i with byte i + 1; the last lane of each 9-pixel row wraps to the next
# row: those get 0x01 (deleted before the digits are read), the others keep their 0x80 bit.
_LANES_WRAP = int.from_bytes(bytes(1 if i % 9 == 8 else 0 for i in range(72)), "big")
_LANES_KEEP = int.from_bytes(bytes(0 if i % 9 == 8 else 0x80 for i in range(72)), "big")
_LANES_AS_DIGITS = bytes.maketrans(b"\x00\x80", b"01")


def difference_hash(img: Image.Image, core_thumbnails: bool = False) -> tuple[str, str]:
    """Return a 64-bit difference hash (16 hex digits) and the 9x8 thumbnail's bytes as hex.

    ``core_thumbnails`` (when the probe in ``capabilities`` allowed it) takes the thumbnail of
    L/RGB/RGBA images through Pillow's core calls: the same bytes for a third of the cost.
    """
    mode = img.mode
    if core_thumbnails and (
        mode == "L" or (mode in ("RGB", "RGBA") and "transparency" not in img.info)
    ):
        small = core_thumbnail(img)
    else:
        small = img.convert("L").resize(THUMB_SIZE, Image.Resampling.BILINEAR).tobytes()
    return f"{brighter_bits(small):016x}", small.hex()


def hash_decoded(img: Image.Image, core_thumbnails: bool = False) -> tuple[str, str]:
    """Return difference_hash of a decoded image, even when its metadata breaks convert().

    A text chunk may plant a bogus ``transparency`` entry in ``img.info``; convert("L")
    then fails while converting that colour, although the pixels are fine (and the grey
    levels never depend on it). The hash is then taken without the entry.
    """
    try:
        return difference_hash(img, core_thumbnails)
    except Exception:
        if "transparency" not in img.info:
            raise
        img.info.pop("transparency")
        return difference_hash(img, core_thumbnails)


def core_thumbnail(img: Image.Image) -> bytes:
    """Return ``img.convert("L").resize((9, 8), BILINEAR).tobytes()`` for L/RGB/RGBA images.

    The same core calls those methods make for these modes (convert("L") of an L image is a
    copy; of RGB/RGBA without "transparency" it is core convert with Floyd-Steinberg, which
    only matters for "1"/"P"), without the Image objects in between: a third of the cost.
    """
    core = img.im
    if img.mode != "L":
        core = core.convert("L", Image.Dither.FLOYDSTEINBERG)
    if core.size != THUMB_SIZE:
        core = core.resize(THUMB_SIZE, Image.Resampling.BILINEAR, (0, 0, *core.size))
    return bytes(core)


def brighter_bits(small: bytes) -> int:
    """Return the 64 bits "pixel > right neighbour" of a 9x8 thumbnail, row by row, MSB first."""
    left = int.from_bytes(small, "big")
    right = (left << 8) & _LANES_ALL  # lane i now holds byte i + 1
    # Per-lane unsigned left > right without borrows between lanes: compare the high bits,
    # and the low 7 bits (0x80 | right_low) - left_low, whose 0x80 bit says right_low >= left_low.
    right_low_ge = ((right & _LANES_LOW) | _LANES_HIGH) - (left & _LANES_LOW)
    greater = (left & ~right) | (~(left ^ right) & ~right_low_ge)
    lanes = (greater & _LANES_KEEP) | _LANES_WRAP
    return int(lanes.to_bytes(72, "big").translate(_LANES_AS_DIGITS, b"\x01"), 2)


def probe_core_thumbnails() -> bool:
    """Return True when core_thumbnail gives Pillow's thumbnail bytes on sample images."""
    try:
        gradient = Image.linear_gradient("L").resize((37, 23))
        samples = [
            Image.merge(
                "RGB",
                (
                    gradient,
                    gradient.rotate(90),
                    gradient.transpose(Image.Transpose.FLIP_LEFT_RIGHT),
                ),
            ),
            gradient,
            Image.new("RGBA", (1, 1), (10, 200, 30, 7)),
            gradient.crop((0, 0, 9, 8)),
        ]
        return all(
            core_thumbnail(img)
            == img.convert("L").resize(THUMB_SIZE, Image.Resampling.BILINEAR).tobytes()
            for img in samples
        )
    except Exception:  # any failure of the core API means "not usable"; the caller warns
        logger.debug("core thumbnails: Pillow's core image API differs", exc_info=True)
        return False
