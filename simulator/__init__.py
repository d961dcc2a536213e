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
    ExploreReport(seeds=20, distinct_schedules=14)

Command line (torchrun-style scripts)::

    python -m simulator --nproc-per-node 4 train.py --epochs 1

See docs/simulator.md for the guide.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what static tools (type checkers, the docs' API reference) read; loaded on first use below
    from .backend import SimBackend
    from .errors import (
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
    from .explore import ExploreReport, check_reproducible, explore
    from .faults import Crash, Delay, Fault, random_faults
    from .trace import CostModel, Event, Trace
    from .world import World, current_rank_state, last_trace, rank_device, run

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
                     "InjectedFault", "SimTimeoutError", "ExploreError", "NotReproducibleError"), "errors"),
    **dict.fromkeys(("Crash", "Delay", "Fault", "random_faults"), "faults"),
    **dict.fromkeys(("CostModel", "Event", "Trace"), "trace"),
    **dict.fromkeys(("World", "current_rank_state", "last_trace", "rank_device", "run"), "world"),
    "SimBackend": "backend",
    **dict.fromkeys(("ExploreReport", "check_reproducible", "explore"), "explore"),
}
#: submodules whose import does not load the simulator
_LIGHT = frozenset({"pytest_plugin"})
_registered = False


def _register() -> None:
    """Register the simulator's RPC transports with tensorplay (what importing the package always did)."""
    global _registered
    if _registered:
        return
    from tensorplay.distributed.rpc._agent import register_transport  # (imports nothing of the simulator)

    register_transport("sim", f"{__name__}.rpc")  # RPC inside a simulated world (imported when a world uses it)
    register_transport("sim-process", f"{__name__}.isolation.rpc_process")  # RPC in a process-isolated rank
    _registered = True


def _load() -> None:
    """Import every name of ``__all__`` (the first use of one), as importing the package used to."""
    _register()
    for name, where in _WHERE.items():
        globals()[name] = getattr(importlib.import_module(f"{__name__}.{where}"), name)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package's module type: importing any of its modules (but the plugin) registers the transports.

    A rank process starts with ``from simulator.isolation.child import serve`` and a program may import
    ``simulator.world`` or ``simulator.rpc`` without touching a name above; the transports must be there for
    them too.  Registering imports nothing of the simulator, so it is safe half-way through another import.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}":
            if name not in _LIGHT:  # the import system binds every submodule it imports to its package
                _register()
            if name in _WHERE:  # simulator.explore is the function, as it always was, not its module
                value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
