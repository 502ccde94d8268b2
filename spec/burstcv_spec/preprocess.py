"""Decode and normalise images exactly as the model was trained: the one definition.

Training, export parity checks and the service all go through these functions, driven by the
``preprocess`` block of ``model.json``; they need only numpy and Pillow, never torch.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

# Formats a client may send and a dataset may contain. Pillow's names.
SUPPORTED_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP")

# ImageNet statistics are the conventional default for torchvision models; a job may override.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Share of the resized short side that the eval centre crop keeps: torchvision's ImageNet
# recipe (resize 256, crop 224), so pretrained features see objects at the scale they learnt.
CROP_FRACTION = 0.875

# Pillow modes of 16 bits per sample: convert("RGB") clips them at 255 instead of scaling.
_SIXTEEN_BIT_MODES = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N"})


class ImageDecodeError(ValueError):
    """Raise when bytes are not a usable image; the message says why, for a 4xx or a report."""


class UnsupportedFormatError(ImageDecodeError):
    """Raise when the bytes are an image in a format that is not accepted."""


class ImageTooLargeError(ImageDecodeError):
    """Raise when an image declares more pixels than allowed (a decompression bomb, say)."""


@dataclass(frozen=True)
class PreprocessSpec:
    """Describe the eval transform: RGB, resize (and crop) to (height, width), normalise, NCHW.

    Without ``resize_short`` the image is resized straight to height x width, aspect not kept
    (the digits); with it, the short side goes to ``resize_short`` and the centre is cropped.
    """

    height: int = 32
    width: int = 32
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: str = "bilinear"  # Pillow resample filter used when the size differs
    color_mode: str = "RGB"
    layout: str = "NCHW"
    scale: float = 1.0 / 255.0
    formats: tuple[str, ...] = field(default=SUPPORTED_FORMATS)
    resize_short: int | None = None  # px of the short side before the centre crop; None: none

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready form written into model.json."""
        data = asdict(self)
        data.update(mean=list(self.mean), std=list(self.std), formats=list(self.formats))
        if self.resize_short is None:
            del data["resize_short"]  # a plain-resize spec writes the model.json it always did
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PreprocessSpec:
        """Build a spec from model.json's ``preprocess`` block, refusing unknown transforms."""
        spec = cls(
            height=int(data["height"]),
            width=int(data["width"]),
            mean=_triple(data.get("mean", IMAGENET_MEAN), "mean"),
            std=_triple(data.get("std", IMAGENET_STD), "std"),
            interpolation=str(data.get("interpolation", "bilinear")),
            color_mode=str(data.get("color_mode", "RGB")),
            layout=str(data.get("layout", "NCHW")),
            scale=float(data.get("scale", 1.0 / 255.0)),
            formats=tuple(data.get("formats", SUPPORTED_FORMATS)),
            resize_short=_optional_px(data.get("resize_short"), "resize_short"),
        )
        if spec.interpolation not in _RESAMPLE:
            raise ValueError(
                f"unknown interpolation {spec.interpolation!r}; choose {', '.join(_RESAMPLE)}"
            )
        if spec.color_mode != "RGB" or spec.layout != "NCHW":
            raise ValueError("only color_mode RGB and layout NCHW are supported")
        if spec.height <= 0 or spec.width <= 0:
            raise ValueError("height and width must be positive")
        if any(s <= 0 for s in spec.std):
            raise ValueError("std must be positive")
        if spec.resize_short is not None and spec.resize_short < max(spec.height, spec.width):
            raise ValueError(
                f"resize_short {spec.resize_short} is smaller than the {spec.height}x"
                f"{spec.width} crop taken from it"
            )
        return spec

    @property
    def stored_size(self) -> tuple[int, int]:
        """Return (height, width) of the images pack stores with a margin (margin_spec)."""
        if self.resize_short is None:
            return (self.height, self.width)
        return (self.resize_short, self.resize_short)


def resize_short_for(size_px: int, crop_fraction: float = CROP_FRACTION) -> int:
    """Return the short side to resize to before a centre crop of ``size_px`` (224 -> 256)."""
    if size_px <= 0 or not 0 < crop_fraction <= 1:
        raise ValueError(
            f"need size_px > 0 and 0 < crop_fraction <= 1, got {size_px}, {crop_fraction}"
        )
    return max(size_px, round(size_px / crop_fraction))


