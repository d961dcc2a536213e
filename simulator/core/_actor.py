"""Which simulated actor (a rank, or a thread a rank started) runs on the calling OS thread.

The bottom of the simulator's imports: the state, the schedulers and the adapters all ask it, and it
imports nothing of the simulator.  The actor states are here too, shared by the state, the schedulers and
the reports.
"""
from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["current_rank_state", "quiet", "bind_env", "unbind_env", "rank_env", "start_thread_plainly", "NOT_STARTED", "RUNNABLE", "BLOCKED", "DONE", "FREE"]

#: an actor's state in its run's schedule (``RankState.state``); FREE: a thread a rank started, running
#: outside the scheduler (it enters it only for its operations)
NOT_STARTED, RUNNABLE, BLOCKED, DONE, FREE = 0, 1, 2, 3, 4

#: per OS thread: ``rs`` (the actor running on it) and, for the torch adapter, ``world``
_local = threading.local()


def current_rank_state() -> Any:
    """The calling rank thread's state (a :class:`simulator.core.state.RankState`), or ``None`` outside a world."""
    return getattr(_local, "rs", None)


def _forked_from_a_rank() -> None:
    # A process forked from a rank thread (a pool worker, a fork of its own) is a real process outside the world:
    # no scheduler runs there, so its joins, waits and exits are its own.  (It keeps the rank's environment.)
    _local.rs = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked_from_a_rank)


#: per OS thread: ``depth > 0`` inside ``Thread.start`` (whose short wait for the new thread must not step out
#: of the schedule) and around the simulator's own thread starts
quiet = threading.local()
#: per OS thread: the environment dict a rank's ``os.environ`` reads (simulator.adapters._environ); None: the real
_env = threading.local()
#: ``Thread.start`` as it was before any adapter: the simulator's own threads are never adopted by a rank
_THREAD_START = threading.Thread.start


def bind_env(env: "dict[str, str] | None") -> None:
    """Give the calling thread a rank's environment (a copy of the real one plus the rank's variables)."""
    _env.env = env


def unbind_env() -> None:
    _env.env = None


def rank_env() -> "dict[str, str] | None":
    """The calling thread's rank environment, or ``None`` (the real one)."""
    return getattr(_env, "env", None)


def start_thread_plainly(t: threading.Thread) -> None:
    """Start ``t`` as a thread of the simulator's own (not adopted by the calling rank, whoever calls)."""
    quiet.depth = getattr(quiet, "depth", 0) + 1
    try:
        _THREAD_START(t)
    finally:
        quiet.depth -= 1
