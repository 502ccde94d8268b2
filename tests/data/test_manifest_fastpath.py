"""The scanner's own shortcuts (reads, format search, hash bits) change no row, for any file.

Each test compares the scanner with the plain Pillow calls it stands for (the references
below): a plain open, read and convert/resize per file.
"""

from __future__ import annotations

import io
import operator
import os
import struct
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageFile, PngImagePlugin, UnidentifiedImageError

from burstcv.data.manifest import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_PIXELS
from burstcv.data.scanner import dhash, formats, inspection

_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# ---------------------------------------------------------------------------------------------
# Today's implementation, verbatim in behaviour: every row must match what it produces.


def _reference_read(task: Any, max_file_bytes: int, s3_client: Any) -> bytes | str:
    _, uri, size = task
    if size is not None and size > max_file_bytes:
        return f"file is {size} bytes; the limit is {max_file_bytes}"
    with open(uri, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_file_bytes:
            return f"file is {size} bytes; the limit is {max_file_bytes}"
        data = fh.read()
    if len(data) > max_file_bytes:
        return f"file is over {max_file_bytes} bytes, the limit"
    return data


def _reference_decode(data: bytes, ext: str, max_pixels: int) -> tuple[Any, ...]:
    bad = inspection.BadImage
    header: tuple[Any, ...] = (None, None, None, None, None)
    if not data:
        raise bad("empty file", header)
    fmt = "unknown"
    try:
        img = Image.open(io.BytesIO(data))
        fmt = img.format or "unknown"
        width, height = img.size
        header = (fmt, width, height, img.mode, len(img.getbands()))
        allowed = formats.EXTENSION_FORMATS.get(ext)
        if allowed is None:
            raise bad(
                f"extension {ext or '(none)'!r} is not an image extension; the content is {fmt}",
                header,
            )
        if fmt not in allowed:
            raise bad(f"extension {ext!r} lies: the content is {fmt}", header)
        if width <= 0 or height <= 0:
            raise bad(f"image declares an empty size {width}x{height}", header)
        if width * height > max_pixels:
            raise bad(
                f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}",
                header,
            )
        img.load()
    except bad:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise bad(f"decompression bomb refused: {exc}", header) from exc
    except UnidentifiedImageError as exc:
        raise bad("not an image (no known format signature)", header) from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise bad(f"corrupt or truncated {fmt} data: {exc}", header) from exc
    return (fmt, width, height, header[3], header[4], img)


def _reference_dhash(img: Image.Image) -> tuple[str, str]:
    small = img.convert("L").resize((9, 8), Image.Resampling.BILINEAR).tobytes()
    brighter = bytes(map(operator.gt, small[:-1], small[1:]))
    bits = b"".join([brighter[start : start + 8] for start in range(0, 72, 9)])
    digits = bits.translate(bytes.maketrans(b"\x00\x01", b"01"))
    return f"{int(digits, 2):016x}", small.hex()


# ---------------------------------------------------------------------------------------------
# PNG crafting


def _chunk(kind: bytes, body: bytes, crc: int | None = None) -> bytes:
    value = zlib.crc32(kind + body) if crc is None else crc
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", value & 0xFFFFFFFF)


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """Split a well-formed PNG into (type, body) pairs."""
    out = []
    pos = 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        out.append((kind, data[pos + 8 : pos + 8 + length]))
        pos += 12 + length
    return out


def _assemble(chunks: list[tuple[bytes, bytes]]) -> bytes:
    return _SIGNATURE + b"".join(_chunk(kind, body) for kind, body in chunks)


def _ihdr(width: int, height: int, depth: int = 8, color: int = 2, interlace: int = 0) -> bytes:
    return struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, interlace)


def _encode(img: Image.Image, **params: Any) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, "PNG", **params)
    return buffer.getvalue()


def _with_idat(data: bytes, idat: list[bytes]) -> bytes:
    """Return the PNG with its IDAT run replaced by chunks holding ``idat``."""
    chunks = _chunks(data)
    first = next(i for i, (kind, _) in enumerate(chunks) if kind == b"IDAT")
    rest = [chunk for chunk in chunks[first:] if chunk[0] != b"IDAT"]
    return _assemble(chunks[:first] + [(b"IDAT", body) for body in idat] + rest)


