"""Find the user's line that issued a call: the first frame outside the library code.

Frames in tensorplay/, simulator/, torch/ and the threading/runpy machinery
are skipped.  Walking ``sys._getframe`` costs a few microseconds; the verdict
per file name is cached.

A collective that torch issues inside one of its composite calls (``broadcast_object_list`` sends a tensor of
sizes first) is named with that call: ``"file.py:5 in broadcast_object_list"``, so that a mismatch report names
what the user wrote, not torch's internal tensor.
"""
from __future__ import annotations

import os
import runpy
import threading
from sys import _getframe  # (bound once: while a world runs, sys's attributes are looked up in Python)

import torch

import tensorplay

__all__ = ["call_site", "split_site", "COMPOSITES", "C10D_FILE"]

_SKIP_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (tensorplay, torch)
) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # the simulator package (this is core/)
_SKIP_FILES = {os.path.abspath(threading.__file__), os.path.abspath(runpy.__file__)}
_verdict: dict[str, str | None] = {}  # file name -> its basename if it is user code, None if library
C10D_FILE = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "distributed", "distributed_c10d.py")
_LIB = None
_COMPOSITE = ""  # the verdict of distributed_c10d.py: library code whose function names are worth keeping
# torch's calls that issue collectives of their own on tensors the user never sees
COMPOSITES = frozenset({"broadcast_object_list", "scatter_object_list", "gather_object", "all_gather_object",
                        "send_object_list", "recv_object_list"})


def _user_name(filename: str) -> str | None:
    """``basename(filename)`` for a user's file, ``None`` for library code (cached per file name)."""
    try:
        return _verdict[filename]
    except KeyError:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        lib = path.startswith(_SKIP_DIRS) or path in _SKIP_FILES or filename.startswith("<frozen")
        name = (_COMPOSITE if path == C10D_FILE else _LIB) if lib else os.path.basename(filename)
        _verdict[filename] = name
        return name


def call_site(depth: int = 2) -> str:
    """``"file.py:123"`` of the first non-library frame above the caller (``"?"`` if none), with
    ``" in broadcast_object_list"`` (one of :data:`COMPOSITES`) when torch issued the call inside it."""
    try:
        f = _getframe(depth)
    except ValueError:  # pragma: no cover
        return "?"
    within = ""
    while f is not None:
        name = _user_name(f.f_code.co_filename)
        if name:
            return f"{name}:{f.f_lineno}{within}"
        if name is _COMPOSITE and f.f_code.co_name in COMPOSITES:
            within = f" in {f.f_code.co_name}"
        f = f.f_back
    return "?"


def split_site(site: str) -> tuple[str, str]:
    """``("file.py:5", "broadcast_object_list")`` from a site of :func:`call_site` (``""``: not in a composite)."""
    where, sep, api = site.rpartition(" in ")
    return (where, api) if sep and api in COMPOSITES else (site, "")
