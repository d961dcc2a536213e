"""Backend registry: one interface (:class:`Backend`), implementations keyed by name.

``gloo`` and ``nccl`` run on torch's c10d (:mod:`.c10d`).  ``sim`` is the
in-process simulator; its backend module (``simulator.core.backend``) registers it
when imported, and the registry imports that module lazily the first time
``"sim"`` is asked for (a bare ``import simulator`` is lazy and imports nothing).

Writing a backend: :mod:`tensorplay.distributed.backends.kit` gathers everything
a backend (or a harness that starts worlds itself) needs from tensorplay.
"""
from __future__ import annotations

import importlib
from typing import Type

from .base import Backend, ChainedWork, CompletedWork, Work

__all__ = ["Backend", "Work", "CompletedWork", "ChainedWork", "register_backend", "get_backend_class", "registered"]

_REGISTRY: dict[str, Type[Backend]] = {}
# name -> module that registers it on import (kept lazy: importing the
# simulator or torch's c10d costs time nobody should pay up front)
_LAZY: dict[str, str] = {
    "gloo": "tensorplay.distributed.backends.c10d",
    "nccl": "tensorplay.distributed.backends.c10d",
    "sim": "simulator.core.backend",
}


def register_backend(name: str, cls: Type[Backend]) -> None:
    """Register ``cls`` under ``name`` (lower case); a later registration replaces an earlier one."""
    _REGISTRY[name.lower()] = cls


def get_backend_class(name: str) -> Type[Backend]:
    """The class registered under ``name`` (importing its module first if it registers lazily); ``KeyError``
    when none is."""
    key = name.lower()
    if key not in _REGISTRY and key in _LAZY:
        importlib.import_module(_LAZY[key])
    try:
        return _REGISTRY[key]
    except KeyError:
        raise KeyError(name) from None


def registered() -> list[str]:
    """Every backend name that :func:`get_backend_class` can answer, sorted."""
    return sorted(set(_REGISTRY) | set(_LAZY))
