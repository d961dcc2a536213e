"""Per-rank ``os.environ`` for scripts run by ``python -m simulator``.

While a simulated world runs, ``os.environ`` is replaced by a mapping that
reads and writes the calling rank thread's own dictionary (so ``RANK`` differs
per rank) and falls back to the real environment outside rank threads.  The
real ``os.environ`` object is put back when the run ends.

A rank's assignment also reaches the process's C environment (``putenv``), as
``os.environ``'s own does: code that reads it with ``getenv`` (a compiled
extension: torch inductor's generated modules read the address Python stored in
``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR``) sees the latest value a rank set
(thread ranks share one C environment).  The process's values are back in the C
environment when the run ends.
"""
from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import MutableMapping
from typing import Iterator

from simulator.core._actor import bind_env, rank_env, unbind_env

try:  # (POSIX only; subprocess and multiprocessing start every child through it)
    import _posixsubprocess
except ImportError:  # pragma: no cover
    _posixsubprocess = None  # type: ignore[assignment]

__all__ = ["RankEnviron", "install", "uninstall", "bind", "unbind"]

_installed: "RankEnviron | None" = None
_touched: set[str] = set()  # what ranks set or deleted in the C environment while installed
_depth = 0
_lock = threading.Lock()


class RankEnviron(MutableMapping):
    """``os.environ`` stand-in that dispatches to the current rank thread's dict."""

    def __init__(self, real: "os._Environ[str]") -> None:
        self._real = real

    def _target(self) -> MutableMapping:
        d = rank_env()
        return self._real if d is None else d

    def __getitem__(self, key: str) -> str:
        return self._target()[key]

    def __setitem__(self, key: str, value: str) -> None:
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"str expected, not {type(key).__name__ if not isinstance(key, str) else type(value).__name__}")
        target = self._target()
        target[key] = value
        if target is not self._real:
            os.putenv(key, value)  # (see the module docstring)
            _touched.add(key)

    def __delitem__(self, key: str) -> None:
        target = self._target()
        del target[key]
        if target is not self._real:
            os.unsetenv(key)
            _touched.add(key)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._target()))

    def __len__(self) -> int:
        return len(self._target())

    def copy(self) -> dict:
        return dict(self._target())

    def __repr__(self) -> str:
        return f"RankEnviron({dict(self._target())!r})"

    # os.environ API used by some libraries
    def __getattr__(self, name: str):
        return getattr(self._real, name)


def _inheriting(fork_exec):  # noqa: ANN001, ANN202  (CPython's private spawner: see install)
    """``_posixsubprocess.fork_exec`` that gives a child started by a rank thread without an explicit environment
    (``subprocess.run(...)``, a ``spawn``-context DataLoader worker) the rank's environment, as a process's child
    inherits its parent's (``RANK``, ``LOCAL_RANK`` from the launcher): the C environment is the launcher's."""
    def spawn(*args):  # noqa: ANN002, ANN202
        env = rank_env()
        if env is not None and len(args) > 5 and args[5] is None:  # (args, executable_list, close_fds, fds, cwd, env
            args = (*args[:5], [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()], *args[6:])
        return fork_exec(*args)

    spawn.original = fork_exec  # type: ignore[attr-defined]
    return spawn


def install() -> None:
    """Replace ``os.environ`` (nested installs are counted), and make the children rank threads start inherit it."""
    global _installed, _depth
    with _lock:
        if _depth == 0:
            _installed = RankEnviron(os.environ)
            os.environ = _installed  # type: ignore[assignment]
            if _posixsubprocess is not None:
                _posixsubprocess.fork_exec = _inheriting(_posixsubprocess.fork_exec)
                if getattr(subprocess, "_fork_exec", None) is _posixsubprocess.fork_exec.original:
                    subprocess._fork_exec = _posixsubprocess.fork_exec  # (bound by name on import)
        _depth += 1


def uninstall() -> None:
    global _installed, _depth
    with _lock:
        _depth -= 1
        if _depth == 0 and _installed is not None:
            real = os.environ = _installed._real  # type: ignore[assignment]
            _installed = None
            if _posixsubprocess is not None and hasattr(_posixsubprocess.fork_exec, "original"):
                _posixsubprocess.fork_exec = _posixsubprocess.fork_exec.original
                if hasattr(getattr(subprocess, "_fork_exec", None), "original"):
                    subprocess._fork_exec = _posixsubprocess.fork_exec
            for key in _touched:  # the process's own values, in the C environment too
                if key in real:
                    os.putenv(key, real[key])
                else:
                    os.unsetenv(key)
            _touched.clear()


def bind(env: dict[str, str]) -> None:
    """Give the calling rank thread its own environment (a copy of the real one plus ``env``)."""
    bind_env(env)


def unbind() -> None:
    unbind_env()
