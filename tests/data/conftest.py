"""Build small ImageFolder datasets in tmp_path for the dataset-gate tests."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

CLASSES = ("cat", "dog", "fox")
SPLITS = ("train", "val")
PER_CLASS = 10  # per split: above the default minimum of 5, so the clean dataset passes


def smooth_image(seed: int, size: int = 32) -> Image.Image:
    """Return a distinct, smooth RGB image: 8x8 random colours, upscaled."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    return Image.fromarray(small, "RGB").resize((size, size), Image.Resampling.BILINEAR)


def write_dataset(
    root: Path,
    *,
    classes: tuple[str, ...] = CLASSES,
    per_class: int | dict[tuple[str, str], int] = PER_CLASS,
    seed: int = 0,
) -> Path:
    """Write <root>/<split>/<class>/<n>.png and return root; every image is distinct."""
    counter = seed * 100_000
    for split in SPLITS:
        for label in classes:
            n = per_class if isinstance(per_class, int) else per_class.get((split, label), 0)
            folder = root / split / label
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                counter += 1
                smooth_image(counter).save(folder / f"{i:03d}.png")
    return root


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """Return a clean 3-class dataset with 10 images per class and split."""
    return write_dataset(tmp_path / "pets")


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    """Return an output folder for validation artifacts."""
    return tmp_path / "out"


def png_header_only(width: int, height: int) -> bytes:
    """Return a tiny PNG whose IHDR declares width x height (a decompression bomb's header)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def read_validation(out: Path) -> dict[str, Any]:
    """Return the parsed validation.json under an output folder."""
    doc: dict[str, Any] = json.loads((out / "validation.json").read_text())
    return doc


def expectation(doc: dict[str, Any], name: str) -> dict[str, Any]:
    """Return one expectation entry of validation.json by check name."""
    for item in doc["expectations"]:
        if item["name"] == name:
            return item
    raise KeyError(f"no expectation {name!r}; have {[e['name'] for e in doc['expectations']]}")


def failed_names(doc: dict[str, Any]) -> set[str]:
    """Return the names of the failed expectations in validation.json."""
    return {item["name"] for item in doc["expectations"] if not item["success"]}


class Kit:
    """Bundle the helpers above for tests (a fixture, so no test imports conftest by name)."""

    classes = CLASSES
    per_class = PER_CLASS
    smooth_image = staticmethod(smooth_image)
    write_dataset = staticmethod(write_dataset)
    png_header_only = staticmethod(png_header_only)
    read_validation = staticmethod(read_validation)
    expectation = staticmethod(expectation)
    failed_names = staticmethod(failed_names)


@pytest.fixture
def kit() -> type[Kit]:
    """Return the dataset-building and validation.json-reading helpers."""
    return Kit
