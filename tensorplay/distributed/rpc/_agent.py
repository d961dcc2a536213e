"""The transport interface, the transport registry, and where the calling worker's agent lives.

An *agent* is one worker's end of an RPC world.  Two implementations:

* :class:`~tensorplay.distributed.rpc.tensorpipe.TensorPipeAgent` - one per
  process, wrapping ``torch.distributed.rpc``'s TensorPipe agent;
* :class:`simulator.rpc.SimAgent` - one per simulated rank
  thread, talking through an in-process mailbox.

A transport is a module registered by name (:func:`register_transport`);
tensorplay registers ``"tensorpipe"`` (the default) and the simulator
registers ``"sim"`` when any of its names or modules is first used (``simulator.run``, a submodule).  Nothing above this module compares
transport names: a transport module *declares* what callers need
(:class:`Transport`), and an agent declares what it offers (whether it is
bound to a thread, its distributed-autograd engine).

Like :mod:`tensorplay.distributed.state`, a thread may carry its own agent
(the simulator's rank threads do, and a simulated call runs the callee's code
with the callee's agent bound), which then takes precedence over the
process's.  The public functions in :mod:`.api` ask :func:`current` on every
call and never cache it.

Imports: this module imports only ``errors`` and ``worker`` of the RPC
package, so ``rref``, ``api`` and the transports can all use it (``rref``'s
proxies call :func:`invoke` without importing ``api``) and no circle forms;
transports are imported by name through the registry.
"""
from __future__ import annotations

import importlib
import numbers
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..errors import DistRuntimeError, DistTypeError, DistValueError, NotInitializedError
from .errors import rpc_message
from .worker import WorkerInfo

if TYPE_CHECKING:  # pragma: no cover
    from .futures import Future
    from .rref import RRef

__all__ = ["Agent", "Transport", "DistributedAutograd", "current", "require", "set_process_agent", "bind_thread",
           "unbind_thread", "install", "uninstall", "register_transport", "transport", "transport_names",
           "transport_for", "invoke", "check_timeout", "check_call", "DEFAULT_TRANSPORT"]


class DistributedAutograd(Protocol):
    """A transport's distributed-autograd engine (what :mod:`tensorplay.distributed.autograd` calls)."""

    def context(self) -> Any:
        """A context manager whose ``__enter__`` returns a new context id."""

    def backward(self, context_id: int, roots: list[Any], retain_graph: bool) -> None:
        """The backward pass from ``roots`` (checked scalars) in that context."""

    def get_gradients(self, context_id: int) -> dict[Any, Any]:
        """This worker's gradients in that context.

        An engine whose backward passes accumulate through the leaves' ``.grad`` also has ``grads_held()``: a
        context manager that a DistributedOptimizer's step (which sets ``.grad`` and reads it) runs in."""


class Transport(Protocol):
    """What a module registered with :func:`register_transport` provides."""

    #: where its workers live, for an error (e.g. "inside a simulated rank")
    WHERE: str
    #: how to get a worker onto this transport, for an error's "Fix:" (e.g. "run it inside simulator.run")
    USAGE: str

    def claims_caller(self) -> bool:
        """Whether the calling thread belongs to a world of this transport (then it serves this worker,
        whatever backend the program names)."""

    def default_rank_and_size(self) -> tuple[int, int | None]:
        """``rank`` (-1 if unknown) and ``world_size`` (``None`` if unknown) when ``init_rpc`` leaves them out."""

    def start(self, name: str, rank: int, world_size: int, options: Any) -> "Agent":
        """Start (and rendezvous) this worker's agent; returns once every worker has started."""


class Agent:
    """One worker's end of the RPC world (the interface both transports implement)."""

    #: the registered transport name (for messages and the trace only: nothing branches on it)
    kind: str = ""
    #: True when the agent belongs to the thread that started it (and threads serving it), not the process
    per_thread: bool = False
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

    def ready(self) -> None:
        """Called once the agent is installed: return when every worker can serve calls (bounded)."""

    def distributed_autograd(self) -> DistributedAutograd:
        """This transport's distributed-autograd engine."""
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


def install(agent: Agent) -> None:
    """Make ``agent`` the calling worker's: the thread's if it is per-thread, else the process's."""
    if agent.per_thread:
        bind_thread(agent)
    else:
        set_process_agent(agent)


def uninstall(agent: Agent) -> None:
    """Undo :func:`install` (the agent shut down)."""
    if agent.per_thread:
        unbind_thread()
    elif _process_agent is agent:
        set_process_agent(None)