def _insert(data: bytes, before: bytes, extra: list[tuple[bytes, bytes]]) -> bytes:
    """Return the PNG with ``extra`` chunks inserted before the first chunk of type ``before``."""
    chunks = _chunks(data)
    at = next(i for i, (kind, _) in enumerate(chunks) if kind == before)
    return _assemble(chunks[:at] + extra + chunks[at:])


def _scanlines(img: Image.Image, rows: int | None = None, filter_type: int = 0) -> bytes:
    """Return ``rows`` unfiltered scanlines of an 8-bit image, each with a filter-type byte."""
    raw = img.tobytes()
    stride = len(raw) // img.height
    count = img.height if rows is None else rows
    return b"".join(
        bytes([filter_type]) + raw[(y % img.height) * stride : (y % img.height + 1) * stride]
        for y in range(count)
    )


def _adam7(img: Image.Image) -> bytes:
    """Return an interlaced (Adam7) RGB PNG of ``img``, which Pillow can read but not write."""
    raw, (width, height) = img.tobytes(), img.size
    # (first row, first column, row step, column step) of each of the seven passes
    passes = [(0, 0, 8, 8), (0, 4, 8, 8), (4, 0, 8, 4), (0, 2, 4, 4), (2, 0, 4, 2)]
    passes += [(0, 1, 2, 2), (1, 0, 2, 1)]
    lines = []
    for row0, col0, row_step, col_step in passes:
        cols = range(col0, width, col_step)
        if not cols:
            continue
        for y in range(row0, height, row_step):
            pixels = b"".join(raw[(y * width + x) * 3 : (y * width + x + 1) * 3] for x in cols)
            lines.append(b"\x00" + pixels)
    idat = zlib.compress(b"".join(lines))
    return _assemble(
        [(b"IHDR", _ihdr(width, height, interlace=1)), (b"IDAT", idat), (b"IEND", b"")]
    )


def _smooth(seed: int, size: tuple[int, int] = (32, 32), mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    return Image.fromarray(small, "RGB").resize(size, Image.Resampling.BILINEAR).convert(mode)


def _noise(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))


def _flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x5A]) + data[offset + 1 :]


def _other_format(img: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, fmt)
    return buffer.getvalue()


