"""Hash many small images at once: decoded one under the other into a strip per (mode, size).

The PNG fast path decodes small images into slots of one tall image per (mode, size), a
strip, and each strip is hashed in a handful of whole-strip calls instead of a dozen calls
per image (on 32x32 images the hash cost as much as the decode). Every value is the one
``dhash.difference_hash`` gives for the image alone; ``probe`` checks that on sample images.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from PIL import Image

from burstcv.data.scanner import dhash
from burstcv.data.scanner.dhash import THUMB_SIZE

logger = logging.getLogger(__name__)

MAX_PIXELS = 64 * 64  # larger images are hashed one by one: their decode dominates
SLOTS = 64  # images per strip (1 MiB for 64x64 RGBA)
_STRIPS_OPEN = 4  # distinct (mode, size) strips a chunk holds at once; the oldest is hashed

# Which pass Pillow's resize runs first for a size: "rows", "columns", or None (neither
# reproduces its bytes). Capabilities.pass_order answers it, probing each size once.
PassOrder = Callable[[int, int], str | None]


class Strip:
    """One tall image whose slots hold same-sized images, one under the other."""

    def __init__(self, mode: str, width: int, height: int, slots: int) -> None:
        self.mode, self.width, self.height, self.slots = mode, width, height, slots
        self.core = Image.new(mode, (width, height * slots), None).im
        self.rows: list[int] = []  # chunk row of each filled slot, top to bottom

    def free_top(self) -> int:
        """Return the top pixel row of the first free slot."""
        return len(self.rows) * self.height


class Strips:
    """Give the fast path slots to decode into, and hash each full strip in one go.

    ``slot`` offers the next free slot of the image's strip (None for a large image, which
    gets an image of its own); ``keep`` fills it with the chunk row just decoded there (a
    failed decode leaves it free for the next image). Without hashing, one slot per strip is
    reused as scratch space. ``finish`` returns row -> (phash, thumb), or the error message
    for a row whose thumbnail failed.
    """

    def __init__(self, hashing: bool, core_thumbnails: bool, pass_order: PassOrder) -> None:
        self.hashing = hashing
        self.core_thumbnails = core_thumbnails
        self.pass_order = pass_order
        self._strips: dict[tuple[str, int, int], Strip] = {}
        self._last: Strip | None = None
        self._hashes: dict[int, tuple[str, str] | str] = {}

    def slot(self, mode: str, width: int, height: int) -> tuple[Any, int] | None:
        """Return (core image, top row) of the slot to decode into, or None for no slot."""
        if width * height > MAX_PIXELS or (self.hashing and not self.pass_order(width, height)):
            return None
        key = (mode, width, height)
        strip = self._strips.get(key)
        if strip is None:
            if len(self._strips) >= _STRIPS_OPEN:
                self._flush(self._strips.pop(next(iter(self._strips))))
            slots = SLOTS if self.hashing else 1
            strip = self._strips[key] = Strip(mode, width, height, slots)
        self._last = strip
        top = strip.free_top()
        if self.hashing:
            # Blank, as a new image is: a stream that ends early is a clean finish for Pillow,
            # and the rows it never wrote must not keep an earlier image's pixels.
            strip.core.paste(0, (0, top, width, top + height))
        return strip.core, top

    def keep(self, row: int) -> None:
        """Fill the slot last offered with chunk row ``row``; hash the strip once it is full."""
        strip = self._last
        assert strip is not None and self.hashing
        strip.rows.append(row)
        if len(strip.rows) == strip.slots:
            self._flush(strip)

    def finish(self) -> dict[int, tuple[str, str] | str]:
        """Hash what every strip still holds and return all hashes by chunk row."""
        for strip in self._strips.values():
            self._flush(strip)
        self._strips.clear()
        return self._hashes

    def _flush(self, strip: Strip) -> None:
        if not strip.rows:
            return
        try:
            order = self.pass_order(strip.width, strip.height)
            hashes: list[tuple[str, str] | str] = list(strip_hashes(strip, len(strip.rows), order))
        except Exception:  # never lose the scan: hash each slot the usual way
            logger.debug("strip hashing failed; hashing one by one", exc_info=True)
            hashes = [
                slot_hash(strip, slot, self.core_thumbnails) for slot in range(len(strip.rows))
            ]
        self._hashes.update(zip(strip.rows, hashes, strict=True))
        strip.rows = []


def core_bytes(core: Any) -> bytes:
    """Return a core image's pixel bytes (what Image.tobytes gives for its Image)."""
    return Image.Image()._new(core).tobytes()


