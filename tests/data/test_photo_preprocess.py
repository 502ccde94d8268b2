"""Photos: EXIF orientation, every colour mode, resize-short + centre crop, and the pack margin."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from torchvision.transforms import v2

from burstcv.data.pack import pack_dataset
from burstcv_spec.preprocess import (
    ImageTooLargeError,
    PreprocessSpec,
    decode_to_uint8,
    eval_view,
    load_for,
    load_image,
    margin_spec,
    open_image,
    probe_image,
    resize_short_for,
    to_uint8,
)

ORIENTATION = 0x0112
ROTATE_RIGHT = 6  # the EXIF value of a phone photo taken in portrait: display rotated 90° CW


def _scene(width: int, height: int, seed: int = 0) -> Image.Image:
    """Return a smooth RGB picture with no symmetry (JPEG keeps it close to the original)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rng = np.random.default_rng(seed)
    phase = rng.uniform(0, 6.28, 3)
    channels = [
        127 + 120 * np.sin(x / (7 + 5 * c) + y / (11 + 3 * c) + phase[c]) * (x / width)
        for c in range(3)
    ]
    return Image.fromarray(np.stack(channels, axis=-1).clip(0, 255).astype(np.uint8))


def _encode(img: Image.Image, fmt: str, **options: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **options)
    return buf.getvalue()


def _stored_sideways(upright: Image.Image, fmt: str, **options: object) -> bytes:
    """Encode ``upright`` as a camera does: pixels stored landscape, an EXIF tag to turn them."""
    exif = Image.Exif()
    exif[ORIENTATION] = ROTATE_RIGHT
    sideways = upright.transpose(Image.Transpose.ROTATE_90)  # tag 6 turns it back upright
    return _encode(sideways, fmt, exif=exif, **options)


