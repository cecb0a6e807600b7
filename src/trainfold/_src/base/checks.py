"""Argument checks and names that know nothing of the run: positive ints, lengths, readable names of functions, notes on errors."""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any, Callable, TypeVar

import toolz

_F = TypeVar("_F", bound=Callable[..., Any])


def name_of(fn: Any) -> str:
    """A readable name for a function, a curry (its function's name) or a callable object."""
    fn = getattr(fn, "func", fn)
    return getattr(fn, "__name__", None) or type(fn).__name__


def named(fn: _F, name: str) -> _F:
    """Give a composed function a readable ``__name__`` and ``__qualname__`` (like toolz's Compose)."""
    fn.__name__ = fn.__qualname__ = name
    return fn


#: where trainfold's and toolz's code lives: frames a warning is not attributed to
_LIBRARY_DIRS = (
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep,
    os.path.dirname(os.path.abspath(toolz.__file__)) + os.sep,
)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn`` name the first line outside trainfold and toolz: the user's.

    Called as ``warnings.warn(..., stacklevel=user_stacklevel())``: a fixed level names the right line for one
    composition only (through ``loop``, ``compose`` and a curried primitive, the warning pointed into toolz).
    """
    frame: FrameType | None = sys._getframe(1)  # the function that warns: level 1
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def add_note(exc: BaseException, note: str) -> None:
    """Attach context to an exception without changing its type (PEP 678 where available)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def positive_int(name: str, n: Any) -> int:
    """Return ``n`` if it is a positive int, else raise a ValueError naming ``name``."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{name} must be a positive int (got {n!r}).")
    return n


def counter(name: str, v: Any) -> int:
    """Return ``v`` if it is a non-negative int (a count read from a checkpoint), else raise a ValueError naming ``name``."""
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"counter {name!r} is {v!r}, not a non-negative int")
    return v


def length_or_none(x: Any) -> int | None:
    """``len(x)``, or None for an object without a length (an iterable loader)."""
    try:
        return len(x)
    except TypeError:
        return None
