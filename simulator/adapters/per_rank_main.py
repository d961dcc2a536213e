"""``sys.modules["__main__"]``: each thread rank's own script module.

A script run under ``python -m simulator`` runs once per rank, each run in a module of its own, as each
process runs it as its ``__main__``.  Python names a script's functions and classes by that module's name,
``__main__``, and finds them again through ``sys.modules["__main__"]``: pickle sends a function by that
reference (``rpc_sync("worker0", incr)``), the receiver looks it up there, ``import __main__`` reads it.  On
thread ranks that entry is one slot for every rank: ``runpy`` set it to whichever rank started last, so a
function pickled on one rank was found in another rank's module (or not at all), and an RPC handler ran
against the wrong rank's globals, its state lost.

While a world runs, the entry holds a dispatcher that forwards every attribute to the calling thread's rank's
own script module (:func:`run_path` makes it, and a thread the rank starts shares it), and outside a rank to
the process's.  Rank processes are processes: :func:`run_path` is ``runpy.run_path`` there.

Example (two ranks; each finds its own ``COUNT`` through ``__main__``)::

    python -m simulator --nproc-per-node 2 script.py    # script.py: COUNT = rank; import __main__
"""
from __future__ import annotations

import io
import runpy
import sys
import types
from typing import Any, ContextManager

from simulator.adapters._patch import Installation
from simulator.core.state import current_rank_state

__all__ = ["run_path", "enabled"]

_KEY = (0, "__main__")  # in RankState.own()
_PROCESS: list[Any] = [None]  # the process's __main__ while a world runs


def _target() -> types.ModuleType:
    rs = current_rank_state()
    if rs is not None:
        module = rs.own().get(_KEY)
        if module is not None:
            return module
    return _PROCESS[0]


class _RankMain(types.ModuleType):
    """``sys.modules["__main__"]`` while a world runs: the calling rank's script module, seen through."""

    def __getattribute__(self, name: str) -> Any:
        return getattr(_target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(_target(), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(_target(), name)

    def __dir__(self) -> list[str]:
        return dir(_target())

    def __repr__(self) -> str:
        return repr(_target())


def script_module(path: str) -> tuple[Any, types.ModuleType]:
    """The code of the script at ``path`` and a fresh ``__main__`` module to run it in, as ``runpy.run_path(path,
    run_name="__main__")`` makes them (without touching ``sys.argv``, which run_path sets to ``path``)."""
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec")
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __cached__=None, __doc__=None, __loader__=None, __package__="",
                           __spec__=None)
    return code, module


def run_path(path: str) -> None:
    """Run the script at ``path`` as the calling rank's ``__main__`` (as ``runpy.run_path(path, run_name=
    "__main__")`` runs it in a process)."""
    rs = current_rank_state()
    if rs is None or not _INSTALLATION.active:
        runpy.run_path(path, run_name="__main__")
        return
    code, module = script_module(path)
    rs.own()[_KEY] = module  # (kept after the rank returns: its RPC handlers still run in it until shutdown)
    exec(code, module.__dict__)


def _install() -> None:
    _PROCESS[0] = sys.modules["__main__"]
    sys.modules["__main__"] = _RankMain("__main__")


def _uninstall() -> None:
    if _PROCESS[0] is not None:
        sys.modules["__main__"] = _PROCESS[0]
        _PROCESS[0] = None


_INSTALLATION = Installation(_install, _uninstall)


def enabled() -> ContextManager[None]:
    """While active, ``sys.modules["__main__"]`` is the calling thread rank's own script module."""
    return _INSTALLATION.enabled()