def margin_spec(spec: PreprocessSpec) -> PreprocessSpec:
    """Return the spec pack stores photos with: the square of side resize_short, uncropped.

    Training's random crops draw from the margin; the centre is exactly what ``spec`` makes.
    """
    if spec.resize_short is None:
        raise ValueError("a margin needs resize_short; this spec resizes straight to its size")
    return replace(spec, height=spec.resize_short, width=spec.resize_short)


def center_crop(images: np.ndarray, height: int, width: int) -> np.ndarray:
    """Return the centre height x width of HWC or NHWC images (a view; offsets round down)."""
    full_h, full_w = images.shape[-3], images.shape[-2]
    if height > full_h or width > full_w:
        raise ValueError(f"cannot crop {height}x{width} from {full_h}x{full_w} images")
    top, left = (full_h - height) // 2, (full_w - width) // 2
    return images[..., top : top + height, left : left + width, :]


def eval_view(images: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    """Return stored (packed) uint8 NHWC images as the model sees them at eval."""
    size = (images.shape[-3], images.shape[-2])
    if size == (spec.height, spec.width):
        return images
    if spec.resize_short is not None and size == spec.stored_size:
        return center_crop(images, spec.height, spec.width)
    margin = f" or {spec.stored_size[0]}x{spec.stored_size[1]}" if spec.resize_short else ""
    raise ValueError(
        f"images are {size[0]}x{size[1]}; the preprocess spec needs {spec.height}x{spec.width}"
        f"{margin}"
    )


_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
}


