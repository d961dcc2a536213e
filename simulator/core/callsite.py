"""Find the user's line that issued a call: the first frame outside the library code.

Frames in tensorplay/, simulator/, torch/ and the threading/runpy machinery
are skipped.  Walking ``sys._getframe`` costs a few microseconds; the verdict
per file name is cached.
"""
from __future__ import annotations

import os
import runpy
import threading
from sys import _getframe  # (bound once: while a world runs, sys's attributes are looked up in Python)

import torch

import tensorplay

__all__ = ["call_site"]

_SKIP_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (tensorplay, torch)
) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # the simulator package (this is core/)
_SKIP_FILES = {os.path.abspath(threading.__file__), os.path.abspath(runpy.__file__)}
_verdict: dict[str, str | None] = {}  # file name -> its basename if it is user code, None if library


def _user_name(filename: str) -> str | None:
    """``basename(filename)`` for a user's file, ``None`` for library code (cached per file name)."""
    try:
        return _verdict[filename]
    except KeyError:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        lib = path.startswith(_SKIP_DIRS) or path in _SKIP_FILES or filename.startswith("<frozen")
        name = None if lib else os.path.basename(filename)
        _verdict[filename] = name
        return name


def call_site(depth: int = 2) -> str:
    """``"file.py:123"`` of the first non-library frame above the caller (``"?"`` if none)."""
    try:
        f = _getframe(depth)
    except ValueError:  # pragma: no cover
        return "?"
    while f is not None:
        name = _user_name(f.f_code.co_filename)
        if name is not None:
            return f"{name}:{f.f_lineno}"
        f = f.f_back
    return "?"
