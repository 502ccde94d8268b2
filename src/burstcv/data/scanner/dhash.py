"""Compute an image's 64-bit difference hash and the 9x8 grayscale thumbnail it comes from.

Bit = is a pixel brighter than its right neighbour. The hash finds candidate pairs fast; the
thumbnail (72 bytes) then tells a re-encoded or retouched copy (a few grey levels apart) from
a different image that merely has the same coarse shape, such as two handwritten zeros.
"""

from __future__ import annotations

from PIL import Image

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


def difference_hash(img: Image.Image) -> tuple[str, str]:
    """Return a 64-bit difference hash (16 hex digits) and the 9x8 thumbnail's bytes as hex."""
    small = img.convert("L").resize(THUMB_SIZE, Image.Resampling.BILINEAR).tobytes()
    return f"{brighter_bits(small):016x}", small.hex()


def hash_decoded(img: Image.Image) -> tuple[str, str]:
    """Return difference_hash of a decoded image, even when a text chunk planted a bogus
    ``transparency`` entry that convert("L") fails on (grey levels never depend on it)."""
    try:
        return difference_hash(img)
    except Exception:
        if "transparency" not in img.info:
            raise
        img.info.pop("transparency")
        return difference_hash(img)


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
