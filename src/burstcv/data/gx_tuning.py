"""Tune Great Expectations' use of tqdm and Jinja for the length of one validation, then undo it.

Two patches, in force only inside :func:`gx_tuning`; importing this module changes nothing:

- tqdm: GX creates (disabled) progress bars, and tqdm starts a monitor thread for every bar,
  even a disabled one, which outlives the validation. A live thread makes the next manifest
  scan in this process start its workers with spawn instead of fork (fork is only safe
  single-threaded), which costs each worker a fresh interpreter and its imports. Inside,
  ``tqdm.monitor_interval`` is 0, tqdm's own switch for that thread.
- Jinja: GX builds a new Jinja environment for every Data Docs page it renders, so each
  validation compiled the same two dozen templates three times over (about a third of a
  second on a small CPU). Inside, each of GX's views is given Jinja's own
  FileSystemBytecodeCache (in the temp folder, per user, written atomically), which turns
  that into loading compiled code, as .pyc files do for modules. The rendered HTML is the
  same. If GX ever changes the class, docs are built uncached.

Entries may nest or overlap (threads): the first applies the patches, the last undoes them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jinja2
from tqdm import std as tqdm_std

Undo = Callable[[], None]


class _Entries:
    """Count the entries in force, so that the first applies the patches and the last undoes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.undo: list[Undo] = []


_ENTRIES = _Entries()


@contextlib.contextmanager
def gx_tuning() -> Iterator[None]:
    """Apply the tqdm and Jinja patches for the duration of the block; restore them after."""
    with _ENTRIES.lock:
        if _ENTRIES.depth == 0:
            _ENTRIES.undo = _apply(_quiet_progress_bars, _cache_view_templates)
        _ENTRIES.depth += 1
    try:
        yield
    finally:
        with _ENTRIES.lock:
            _ENTRIES.depth -= 1
            if _ENTRIES.depth == 0:
                undo, _ENTRIES.undo = _ENTRIES.undo, []
                _run_undo(undo)


def _apply(*patches: Callable[[], Undo]) -> list[Undo]:
    """Apply each patch in turn and return their undos; if one fails, undo the others first."""
    undo: list[Undo] = []
    try:
        for patch in patches:
            undo.append(patch())
    except BaseException:
        _run_undo(undo)
        raise
    return undo


def _run_undo(undo: list[Undo]) -> None:
    """Undo patches in the reverse order of their application."""
    for step in reversed(undo):
        step()


def _quiet_progress_bars() -> Undo:
    """Keep tqdm bars from starting a monitor thread; the undo stops one started meanwhile."""
    tqdm_cls = tqdm_std.tqdm
    interval, monitor = tqdm_cls.monitor_interval, tqdm_cls.monitor
    tqdm_cls.monitor_interval = 0

    def undo() -> None:
        started = tqdm_cls.monitor
        if started is not None and started is not monitor:
            started.exit()
            tqdm_cls.monitor = monitor
        tqdm_cls.monitor_interval = interval

    return undo


def _cache_view_templates() -> Undo:
    """Give every Jinja environment GX's Data Docs views build a shared bytecode cache."""
    try:
        from great_expectations.render.view import view as gx_view

        view_class = gx_view.DefaultJinjaView
        original_init = view_class.__dict__["__init__"]
    except (ImportError, AttributeError, KeyError):  # pragma: no cover - a GX without the class
        return lambda: None
    cache = jinja2.FileSystemBytecodeCache()

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        env = getattr(self, "env", None)
        if isinstance(env, jinja2.Environment) and env.bytecode_cache is None:
            env.bytecode_cache = cache

    view_class.__init__ = init  # type: ignore[method-assign]

    def undo() -> None:
        view_class.__init__ = original_init  # type: ignore[method-assign]

    return undo