def _optional_px(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ValueError(f"{name} must be a whole number of pixels or null, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


def _triple(values: Any, name: str) -> tuple[float, float, float]:
    items = [float(v) for v in values]
    if len(items) != 3:
        raise ValueError(f"{name} needs 3 values (R, G, B), got {len(items)}")
    return (items[0], items[1], items[2])


def open_image(
    data: bytes,
    *,
    max_pixels: int = 4096 * 4096,
    formats: tuple[str, ...] = SUPPORTED_FORMATS,
) -> Image.Image:
    """Decode bytes fully into an RGB image, or raise an ImageDecodeError saying why.

    A decompression bomb is refused from the header alone. Safe to call from several threads
    at once (no process-wide warning filters are touched).
    """
    return load_image(probe_image(data, max_pixels=max_pixels, formats=formats))


def probe_image(
    data: bytes,
    *,
    max_pixels: int = 4096 * 4096,
    formats: tuple[str, ...] = SUPPORTED_FORMATS,
) -> Image.Image:
    """Read only the header: check format and pixel count, decode no pixel (see open_image).

    Cheap at any size: the service decodes small images inline and large ones in a thread.
    """
    if not data:
        raise ImageDecodeError("empty file")
    fmt = "unknown"
    try:
        try:
            # The accepted formats first: the common case probes no other format.
            img: Image.Image = Image.open(io.BytesIO(data), formats=formats)
        except UnidentifiedImageError:
            img = Image.open(io.BytesIO(data))  # not accepted: find out what it is, to say so
        fmt = img.format or "unknown"
        if fmt not in formats and not (fmt == "MPO" and "JPEG" in formats):
            # MPO: a camera's multi-picture JPEG; Pillow decodes its first, plain JPEG picture.
            raise UnsupportedFormatError(
                f"unsupported image format {fmt}; send one of {', '.join(formats)}"
            )
        width, height = img.size
        if width <= 0 or height <= 0:
            raise ImageDecodeError(f"image declares an empty size {width}x{height}")
        if width * height > max_pixels:
            raise ImageTooLargeError(
                f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}"
            )
    except ImageDecodeError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(f"decompression bomb refused: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise ImageDecodeError("not an image (no known format signature)") from exc
    except Exception as exc:  # on untrusted bytes, any failure is a decode error (as in load)
        raise ImageDecodeError(f"corrupt or truncated {fmt} data: {exc}") from exc
    return img


def load_image(img: Image.Image) -> Image.Image:
    """Decode the pixels of an image from probe_image and return it upright, in RGB mode.

    EXIF orientation applied: training and serving see a phone's portrait photo as a viewer.
    """
    fmt = img.format or "unknown"
    try:
        img.load()
        # In place: no copy of the pixels when the tag is absent (the common case).
        ImageOps.exif_transpose(img, in_place=True)
        img = _to_rgb(img)
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(f"decompression bomb refused: {exc}") from exc
    except Exception as exc:
        # A crafted file can make a plugin fail with anything (struct.error, IndexError, ...):
        # untrusted bytes never escape as anything but a decode error.
        raise ImageDecodeError(f"corrupt or truncated {fmt} data: {exc}") from exc
    return img


# A large JPEG is decoded at 1/2, 1/4 or 1/8 scale (libjpeg's scaled IDCT), keeping at least
# this many times the final size so the resize still antialiases: a 4032x3024 photo at 224 px
# decodes 3x faster, pixels within a few levels of a full decode.
DRAFT_OVERSAMPLE = 2


def load_for(img: Image.Image, spec: PreprocessSpec) -> Image.Image:
    """Decode an image from probe_image for ``spec``: as load_image, a large JPEG scaled down.

    Pack, the parity check and the service all decode through here, so the scale chosen (from
    the file and the spec's output size alone) is the same for the same bytes everywhere.
    """
    if img.format in ("JPEG", "MPO"):
        # Both sides at least the target: the short side survives an EXIF rotation too.
        side = DRAFT_OVERSAMPLE * (spec.resize_short or max(spec.height, spec.width))
        try:
            img.draft(None, (side, side))
        except Exception as exc:  # untrusted bytes: as load_image does
            raise ImageDecodeError(f"corrupt or truncated {img.format} data: {exc}") from exc
    return load_image(img)


def _to_rgb(img: Image.Image) -> Image.Image:
    """Return an image in RGB mode, 8 bits per channel.

    16-bit greyscale keeps its high byte (as Pillow reads 16-bit RGB PNGs); every other mode
    uses convert("RGB"), which drops any alpha as torchvision's loader does.
    """
    if img.mode == "RGB":
        return img
    if img.mode in _SIXTEEN_BIT_MODES:
        wide = np.asarray(img).astype(np.int64)  # "I" is 32-bit signed: clip to 16 bits first
        img = Image.fromarray((np.clip(wide, 0, 65535) >> 8).astype(np.uint8))
    return img.convert("RGB")


def to_uint8(img: Image.Image, spec: PreprocessSpec) -> np.ndarray:
    """Resize (and, with resize_short, centre-crop) an image to the spec's size: uint8 HWC."""
    img = _to_rgb(img)
    resample = _RESAMPLE[spec.interpolation]
    if spec.resize_short is None:
        if img.size != (spec.width, spec.height):
            img = img.resize((spec.width, spec.height), resample)
        return np.asarray(img, dtype=np.uint8)
    short = spec.resize_short
    width, height = img.size
    # The long side as torchvision's Resize(int) computes it (truncated).
    if width <= height:
        size = (short, int(short * height / width))
    else:
        size = (int(short * width / height), short)
    # Only the centre resize_short square is used: Pillow resizes just the source box under it
    # (a 4096x1 strip never becomes 256x1048576), and a stored margin image (margin_spec),
    # centre-cropped, is this result exactly, whatever the parity of the sizes.
    left, top = (size[0] - short) // 2, (size[1] - short) // 2
    if size == img.size:
        square = center_crop(np.asarray(img, dtype=np.uint8), short, short)
    else:
        sx, sy = width / size[0], height / size[1]
        box = (left * sx, top * sy, (left + short) * sx, (top + short) * sy)
        square = np.asarray(img.resize((short, short), resample, box=box), dtype=np.uint8)
    return np.ascontiguousarray(center_crop(square, spec.height, spec.width))


def decode_to_uint8(
    data: bytes, spec: PreprocessSpec, *, max_pixels: int = 4096 * 4096
) -> np.ndarray:
    """Decode image bytes into the uint8 HWC array that training and serving both start from."""
    return to_uint8(
        load_for(probe_image(data, max_pixels=max_pixels, formats=spec.formats), spec), spec
    )


def normalize(batch: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    """Turn uint8 NHWC (or HWC) into float32 NCHW: scale, subtract mean, divide by std."""
    if batch.ndim == 3:
        batch = batch[None]
    if batch.ndim != 4 or batch.shape[-1] != 3:
        raise ValueError(f"expected uint8 NHWC with 3 channels, got shape {batch.shape}")
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    x = batch.astype(np.float32) * np.float32(spec.scale)
    x = (x - mean) / std
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