def _cases() -> dict[str, bytes]:
    """Return file name → bytes: plain, unusual, hostile and broken PNGs, and other formats."""
    rgb = _smooth(1)
    base = _encode(rgb)
    rgba = rgb.copy()
    rgba.putalpha(_smooth(2, mode="L"))
    text = PngImagePlugin.PngInfo()
    text.add_text("Comment", "made for a test")
    text.add_text("Author", "burstcv")
    ztxt = PngImagePlugin.PngInfo()
    ztxt.add_text("Comment", "compressed " * 20, zip=True)
    itxt = PngImagePlugin.PngInfo()
    itxt.add_itxt("Title", "titre", lang="fr", tkey="Titre")
    reserved_l = PngImagePlugin.PngInfo()
    reserved_l.add_text("transparency", "7")
    one_frame = [_smooth(3)]
    frames = io.BytesIO()
    rgb.save(frames, "PNG", save_all=True, append_images=one_frame, duration=100)
    ancillary = [
        (b"gAMA", struct.pack(">I", 45455)),
        (b"sRGB", b"\x00"),
        (b"cHRM", struct.pack(">8I", *range(31270, 31278))),
        (b"sBIT", b"\x08\x08\x08"),
        (b"tIME", struct.pack(">HBBBBB", 2024, 1, 2, 3, 4, 5)),
        (b"pHYs", struct.pack(">IIB", 2835, 2835, 1)),
    ]
    stream = _chunks(base)[1][1]
    lines = _scanlines(rgb)
    big = _noise(5, (400, 400))
    cases: dict[str, bytes] = {
        # Plain files.
        "rgb.png": base,
        "l.png": _encode(rgb.convert("L")),
        "rgba.png": _encode(rgba),
        "RGB_UPPER.PNG": base,
        "apng_ext.apng": base,
        "text.png": _encode(rgb, pnginfo=text),
        "dpi.png": _encode(rgb, dpi=(72, 72)),
        "optimize.png": _encode(rgb, optimize=True),
        "level0.png": _encode(rgb, compress_level=0),
        "level9.png": _encode(rgb, compress_level=9),
        "tiny.png": _encode(_smooth(4, (1, 1))),
        "wide.png": _encode(_smooth(5, (300, 7))),
        "thumb_sized.png": _encode(_smooth(6, (9, 8), "L")),
        "ancillary.png": _insert(base, b"IDAT", ancillary),
        "text_after_idat.png": _insert(base, b"IEND", [(b"tEXt", b"Note\x00after the data")]),
        "split_idat.png": _with_idat(base, [stream[:100], b"", stream[100:1000], stream[1000:]]),
        "big_idat.png": _with_idat(
            _encode(big, compress_level=0), [zlib.compress(_scanlines(big))]
        ),
        "reserved_text_l.png": _encode(rgb.convert("L"), pnginfo=reserved_l),
        # Files Pillow reads in its less common ways.
        "p.png": _encode(rgb.convert("P", palette=Image.Palette.ADAPTIVE)),
        "la.png": _encode(rgba.convert("LA")),
        "i16.png": _encode(Image.fromarray(np.arange(64, dtype=np.uint16).reshape(8, 8) * 999)),
        "one.png": _encode(rgb.convert("1")),
        "rgb_trns.png": _encode(rgb, transparency=(10, 20, 30)),
        "l_trns.png": _encode(rgb.convert("L"), transparency=5),
        "p_trns.png": _encode(rgb.convert("P"), transparency=3),
        "ztxt.png": _encode(rgb, pnginfo=ztxt),
        "itxt.png": _encode(rgb, pnginfo=itxt),
        "icc.png": _encode(rgb, icc_profile=b"not really a profile"),
        "exif.png": _encode(rgb, exif=b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\x00\x00"),
        "interlaced.png": _adam7(_smooth(7, (13, 11))),
        "animated.png": frames.getvalue(),
        "rgb16.png": _assemble(
            [
                (b"IHDR", _ihdr(4, 4, depth=16)),
                (b"IDAT", zlib.compress(b"\x00" + bytes(range(24)) * 4)),
                (b"IEND", b""),
            ]
        ),
        "plte_in_rgb.png": _insert(base, b"IDAT", [(b"PLTE", bytes(range(48)))]),
        "private_chunk.png": _insert(base, b"IDAT", [(b"prIv", b"private")]),
        "gama_short.png": _insert(base, b"IDAT", [(b"gAMA", b"\x00\x01")]),
        "phys_long.png": _insert(base, b"IDAT", [(b"pHYs", b"\x00" * 12)]),
        "big_text.png": _insert(base, b"IDAT", [(b"tEXt", b"Big\x00" + b"x" * 70_000)]),
        "reserved_text_exif.png": _insert(base, b"IDAT", [(b"tEXt", b"exif\x00abc")]),
        # Streams that end early, late, or carry extra bytes.
        "early_end.png": _with_idat(base, [zlib.compress(_scanlines(rgb, rows=31))]),
        "early_end_split.png": _with_idat(
            base,
            [
                zlib.compress(_scanlines(rgb, rows=31))[:-4],
                zlib.compress(_scanlines(rgb, rows=31))[-4:],
            ],
        ),
        "early_mid_row.png": _with_idat(base, [zlib.compress(lines[:-50])]),
        "more_rows.png": _with_idat(base, [zlib.compress(_scanlines(rgb, rows=40))]),
        "junk_after_stream.png": _with_idat(base, [stream + b"junk after the stream"]),
        "no_adler.png": _with_idat(base, [stream[:-4]]),
        "bad_adler.png": _with_idat(base, [stream[:-4] + b"\x00\x00\x00\x00"]),
        "bad_filter.png": _with_idat(base, [zlib.compress(_scanlines(rgb, filter_type=7))]),
        "paeth_rows.png": _with_idat(base, [zlib.compress(_scanlines(rgb, filter_type=4))]),
        # Broken files.
        "idat_byte_flipped.png": _with_idat(base, [_flip(stream, len(stream) // 2)]),
        "idat_byte_flipped_crc_kept.png": _flip(base, 33 + 8 + len(stream) // 2),
        "ihdr_crc_flipped.png": _flip(base, 29),
        "idat_crc_flipped.png": _flip(base, 33 + 8 + len(stream)),
        "iend_crc_flipped.png": _flip(base, len(base) - 1),
        "trailing_garbage.png": base + b"garbage",
        "chunk_after_iend.png": base + _chunk(b"tEXt", b"late\x00chunk"),
        "zero_idat.png": _with_idat(base, [b""]),
        "no_idat.png": _assemble([_chunks(base)[0], (b"IEND", b"")]),
        "missing_iend.png": base[:-12],
        "iend_with_body.png": base[:-12] + _chunk(b"IEND", b"x"),
        "ihdr_not_first.png": _assemble([(b"tEXt", b"a\x00b"), *_chunks(base)]),
        "ihdr_long.png": _assemble([(b"IHDR", _chunks(base)[0][1] + b"\x00"), *_chunks(base)[1:]]),
        "text_between_idat.png": _with_idat(base, [stream[:500]])[:-12]
        + _chunk(b"tEXt", b"a\x00b")
        + _chunk(b"IDAT", stream[500:])
        + _chunk(b"IEND", b""),
        "huge_length.png": base[:33] + struct.pack(">I", 0x7FFFFFFF) + base[37:],
        "bomb.png": _assemble(
            [
                (b"IHDR", _ihdr(30000, 30000)),
                (b"IDAT", zlib.compress(b"\x00" * 64)),
                (b"IEND", b""),
            ]
        ),
        "over_limit.png": _assemble(
            [
                (b"IHDR", _ihdr(5000, 5000)),
                (b"IDAT", zlib.compress(b"\x00" * 64)),
                (b"IEND", b""),
            ]
        ),
        "width0.png": _assemble(
            [(b"IHDR", _ihdr(0, 32)), (b"IDAT", zlib.compress(b"")), (b"IEND", b"")]
        ),
        "height0.png": _assemble(
            [(b"IHDR", _ihdr(32, 0)), (b"IDAT", zlib.compress(b"")), (b"IEND", b"")]
        ),
        "signature_only.png": _SIGNATURE,
        # Other formats and lying extensions.
        "photo.jpg": _other_format(rgb, "JPEG"),
        "photo.webp": _other_format(rgb, "WEBP"),
        "anim.gif": _other_format(rgb, "GIF"),
        "png_as.jpg": base,
        "jpeg_as.png": _other_format(rgb, "JPEG"),
        "png_as.txt": base,
        "notes.png": b"just some text, no image at all",
        "no_extension": base,
    }
    cuts = {"8": 8, "16": 16, "20": 20, "33": 33, "40": 40, "half": len(base) // 2}
    cuts |= {"before_iend": len(base) - 13, "in_iend_crc": len(base) - 4}
    for label, offset in cuts.items():
        cases[f"truncated_{label}.png"] = base[:offset]
    return cases


CASES = _cases()
# Plain files, which every check must pass (the cases are what they claim to be).
PLAIN = {
    "rgb.png",
    "l.png",
    "rgba.png",
    "RGB_UPPER.PNG",
    "apng_ext.apng",
    "text.png",
    "dpi.png",
    "optimize.png",
    "level0.png",
    "level9.png",
    "tiny.png",
    "wide.png",
    "thumb_sized.png",
    "ancillary.png",
    "text_after_idat.png",
    "split_idat.png",
    "big_idat.png",
    "paeth_rows.png",
}


# ---------------------------------------------------------------------------------------------
# Harness


def _rows(
    root: Path, names: list[str], max_pixels: int = DEFAULT_MAX_PIXELS
) -> dict[str, tuple[Any, ...]]:
    """Return path → row (or the exception it raised) for files under root/train/cat."""
    out: dict[str, tuple[Any, ...]] = {}
    for name in names:
        task = (f"train/cat/{name}", str(root / name), None)
        try:
            columns = inspection.inspect_chunk([task], max_pixels, DEFAULT_MAX_FILE_BYTES, True)
        except Exception as exc:
            out[name] = ("raised", type(exc).__name__, str(exc))
        else:
            out[name] = tuple(column[0] for column in columns)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Write every case into one folder and return it."""
    root = tmp_path_factory.mktemp("fastpath")
    for name, data in CASES.items():
        (root / name).write_bytes(data)
    return root


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("max_pixels", [DEFAULT_MAX_PIXELS, 1000])
def test_every_row_matches_todays_implementation(
    files: Path, monkeypatch: pytest.MonkeyPatch, max_pixels: int
) -> None:
    names = sorted(CASES)
    with monkeypatch.context() as patch:
        patch.setattr(inspection, "decode", _reference_decode)
        patch.setattr(dhash, "difference_hash", _reference_dhash)
        patch.setattr(inspection, "read_task", _reference_read)
        expected = _rows(files, names, max_pixels)
    rows = _rows(files, names, max_pixels)
    for name in names:
        assert rows[name] == expected[name], name
    # The cases are what they claim to be: broken files fail, plain ones decode.
    assert not expected["truncated_40.png"][14] and not expected["bad_filter.png"][14]
    if max_pixels == DEFAULT_MAX_PIXELS:
        assert all(expected[name][14] for name in PLAIN)


@pytest.mark.parametrize(
    ("setting", "value"),
    [("MAX_IMAGE_PIXELS", 500), ("MAX_IMAGE_PIXELS", 2000), ("LOAD_TRUNCATED_IMAGES", True)],
)
def test_rows_match_under_other_pillow_settings(
    files: Path, monkeypatch: pytest.MonkeyPatch, setting: str, value: Any
) -> None:
    # A lower bomb limit (a warning, an error here, then a hard error at twice the limit) and
    # lenient truncated-image loading change Pillow's verdicts: the scanner must follow.
    owner = Image if setting == "MAX_IMAGE_PIXELS" else ImageFile
    monkeypatch.setattr(owner, setting, value)
    names = sorted(PLAIN | {"truncated_half.png", "early_end_split.png", "missing_iend.png"})
    with monkeypatch.context() as patch:
        patch.setattr(inspection, "decode", _reference_decode)
        patch.setattr(dhash, "difference_hash", _reference_dhash)
        patch.setattr(inspection, "read_task", _reference_read)
        expected = _rows(files, names)
    assert _rows(files, names) == expected
    if setting == "MAX_IMAGE_PIXELS":
        assert "decompression bomb" in expected["rgb.png" if value < 1024 else "wide.png"][15]


def test_a_text_chunk_named_transparency_is_hashed_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pillow copies the tEXt value into info["transparency"], where convert("L") chokes on it;
    # the pixels are fine, so the file decodes and is hashed without that entry.
    info = PngImagePlugin.PngInfo()
    info.add_text("transparency", "x")
    image = _smooth(9)
    (tmp_path / "odd.png").write_bytes(_encode(image, pnginfo=info))
    (tmp_path / "plain.png").write_bytes(_encode(image))
    rows = _rows(tmp_path, ["odd.png", "plain.png"])
    odd, plain = rows["odd.png"], rows["plain.png"]
    assert odd[14] is True and odd[15] is None  # decode_ok, no error
    assert odd[12:14] == plain[12:14]  # same difference hash and thumbnail as the plain copy


@pytest.mark.parametrize(
    "mode", ["L", "RGB", "RGBA", "RGBX", "P", "LA", "I;16", "I", "F", "CMYK", "1", "YCbCr"]
)
@pytest.mark.parametrize("size", [(32, 32), (9, 8), (1, 1), (300, 7), (8, 9)])
def test_dhash_is_todays_for_every_mode(mode: str, size: tuple[int, int]) -> None:
    for img in (_noise(11, size).convert(mode), _smooth(12, size).convert(mode)):
        assert dhash.difference_hash(img) == _reference_dhash(img)
    rgba = _noise(13, size).convert("RGBA")
    rgba.putalpha(_noise(14, size).convert("L"))
    assert dhash.difference_hash(rgba) == _reference_dhash(rgba)


def test_hash_bits_are_todays_for_every_neighbour_pattern() -> None:
    rng = np.random.default_rng(15)
    thumbs = [bytes(72), b"\xff" * 72, bytes(range(72)), bytes(range(255, 183, -1))]
    thumbs += [bytes([0, 255] * 36), bytes([255, 0] * 36), bytes([127, 128] * 36)]
    thumbs += [bytes([128, 127] * 36), bytes([128, 0, 255, 127] * 18)]
    thumbs += [rng.integers(0, 256, 72, dtype=np.uint8).tobytes() for _ in range(500)]
    thumbs += [rng.integers(120, 136, 72, dtype=np.uint8).tobytes() for _ in range(500)]
    for small in thumbs:
        img = Image.frombytes("L", (9, 8), small)
        assert dhash.difference_hash(img) == _reference_dhash(img)


def test_open_formats_find_the_format_the_full_search_finds(files: Path) -> None:
    for name, data in CASES.items():
        ext = os.path.splitext(name)[1].lower()
        allowed = formats.EXTENSION_FORMATS.get(ext)
        if allowed is None:
            continue
        planned = formats.open_formats(allowed, data[:16])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected: Any = Image.open(io.BytesIO(data)).format
        except Exception as exc:
            expected = type(exc)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got: Any = formats.open_image(data, planned).format
        except Exception as exc:
            got = type(exc)
        assert got == expected, name


class _ShortReads:
    """Stand in for the os module, returning at most a few bytes per read."""

    def __init__(self, limit: int, shrink: int = 0) -> None:
        self.limit, self.shrink = limit, shrink

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def read(self, fd: int, n: int) -> bytes:
        return os.read(fd, min(n, self.limit))

    def fstat(self, fd: int) -> os.stat_result:
        real = os.fstat(fd)
        values = list(real)
        values[6] = max(0, real.st_size - self.shrink)  # st_size: as if the file grew since
        return os.stat_result(values)


@pytest.mark.parametrize(("limit", "shrink"), [(7, 0), (1, 0), (1 << 30, 10), (5, 1000)])
def test_local_reads_return_the_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int, shrink: int
) -> None:
    path = tmp_path / "f.png"
    path.write_bytes(CASES["rgb.png"])
    task = ("train/cat/f.png", str(path), None)
    limit_below = len(CASES["rgb.png"]) - 1
    expected = _reference_read(task, limit_below, None)
    monkeypatch.setattr(inspection, "os", _ShortReads(limit, shrink))
    assert inspection.read_task(task, DEFAULT_MAX_FILE_BYTES, None) == path.read_bytes()
    if shrink:  # fstat said the file fits; it did not, once read
        expected = f"file is over {limit_below} bytes, the limit"
    assert inspection.read_task(task, limit_below, None) == expected


def _open_and_close(path: str) -> None:
    with open(path, "rb"):
        pass


def test_local_read_errors_read_as_before(tmp_path: Path) -> None:
    def message(call: Callable[[], object]) -> str:
        with pytest.raises(OSError) as info:
            call()
        return str(info.value)

    for path in (str(tmp_path), str(tmp_path / "missing.png")):
        assert message(lambda: inspection.read_local(path, 10)) == message(  # noqa: B023
            lambda: _open_and_close(path)  # noqa: B023
        )
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    assert inspection.read_local(str(empty), 10) == b""
    big = tmp_path / "big.png"
    big.write_bytes(b"x" * 11)
    assert inspection.read_local(str(big), 10) == "file is 11 bytes; the limit is 10"
