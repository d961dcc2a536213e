"""Where the calling rank's distributed state lives (public: backends and harnesses install worlds here).

A real backend has one state per process.  A harness that runs many ranks as
threads of one process (the simulator) gives each thread its own state, which
then takes precedence over the process's.  Everything in the API asks
:func:`current` and never caches it.

For backend and transport authors (see :mod:`tensorplay.distributed.backends.kit`):

* :func:`install_backend` makes a started backend the calling rank's world
  (``thread_local=True``: only the calling thread's), :func:`uninstall` forgets it;
* :func:`bind_thread` / :func:`unbind_thread` hand a state to another thread
  (a rank's helper threads see the rank's world);
* :func:`backward_of` / :func:`current_backward` say which collective's
  autograd backward the calling thread is running, so a backend can explain a
  stuck backward.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TYPE_CHECKING

from .group import ProcessGroup

if TYPE_CHECKING:  # pragma: no cover
    from .backends.base import Backend

__all__ = ["DistState", "current", "set_process_state", "bind_thread", "unbind_thread", "install_backend",
           "uninstall", "backward_of", "current_backward"]


@dataclass
class DistState:
    """One rank's view: its backend, the world group and the groups it created."""

    backend: "Backend"
    world: ProcessGroup
    timeout_s: float
    groups: list[ProcessGroup] = field(default_factory=list)
    #: caches of tools built on the API that must live exactly as long as this rank's world (e.g. the
    #: conformance suite's subgroups); cleared with the state
    cache: dict[Any, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def world_size(self) -> int:
        return self.backend.world_size


_process_state: DistState | None = None
_thread = threading.local()


def current() -> DistState | None:
    """The calling thread's state if it has one, else the process's, else ``None``."""
    st = getattr(_thread, "state", None)
    return st if st is not None else _process_state


def set_process_state(state: DistState | None) -> None:
    """Make ``state`` the process's state (``None``: the process has none)."""
    global _process_state
    _process_state = state


def bind_thread(state: DistState | None) -> None:
    """Give the calling thread its own state (the simulator binds one per rank thread)."""
    _thread.state = state


def unbind_thread() -> None:
    """The calling thread falls back to the process's state (and forgets a world it left: see :func:`rejoin`)."""
    _thread.state = None
    _thread.left = None


def install_backend(backend: "Backend", timeout: timedelta, *, thread_local: bool = False) -> DistState:
    """Make ``backend`` (started, knowing its rank and world size) the calling rank's default world.

    ``init_process_group`` calls this for gloo/nccl; a harness that starts worlds itself calls it on each
    rank (``thread_local=True`` when the rank is a thread).  ``timeout`` becomes the default of new groups.
    """
    world = ProcessGroup(range(backend.world_size), backend, backend.world_handle(), group_id=0)
    st = DistState(backend=backend, world=world, timeout_s=timeout.total_seconds())
    if thread_local:
        bind_thread(st)
    else:
        set_process_state(st)
    return st


def uninstall(state: DistState) -> None:
    """Forget ``state`` where it is installed: the calling thread's binding if it is that, else the process's.

    A rejoinable backend's state is kept aside there (see :func:`rejoin`)."""
    kept = state if state.backend.rejoinable else None
    if getattr(_thread, "state", None) is state:
        unbind_thread()
        _thread.left = kept
    else:
        set_process_state(None)
        global _process_left
        _process_left = kept


_process_left: DistState | None = None


def rejoin(timeout: timedelta) -> DistState | None:
    """The world the calling rank left with ``destroy_process_group``, installed again where it was (a default
    group afresh, ``timeout`` its new groups' default), if its backend is rejoinable; else None."""
    global _process_left
    left = getattr(_thread, "left", None)
    if left is not None:
        _thread.left = None
        return install_backend(left.backend, timeout, thread_local=True)
    if _process_left is not None and getattr(_thread, "state", None) is None:
        left, _process_left = _process_left, None
        return install_backend(left.backend, timeout)
    return None


# -- which autograd backward (if any) the calling rank is running -------------
# The autograd collectives mark their backward so a backend can explain a
# stuck backward ("rank 1 never ran the backward of reduce") instead of only
# reporting a wait.


class backward_of:  # noqa: N801  (used as a context manager, read like a function)
    """Context manager: the calling thread is running the backward of ``collective``."""

    __slots__ = ("name",)

    def __init__(self, collective: str) -> None:
        self.name = collective

    def __enter__(self) -> "backward_of":
        stack = getattr(_thread, "backward", None)
        if stack is None:
            stack = _thread.backward = []
        stack.append(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        _thread.backward.pop()


def current_backward() -> str | None:
    """Name of the collective whose backward the calling thread is in, or ``None``."""
    stack = getattr(_thread, "backward", None)
    return stack[-1] if stack else None
