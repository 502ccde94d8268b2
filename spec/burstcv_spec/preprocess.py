"""Decode and normalise images exactly as the model was trained: the one definition.

Training (through ``burstcv.data.pack`` and ``burstcv.training``), export parity checks and
the service all go through these functions, driven by the ``preprocess`` block of
``model.json``. The module needs only numpy and Pillow, never torch.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

# Formats a client may send and a dataset may contain. Pillow's names.
SUPPORTED_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP")

# ImageNet statistics are the conventional default for torchvision models; a job may override.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImageDecodeError(ValueError):
    """Raise when bytes are not a usable image; the message says why, for a 4xx or a report."""


class UnsupportedFormatError(ImageDecodeError):
    """Raise when the bytes are an image in a format that is not accepted."""


class ImageTooLargeError(ImageDecodeError):
    """Raise when an image declares more pixels than allowed (a decompression bomb, say)."""


@dataclass(frozen=True)
class PreprocessSpec:
    """Describe the eval transform: RGB, resize to (height, width), scale, normalise, NCHW."""

    height: int = 32
    width: int = 32
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: str = "bilinear"  # Pillow resample filter used when the size differs
    color_mode: str = "RGB"
    layout: str = "NCHW"
    scale: float = 1.0 / 255.0
    formats: tuple[str, ...] = field(default=SUPPORTED_FORMATS)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready form written into model.json."""
        data = asdict(self)
        data["mean"] = list(self.mean)
        data["std"] = list(self.std)
        data["formats"] = list(self.formats)
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
        return spec


_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
}


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

    The pixel count is checked from the header before any pixel is decoded, so a
    decompression bomb costs nothing; truncated data fails in ``load()``. Safe to call from
    several threads at once (no process-wide warning filters are touched).
    """
    return load_image(probe_image(data, max_pixels=max_pixels, formats=formats))


def probe_image(
    data: bytes,
    *,
    max_pixels: int = 4096 * 4096,
    formats: tuple[str, ...] = SUPPORTED_FORMATS,
) -> Image.Image:
    """Read only the header: check format and pixel count, decode no pixel (see open_image).

    Cheap at any declared size, so a caller may decide from ``img.size`` where to spend the
    decode (the service decodes small images inline and large ones in a thread).
    """
    if not data:
        raise ImageDecodeError("empty file")
    fmt = "unknown"
    try:
        # Pillow's own bomb check raises DecompressionBombError past 2x MAX_IMAGE_PIXELS; the
        # warning it gives below that is made moot by the max_pixels check right after.
        try:
            # Only the accepted formats' plugins are tried first: the common case skips
            # probing every other format Pillow knows.
            img: Image.Image = Image.open(io.BytesIO(data), formats=formats)
        except UnidentifiedImageError:
            img = Image.open(io.BytesIO(data))  # not accepted: find out what it is, to say so
        fmt = img.format or "unknown"
        if fmt not in formats:
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
    """Decode the pixels of an image from probe_image and return it in RGB mode."""
    fmt = img.format or "unknown"
    try:
        img.load()
        if img.mode != "RGB":
            img = img.convert("RGB")
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(f"decompression bomb refused: {exc}") from exc
    except Exception as exc:
        # Pillow reports truncated or corrupt streams as OSError/SyntaxError/EOFError, and a
        # crafted file can make a plugin fail with anything (struct.error, IndexError, ...):
        # untrusted bytes never escape as anything but a decode error.
        raise ImageDecodeError(f"corrupt or truncated {fmt} data: {exc}") from exc
    return img


def to_uint8(img: Image.Image, spec: PreprocessSpec) -> np.ndarray:
    """Resize an RGB image to the spec's size and return it as uint8 HWC."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    if img.size != (spec.width, spec.height):
        img = img.resize((spec.width, spec.height), _RESAMPLE[spec.interpolation])
    return np.asarray(img, dtype=np.uint8)


def decode_to_uint8(
    data: bytes, spec: PreprocessSpec, *, max_pixels: int = 4096 * 4096
) -> np.ndarray:
    """Decode image bytes into the uint8 HWC array that training and serving both start from."""
    return to_uint8(open_image(data, max_pixels=max_pixels, formats=spec.formats), spec)


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
