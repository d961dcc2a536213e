"""Ranks that stand for processes the program started itself (``mp.spawn``, ``Process``, torch's test harness).

Such a process has only the environment it inherited and the variables it set: nothing of what torchrun (or the
simulator's torchrun-style launch, or ``simulator.run``) gives its ranks.  torch's ``env://`` rendezvous reads
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` from it, so on such a rank a missing one fails as it
fails there (:func:`require_env`), before the simulator stands in for the rendezvous itself.

Example (a spawned rank that set nothing)::

    def rank_fn(rank, size):
        dist.init_process_group("gloo")   # ValueError: ... environment variable RANK expected, but not set

    mp.spawn(rank_fn, args=(2,), nprocs=2)   # under python -m simulator, as on real processes
"""
from __future__ import annotations

import os
from typing import Any, Callable

from simulator.core._actor import current_rank_state

__all__ = ["launched_process", "started_by_the_program", "require_env"]

#: set in a rank process that stands for a process the program started itself (simulator.isolation.launched)
launched_process = False


def started_by_the_program() -> bool:
    """The calling rank stands for a process the program started, not one a torchrun-style launch or
    ``simulator.run`` made (a thread rank's world says so: ``world.launched``, set by :mod:`simulator.launch`)."""
    if launched_process:
        return True
    run = getattr(current_rank_state(), "run", None)
    return bool(getattr(getattr(run, "world", None), "launched", False))


def require_env(url: str, query: dict[str, str], torch_handler: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """``env://`` on a rank the program started: what torch's handler reads from the environment must be there.
    A missing one fails with torch's own error, raised by ``torch_handler`` (torch's env:// handler) before it
    connects anywhere."""
    needed = [v for v, q in (("RANK", "rank"), ("WORLD_SIZE", "world_size")) if q not in query]
    if any(not os.environ.get(v) for v in (*needed, "MASTER_ADDR", "MASTER_PORT")):
        next(torch_handler(url, **kwargs))  # raises torch's "environment variable X expected, but not set"
        raise AssertionError("unreachable: torch's env:// handler accepted a missing variable")  # pragma: no cover
