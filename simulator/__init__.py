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
from .faults import Crash, Delay, Fault, random_faults
from .trace import CostModel, Event, Trace
from .world import World, current_rank_state, last_trace, rank_device, run
from .backend import SimBackend  # noqa: E402  (registers the "sim" backend)
from tensorplay.distributed.rpc._agent import register_transport  # noqa: E402

register_transport("sim", f"{__name__}.rpc")  # RPC inside a simulated world (imported when a world uses it)
register_transport("sim-process", f"{__name__}.isolation.rpc_process")  # RPC in a process-isolated rank
from .explore import ExploreReport, check_reproducible, explore

__all__ = [
    "run", "World", "explore", "check_reproducible", "ExploreReport", "last_trace", "rank_device",
    "current_rank_state", "SimBackend",
    "CostModel", "Trace", "Event",
    "Crash", "Delay", "Fault", "random_faults",
    "SimError", "CollectiveMismatchError", "DeadlockError", "RankFailedError", "RankExitError", "InjectedFault",
    "SimTimeoutError", "ExploreError", "NotReproducibleError",
]
