"""The scanner's capability probes: once, on first use, and a clean fallback when one fails."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from burstcv.data.manifest import scan
from burstcv.data.scanner import pngfast
from burstcv.data.scanner.capabilities import capabilities

_LOGGER = "burstcv.data.scanner.capabilities"


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    """Forget this process's probe before and after the test, so it probes again."""
    capabilities.cache_clear()
    yield
    capabilities.cache_clear()


class _PillowWithout:
    """Stand in for PIL.Image as a release without one internal would look to the fast path."""

    def __init__(self, missing: str) -> None:
        self.missing = missing

    def __getattr__(self, name: str) -> Any:
        if name == self.missing:
            raise AttributeError(f"module 'PIL.Image' has no attribute {name!r}")
        return getattr(Image, name)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == _LOGGER and record.levelno >= logging.WARNING
    ]


def test_importing_the_scanner_probes_nothing() -> None:
    code = (
        "import sys, burstcv.data.manifest, burstcv.data.scanner.dispatch; "
        "from burstcv.data.scanner.capabilities import capabilities; "
        "print(capabilities.cache_info().currsize)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "0"  # the probes wait for the first file


def test_a_scan_probes_once_and_keeps_the_answers(
    fresh_probe: None, tmp_path: Path, kit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = kit.write_dataset(tmp_path / "ds", per_class=2)
    calls: list[int] = []
    real = pngfast.probe

    def counted() -> bool:
        calls.append(1)
        return real()

    monkeypatch.setattr(pngfast, "probe", counted)
    first = scan(str(root), workers=1).manifest
    second = scan(str(root), workers=1).manifest
    assert calls == [1]
    assert capabilities() is capabilities()
    assert capabilities().png_fast_path and capabilities().strip_hashing
    assert first.equals(second)


@pytest.mark.parametrize("breakage", ["internal missing", "pixels differ"])
def test_a_failed_fast_path_probe_falls_back_to_pillow_with_one_warning(
    fresh_probe: None,
    tmp_path: Path,
    kit: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    breakage: str,
) -> None:
    root = kit.write_dataset(tmp_path / "ds", per_class=4)
    expected = scan(str(root), workers=1).manifest  # with the fast path, on this Pillow
    assert capabilities().png_fast_path
    capabilities.cache_clear()
    decoded: list[int] = []
    real_decode = pngfast.decode_png

    def spy(*args: Any) -> Any:
        decoded.append(1)
        return real_decode(*args)

    with monkeypatch.context() as patch:
        # A Pillow release that renamed an internal, or whose decoder fills pixels differently.
        if breakage == "internal missing":
            patch.setattr(pngfast, "Image", _PillowWithout("_getdecoder"))
        else:
            patch.setattr(pngfast, "feed_decoder", lambda decoder, chunks: True)
        caplog.set_level(logging.WARNING, logger=_LOGGER)
        fallback = scan(str(root), workers=1).manifest
        patch.setattr(pngfast, "decode_png", spy)
        again = scan(str(root), workers=1).manifest
    assert not capabilities().png_fast_path
    assert decoded == []  # every PNG went through Image.open
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "PNG fast path off" in warnings[0], warnings
    assert fallback.equals(expected) and again.equals(expected)
    assert expected["decode_ok"].all()


def test_the_fast_path_meeting_a_changed_internal_warns_once(
    fresh_probe: None,
    tmp_path: Path,
    kit: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = kit.write_dataset(tmp_path / "ds", per_class=4)
    expected = scan(str(root), workers=1).manifest
    assert capabilities().png_fast_path  # probed, and fine: the change comes after

    def missing(*args: Any) -> Any:
        raise AttributeError("'ImagingDecoder' object has no attribute 'decode'")

    monkeypatch.setattr(pngfast, "feed_decoder", missing)
    caplog.set_level(logging.WARNING, logger=_LOGGER)
    assert scan(str(root), workers=1).manifest.equals(expected)
    assert not capabilities().png_fast_path
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "decoder internals changed" in warnings[0], warnings
