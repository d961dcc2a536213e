"""Test infrastructure: persistent pools of real rank processes on loopback.

Not needed to run programs: a plain ``pip install tensorplay`` gives a working
:mod:`tensorplay.distributed` and simulator.  The pools ship functions to their
ranks with ``dill`` through ``multiprocess``, which comes with the ``testing``
extra (``pip install "tensorplay[testing]"``; the ``test`` extra includes it).

* :class:`RankPool` - ``world_size`` processes with a process group each
  (gloo by default), reused across any number of calls;
* :class:`RpcPool` - the same with TensorPipe RPC initialised as
  ``worker0``, ``worker1``, ...;
* :func:`free_port` - a loopback port for a rendezvous.

Example (needs the extra)::

    from tensorplay.testing import RankPool

    def body(x):
        import tensorplay.distributed as dist
        t = x + dist.get_rank()
        dist.all_reduce(t)
        return t

    with RankPool(2) as pool:
        print(pool.run(body, 1.0))        # [tensor(3.), tensor(3.)] in rank order
"""
from __future__ import annotations

from typing import Any

from ._ports import free_port

__all__ = ["RankPool", "RankError", "RpcPool", "free_port"]

_LAZY = {"RankPool": "pool", "RankError": "pool", "RpcPool": "rpc"}


def __getattr__(name: str) -> Any:
    # the pools import ``multiprocess`` (an extra); importing this package must not
    if name not in _LAZY:
        raise AttributeError(f"module 'tensorplay.testing' has no attribute {name!r}")
    try:
        import multiprocess  # noqa: F401
    except ImportError as e:
        raise ImportError(f"tensorplay.testing.{name} needs the 'multiprocess' package, which is not installed. "
                          "Fix: pip install \"tensorplay[testing]\" (or pip install multiprocess)") from e
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
