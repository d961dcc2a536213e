"""Remote procedure calls between workers, on TensorPipe or on the simulator.

The API is torch.distributed.rpc's: :func:`init_rpc`, :func:`rpc_sync`,
:func:`rpc_async`, :func:`remote`, :class:`RRef`, :func:`get_worker_info`,
:func:`shutdown`, and ``functions.async_execution``.  Two transports sit behind it:

* **TensorPipe** (torch's agent) between real processes.  It binds to
  loopback unless ``init_method``/``MASTER_ADDR`` name another address.
* **The simulator's** in-process transport, used automatically inside
  ``simulator.run`` / ``python -m simulator``: arguments and results are
  serialised (never aliased), RRefs follow the ownership rules, and message
  delays and drops can be injected by seed.

Differences from torch that you will notice: a remote exception arrives with
its own type (plus the remote traceback as a note); every wait is bounded
(``timeout=0`` "forever" is refused, ``shutdown`` has a finite timeout and
does not hang when a worker died); functions that pickle cannot send
(lambdas, closures) are sent with dill.

Security: calls are pickled, so a peer can make this worker run any code.
Set ``TENSORPLAY_RPC_SECRET`` (or ``TENSORPLAY_RPC_SECRET_FILE``, an owner-only
file) to the same secret on every member and each message is authenticated
and checked before anything is unpickled (``tensorplay.testing.RpcPool`` and the
simulator do this by default); payloads are still not encrypted, and torch's
C++-only messages are not covered.  See "Networking and the trust model" in
docs/rpc.md for exactly what is and is not protected.

Example (2 ranks; each rank calls the other)::

    >>> import tensorplay.distributed.rpc as rpc
    >>> rpc.init_rpc(f"worker{dist.get_rank()}")
    >>> out = rpc.rpc_sync(f"worker{1 - dist.get_rank()}", torch.add, args=(torch.ones(2), dist.get_rank()))
    >>> out.tolist() == [1.0 + dist.get_rank()] * 2     # computed on the other worker
    True
    >>> rpc.shutdown()
"""
from __future__ import annotations

from torch.distributed.rpc import BackendType, TensorPipeRpcBackendOptions

from . import functions

from .api import (
    DEFAULT_RPC_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT,
    get_worker_info,
    init_rpc,
    is_initialized,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .errors import InterfaceError, RemoteError, RpcError, RpcTimeoutError, WorkerUnavailableError
from .futures import Future, wait_all
from .rref import RRef
from .worker import WorkerInfo

__all__ = [
    "BackendType", "DEFAULT_RPC_TIMEOUT", "DEFAULT_SHUTDOWN_TIMEOUT", "Future", "InterfaceError", "RRef", "RemoteError", "RpcError",
    "RpcTimeoutError", "TensorPipeRpcBackendOptions", "WorkerInfo", "WorkerUnavailableError",
    "functions", "get_worker_info", "init_rpc", "is_initialized", "remote", "rpc_async", "rpc_sync", "shutdown", "wait_all",
]
