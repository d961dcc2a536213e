"""One counted installation of process-wide hooks, shared by the simulator's adapters.

Each adapter (rank-owned threads, torch.distributed, torch's RPC, the clock's import and optimizer
hooks) patches process-wide objects while at least one simulated world runs.  Nested and concurrent
worlds share one installation: the first ``enabled()`` installs, the last one to leave restores
exactly what was there.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

__all__ = ["Installation", "replace"]


def replace(owner: Any, name: str, value: Any) -> Callable[[], None]:
    """Set ``owner.name`` to ``value``; returns the undo, which puts back exactly what was there (an attribute
    the owner's own ``__dict__`` lacked is removed again, so an inherited one shows through)."""
    had = name in vars(owner)
    previous = vars(owner).get(name)
    setattr(owner, name, value)

    def undo() -> None:
        if had:
            setattr(owner, name, previous)
        else:
            delattr(owner, name)

    return undo


class Installation:
    """``install()`` on the first :meth:`enabled`, ``uninstall()`` when the last one leaves.

    An ``install()`` that raises is undone with ``uninstall()`` (which must therefore tolerate a partial
    installation) and the error propagates.
    """

    def __init__(self, install: Callable[[], None], uninstall: Callable[[], None]) -> None:
        self._install = install
        self._uninstall = uninstall
        self._lock = threading.Lock()
        self._active = 0

    @property
    def active(self) -> bool:
        return self._active > 0

    @contextlib.contextmanager
    def enabled(self) -> Iterator[None]:
        with self._lock:
            if self._active == 0:
                try:
                    self._install()
                except BaseException:
                    self._uninstall()
                    raise
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self._uninstall()
