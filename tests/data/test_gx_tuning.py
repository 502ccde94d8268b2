"""The GX tuning patches hold only inside gx_tuning(), and are undone after, even on error."""

from __future__ import annotations

import subprocess
import sys
import threading

import jinja2
import pytest
from great_expectations.render.view.view import DefaultJinjaView
from tqdm import std as tqdm_std

from burstcv.data.gx_tuning import gx_tuning


def _in_force() -> tuple[int, bool]:
    """Return tqdm's monitor interval, and whether a new GX view gets a bytecode cache."""
    cache = DefaultJinjaView().env.bytecode_cache
    return tqdm_std.tqdm.monitor_interval, isinstance(cache, jinja2.FileSystemBytecodeCache)


def test_the_patches_hold_inside_only_and_are_undone_after() -> None:
    outside = _in_force()
    assert outside == (10, False)  # tqdm's default interval; GX's views uncached
    original_init = DefaultJinjaView.__dict__["__init__"]
    with gx_tuning():
        assert _in_force() == (0, True)
        # A bar made inside (as GX makes them) starts no monitor thread.
        threads, monitor = set(threading.enumerate()), tqdm_std.tqdm.monitor
        with tqdm_std.tqdm(total=3, disable=True) as bar:
            bar.update(3)
        assert set(threading.enumerate()) == threads
        assert tqdm_std.tqdm.monitor is monitor
    assert _in_force() == outside
    assert DefaultJinjaView.__dict__["__init__"] is original_init


def test_nested_entries_undo_only_when_the_last_one_leaves() -> None:
    with gx_tuning():
        with gx_tuning():
            assert _in_force() == (0, True)
        assert _in_force() == (0, True)  # the outer block still relies on them
    assert _in_force() == (10, False)


def test_the_patches_are_undone_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="validation broke"), gx_tuning():
        raise RuntimeError("validation broke")
    assert _in_force() == (10, False)


def test_importing_the_data_modules_patches_nothing() -> None:
    """In a fresh interpreter: nothing is in force until a validation enters gx_tuning()."""
    code = (
        "import burstcv.data.gx_tuning, burstcv.data.suite, burstcv.data.validate\n"
        "from great_expectations.render.view.view import DefaultJinjaView\n"
        "from tqdm import std\n"
        "print(std.tqdm.monitor_interval, DefaultJinjaView().env.bytecode_cache)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.split() == ["10", "None"]
