"""Probe once per process, on first use, which Pillow internals the scanner's fast paths may use.

Each fast path (the PNG decode, core thumbnails, strip hashing) gives the same bytes as the
public Pillow calls it stands for, but leans on internals that a Pillow release may change.
``capabilities()`` checks each against the public path on sample images the first time a
scan needs it and keeps the answers in one object; a path whose check fails stays off for
the process, with one warning, and every file takes the public path instead.
"""

from __future__ import annotations

import functools
import logging

from burstcv.data.scanner import dhash, pngfast, strips

logger = logging.getLogger(__name__)


class Capabilities:
    """Hold what this process's Pillow allows: one probe per fast path, one per strip size."""

    def __init__(self) -> None:
        self.png_fast_path = pngfast.probe()
        if not self.png_fast_path:
            logger.warning(
                "PNG fast path off: this Pillow's decoder internals do not match its public "
                "decode; every PNG goes through Image.open (same rows, slower scan)"
            )
        self.core_thumbnails = dhash.probe_core_thumbnails()
        if not self.core_thumbnails:
            logger.warning("core thumbnails off: Pillow's core image API differs")
        self._pass_orders: dict[tuple[int, int], str | None] = {}
        # Strips only ever receive images that the PNG fast path decoded.
        self.strip_hashing = self.png_fast_path and strips.probe(
            self.core_thumbnails, self.pass_order
        )
        if self.png_fast_path and not self.strip_hashing:
            logger.warning("strip hashing off: Pillow's core image API differs")

    def pass_order(self, width: int, height: int) -> str | None:
        """Return which pass Pillow's resize runs first for this size (probed once per size)."""
        key = (width, height)
        if key not in self._pass_orders:
            self._pass_orders[key] = strips.probe_pass_order(width, height)
        return self._pass_orders[key]

    def turn_off_png_fast_path(self, reason: BaseException) -> None:
        """Stop using the PNG fast path in this process after it met an internal it lacks."""
        if self.png_fast_path:
            self.png_fast_path = False
            logger.warning(
                "PNG fast path off: Pillow's decoder internals changed (%r); every PNG goes "
                "through Image.open from now on",
                reason,
            )


@functools.cache
def capabilities() -> Capabilities:
    """Return this process's Capabilities, probing on the first call."""
    return Capabilities()
