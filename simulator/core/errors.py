"""Errors the simulator raises on top of tensorplay.distributed's hierarchy.

Every class is a :class:`tensorplay.distributed.DistError` and a ``RuntimeError``,
so ``except DistError`` catches anything the simulator reports.  What the simulator reports at once where a
real backend fails later (a deadlock, a mismatch, a failed peer) is also what that backend raises then, so a
program's own ``except`` clauses run as on gloo: ``torch.distributed.DistBackendError`` and tensorplay's
``DistBackendError`` (a peer's closed connection, torch's timeouts).  Not ``TimeoutError``, which tensorplay's
gloo backend raises when a wait runs out: an ``OSError`` (the simulator's own ``except OSError`` clauses around
its channels would catch it); docs/deviations.md.

An *incident* is one event that several ranks learn about at once (a mismatch
in one collective, one deadlock, one rank's failure).  Every rank raises its own
exception object for it, but they share ``incident`` so :func:`simulator.run`
reports the incident once.
"""
from __future__ import annotations

import torch.distributed

from tensorplay.distributed.errors import DistBackendError, DistError, DistTimeoutError

__all__ = [
    "SimError",
    "CollectiveMismatchError",
    "DeadlockError",
    "RankFailedError",
    "RankExitError",
    "InjectedFault",
    "SimTimeoutError",
    "ExploreError",
    "NotReproducibleError",
    "also_a",
]


class SimError(DistError, RuntimeError):
    """Root of the simulator's own errors."""

    #: the shared incident object (see module docstring); ``None`` for one-rank errors
    incident: object = None
    #: the global rank that raised it (set by the simulator)
    rank: int | None = None


class CollectiveMismatchError(SimError, DistBackendError, torch.distributed.DistBackendError):
    """Members of a group called different collectives (or disagree on op, root, dtype, shape, splits)
    at the same position of the group's sequence.  Raised on every member, with a table of the calls."""


class DeadlockError(SimError, DistBackendError, torch.distributed.DistBackendError):
    """Every live rank is blocked and nothing can make progress; the message says what each waits for."""


class RankFailedError(SimError, DistBackendError, torch.distributed.DistBackendError):
    """Another rank failed; this rank was released from its current (or next) wait.

    ``failed_rank`` is the global rank whose exception started it; ``__cause__``
    is that exception.
    """

    failed_rank: int | None = None


def os_status(code: int) -> int:
    """The status a process that exits with ``code`` reports to its parent: the low 8 bits, as POSIX keeps them
    (``sys.exit(256)`` is a success, ``sys.exit(-3)`` is 253, ``os._exit(300)`` is 44)."""
    return code & 0xFF


class RankExitError(SimError):
    """A rank's code called ``sys.exit(code)`` (or raised ``SystemExit``) with a non-zero code.

    On real processes that rank's process ends with that status and torchrun
    reports the child as failed; here the rank fails, every other rank is
    released with :class:`RankFailedError` naming it, and :func:`simulator.run`
    raises this error.  ``exit_code`` is the status the rank's parent sees (an int code's low 8 bits:
    :func:`os_status`).  ``sys.exit(0)``, ``sys.exit(256)`` and ``sys.exit()`` are a normal return, as for a process.
    """

    exit_code: object = None


class InjectedFault(SimError):
    """Raised on purpose by a :class:`simulator.Crash` fault."""


class SimTimeoutError(SimError, DistTimeoutError):
    """A bound of the run ran out: ``stall_timeout`` (actors waited while nothing progressed for that long) or
    the whole-run ``timeout``.  The message says which, who waits where and where computing ranks are."""

    #: which bound ran out: ``"stall_timeout"`` or ``"timeout"`` (None: a rank's own backstop, see the message)
    bound: str | None = None


class ExploreError(SimError):
    """A run under :func:`simulator.explore` failed; ``seed`` names it and ``__cause__`` is the failure."""

    seed: int | None = None


class NotReproducibleError(SimError):
    """Two runs with the same seed produced different traces or results."""


_MIXED: dict[tuple[type, type], type] = {}


def also_a(e: BaseException, kind: type) -> BaseException:
    """``e``, re-classed in place as ``kind`` too (a subclass of both ``type(e)`` and ``kind``, made once per pair,
    with ``type(e)``'s name): an error of tensorplay's that must also be what torch's API raises there, for the
    program's own ``except`` clauses.  ``e`` is returned as it is when it is one already."""
    if not isinstance(e, kind):
        t = type(e)
        both = _MIXED.get((t, kind))
        if both is None:
            both = _MIXED[(t, kind)] = type(t.__name__, (t, kind), {"__module__": t.__module__,
                                                                     "__qualname__": t.__qualname__})
        e.__class__ = both
    return e
