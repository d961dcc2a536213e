"""``tensorplay.distributed.rpc`` in a process-isolated simulated rank: TensorPipe, rendezvoused by the simulator.

On thread ranks the simulator's own transport (:mod:`simulator.rpc`) carries
every RPC, in virtual time and on the seeded schedule.  A rank *process* has no
in-process peers, so its workers talk over tensorplay's TensorPipe transport,
as under torchrun; what this module adds is what torchrun would have given
them: a rendezvous (a loopback port the coordinator chose for the run), the
rank and the world size, so ``init_rpc(name)`` works as it does on thread
ranks.  Its calls are real: they are not matched, traced or scheduled by the
simulator, and their order between workers is the operating system's (see
docs/simulator.md, limits of process ranks).

In ``coop`` mode a rank that calls ``init_rpc`` runs its compute outside the
seeded schedule from then on (its collectives still take their turn): its
waits on RPC answers are invisible to the scheduler, and a rank holding the
turn there would keep it from the rank that must answer.

Example (each rank its own process)::

    def worker():
        r = dist.get_rank()
        rpc.init_rpc(f"worker{r}")        # no MASTER_PORT needed: the simulator rendezvouses the workers
        out = rpc.rpc_sync(f"worker{(r + 1) % 2}", torch.add, args=(torch.ones(2), r))
        rpc.shutdown()
        return out

    simulator.run(worker, 2, isolation="process")
"""
from __future__ import annotations

import os
from typing import Any

from tensorplay.distributed.errors import DistRuntimeError, DistTypeError
from tensorplay.distributed.rpc.errors import rpc_message

__all__ = ["WHERE", "USAGE", "claims_caller", "default_rank_and_size", "start"]

WHERE = "in a process-isolated simulated rank"
USAGE = "call init_rpc inside simulator.run(fn, world_size, isolation='process')"

#: set in a rank process by :func:`simulator.isolation.child.main`: (rank, world size, rendezvous port, mode)
RANK: tuple[int, int, int, str] | None = None


def claims_caller() -> bool:
    """A rank process's workers are served here (whatever transport the program names)."""
    return RANK is not None


def _mine(call: str) -> tuple[int, int, int, str]:
    if RANK is None:
        raise DistRuntimeError(rpc_message(call, f"this transport only works {WHERE}", fix=USAGE))
    return RANK


def default_rank_and_size() -> tuple[int, int | None]:
    """The simulated rank and world size (what ``init_rpc`` takes when the program leaves them out)."""
    rank, size, _, _ = _mine("init_rpc")
    return rank, size


def start(name: str, rank: int, world_size: int, options: Any, *, default_timeout: float | None = None) -> Any:
    """Start a TensorPipe agent; without a rendezvous of the program's own, use the run's."""
    import torch.distributed.rpc as trpc

    from tensorplay.distributed.rpc import tensorpipe

    rank_, size_, port, mode = _mine("init_rpc")
    if mode == "coop":
        from . import rank_threads

        # the agent's waits (rpc_sync, Future.wait, to_here, shutdown's barrier) are invisible to the scheduler:
        # a rank waiting there while holding the coop turn would keep it from the rank that must answer
        rank_threads.free_running()
    timeout = 60.0 if default_timeout is None else default_timeout
    if options is not None and not isinstance(options, trpc.TensorPipeRpcBackendOptions):
        raise DistTypeError(rpc_message(
            "init_rpc", "process-isolated ranks talk over TensorPipe: rpc_backend_options must be "
            "TensorPipeRpcBackendOptions (or None)", values={"rpc_backend_options": type(options).__name__},
            fix="pass rpc.TensorPipeRpcBackendOptions(rpc_timeout=...) or None; the simulator's own options "
                "(SimRpcBackendOptions, message faults) need isolation='thread'"))
    if options is None:
        options = trpc.TensorPipeRpcBackendOptions(rpc_timeout=timeout, _transports=["uv"])
    if options.init_method == "env://" and not os.environ.get("MASTER_PORT"):
        options.init_method = f"tcp://127.0.0.1:{port}"  # what torchrun's MASTER_ADDR/MASTER_PORT would give
    return tensorpipe.start(name, rank, world_size, options, default_timeout=default_timeout)
