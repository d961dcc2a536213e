"""Find the user's line that issued a call: the first frame outside the library code.

Frames in tensorplay/, simulator/, torch/ and the threading/runpy machinery
are skipped.  Walking ``sys._getframe`` costs a few microseconds; the verdict
per file name is cached.
"""
from __future__ import annotations

import os
import runpy
import sys
import threading

import torch

import tensorplay

__all__ = ["call_site"]

_SKIP_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (tensorplay, torch)
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
_SKIP_FILES = {os.path.abspath(threading.__file__), os.path.abspath(runpy.__file__)}
_verdict: dict[str, bool] = {}


def _is_library(filename: str) -> bool:
    v = _verdict.get(filename)
    if v is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        v = path.startswith(_SKIP_DIRS) or path in _SKIP_FILES or filename.startswith("<frozen")
        _verdict[filename] = v
    return v


def call_site(depth: int = 2) -> str:
    """``"file.py:123"`` of the first non-library frame above the caller (``"?"`` if none)."""
    try:
        f = sys._getframe(depth)
    except ValueError:  # pragma: no cover
        return "?"
    while f is not None:
        code = f.f_code
        if not _is_library(code.co_filename):
            return f"{os.path.basename(code.co_filename)}:{f.f_lineno}"
        f = f.f_back
    return "?"
