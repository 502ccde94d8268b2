"""Write the handwritten-digits images that scikit-learn ships as an ImageFolder dataset."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image

from burstcv.data.pack import pack_dataset
from burstcv_spec.contracts import Packed
from burstcv_spec.preprocess import PreprocessSpec

log = logging.getLogger(__name__)

DEMO_SIZE_PX = 32
VAL_FRACTION = 0.2
SPLIT_SEED = 0  # fixed: the same files land in the same split on every machine


def write_demo_dataset(root: str | Path, *, size_px: int = DEMO_SIZE_PX) -> dict[str, int]:
    """Write ``root/{train,val}/<digit>/<n>.png`` (RGB, size_px square) and return split counts
    (the split is stratified by class and deterministic)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    labels = digits.target.astype(int)
    train_idx, val_idx = train_test_split(
        np.arange(len(labels)), test_size=VAL_FRACTION, stratify=labels, random_state=SPLIT_SEED
    )
    root = Path(root)
    counts: dict[str, int] = {}
    for split, idx in (("train", train_idx), ("val", val_idx)):
        for i in sorted(idx):
            folder = root / split / str(labels[i])
            folder.mkdir(parents=True, exist_ok=True)
            img = Image.fromarray(images[i], mode="L").resize(
                (size_px, size_px), Image.Resampling.BICUBIC
            )
            img.convert("RGB").save(folder / f"{i}.png", optimize=False)
        counts[split] = len(idx)
    log.info("wrote %s: %s", root, counts)
    return counts


def pack_demo(
    root: str | Path, out_uri: str, spec: PreprocessSpec | None = None
) -> tuple[Packed, PreprocessSpec]:
    """Pack a demo dataset (digits or photos) for benchmarks and test fixtures, unvalidated
    (the default spec is the digits': round figures close to their own statistics)."""
    root = Path(root)
    rows = [
        {
            "path": str(p.relative_to(root)),
            "uri": str(p),
            "split": p.parts[-3],
            "label": p.parts[-2],
            "decode_ok": True,
        }
        for p in sorted(root.rglob("*"))
        if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp")
    ]
    spec = spec or PreprocessSpec(mean=(0.25, 0.25, 0.25), std=(0.35, 0.35, 0.35))
    return pack_dataset(pd.DataFrame(rows), out_uri, spec), spec
