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

import contextlib
import dataclasses
import importlib.machinery
import importlib.util
import io
import os
import runpy
import sys
import types
from typing import Any, Callable, ContextManager, Sequence

from simulator.adapters._patch import Installation
from simulator.core.state import current_rank_state

__all__ = ["Program", "ProgramNotFoundError", "run_path", "run_as_main", "enabled"]

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


_COMPILED: dict[tuple[str, int, int], Any] = {}  # the last script compiled: (path, mtime, size) -> code


def script_module(path: str) -> tuple[Any, types.ModuleType]:
    """The code of the script at ``path`` and a fresh ``__main__`` module to run it in, as ``runpy.run_path(path,
    run_name="__main__")`` makes them (without touching ``sys.argv``, which run_path sets to ``path``)."""
    stat = os.stat(path)
    key = (path, stat.st_mtime_ns, stat.st_size)
    code = _COMPILED.get(key)
    if code is None:  # compiled once for every rank (a code object is immutable; each rank runs it in its module)
        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec")
        _COMPILED.clear()
        _COMPILED[key] = code
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __cached__=None, __doc__=None, __loader__=None, __package__="",
                           __spec__=None)
    return code, module


class ProgramNotFoundError(ImportError):
    """``-m name`` names no module python can run (python says so in one line and exits with 1)."""


def _main_spec(name: str) -> importlib.machinery.ModuleSpec:
    """The spec ``python -m name`` runs: the module, or a package's ``__main__`` (importing the parent packages,
    as ``python -m`` does).  ImportError, in python's words, when there is none."""
    if name.startswith("."):
        raise ProgramNotFoundError("Relative module names not supported")
    try:
        spec = importlib.util.find_spec(name)
    except ImportError as e:  # a parent package is missing, or its import failed
        raise ProgramNotFoundError(f"Error while finding module specification for {name!r} "
                                   f"({type(e).__name__}: {e})") from e
    if spec is None:
        raise ProgramNotFoundError(f"No module named {name}")
    if spec.submodule_search_locations is not None:  # a package: its __main__ runs
        if name == "__main__" or name.endswith(".__main__"):
            raise ProgramNotFoundError("Cannot use package as __main__ module")
        try:
            return _main_spec(name + ".__main__")
        except ImportError as e:
            raise ProgramNotFoundError(f"{e}; {name!r} is a package and cannot be directly executed") from None
    if spec.loader is None:
        raise ProgramNotFoundError(f"{name!r} is a namespace package and cannot be executed")
    return spec


def module_main(name: str) -> tuple[Any, types.ModuleType]:
    """The code of module ``name`` and a fresh ``__main__`` module to run it in, as ``python -m name`` (and
    ``runpy.run_module(name, run_name="__main__")``) makes them: ``__package__`` and ``__spec__`` set, so the
    module's relative imports work."""
    spec = _main_spec(name)
    code = spec.loader.get_code(spec.name)  # type: ignore[union-attr]
    if code is None:
        raise ProgramNotFoundError(f"No code object available for {name}")
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=spec.origin, __cached__=spec.cached, __doc__=None, __loader__=spec.loader,
                           __package__=spec.parent, __spec__=spec)
    return code, module


@dataclasses.dataclass(frozen=True)
class Program:
    """What ``python -m simulator`` runs on each rank: a script (``typed`` is its path as the command line gave
    it) or, with ``module``, a module run as ``python -m typed`` runs it."""

    typed: str
    module: bool = False

    @property
    def folder(self) -> str:
        """``sys.path[0]`` as python gives it: the script's folder (a directory run as a script: itself), or for
        ``-m`` the working directory."""
        if self.module:
            return os.getcwd()
        typed = os.path.abspath(self.typed)
        return typed if os.path.isdir(typed) else os.path.dirname(typed)

    @property
    def script(self) -> str:
        """The file a script program runs: the script, or for a directory (``python dir``) its ``__main__.py``."""
        typed = os.path.abspath(self.typed)
        return os.path.join(typed, "__main__.py") if os.path.isdir(typed) else typed

    def load(self) -> tuple[Any, types.ModuleType]:
        """The program's code and a fresh ``__main__`` module to run it in (``self.folder`` must be on
        ``sys.path`` for a module).  SyntaxError or ImportError, in python's words."""
        return module_main(self.typed) if self.module else script_module(self.script)

    def argv0(self, main: types.ModuleType) -> str:
        """``sys.argv[0]``: the script's path as typed, or the module's file (as python and torchrun give them)."""
        return main.__file__ if self.module else self.typed  # type: ignore[return-value]


def run_path(program: Program) -> None:
    """Run ``program`` as the calling rank's ``__main__`` (as ``runpy.run_path(path, run_name="__main__")`` or
    ``runpy.run_module`` runs it in a process)."""
    rs = current_rank_state()
    if rs is None or not _INSTALLATION.active:
        if program.module:
            runpy.run_module(program.typed, run_name="__main__")
        else:
            runpy.run_path(program.typed, run_name="__main__")
        return
    code, module = program.load()
    if program.module:  # (the thread ranks share sys.argv: each writes the same file name)
        sys.argv[0] = program.argv0(module)
    rs.own()[_KEY] = module  # (kept after the rank returns: its RPC handlers still run in it until shutdown)
    exec(code, module.__dict__)


def run_as_main(program: Program, argv: Sequence[str],
                watch: Callable[[str], ContextManager[Any]] | None = None) -> None:
    """Run ``program`` as this process's ``__main__`` as python runs it: ``sys.path[0]`` its folder, ``sys.argv``
    ``[argv0, *argv]``, ``sys.modules["__main__"]`` its module (all three put back after).  ``watch(file)``, when
    given, is entered around the run (the launcher's :class:`~simulator.launch_seeds.SeedWatch`)."""
    folder, old_argv = program.folder, sys.argv
    before = {name: sys.modules.get(name) for name in ("__main__", "__mp_main__")}
    sys.path.insert(0, folder)
    try:
        code, main = program.load()
        sys.argv = [program.argv0(main), *argv]
        # and multiprocessing's alias of __main__ (set when it is first imported: in `python script.py`, the script):
        # a child process pickles the script's classes as __mp_main__.Name, which the launcher finds there
        sys.modules["__main__"] = sys.modules["__mp_main__"] = main
        with watch(main.__file__) if watch is not None else contextlib.nullcontext():  # type: ignore[arg-type]
            exec(code, main.__dict__)
    finally:
        for name, module in before.items():  # (as runpy puts __main__ back)
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        sys.argv = old_argv
        if sys.path and sys.path[0] == folder:
            del sys.path[0]


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
