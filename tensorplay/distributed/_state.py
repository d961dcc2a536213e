"""Where the calling rank's distributed state lives.

A real backend has one state per process.  The simulator runs many ranks as
threads of one process, so a thread may carry its own state, which then takes
precedence.  Everything in the API asks :func:`current` and never caches it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .backends.base import Backend
    from .group import ProcessGroup

__all__ = ["DistState", "current", "set_process_state", "bind_thread", "unbind_thread"]


@dataclass
class DistState:
    """One rank's view: its backend, the world group and the groups it created."""

    backend: "Backend"
    world: "ProcessGroup"
    timeout_s: float
    groups: list["ProcessGroup"] = field(default_factory=list)
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
    global _process_state
    _process_state = state


def bind_thread(state: DistState | None) -> None:
    """Give the calling thread its own state (used by the simulator for each rank thread)."""
    _thread.state = state


def unbind_thread() -> None:
    _thread.state = None


# -- which autograd backward (if any) the calling rank is running -------------
# The autograd collectives mark their backward so a backend can explain a
# stuck backward ("rank 1 never ran the backward of reduce") instead of only
# reporting a wait.


class backward_of:
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