def strip_hashes(strip: Strip, count: int, order: str | None) -> list[tuple[str, str]]:
    """Return the difference hashes of the first ``count`` slots, computed for the whole strip.

    Pillow's bilinear resize is separable: one pass over rows, one over columns, rounding to
    8 bits in between, in an order it picks from the sizes (``order``, from probe_pass_order).
    Stacked, each row of the strip is a row of one image; side by side, each column is a
    column of one image: both passes run once for the whole strip. Same calls, same rounding,
    same bytes.
    """
    import numpy as np

    if order is None:
        raise ValueError(f"no strip pass order reproduces Pillow for {strip.width}x{strip.height}")
    width, height = strip.width, strip.height
    core = strip.core if count == strip.slots else strip.core.crop((0, 0, width, height * count))
    if strip.mode != "L":
        core = core.convert("L", Image.Dither.FLOYDSTEINBERG)
    pixels = np.frombuffer(core_bytes(core), np.uint8)
    images = pixels.reshape(count, height, width)
    first, second = (_row_pass, _column_pass) if order == "rows" else (_column_pass, _row_pass)
    thumbs = second(first(images))
    brighter = thumbs[:, :, :-1] > thumbs[:, :, 1:]  # (count, 8, 8): brighter than the right
    hashes = np.packbits(brighter.reshape(count, 64), axis=1).view(">u8").ravel().tolist()
    digits = np.ascontiguousarray(thumbs).tobytes().hex()
    step = 2 * THUMB_SIZE[0] * THUMB_SIZE[1]
    return [(f"{value:016x}", digits[i * step : (i + 1) * step]) for i, value in enumerate(hashes)]


def _row_pass(images: Any) -> Any:
    """Resize (count, height, width) grey images to the thumbnail width, rows only."""
    import numpy as np

    count, height, width = images.shape
    target = THUMB_SIZE[0]
    if width == target:  # Pillow's own test: no row pass
        return images
    tall = count * height
    stacked = Image.frombytes("L", (width, tall), images.tobytes()).im
    resized = stacked.resize((target, tall), Image.Resampling.BILINEAR, (0, 0, width, tall))
    data = np.frombuffer(core_bytes(resized), np.uint8)
    return data.reshape(count, height, target)


def _column_pass(images: Any) -> Any:
    """Resize (count, height, width) grey images to the thumbnail height, columns only."""
    import numpy as np

    count, height, width = images.shape
    target = THUMB_SIZE[1]
    if height == target:
        return images
    wide = count * width
    side = np.ascontiguousarray(images.transpose(1, 0, 2)).reshape(height, wide)
    core = Image.frombytes("L", (wide, height), side.tobytes()).im
    resized = core.resize((wide, target), Image.Resampling.BILINEAR, (0, 0, wide, height))
    data = np.frombuffer(core_bytes(resized), np.uint8)
    return data.reshape(target, count, width).transpose(1, 0, 2)


def probe_pass_order(width: int, height: int) -> str | None:
    """Return which pass Pillow runs first resizing this size to the thumbnail, or None.

    Pillow picks the order from the sizes alone; two noise images tell which order gives its
    bytes ("rows" when either does, as when one pass is a no-op). None: neither does, and
    images of this size are hashed one by one.
    """
    import numpy as np

    rng = np.random.default_rng(width * 65536 + height)
    orders = {"rows", "columns"}
    for _ in range(2):
        images = rng.integers(0, 256, (1, height, width), dtype=np.uint8)
        grey = Image.frombytes("L", (width, height), images.tobytes()).im
        resized = grey.resize(THUMB_SIZE, Image.Resampling.BILINEAR, (0, 0, width, height))
        expected = core_bytes(resized)
        if _column_pass(_row_pass(images)).tobytes() != expected:
            orders.discard("rows")
        if _row_pass(_column_pass(images)).tobytes() != expected:
            orders.discard("columns")
    return "rows" if "rows" in orders else next(iter(orders), None)


def slot_hash(strip: Strip, slot: int, core_thumbnails: bool) -> tuple[str, str] | str:
    """Return one slot's difference hash, or the error message its row gets if that fails."""
    top = slot * strip.height
    try:
        img = Image.Image()._new(strip.core.crop((0, top, strip.width, top + strip.height)))
        return dhash.difference_hash(img, core_thumbnails)
    except Exception as exc:
        return f"decoded, but its grayscale thumbnail failed: {exc}"


def probe(core_thumbnails: bool, pass_order: PassOrder) -> bool:
    """Return True when strip hashing gives difference_hash's values on sample images."""
    try:
        gradient = Image.linear_gradient("L")
        samples = []
        for size in ((32, 32), (9, 8), (1, 1), (64, 64), (37, 23), (8, 9), (9, 30)):
            grey = gradient.resize(size).rotate(17)
            rgb = Image.merge("RGB", (grey, grey.transpose(Image.Transpose.FLIP_LEFT_RIGHT), grey))
            samples += [grey, rgb, rgb.convert("RGBA")]
        strips = Strips(hashing=True, core_thumbnails=core_thumbnails, pass_order=pass_order)
        for row, img in enumerate(samples):
            slot = strips.slot(img.mode, *img.size)
            assert slot is not None
            core, top = slot
            core.paste(img.im, (0, top, img.width, top + img.height))
            strips.keep(row)
        hashes = strips.finish()
        return all(
            hashes[row] == dhash.difference_hash(img, core_thumbnails)
            for row, img in enumerate(samples)
        )
    except Exception:  # any failure of the core API means "not usable"; the caller warns
        logger.debug("strip hashing: Pillow's core image API differs", exc_info=True)
        return False
