"""Decode plain 8-bit PNGs with Pillow's own zlib decoder, without Image.open.

Most datasets are small 8-bit PNGs, and Image.open + load spends more time in Python (plugin
search, chunk handlers, file-object reads) than in decoding. This path checks the whole chunk
stream itself and runs Pillow's own zip decoder exactly as ImageFile.load does, so the pixels
are Pillow's. It only ever answers "ok" (a file Pillow decodes the same way); anything unusual
or broken returns None and goes through Pillow, which gives the verdict and the message.

It uses Pillow internals (``Image._getdecoder``, the decoder object's ``setimage``/``decode``,
``ImageFile.MAXBLOCK``): ``probe`` checks them against Pillow's public decode once per
process (see ``capabilities``), and pyproject.toml pins the Pillow versions it is tested with.
"""

from __future__ import annotations

import io
import logging
import struct
import zlib
from typing import Any

from PIL import Image, ImageFile

from burstcv.data.scanner.strips import Strips

logger = logging.getLogger(__name__)

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_CHUNK_HEAD = struct.Struct(">I4s")
_PNG_IHDR = struct.Struct(">IIBBBBB")
_PNG_CRC = struct.Struct(">I")
# Colour type at bit depth 8 → (mode, rawmode, channels), as PngImagePlugin._MODES has them.
_PNG_COLOR_TYPES = {0: ("L", "L", 1), 2: ("RGB", "RGB", 3), 6: ("RGBA", "RGBA", 4)}
# Ancillary chunks that change no pixel, with the body lengths the PNG spec gives them (Pillow
# raises on a short gAMA, cHRM, sRGB or pHYs).
_PNG_ANCILLARY = {
    b"gAMA": (4, 4),
    b"sRGB": (1, 1),
    b"pHYs": (9, 9),
    b"cHRM": (32, 32),
    b"sBIT": (1, 4),
    b"tIME": (7, 7),
}
_PNG_TEXT_LIMIT = 64 * 1024  # all tEXt bodies together
# tEXt keywords that Pillow copies into Image.info under a name its own code reads
# ("transparency" changes convert()): such files take the normal path.
_PNG_TEXT_RESERVED = frozenset({b"transparency", b"exif", b"icc_profile"})


def decode_png(
    data: bytes, max_pixels: int, strips: Strips | None = None
) -> tuple[str, int, int, str, int, Image.Image | None] | None:
    """Decode a plain 8-bit L/RGB/RGBA PNG as Pillow would, or return None to ask Pillow.

    Accepted: IHDR first (8-bit grey, RGB or RGBA; not interlaced; a size within both
    ``max_pixels`` and Pillow's bomb limit), one run of IDAT chunks, IEND last with nothing
    after it, every CRC right, and only gAMA/sRGB/pHYs/cHRM/sBIT/tIME/tEXt besides. The IDAT
    data goes to the zip decoder in the pieces ImageFile.load feeds it (one call per IDAT chunk
    and MAXBLOCK), and only the decoder's own "finished, no error" counts. A small image goes
    into a slot of ``strips`` when given (the returned image is then None).
    """
    end = len(data)
    if end < 57 or not data.startswith(_PNG_SIGNATURE) or ImageFile.LOAD_TRUNCATED_IMAGES:
        return None  # 57 bytes: signature, IHDR, one IDAT and IEND, each with no spare byte
    length, kind = _PNG_CHUNK_HEAD.unpack_from(data, 8)
    if length != 13 or kind != b"IHDR":
        return None
    width, height, depth, color, compression, filtering, interlace = _PNG_IHDR.unpack_from(data, 16)
    spec = _PNG_COLOR_TYPES.get(color)
    if spec is None or depth != 8 or compression or filtering or interlace:
        return None
    pixels = width * height
    bomb = Image.MAX_IMAGE_PIXELS
    if not 0 < pixels <= max_pixels or (bomb is not None and pixels > bomb):
        return None
    view = memoryview(data)
    idat: list[memoryview] = []
    text = 0
    stage = 0  # 0: before the IDAT run, 1: in it, 2: after it
    pos = 8
    while True:
        if pos + 12 > end:
            return None
        length, kind = _PNG_CHUNK_HEAD.unpack_from(data, pos)
        body = pos + 8
        stop = body + length
        if (
            stop + 4 > end
            or zlib.crc32(view[pos + 4 : stop]) != _PNG_CRC.unpack_from(data, stop)[0]
        ):
            return None
        pos = stop + 4
        if kind == b"IDAT":
            if stage == 2:
                return None
            stage = 1
            if length:
                idat.append(view[body:stop])
            continue
        if stage == 1:
            stage = 2
        if kind == b"IEND":
            if stage != 2 or length or pos != end:
                return None
            break
        if kind == b"tEXt":
            text += length
            nul = data.find(b"\0", body, stop)
            if (
                text > _PNG_TEXT_LIMIT
                or data[body : stop if nul < 0 else nul] in _PNG_TEXT_RESERVED
            ):
                return None
        elif kind == b"IHDR":
            if body != 16:
                return None
        else:
            bounds = _PNG_ANCILLARY.get(kind)
            if bounds is None or not bounds[0] <= length <= bounds[1]:
                return None
    if not idat:
        return None
    mode, rawmode, channels = spec
    slot = strips.slot(mode, width, height) if strips is not None else None
    img: Image.Image | None = None
    if slot is None:
        img = Image.new(mode, (width, height), None)  # core.new, as ImageFile.load_prepare does
        core, top = img.im, 0
    else:
        core, top = slot
    decoder = Image._getdecoder(mode, "zip", rawmode)
    try:
        if decoder.pulls_fd:
            return None
        decoder.setimage(core, (0, top, width, top + height))
        if not feed_decoder(decoder, idat):
            return None
    finally:
        decoder.cleanup()
    return "PNG", width, height, mode, channels, img


