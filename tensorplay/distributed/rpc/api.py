"""The public RPC calls: validate at the boundary, then hand the call to the calling worker's agent.

The transport is picked once, by :func:`init_rpc`, through the registry of
:mod:`._agent`: a registered transport that claims the calling thread serves it
(inside a simulated rank, the simulator's in-process transport), anywhere else
torch's TensorPipe agent.  Everything after that is the same code on every
transport, and nothing here compares transport names.
"""
from __future__ import annotations

import numbers
import os
from datetime import timedelta
from typing import Any, Callable, TypeVar

from ..errors import DistRuntimeError, DistValueError
from . import _agent
from .errors import rpc_message
from .futures import Future
from .rref import RRef
from .worker import NAME_PATTERN, WorkerInfo

__all__ = [
    "DEFAULT_RPC_TIMEOUT",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "init_rpc",
    "shutdown",
    "is_initialized",
    "rpc_sync",
    "rpc_async",
    "remote",
    "get_worker_info",
]

T = TypeVar("T")

#: seconds a call may take unless it says otherwise (torch's default too); TENSORPLAY_RPC_TIMEOUT overrides
DEFAULT_RPC_TIMEOUT = float(os.environ.get("TENSORPLAY_RPC_TIMEOUT", "60"))
#: bound on a graceful shutdown's wait for the other workers (torch's default waits forever)
DEFAULT_SHUTDOWN_TIMEOUT = float(os.environ.get("TENSORPLAY_RPC_SHUTDOWN_TIMEOUT", "30"))


def _backend_name(backend: Any) -> str | None:
    if backend is None:
        return None
    name = getattr(backend, "name", backend)  # torch's BackendType.TENSORPIPE has .name
    known = _agent.transport_names()
    if isinstance(name, str) and name.lower() in known:
        return name.lower()
    raise DistValueError(rpc_message(
        "init_rpc", "unknown RPC backend", values={"backend": backend, "known": known},
        fix="leave backend=None: the simulator's transport is used inside simulator.run, TensorPipe elsewhere"))


