"""Build small ImageFolder datasets in tmp_path for the dataset-gate tests."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from burstcv_testkit import CLASSES, PER_CLASS, SPLITS, smooth_image, write_dataset

__all__ = ["CLASSES", "PER_CLASS", "SPLITS", "smooth_image", "write_dataset"]


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
