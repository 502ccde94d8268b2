"""The demo dataset: real scikit-learn digits as an ImageFolder, split the same way every time."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from PIL import Image

from burstcv.data.demo import write_demo_dataset


def test_demo_dataset_has_every_digit_as_32px_rgb_png(demo_dataset: Path) -> None:
    files = sorted(demo_dataset.rglob("*.png"))
    assert len(files) == 1797
    assert {p.parts[-2] for p in files} == {str(d) for d in range(10)}
    with Image.open(files[0]) as img:
        assert img.size == (32, 32)
        assert img.mode == "RGB"
        assert img.format == "PNG"


def test_demo_split_is_stratified_and_deterministic(demo_dataset: Path, tmp_path: Path) -> None:
    train = Counter(p.parts[-2] for p in (demo_dataset / "train").rglob("*.png"))
    val = Counter(p.parts[-2] for p in (demo_dataset / "val").rglob("*.png"))
    assert sum(train.values()) == 1437 and sum(val.values()) == 360
    for digit in map(str, range(10)):
        share = val[digit] / (val[digit] + train[digit])
        assert 0.18 < share < 0.22, f"class {digit} val share {share:.2f}"
    again = tmp_path / "again"
    write_demo_dataset(again)
    first = sorted(str(p.relative_to(demo_dataset)) for p in demo_dataset.rglob("*.png"))
    second = sorted(str(p.relative_to(again)) for p in again.rglob("*.png"))
    assert first == second
    sample = first[0]
    assert (demo_dataset / sample).read_bytes() == (again / sample).read_bytes()