# -- transports ---------------------------------------------------------------------------------------------
#: transport name -> the module implementing it (a :class:`Transport`); a module named here is imported only when
#: a world uses it.  tensorplay registers its own TensorPipe transport; other packages add theirs (the simulator
#: registers "sim" when imported)
_TRANSPORTS: dict[str, str] = {}
#: the transport of a worker that no other transport claims
DEFAULT_TRANSPORT = "tensorpipe"


def register_transport(name: str, module: str) -> None:
    """Make ``init_rpc`` use ``module`` (imported on first use) for worlds whose backend is named ``name``."""
    _TRANSPORTS[name] = module


def transport_names() -> list[str]:
    return sorted(_TRANSPORTS)


def transport(name: str, call: str = "init_rpc") -> Any:
    """The module registered for transport ``name``; a clear error when none is."""
    module = _TRANSPORTS.get(name)
    if module is None:
        raise DistRuntimeError(rpc_message(
            call, f"no RPC transport is registered for backend {name!r}",
            values={"backend": name, "registered": sorted(_TRANSPORTS)},
            fix="import the package that registers it first (the simulator registers its transport when one of its "
                "names or modules is first used, e.g. `import simulator.rpc` or a call to simulator.run)"))
    return importlib.import_module(module)


def transport_for(requested: str | None, call: str = "init_rpc") -> tuple[str, Any]:
    """The transport that serves the calling worker: the one whose world the caller belongs to, else
    ``requested``, else the default.

    A program written for real runs names TensorPipe; inside another transport's world (a simulated
    rank) it runs on that transport instead.  A transport named explicitly that does not claim the
    caller is refused with the transport's own usage hint.
    """
    for name, module in list(_TRANSPORTS.items()):
        if name == DEFAULT_TRANSPORT:
            continue
        mod = importlib.import_module(module)
        if mod.claims_caller():
            return name, mod
    name = requested or DEFAULT_TRANSPORT
    mod = transport(name, call)
    if name != DEFAULT_TRANSPORT and not mod.claims_caller():
        raise DistRuntimeError(rpc_message(
            call, f"backend={name!r} only works {getattr(mod, 'WHERE', 'inside a world of that transport')}",
            values={"backend": name},
            fix=getattr(mod, "USAGE", "start the worker the way that transport's documentation says")))
    return name, mod


register_transport(DEFAULT_TRANSPORT, "tensorplay.distributed.rpc.tensorpipe")


# -- one call, validated at the boundary ------------------------------------------------------------------------
def check_timeout(call: str, timeout: Any, agent: Agent) -> float:
    """A call's timeout in seconds (the agent's default for ``None``); bad values raise before anything is sent."""
    if timeout is None:
        return agent.timeout
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise DistTypeError(rpc_message(call, "timeout must be a number of seconds", worker=agent.name,
                                        values={"timeout": timeout}, fix="pass e.g. timeout=10.0, or None"))
    if not timeout > 0:
        raise DistValueError(rpc_message(
            call, "timeout must be positive: every call is bounded", worker=agent.name,
            values={"timeout": timeout}, fix="pass a positive number of seconds, or None for the default"))
    return float(timeout)


def check_call(call: str, agent: Agent, func: Any, args: Any, kwargs: Any) -> tuple[tuple, dict]:
    """``args`` as a tuple and ``kwargs`` as a dict; a non-callable ``func`` or wrong types raise."""
    if not callable(func):
        raise DistTypeError(rpc_message(call, "func must be callable", worker=agent.name,
                                        values={"func": func}, fix="pass a function, e.g. rpc_sync(to, torch.add, args=(x, 1))"))
    if args is None:
        args = ()
    elif isinstance(args, list):
        args = tuple(args)
    elif not isinstance(args, tuple):
        raise DistTypeError(rpc_message(call, "args must be a tuple", worker=agent.name,
                                        values={"args": type(args).__name__}, fix="write args=(x,) for one argument"))
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise DistTypeError(rpc_message(call, "kwargs must be a dict", worker=agent.name,
                                        values={"kwargs": type(kwargs).__name__}, fix="pass kwargs={'name': value}"))
    return args, kwargs


def invoke(call: str, to: Any, func: Any, args: Any, kwargs: Any, timeout: Any) -> Any:
    """``rpc_sync``, ``rpc_async`` or ``remote`` (``call``) on the calling worker's agent, validated first."""
    a = require(call)
    dst = a.resolve(call, to)
    args, kwargs = check_call(call, a, func, args, kwargs)
    t = check_timeout(call, timeout, a)
    if call == "rpc_sync":
        return a.call_sync(call, dst, func, args, kwargs, t)
    if call == "rpc_async":
        return a.call_async(call, dst, func, args, kwargs, t)
    return a.remote(dst, func, args, kwargs, t)
