"""simulator: run N ranks of tensorplay.distributed code in one process, deterministically.

Each rank is a thread with tensorplay.distributed initialised on the ``"sim"``
backend.  Collectives are matched by (group, sequence number) and checked for
agreement before any work; deadlocks and failures are reported at once, on
every rank, with what each rank was doing and where.

Example::

    >>> import simulator, tensorplay as tp, tensorplay.distributed as dist
    >>> def f():
    ...     x = tp.arange(3.) + dist.get_rank()
    ...     dist.all_reduce(x)
    ...     return x
    >>> simulator.run(f, 4)                          # one result per rank, in rank order
    [tensor([ 6., 10., 14.]), tensor([ 6., 10., 14.]), tensor([ 6., 10., 14.]), tensor([ 6., 10., 14.])]
    >>> doc = simulator.last_trace().to_chrome("f.json")   # Perfetto / chrome://tracing timeline
    >>> simulator.run(f, 4, seed=3, mode="threads")[0]     # free-running threads, the same result
    tensor([ 6., 10., 14.])
    >>> simulator.explore(f, 4, seeds=range(20))     # many schedules (raises ExploreError naming a failing seed)
    ExploreReport(seeds=20, distinct_schedules=13)

Command line (torchrun-style scripts)::

    python -m simulator --nproc-per-node 4 train.py --epochs 1

See docs/simulator.md for the guide.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what static tools (type checkers, the docs' API reference) read; loaded on first use below
    from simulator.core.backend import SimBackend
    from simulator.core.errors import (
        CollectiveMismatchError,
        DeadlockError,
        ExploreError,
        InjectedFault,
        NotReproducibleError,
        RankExitError,
        RankFailedError,
        SimError,
        SimTimeoutError,
    )
    from simulator.exploring import ExploreReport, check_reproducible, explore
    from simulator.core.faults import Crash, Delay, Fault, random_faults
    from simulator.core.trace import Event, Trace
    from simulator.timing.cost import CostModel
    from simulator.world import World, current_rank_state, last_trace, rank_device, run

__all__ = [
    "run", "World", "explore", "check_reproducible", "ExploreReport", "last_trace", "rank_device",
    "current_rank_state", "SimBackend",
    "CostModel", "Trace", "Event",
    "Crash", "Delay", "Fault", "random_faults",
    "SimError", "CollectiveMismatchError", "DeadlockError", "RankFailedError", "RankExitError", "InjectedFault",
    "SimTimeoutError", "ExploreError", "NotReproducibleError",
]

# The package is lazy (PEP 562): pytest imports it at every start-up, in every project where tensorplay is
# installed, as the parent of its plugin (the pytest11 entry point ``simulator.pytest_plugin``), and the
# simulator imports torch, seconds that a session not using it must not pay.  The first use of a name below
# imports all of them, in this order (``backend`` registers the "sim" backend).
_WHERE = {
    **dict.fromkeys(("SimError", "CollectiveMismatchError", "DeadlockError", "RankFailedError", "RankExitError",
                     "InjectedFault", "SimTimeoutError", "ExploreError", "NotReproducibleError"), "core.errors"),
    **dict.fromkeys(("Crash", "Delay", "Fault", "random_faults"), "core.faults"),
    **dict.fromkeys(("Event", "Trace"), "core.trace"),
    "CostModel": "timing.cost",
    **dict.fromkeys(("World", "current_rank_state", "last_trace", "rank_device", "run"), "world"),
    "SimBackend": "core.backend",
    **dict.fromkeys(("ExploreReport", "check_reproducible", "explore"), "exploring"),
}


def _load() -> None:
    """Import every name of ``__all__`` (the first use of one), as importing the package used to."""
    for name, where in _WHERE.items():
        globals()[name] = getattr(importlib.import_module(f"{__name__}.{where}"), name)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
