"""The adapters a running world installs, in order: each routes one of torch's (or the standard library's)
own APIs on rank threads to the world, behind an :class:`~simulator.adapters._patch.Installation`.

=================  ==========================================================================
adapter            what it routes
=================  ==========================================================================
threads            ``threading.Thread`` started by a rank, its joins and waits, ``time.sleep``,
                   ``os.getpid`` (a rank's threads are actors of that rank)
torch_native       ``torch.distributed``'s process groups, rendezvous and per-rank globals
torch_rpc          ``torch.distributed.rpc`` and its distributed autograd
clock_hooks        import time (not compute) and ``torch.optim`` steps (the step time)
per_rank_state     process-global state of libraries (Hydra) kept per rank
per_rank_streams   ``sys.stdout``/``stderr``, ``print``, warning filters, loggers' settings
per_rank_main      ``sys.modules["__main__"]``: each rank's own script module
torch_profiling    torch's profiler, one per process: refused on one of several thread ranks
=================  ==========================================================================

The CUDA stand-in (:mod:`simulator.standin`) is installed before these when a world runs with
``devices="cuda"``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from simulator.adapters import (clock_hooks, per_rank_main, per_rank_state, per_rank_streams, threads, torch_native,
                                torch_profiling, torch_rpc)

__all__ = ["ADAPTERS", "enabled"]

ADAPTERS = (threads, torch_native, torch_rpc, clock_hooks, per_rank_state, per_rank_streams, per_rank_main,
            torch_profiling)


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Install every adapter for the duration (and remove them, in reverse order, after)."""
    with contextlib.ExitStack() as stack:
        for adapter in ADAPTERS:
            stack.enter_context(adapter.enabled())
        yield