# ---------------------------------------------------------------------------
# life cycle
# ---------------------------------------------------------------------------
def init_rpc(name: str, backend: Any = None, rank: int = -1, world_size: int | None = None,
             rpc_backend_options: Any = None) -> None:
    """Start this worker's RPC agent and wait until every worker of the world has started.

    Args:
        name: this worker's unique name (letters, digits, ``_``, ``:``, ``-``; < 128 characters).
        backend: ``None`` (pick automatically), ``"tensorpipe"`` or ``"sim"``; torch's
            ``BackendType.TENSORPIPE`` is accepted too.  Inside a simulated rank, TensorPipe
            means the simulator's transport (a program written for real runs runs unchanged).
        rank: this worker's rank; ``-1`` reads ``RANK`` (or, in the simulator, the rank's own).
        world_size: number of workers; ``None`` reads ``WORLD_SIZE`` (or the simulated world's size).
        rpc_backend_options: a :class:`TensorPipeRpcBackendOptions`.  Without one, the rendezvous
            is ``tcp://$MASTER_ADDR:$MASTER_PORT`` with ``MASTER_ADDR`` defaulting to ``127.0.0.1``,
            and calls time out after :data:`DEFAULT_RPC_TIMEOUT` seconds.  Inside a simulated rank
            it is mapped by :func:`simulator.rpc.options_from` (``rpc_timeout`` and
            ``device_maps`` kept, the rest has no meaning there); the simulator's own options
            (``simulator.rpc.SimRpcBackendOptions``) work too.

    Example (2 ranks; each rank is one worker)::

        >>> import tensorplay.distributed.rpc as rpc
        >>> rpc.init_rpc(f"worker{dist.get_rank()}", rank=dist.get_rank(), world_size=2)
        >>> rpc.get_worker_info().name == f"worker{dist.get_rank()}"
        True
        >>> rpc.shutdown()
    """
    call = "init_rpc"
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise DistValueError(rpc_message(
            call, "invalid worker name", values={"name": name},
            fix="use 1-127 characters from letters, digits, '_', ':' and '-', e.g. 'worker0'"))
    if _agent.current() is not None:
        raise DistRuntimeError(rpc_message(
            call, "RPC is already initialised on this worker", worker=_agent.current().name,  # type: ignore[union-attr]
            values={"name": name}, fix="call rpc.shutdown() before initialising again"))
    requested = _backend_name(backend)
    # a transport whose world the caller belongs to serves it, whatever it names (a program written for
    # real runs names TensorPipe; inside a simulated rank it runs on the simulator's transport)
    _, transport = _agent.transport_for(requested, call)
    default_rank, default_size = transport.default_rank_and_size()
    rank = default_rank if rank == -1 else rank
    world_size = default_size if world_size is None else world_size
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise DistValueError(rpc_message(call, "rank must be an int >= 0", values={"name": name, "rank": rank},
                                         fix="pass rank=<this worker's rank> or set RANK"))
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise DistValueError(rpc_message(
            call, "world_size must be an int >= 1 (dynamic worlds are not supported)",
            values={"name": name, "world_size": world_size}, fix="pass world_size=<number of workers> or set WORLD_SIZE"))
    if rank >= world_size:
        raise DistValueError(rpc_message(call, "rank must be < world_size", values={"rank": rank, "world_size": world_size},
                                         fix="number the workers 0 .. world_size-1"))

    agent = transport.start(name, rank, world_size, rpc_backend_options, default_timeout=DEFAULT_RPC_TIMEOUT)
    _agent.install(agent)
    try:
        # a transport that serves requests as soon as it starts waits until every worker has its agent
        # installed too, or an early call could reach a worker that cannot handle it yet
        agent.ready()
    except BaseException:
        _agent.uninstall(agent)
        raise


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop this worker's agent.

    With ``graceful=True`` (default) it first waits, at most ``timeout``
    seconds, until every worker has called ``shutdown`` and no call is in
    flight, so nobody loses an answer.  A worker that died or does not arrive
    in time does not hold the others: they stop locally and warn (a
    ``RuntimeWarning`` naming the missing workers).  ``graceful=False`` stops
    at once.
    """
    a = _agent.require("shutdown")
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise DistValueError(rpc_message("shutdown", "timeout must be a positive number of seconds", worker=a.name,
                                         values={"timeout": timeout}, fix=f"pass e.g. timeout={DEFAULT_SHUTDOWN_TIMEOUT}"))
    try:
        a.shutdown(bool(graceful), float(timeout))
    finally:
        _agent.uninstall(a)


def is_initialized() -> bool:
    """Whether the calling worker has an RPC agent."""
    return _agent.current() is not None


# ---------------------------------------------------------------------------
# calls
# ---------------------------------------------------------------------------
def rpc_sync(to: Any, func: Callable[..., T], args: Any = None, kwargs: Any = None,
             timeout: float | None = None) -> T:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    Arguments and the result cross by value.  If ``func`` raises, the same
    exception (type and args) is raised here, with the remote traceback in its
    notes.  A dead destination raises :class:`WorkerUnavailableError`; a call
    past ``timeout`` seconds raises :class:`RpcTimeoutError`.

    Example (2 ranks)::

        >>> import tensorplay.distributed.rpc as rpc
        >>> rpc.init_rpc(f"worker{dist.get_rank()}")
        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))   # computed on worker1
        tensor([4., 4.])
        >>> rpc.shutdown()
    """
    return _agent.invoke("rpc_sync", to, func, args, kwargs, timeout)


def rpc_async(to: Any, func: Callable[..., T], args: Any = None, kwargs: Any = None,
              timeout: float | None = None) -> Future[T]:
    """Like :func:`rpc_sync` but returns a :class:`Future` at once; ``wait()`` gives the result.

    Example (3 ranks)::

        >>> import tensorplay.distributed.rpc as rpc
        >>> rpc.init_rpc(f"worker{dist.get_rank()}")
        >>> futs = [rpc.rpc_async(w, torch.add, args=(torch.ones(1), i)) for i, w in enumerate(["worker1", "worker2"])]
        >>> [f.wait().item() for f in futs]
        [1.0, 2.0]
        >>> rpc.shutdown()
    """
    return _agent.invoke("rpc_async", to, func, args, kwargs, timeout)


def remote(to: Any, func: Callable[..., T], args: Any = None, kwargs: Any = None,
           timeout: float | None = None) -> RRef[T]:
    """Run ``func(*args, **kwargs)`` on ``to`` and return an :class:`RRef` to the result, owned by ``to``.

    Returns at once; ``to_here()`` waits for the value (and raises ``func``'s
    exception if it failed).

    Example (2 ranks)::

        >>> import tensorplay.distributed.rpc as rpc
        >>> rpc.init_rpc(f"worker{dist.get_rank()}")
        >>> rref = rpc.remote("worker1", torch.ones, args=(2,))   # the tensor lives on worker1
        >>> rref.to_here()
        tensor([1., 1.])
        >>> rpc.shutdown()
    """
    return _agent.invoke("remote", to, func, args, kwargs, timeout)


def get_worker_info(worker_name: Any = None) -> WorkerInfo:
    """The :class:`WorkerInfo` of ``worker_name`` (a name or a rank), or of the calling worker."""
    a = _agent.require("get_worker_info")
    if worker_name is None:
        return a.info()
    return a.resolve("get_worker_info", worker_name)


def _all_worker_infos() -> list[WorkerInfo]:
    return _agent.require("get_worker_infos").worker_infos()