def feed_decoder(decoder: Any, chunks: list[memoryview]) -> bool:
    """Feed IDAT bodies as ImageFile.load does; return True when the decoder finished cleanly."""
    block = ImageFile.MAXBLOCK
    pending = b""
    for chunk in chunks:
        step = block if block > 0 else len(chunk)
        for start in range(0, len(chunk), step):
            piece = chunk[start : start + step]
            buffer = pending + piece if pending else piece
            consumed, status = decoder.decode(buffer)
            if consumed < 0:
                return bool(status >= 0)  # what ImageFile.load raises on is status < 0
            pending = bytes(buffer[consumed:])
    return False  # out of data before the last row: Pillow says "image file is truncated"


# What probe needs from Pillow before it tries a decode: owner, attribute.
_INTERNALS = (
    (Image, "_getdecoder"),
    (Image, "new"),
    (Image.core, "zip_decoder"),
    (ImageFile, "MAXBLOCK"),
    (ImageFile, "LOAD_TRUNCATED_IMAGES"),
)


def probe() -> bool:
    """Return True when decode_png gives Pillow's own pixels for sample L, RGB and RGBA PNGs.

    Any missing internal, exception or differing byte means this Pillow is not one the fast
    path knows; the caller then keeps every file on the public Image.open path.
    """
    missing = [name for owner, name in _INTERNALS if not hasattr(owner, name)]
    if missing:
        logger.debug("PNG fast path: this Pillow lacks %s", ", ".join(missing))
        return False
    try:
        gradient = Image.linear_gradient("L").resize((37, 23))
        rgb = Image.merge("RGB", (gradient, gradient.rotate(180), gradient.rotate(90)))
        rgba = rgb.copy()
        rgba.putalpha(gradient.transpose(Image.Transpose.FLIP_LEFT_RIGHT))
        for img in (gradient, rgb, rgba):
            buffer = io.BytesIO()
            img.save(buffer, "PNG")
            data = buffer.getvalue()
            decoded = decode_png(data, img.width * img.height)
            with Image.open(io.BytesIO(data)) as reference:
                reference.load()
                if (
                    decoded is None
                    or decoded[:5] != ("PNG", *reference.size, reference.mode, len(img.getbands()))
                    or decoded[5] is None
                    or decoded[5].tobytes() != reference.tobytes()
                ):
                    return False
        return True
    except Exception:  # any failure of the internals means "not usable"; the caller warns
        logger.debug("PNG fast path: Pillow's decoder internals differ", exc_info=True)
        return False