def _png_rgb16(pixels: np.ndarray) -> bytes:
    """Encode uint16 HxWx3 pixels as a 16-bit RGB PNG (Pillow cannot write one)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    height, width, _ = pixels.shape
    header = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)  # 16 bits, truecolour
    rows = b"".join(b"\x00" + row.astype(">u2").tobytes() for row in pixels)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


PHOTO = PreprocessSpec(height=56, width=56, resize_short=64)


# --------------------------------------------------------------------------------------------
# The spec


def test_a_plain_spec_writes_the_model_json_it_always_wrote() -> None:
    assert PreprocessSpec().to_dict() == {
        "height": 32,
        "width": 32,
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
        "interpolation": "bilinear",
        "color_mode": "RGB",
        "layout": "NCHW",
        "scale": 1.0 / 255.0,
        "formats": ["PNG", "JPEG", "WEBP"],
    }


def test_resize_short_round_trips_through_model_json() -> None:
    spec = PreprocessSpec(height=224, width=192, resize_short=256, mean=(0.1, 0.2, 0.3))
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["resize_short"] == 256
    assert PreprocessSpec.from_dict(data) == spec
    assert PreprocessSpec.from_dict({"height": 32, "width": 32}).resize_short is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (200, "resize_short 200 is smaller than the 224x224 crop"),
        (0, "resize_short must be positive"),
        ("256", "resize_short must be a whole number"),
        (True, "resize_short must be a whole number"),
        (256.5, "resize_short must be a whole number"),
    ],
)
def test_an_unusable_resize_short_is_refused(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PreprocessSpec.from_dict({"height": 224, "width": 224, "resize_short": value})


def test_resize_short_is_chosen_as_torchvision_does() -> None:
    assert resize_short_for(224) == 256
    assert resize_short_for(32) == 37
    assert resize_short_for(160, crop_fraction=1.0) == 160


@pytest.mark.parametrize("size", [(300, 200), (200, 300), (97, 201), (64, 64), (40, 30)])
def test_eval_transform_is_torchvision_resize_then_center_crop(size: tuple[int, int]) -> None:
    img = _scene(*size)
    ours = decode_to_uint8(_encode(img, "PNG"), PHOTO)
    assert ours.shape == (56, 56, 3) and ours.dtype == np.uint8
    # torchvision's ImageNet eval transform on the same picture. It rounds an odd crop offset
    # differently, so the comparison lets the crop move by one pixel; and Pillow resamples
    # only the box under the crop here, which may round a value one level apart.
    resized = np.asarray(v2.Resize(64)(img))
    best = min(
        np.abs(resized[top : top + 56, left : left + 56].astype(int) - ours).max()
        for top in range((resized.shape[0] - 56) // 2, (resized.shape[0] - 56 + 1) // 2 + 1)
        for left in range((resized.shape[1] - 56) // 2, (resized.shape[1] - 56 + 1) // 2 + 1)
    )
    assert best <= 1


def test_a_one_pixel_strip_is_resized_only_where_it_is_cropped() -> None:
    strip = Image.new("RGB", (4096, 1), (10, 200, 30))
    decoded = decode_to_uint8(_encode(strip, "PNG"), PreprocessSpec(224, 224, resize_short=256))
    assert decoded.shape == (224, 224, 3) and (decoded == (10, 200, 30)).all()


def test_a_plain_spec_still_resizes_straight_to_its_size() -> None:
    img = _scene(300, 200)
    expected = np.asarray(img.resize((32, 32), Image.Resampling.BILINEAR))
    assert np.array_equal(decode_to_uint8(_encode(img, "PNG"), PreprocessSpec()), expected)


# --------------------------------------------------------------------------------------------
# Decoding: orientation and colour modes


@pytest.mark.parametrize("spec", [PreprocessSpec(), PHOTO], ids=["plain", "photo"])
def test_exif_orientation_is_applied(spec: PreprocessSpec) -> None:
    upright = _scene(60, 90)
    tagged = _stored_sideways(upright, "PNG")
    assert Image.open(io.BytesIO(tagged)).size == (90, 60)  # stored landscape
    assert open_image(tagged).size == (60, 90)
    assert np.array_equal(
        decode_to_uint8(tagged, spec), decode_to_uint8(_encode(upright, "PNG"), spec)
    )


def test_a_16_bit_greyscale_png_keeps_its_high_byte() -> None:
    levels = np.arange(0, 256, dtype=np.uint16).reshape(16, 16)
    img = Image.fromarray(levels * 256 + 255)  # 16-bit values, low bytes not zero
    data = _encode(img, "PNG")
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    decoded = decode_to_uint8(data, PreprocessSpec(height=16, width=16))
    assert np.array_equal(decoded, np.repeat(levels.astype(np.uint8)[..., None], 3, axis=-1))


def test_a_16_bit_rgb_png_keeps_its_high_bytes() -> None:
    rng = np.random.default_rng(1)
    wide = rng.integers(0, 65536, (8, 8, 3), dtype=np.uint16)
    decoded = decode_to_uint8(_png_rgb16(wide), PreprocessSpec(height=8, width=8))
    assert np.array_equal(decoded, (wide >> 8).astype(np.uint8))


def test_a_cmyk_jpeg_decodes_to_its_rgb_colours() -> None:
    img = Image.new("CMYK", (64, 64))
    inks = {
        (0, 0): (255, 0, 0, 0),  # cyan
        (32, 0): (0, 255, 0, 0),  # magenta
        (0, 32): (0, 0, 255, 0),  # yellow
        (32, 32): (0, 0, 0, 255),  # black
    }
    for (x, y), ink in inks.items():
        img.paste(ink, (x, y, x + 32, y + 32))
    data = _encode(img, "JPEG", quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    decoded = decode_to_uint8(data, PreprocessSpec(height=64, width=64)).astype(int)
    expected = {(0, 0): (0, 255, 255), (32, 0): (255, 0, 255), (0, 32): (255, 255, 0)}
    expected[(32, 32)] = (0, 0, 0)
    for (x, y), rgb in expected.items():
        assert np.abs(decoded[y + 16, x + 16] - np.array(rgb)).max() <= 6, (x, y)


def test_palette_la_and_rgba_images_drop_alpha_and_keep_their_colours() -> None:
    palette = Image.new("P", (8, 8), 1)
    palette.putpalette([0, 0, 0, 200, 10, 30] + [0] * 762)
    grey_alpha = Image.new("LA", (8, 8), (100, 7))
    rgba = Image.new("RGBA", (8, 8), (10, 20, 30, 0))
    spec = PreprocessSpec(height=8, width=8)
    for img, options, rgb in (
        (palette, {"transparency": 1}, (200, 10, 30)),
        (grey_alpha, {}, (100, 100, 100)),
        (rgba, {}, (10, 20, 30)),
    ):
        data = _encode(img, "PNG", **options)
        assert Image.open(io.BytesIO(data)).mode == img.mode
        decoded = decode_to_uint8(data, spec)
        assert (decoded == np.array(rgb, dtype=np.uint8)).all(), img.mode


def test_a_camera_multi_picture_jpeg_decodes_its_first_picture() -> None:
    first, second = Image.new("RGB", (32, 32), (200, 0, 0)), Image.new("RGB", (32, 32), (0, 200, 0))
    data = _encode(first, "MPO", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(data)).format == "MPO"
    decoded = decode_to_uint8(data, PreprocessSpec()).astype(int)
    assert np.abs(decoded - np.array([200, 0, 0])).max() <= 4


def test_the_pixel_limit_still_holds_for_photos() -> None:
    data = _stored_sideways(_scene(60, 90), "JPEG")
    with pytest.raises(ImageTooLargeError, match="90x60 = 5400 pixels; the limit is 5000"):
        decode_to_uint8(data, PHOTO, max_pixels=5000)


# --------------------------------------------------------------------------------------------
# Pack with the margin


def _manifest(tmp_path: Path, files: dict[str, bytes]) -> pd.DataFrame:
    rows = []
    for i, (name, data) in enumerate(files.items()):
        path = tmp_path / "data" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        split = "val" if i % 3 == 2 else "train"
        rows.append(
            {
                "path": name,
                "uri": str(path),
                "split": split,
                "label": f"c{i % 2}",
                "decode_ok": True,
            }
        )
    return pd.DataFrame(rows)


def _stored(uris: list[str]) -> np.ndarray:
    parts = []
    for uri in uris:
        with np.load(io.BytesIO(Path(uri).read_bytes()), allow_pickle=False) as npz:
            parts.append(npz["images"])
    return np.concatenate(parts)


@pytest.mark.parametrize(
    "spec",
    [
        PreprocessSpec(height=56, width=56, resize_short=64),
        PreprocessSpec(height=56, width=56, resize_short=65),  # odd margins
        PreprocessSpec(height=48, width=60, resize_short=resize_short_for(60)),  # not square
    ],
    ids=["even", "odd", "rectangular"],
)
def test_the_centre_of_a_margin_shard_is_the_eval_transform(
    tmp_path: Path, spec: PreprocessSpec
) -> None:
    files = {
        "landscape.jpg": _encode(_scene(301, 200, 1), "JPEG", quality=90),
        "portrait.jpg": _encode(_scene(120, 331, 2), "JPEG", quality=90),
        "exif-rotated.jpg": _stored_sideways(_scene(150, 233, 3), "JPEG", quality=90),
        "square.png": _encode(_scene(80, 80, 4), "PNG"),
        "small.webp": _encode(_scene(40, 27, 5), "WEBP", quality=90),  # upscaled
        "cmyk.jpg": _encode(_scene(90, 70, 6).convert("CMYK"), "JPEG"),
    }
    manifest = _manifest(tmp_path, files)
    result = pack_dataset(manifest, str(tmp_path / "shards"), spec, margin=True, workers=2)

    side = spec.resize_short
    assert _stored(result.train_shards).shape[1:3] == (side, side)
    # Shards hold rows sorted by (split, label, path), as pack_dataset reads them.
    rows = manifest.sort_values(["split", "label", "path"])
    for split, uris in (("train", result.train_shards), ("val", result.val_shards)):
        stored = _stored(uris)
        assert stored.shape[1:] == (side, side, 3) and stored.dtype == np.uint8
        names = rows[rows["split"] == split]["path"].tolist()
        for image, name in zip(eval_view(stored, spec), names, strict=True):
            assert np.array_equal(image, decode_to_uint8(files[name], spec)), name
            assert np.array_equal(
                image,
                decode_to_uint8(files[name], margin_spec(spec))[
                    (side - spec.height) // 2 : (side - spec.height) // 2 + spec.height,
                    (side - spec.width) // 2 : (side - spec.width) // 2 + spec.width,
                ],
            ), name


def test_pack_without_the_margin_stores_the_eval_images(tmp_path: Path) -> None:
    files = {
        "a.jpg": _stored_sideways(_scene(150, 233), "JPEG"),
        "b.png": _encode(_scene(9, 9), "PNG"),
    }
    result = pack_dataset(_manifest(tmp_path, files), str(tmp_path / "shards"), PHOTO)
    stored = _stored(result.train_shards)
    assert stored.shape[1:3] == (56, 56)
    assert np.array_equal(stored[0], decode_to_uint8(files["a.jpg"], PHOTO))
    assert eval_view(stored, PHOTO) is stored


def test_a_margin_needs_resize_short(tmp_path: Path) -> None:
    manifest = _manifest(tmp_path, {"a.png": _encode(_scene(9, 9), "PNG")})
    with pytest.raises(ValueError, match="a margin needs resize_short"):
        pack_dataset(manifest, str(tmp_path / "shards"), PreprocessSpec(), margin=True)


def test_eval_view_names_the_sizes_it_accepts() -> None:
    with pytest.raises(ValueError, match=r"images are 40x40; .* needs 56x56 or 64x64"):
        eval_view(np.zeros((1, 40, 40, 3), np.uint8), PHOTO)


def test_large_images_make_smaller_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from burstcv.data import pack

    monkeypatch.setattr(pack, "SHARD_BYTES", 3 * 64 * 64 * 3)  # three 64x64 images a shard
    files = {f"{i}.png": _encode(_scene(70, 64, i), "PNG") for i in range(8)}
    manifest = _manifest(tmp_path, files)
    result = pack_dataset(manifest, str(tmp_path / "shards"), PHOTO, margin=True)
    assert [len(_stored([u])) for u in result.train_shards] == [3, 3]  # 6 train images


def test_real_photos_pack_with_a_margin_whose_centre_is_what_serving_decodes(
    tmp_path: Path,
) -> None:
    from burstcv.data.photos import write_photo_dataset

    written = write_photo_dataset(tmp_path / "photos", per_class=(3, 3))
    spec = PreprocessSpec(height=224, width=224, resize_short=resize_short_for(224))
    files = sorted((tmp_path / "photos").rglob("*.*"))
    rows = pd.DataFrame(
        {
            "path": [str(f.relative_to(tmp_path / "photos")) for f in files],
            "uri": [str(f) for f in files],
            "split": [f.parts[-3] for f in files],
            "label": [f.parts[-2] for f in files],
            "decode_ok": True,
        }
    )
    result = pack_dataset(rows, str(tmp_path / "shards"), spec, margin=True)
    ordered = rows.sort_values(["split", "label", "path"])
    stored = _stored(result.train_shards + result.val_shards)
    assert stored.shape[1:3] == (256, 256)
    by_path = dict(zip(ordered["uri"], eval_view(stored, spec), strict=True))
    for path in files:
        assert np.array_equal(by_path[str(path)], decode_to_uint8(path.read_bytes(), spec)), path
    for path in written.sixteen_bit:  # decoded as its 8-bit grey, not clipped to white
        with Image.open(path) as img:
            grey8 = Image.fromarray((np.asarray(img) >> 8).astype(np.uint8))
        assert np.array_equal(by_path[str(path)], decode_to_uint8(_encode(grey8, "PNG"), spec))
    for path in written.exif_rotated:  # stored landscape-turned; decoded upright
        with Image.open(path) as img:
            assert open_image(path.read_bytes()).size == img.size[::-1]


def test_a_large_jpeg_is_decoded_at_a_reduced_scale_close_to_a_full_decode() -> None:
    """A 2400x1800 JPEG for 224 px (short side 256) decodes at 1/2 scale (both sides >= 512):
    the same pixels within a few levels of a full decode, in pack and serving alike."""
    spec = PreprocessSpec(height=224, width=224, resize_short=256)
    data = _encode(_scene(2400, 1800), "JPEG", quality=92)
    assert load_for(probe_image(data), spec).size == (1200, 900)
    full = to_uint8(load_image(probe_image(data)), spec).astype(int)
    scaled = decode_to_uint8(data, spec).astype(int)
    assert np.abs(full - scaled).mean() < 1.0 and np.abs(full - scaled).max() <= 12
    # Pack stores the margin square; its centre is what serving computes from the same bytes.
    stored = decode_to_uint8(data, margin_spec(spec))
    assert np.array_equal(eval_view(stored[None], spec)[0], decode_to_uint8(data, spec))


def test_the_reduced_scale_keeps_the_short_side_of_a_rotated_photo() -> None:
    """A portrait photo stored sideways: after the EXIF turn its short side is still >= 2x."""
    spec = PreprocessSpec(height=96, width=96, resize_short=110)
    data = _stored_sideways(_scene(1500, 2000), "JPEG", quality=92)
    upright = load_for(probe_image(data), spec)
    assert upright.size == (375, 500) and min(upright.size) >= 2 * 110
    full = to_uint8(load_image(probe_image(data)), spec).astype(int)
    assert np.abs(full - decode_to_uint8(data, spec).astype(int)).mean() < 1.0


def test_only_jpegs_larger_than_needed_are_scaled() -> None:
    spec = PreprocessSpec(height=224, width=224, resize_short=256)
    small = _encode(_scene(900, 700), "JPEG", quality=92)  # 450x350 would be < 512: kept
    assert load_for(probe_image(small), spec).size == (900, 700)
    png = _encode(_scene(2400, 1800), "PNG")
    assert load_for(probe_image(png), spec).size == (2400, 1800)
