"""Hold the thresholds of the dataset gate: a light module (no Great Expectations, no pandas),
so that the run parameters take their defaults from here without importing the checks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Same bound as the service's open_image: a 4096x4096 image is the largest one accepted.
DEFAULT_MAX_PIXELS = 4096 * 4096
# A file larger than this is refused without being read into memory (an image dataset for a
# 32x32 classifier has no business holding a 64 MiB file; raise it for photo datasets).
DEFAULT_MAX_FILE_BYTES = 64 * 1024 * 1024

# The square sizes a run may train and serve at, px (burstcv.data.imagesize chooses one).
MIN_IMAGE_SIZE = 16
MAX_IMAGE_SIZE = 640
# The chunks validate and pack are split into, one mapped task each: 20,000 files (4 GB at
# most) take a few minutes on a 2-core worker, long enough that a task's start-up is noise,
# short enough that a retried chunk loses little.
DEFAULT_CHUNK_FILES = 20_000
DEFAULT_CHUNK_MB = 4096


@dataclass
class ValidationConfig:
    """Hold the thresholds of the dataset gate; each default carries its reason."""

    expected_classes: list[str] | None = None  # None: whatever class folders exist
    splits: tuple[str, ...] = ("train", "val")
    allowed_formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP")  # what the service decodes
    min_width: int = 8  # px; smaller images carry no signal after resizing
    max_width: int = 4096  # px; the service's open_image refuses larger (4096x4096 pixels)
    min_height: int = 8
    max_height: int = 4096
    allowed_channels: tuple[int, ...] = (1, 3, 4)  # L/P, RGB, RGBA/CMYK; RGB conversion is later
    min_images_per_class: int = 5  # per split: fewer cannot train or measure a class
    max_imbalance_ratio: float = 10.0  # largest/smallest class, per split
    min_total_images: int = 20  # usable images over all splits
    near_duplicate_max_distance: int | None = 0  # dHash bits; 0 = same hash; None = off
    # ...and the 9x8 grayscale thumbnails differ by at most this many grey levels anywhere:
    # re-encodes and 1-pixel edits stay under ~13, distinct handwritten digits exceed ~29.
    near_duplicate_max_pixel_diff: int = 20
    drift_warn: float = 0.10  # drift score above which a warning is reported
    drift_max: float | None = None  # drift score above which validation fails; None = warn only
    max_pixels: int = DEFAULT_MAX_PIXELS  # header check before decoding (decompression bombs)
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES  # refused unread above this

    def __post_init__(self) -> None:
        """Refuse thresholds that cannot be met or make no sense."""
        self.splits = tuple(self.splits)
        self.allowed_formats = tuple(f.upper() for f in self.allowed_formats)
        self.allowed_channels = tuple(int(c) for c in self.allowed_channels)
        if self.expected_classes is not None:
            self.expected_classes = [str(c) for c in self.expected_classes]
            if not self.expected_classes:
                raise ValueError("expected_classes is empty; give class names or None")
        if not self.splits:
            raise ValueError("splits is empty; the default is ('train', 'val')")
        if not 0 < self.min_width <= self.max_width or not 0 < self.min_height <= self.max_height:
            raise ValueError("image bounds need 0 < min <= max for width and height")
        if self.max_imbalance_ratio < 1:
            raise ValueError("max_imbalance_ratio is largest/smallest and must be >= 1")
        distance = self.near_duplicate_max_distance
        if distance is not None and not 0 <= distance <= 16:
            raise ValueError("near_duplicate_max_distance must be 0..16 bits, or None to disable")
        if not 0 <= self.near_duplicate_max_pixel_diff <= 255:
            raise ValueError("near_duplicate_max_pixel_diff is in grey levels, 0..255")
        if self.drift_max is not None and self.drift_max < 0:
            raise ValueError("drift_max must be >= 0, or None to only warn")

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready form recorded in validation.json."""
        data = asdict(self)
        for key in ("splits", "allowed_formats", "allowed_channels"):
            data[key] = list(data[key])
        return data
