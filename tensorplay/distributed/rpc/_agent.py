"""The transport interface and where the calling worker's agent lives.

An *agent* is one worker's end of an RPC world.  Two implementations:

* :class:`~tensorplay.distributed.rpc.tensorpipe.TensorPipeAgent` - one per
  process, wrapping ``torch.distributed.rpc``'s TensorPipe agent;
* :class:`simulator.rpc.SimAgent` - one per simulated rank
  thread, talking through an in-process mailbox.

Like :mod:`tensorplay.distributed._state`, a thread may carry its own agent
(the simulator's rank threads do, and a simulated call runs the callee's code
with the callee's agent bound), which then takes precedence over the
process's.  The public functions in :mod:`.api` ask :func:`current` on every
call and never cache it.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from ..errors import DistRuntimeError, DistTypeError, DistValueError, NotInitializedError
from .errors import rpc_message
from .worker import WorkerInfo

if TYPE_CHECKING:  # pragma: no cover
    from .futures import Future
    from .rref import RRef

__all__ = ["Agent", "current", "require", "set_process_agent", "bind_thread", "unbind_thread"]


class Agent:
    """One worker's end of the RPC world (the interface both transports implement)."""

    #: ``"tensorpipe"`` or ``"sim"``
    kind: str = ""
    name: str
    rank: int
    world_size: int
    #: default per-call timeout in seconds (finite)
    timeout: float
    #: worker-local objects that calls address by key (RemoteModule's modules, optimizers)
    objects: dict[Any, Any]

    # -- workers ------------------------------------------------------------
    def worker_infos(self) -> list[WorkerInfo]:
        raise NotImplementedError

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.name, self.rank)

    def resolve(self, call: str, to: Any) -> WorkerInfo:
        """Turn ``to`` (a name, a rank or a WorkerInfo) into this world's :class:`WorkerInfo`."""
        infos = self.worker_infos()
        if isinstance(to, str):
            for wi in infos:
                if wi.name == to:
                    return wi
            raise DistValueError(rpc_message(
                call, "no worker has this name", worker=self.name,
                values={"to": to, "workers": [w.name for w in infos]},
                fix="pass one of the names given to init_rpc(name=...) on the workers"))
        if isinstance(to, bool) or not isinstance(to, int):
            name, wid = getattr(to, "name", None), getattr(to, "id", None)
            if isinstance(name, str) and isinstance(wid, int):  # ours or torch's WorkerInfo
                wi = self.resolve(call, name)
                if wi.id != wid:
                    raise DistValueError(rpc_message(
                        call, "the WorkerInfo's id does not match the worker of that name", worker=self.name,
                        values={"to": to, "actual": wi}, fix="get WorkerInfo objects from get_worker_info()"))
                return wi
            raise DistTypeError(rpc_message(
                call, "to must be a worker name (str), a rank (int) or a WorkerInfo", worker=self.name,
                values={"to": to, "type": type(to).__name__}, fix="pass e.g. to='worker1'"))
        for wi in infos:
            if wi.id == to:
                return wi
        raise DistValueError(rpc_message(
            call, "no worker has this rank", worker=self.name,
            values={"to": to, "ranks": [w.id for w in infos]}, fix=f"pass a rank in [0, {self.world_size})"))

    # -- calls ----------------------------------------------------------------
    def call_sync(self, call: str, dst: WorkerInfo, fn: Callable[..., Any], args: tuple, kwargs: dict,
                  timeout: float) -> Any:
        raise NotImplementedError

    def call_async(self, call: str, dst: WorkerInfo, fn: Callable[..., Any], args: tuple, kwargs: dict,
                   timeout: float) -> "Future[Any]":
        raise NotImplementedError

    def remote(self, dst: WorkerInfo, fn: Callable[..., Any], args: tuple, kwargs: dict,
               timeout: float) -> "RRef[Any]":
        raise NotImplementedError

    def local_rref(self, value: Any) -> "RRef[Any]":
        raise NotImplementedError

    def shutdown(self, graceful: bool, timeout: float) -> None:
        raise NotImplementedError


_process_agent: Agent | None = None
_thread = threading.local()


def current() -> Agent | None:
    """The calling thread's agent if it has one, else the process's, else ``None``."""
    a = getattr(_thread, "agent", None)
    return a if a is not None else _process_agent


def require(call: str) -> Agent:
    a = current()
    if a is None:
        raise NotInitializedError(rpc_message(
            call, "RPC is not initialised on this worker",
            fix="call tensorplay.distributed.rpc.init_rpc(name, rank=..., world_size=...) first "
                "(inside simulator.run, init_rpc(name) is enough)"))
    return a


def set_process_agent(agent: Agent | None) -> None:
    global _process_agent
    _process_agent = agent


def bind_thread(agent: Agent | None) -> Agent | None:
    """Give the calling thread ``agent``; returns the previous thread agent (to restore later)."""
    prev = getattr(_thread, "agent", None)
    _thread.agent = agent
    return prev


def unbind_thread() -> None:
    _thread.agent = None


# -- transports other packages provide ------------------------------------------------------------------------
#: transport name -> the module implementing it (``start``, ``options_from``, its options class); a module named
#: here is imported only when a world uses it, and tensorplay never names one itself (the simulator registers "sim")
_TRANSPORTS: dict[str, str] = {}


def register_transport(name: str, module: str) -> None:
    """Make ``init_rpc`` use ``module`` (imported on first use) for worlds whose backend is named ``name``."""
    _TRANSPORTS[name] = module


def transport(name: str, call: str = "init_rpc") -> Any:
    """The module registered for transport ``name``; a clear error when none is."""
    import importlib

    module = _TRANSPORTS.get(name)
    if module is None:
        raise DistRuntimeError(rpc_message(
            call, f"no RPC transport is registered for backend {name!r}",
            values={"backend": name, "registered": sorted(_TRANSPORTS)},
            fix="import the package that provides it first (e.g. `import simulator` for the simulator's transport)"))
    return importlib.import_module(module)
