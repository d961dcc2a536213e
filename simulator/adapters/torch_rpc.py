"""Run unmodified ``torch.distributed.rpc`` programs on simulated ranks.

While a simulated world runs, a simulated rank that uses torch's RPC API -
``torch.distributed.rpc`` (``init_rpc``, ``rpc_sync``, ``rpc_async``,
``remote``, ``RRef``, ``get_worker_info``, ``shutdown``, ``functions.async_execution``),
``torch.distributed.autograd`` (``context``, ``backward``, ``get_gradients``),
``torch.distributed.optim.DistributedOptimizer`` and
``torch.distributed.nn.RemoteModule`` - gets tensorplay's implementation on the
simulator's RPC transport (:mod:`simulator.rpc`).  Any other
thread keeps torch's own RPC, untouched.

How deep it reaches, so that ``from torch.distributed.rpc import rpc_sync``
done before the world started does not escape:

* ``rpc_sync``, ``rpc_async``, ``remote``, ``shutdown`` and ``get_worker_info``
  are torch's ``_require_initialized`` wrappers; what each wrapper *calls* (its
  closure cell) is swapped for a dispatcher, and the wrappers' "is an agent
  set?" check answers for the simulated worker;
* ``init_rpc`` is replaced in the module, and the original (imported by name)
  reaches the simulator through the helpers it calls: its rendezvous uses an
  in-memory store, ``dist_autograd._init`` is skipped and ``_init_rpc_backend``
  starts the simulated agent;
* ``RRef(value)``, ``DistributedOptimizer(...)`` and ``RemoteModule(...)``
  construct tensorplay's objects (their ``__new__``);
* ``torch.distributed.autograd``'s functions are module attributes (its
  ``context`` class calls ``_new_context``/``_release_context``, which are routed);
* ``torch.futures.wait_all``/``collect_all`` wait cooperatively for futures of
  ``@async_execution`` calls that have not answered yet.

A remote function's exception reaches ``rpc_sync`` and ``Future.wait`` as torch
raises it: a ``ValueError`` or ``TypeError`` for those types (and subclasses),
else a ``RuntimeError``, whose message starts with the original type's name
(``"KeyError: 'On WorkerInfo(id=1, name=worker1): ..."``), the original
exception as its ``__cause__``.  (tensorplay's own API keeps the type.)

What cannot be routed fails at once, never hangs: torch's C++ functions
imported by name *before* the world started
(``from torch.distributed.autograd import backward``) raise torch's "Could not
find autograd context"; TorchScript RPC (``@torch.jit.script`` functions) is not
supported.  ``rpc._get_current_rpc_agent()`` answers the worker infos only, and
``rpc.api._all_gather`` is the simulator's (what torch's sharded tensors use).
``isinstance(x, torch.distributed.rpc.RRef)`` is false for the simulator's
RRefs (use their methods instead).

Like :mod:`simulator.adapters.torch_native`, this module touches private torch names (the wrappers'
closures, ``_init_rpc_backend``, ``_new_context``..., each listed in :mod:`simulator.adapters.torch_private`); it checks
their shape when installing and refuses with a clear error if torch changed.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.distributed as tdist
import torch.distributed.autograd as tautograd
import torch.distributed.rpc as trpc
import torch.distributed.rpc.api as tapi

import tensorplay.distributed.autograd as tp_autograd
from tensorplay.distributed.errors import DistRuntimeError, format_message
from tensorplay.distributed.nn import RemoteModule as TpRemoteModule
from tensorplay.distributed.optim import DistributedOptimizer as TpDistributedOptimizer
from tensorplay.distributed.rpc import RRef as TpRRef
from tensorplay.distributed.rpc import api
from tensorplay.distributed.rpc import transport as rpc_transport
from tensorplay.distributed.rpc import futures as tp_futures
from tensorplay.distributed.rpc.functions import async_execution

from simulator.adapters.after_import import when_imported
from simulator.adapters.torch_private import check_torch_version
from simulator.adapters._patch import Installation
from simulator.core.errors import also_a
from simulator.core.state import on_simulated_rank

__all__ = ["enabled", "register_sim_agent", "wait_pending"]

#: torch's RPC functions whose wrapper closure is routed, and what they become on a simulated rank
_WRAPPED = ("rpc_sync", "rpc_async", "remote", "shutdown", "get_worker_info")

_undo: list[Callable[[], None]] = []
_saved_get_agent = tapi._get_current_rpc_agent  # torch's (C++), before this module routes it
_contexts = threading.local()  # open torch-style autograd contexts of this thread: {context id: ours}
#: the agent class of the simulator's transport (:class:`simulator.rpc.agent.SimAgent`), registered by that module
#: when it loads: the adapters may not import the rpc wing, and no simulated agent exists before it loads
_sim_agent_classes: tuple[type, ...] = ()


def register_sim_agent(cls: type) -> None:
    """Count ``cls`` among the agent classes of simulated ranks: on a simulated rank, torch's "is an RPC agent set?"
    answers whether the calling thread's agent is one (called by :mod:`simulator.rpc.agent` and, in a rank process,
    :mod:`simulator.isolation.child`)."""
    global _sim_agent_classes
    if cls not in _sim_agent_classes:
        _sim_agent_classes += (cls,)


#: True in a rank process (``--isolation process``) whose torch RPC runs on the simulator: every thread of the
#: process is the rank's (set by :mod:`simulator.isolation.child`)
process_rank = False


def _on_sim() -> bool:
    """Whether the calling thread is a simulated rank (tensorplay.distributed bound to the simulator)."""
    return process_rank or on_simulated_rank()


def _sim_agent() -> Any:
    a = rpc_transport.current()
    return a if isinstance(a, _sim_agent_classes) else None


# ---------------------------------------------------------------------------
# torch's signatures -> tensorplay's
# ---------------------------------------------------------------------------
def _timeout(timeout: Any) -> Any:
    """torch's timeout conventions: negative (UNSET) = the agent's default, 0 = no per-call bound."""
    if timeout is None:
        return None
    t = float(timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout)
    if t < 0:
        return None
    return float("inf") if t == 0 else t


def _as_torch_error(e: BaseException, fetched: bool = False) -> BaseException:
    """A remote exception as torch's RPC raises it (measured on TensorPipe): torch re-creates the remote type from
    the message ``On WorkerInfo(...):\n<repr>\n<traceback>``; ``RRef.to_here`` (``fetched``) raises that, while
    ``rpc_sync``/``Future.wait`` go through its C++ layer, which re-raises it as ``"<Type>: <str(re-created)>"``,
    a ValueError or TypeError for those types and their subclasses, else a RuntimeError (the original exception
    is the cause here)."""
    worker = getattr(e, "remote_worker", None)
    if worker is None:  # not raised by the remote function: the transport's own error, a RuntimeError as torch's
        # (but for a TypeError: torch's pickler refuses arguments with one, before anything is sent); tensorplay's
        # type stays, for its own API's callers
        return e if isinstance(e, TypeError) else also_a(e, RuntimeError)
    wid = "?"
    a = rpc_transport.current()
    if a is not None:
        wid = next((str(w.id) for w in a.worker_infos() if w.name == worker), "?")
    if not isinstance(e, Exception) or getattr(e, "serialising_answer", False):
        # (a remote sys.exit: torch's handler catches Exception only, its C++ the rest; an answer that does not
        # pickle fails in that C++ layer too)
        err = RuntimeError(f"{type(e).__name__}: {e}")
        err.__cause__ = e
        return err
    text = f"On WorkerInfo(id={wid}, name={worker}):\n{e!r}\n{getattr(e, 'remote_traceback', '')}"
    try:
        remade = type(e)(text)
    except Exception:  # noqa: BLE001  a type that cannot be made from one string: its message as it is
        remade = None
    if fetched and remade is not None:
        err = remade
    else:
        text = text if remade is None else str(remade)  # (a KeyError's str quotes its message, as torch's does)
        kind = ValueError if isinstance(e, ValueError) else TypeError if isinstance(e, TypeError) else RuntimeError
        err = kind(f"{type(e).__name__}: {text}")
    err.__cause__ = e
    return err


def _raise_as_torch(e: BaseException, fetched: bool = False) -> None:
    if not isinstance(e, Exception) and getattr(e, "remote_worker", None) is None:
        raise e  # (this thread's own KeyboardInterrupt or exit: not the call's)
    err = _as_torch_error(e, fetched)
    if err is e:
        raise e
    raise err from e


def _torch_errors(f: Any) -> Any:
    """An RPC future's ``then``: its value, or its failure as torch's."""
    try:
        return f.value()
    except BaseException as e:
        _raise_as_torch(e)


class _TorchRRef(TpRRef):
    """An RRef of a worker that started through torch's API: its failures read as torch's (see :func:`_as_torch_error`)
    and its proxies' calls go through torch's API here."""

    __slots__ = ()

    def to_here(self, timeout: Any = trpc.constants.UNSET_RPC_TIMEOUT) -> Any:
        try:
            return super().to_here(_timeout(timeout))
        except BaseException as e:  # (a remote sys.exit too: torch raises it from the call)
            _raise_as_torch(e, fetched=True)

    def rpc_sync(self, timeout: Any = trpc.constants.UNSET_RPC_TIMEOUT) -> Any:
        return _TorchProxy(TpRRef.rpc_sync(self, _timeout(timeout)), "rpc_sync")

    def rpc_async(self, timeout: Any = trpc.constants.UNSET_RPC_TIMEOUT) -> Any:
        return _TorchProxy(TpRRef.rpc_async(self, _timeout(timeout)), "rpc_async")

    def remote(self, timeout: Any = trpc.constants.UNSET_RPC_TIMEOUT) -> Any:
        return _TorchProxy(TpRRef.remote(self, _timeout(timeout)), "remote")


class _TorchProxy:
    """``rref.rpc_sync().m(*a)`` and the like with torch's errors: tensorplay's proxy ``inner``, whose failures
    read as torch's (see :func:`_as_torch_error`)."""

    __slots__ = ("_inner", "_mode")

    def __init__(self, inner: Any, mode: str) -> None:
        self._inner, self._mode = inner, mode

    def __getattr__(self, method: str) -> Any:
        if method.startswith("__"):
            raise AttributeError(method)
        ours, mode = getattr(self._inner, method), self._mode

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                out = ours(*args, **kwargs)
            except BaseException as e:  # (a remote sys.exit too: torch raises it from the call)
                _raise_as_torch(e)
            return out.then(_torch_errors) if mode == "rpc_async" else out

        call.__name__ = method
        return call


def _rpc_call(name: str) -> Callable[..., Any]:
    def call(to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None,
             timeout: Any = trpc.constants.UNSET_RPC_TIMEOUT) -> Any:
        fn = getattr(api, name)
        try:
            out = fn(to, func, args=args, kwargs=kwargs, timeout=_timeout(timeout))
        except BaseException as e:  # (a remote sys.exit too: torch raises it from the call)
            _raise_as_torch(e)
        return out.then(_torch_errors) if name == "rpc_async" else out

    call.__name__ = name
    return call


def _shutdown(graceful: bool = True, timeout: Any = 0) -> None:
    t = _timeout(timeout)
    api.shutdown(graceful=graceful, timeout=api.DEFAULT_SHUTDOWN_TIMEOUT if t in (None, float("inf")) else t)


def _as_torch_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose errors are RuntimeErrors as torch's are (the tensorplay type kept: see also_a)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            _raise_as_torch(e)

    call.__name__ = fn.__name__
    return call


@_as_torch_errors
def _get_worker_info(worker_name: Any = None) -> Any:
    return api.get_worker_info(worker_name)


class _AgentView:
    """``rpc._get_current_rpc_agent()`` on a simulated worker: what torch's own code reads of its agent (the worker
    infos: ShardedTensor's placements by worker name and its ``init_rrefs``)."""

    def get_worker_info(self, worker_name: Any = None) -> Any:
        return _get_worker_info(worker_name)

    def get_worker_infos(self) -> list[Any]:
        return rpc_transport.current().worker_infos()


def _get_current_rpc_agent() -> Any:
    if _sim_agent() is None:  # (no simulated worker yet: torch's own answer, "Current RPC agent is not set")
        return _saved_get_agent()
    return _AgentView()


_gathers_lock = threading.Lock()


@async_execution
def _gather_at_leader(key: tuple, name: str, obj: Any, count: int) -> Any:
    """Runs on the leader worker: one worker's object for gather ``key``; answers every caller once all ``count``
    arrived.  The state is the leader agent's own (thread ranks share this module)."""
    agent = rpc_transport.current()
    with _gathers_lock:
        pending = agent.__dict__.setdefault("_torch_gathers", {})
        fut, got = pending.setdefault(key, (torch.futures.Future(), {}))
        got[name] = obj
        if len(got) == count:
            del pending[key]
            fut.set_result(dict(got))
    return fut


@_as_torch_errors
def _all_gather(obj: Any, worker_names: Any = None, timeout: Any = trpc.constants.UNSET_RPC_TIMEOUT) -> Any:
    """torch's ``rpc.api._all_gather`` (``{worker name: obj}`` of every worker named) on simulated workers: the
    objects meet at the leader (the least name), as in torch, in state of the leader's own instead of torch's
    module-level tables, which rank threads would share."""
    me = rpc_transport.current()
    names = tuple(sorted(worker_names or [w.name for w in me.worker_infos()]))
    seqs = me.__dict__.setdefault("_torch_gather_seq", {})
    seq = seqs[names] = seqs.get(names, -1) + 1  # (every worker calls in the same order, as torch requires)
    return api.rpc_sync(names[0], _gather_at_leader, args=((names, seq), me.name, obj, len(names)),
                        timeout=_timeout(timeout))


_OURS: dict[str, Callable[..., Any]] = {
    "rpc_sync": _rpc_call("rpc_sync"), "rpc_async": _rpc_call("rpc_async"), "remote": _rpc_call("remote"),
    "shutdown": _shutdown, "get_worker_info": _get_worker_info,
}


def _init_rpc(name: str, backend: Any = None, rank: int = -1, world_size: int | None = None,
              rpc_backend_options: Any = None) -> None:
    api.init_rpc(name, backend=backend, rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options)
    rpc_transport.current().rref_type = _TorchRRef  # the RRefs this worker makes and receives read as torch's


def _dispatch(original: Callable[..., Any], ours: Callable[..., Any]) -> Callable[..., Any]:
    """``ours`` on a simulated rank, ``original`` on every other thread."""
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if _on_sim():
            return ours(*args, **kwargs)
        return original(*args, **kwargs)

    dispatch.__name__ = getattr(original, "__name__", "dispatch")
    dispatch.__wrapped__ = original  # type: ignore[attr-defined]
    return dispatch


# ---------------------------------------------------------------------------
# what torch's init_rpc calls, for a copy of it imported by name before the world started
# ---------------------------------------------------------------------------
def _memory_rendezvous(url: str, rank: int = -1, world_size: int = -1, **kwargs: Any) -> Iterator[Any]:
    # never a TCP rendezvous on a simulated rank: every worker is a thread of this process
    yield tdist.HashStore(), rank, world_size


class _DistForInitRpc:
    """``torch.distributed`` as torch's ``init_rpc`` sees it: rendezvous in memory on simulated ranks."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def rendezvous(self, url: str, rank: int = -1, world_size: int = -1, **kwargs: Any) -> Any:
        if _on_sim():
            return _memory_rendezvous(url, rank, world_size)
        return self._real.rendezvous(url, rank, world_size, **kwargs)

    def _create_store_from_options(self, backend_options: Any, rank: int) -> Any:
        if _on_sim():
            return tdist.HashStore()
        return self._real._create_store_from_options(backend_options, rank)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _init_rpc_backend(backend: Any = None, store: Any = None, name: Any = None, rank: int = -1,
                      world_size: Any = None, rpc_backend_options: Any = None) -> None:
    _init_rpc(name, backend, rank, world_size, rpc_backend_options)


# ---------------------------------------------------------------------------
# distributed autograd
# ---------------------------------------------------------------------------
class _ContextHandle:
    """What torch's ``_new_context`` returns; ``context.__enter__`` asks it for the id."""

    __slots__ = ("_cid",)

    def __init__(self, cid: int) -> None:
        self._cid = cid

    def _context_id(self) -> int:
        return self._cid


def _new_context() -> _ContextHandle:
    ctx = tp_autograd.context()
    cid = ctx.__enter__()
    open_ = getattr(_contexts, "open", None)
    if open_ is None:
        open_ = _contexts.open = {}
    open_[cid] = ctx
    return _ContextHandle(cid)


def _release_context(context_id: int) -> None:
    ctx = getattr(_contexts, "open", {}).pop(context_id, None)
    if ctx is not None:
        ctx.__exit__(None, None, None)


@_as_torch_errors
def _autograd_backward(context_id: int, roots: Any, retain_graph: bool = False) -> None:
    tp_autograd.backward(context_id, roots, retain_graph)


@_as_torch_errors
def _autograd_get_gradients(context_id: int) -> Any:
    return tp_autograd.get_gradients(context_id)


def _get_rpc_timeout() -> float:
    return rpc_transport.require("get_rpc_timeout").timeout


def _skip(*args: Any, **kwargs: Any) -> None:
    return None


# ---------------------------------------------------------------------------
# constructors: RRef, DistributedOptimizer, RemoteModule
# ---------------------------------------------------------------------------
def _route_new(cls: type, ours: Callable[..., Any], *, exact: bool = True) -> Callable[[], None]:
    """Make ``cls(...)`` build ``ours(...)`` on a simulated rank; returns the undo."""
    had = "__new__" in cls.__dict__
    saved = cls.__dict__.get("__new__")
    inherited = super(cls, cls).__new__ if not had else None  # type: ignore[misc]
    takes_args = inherited is not object.__new__

    def __new__(klass: type, *args: Any, **kwargs: Any) -> Any:
        if _on_sim() and (klass is cls or not exact):
            return ours(*args, **kwargs)
        if had:
            return saved.__get__(None, klass)(klass, *args, **kwargs)  # type: ignore[union-attr]
        return inherited(klass, *args, **kwargs) if takes_args else inherited(klass)  # type: ignore[misc]

    cls.__new__ = staticmethod(__new__)  # type: ignore[method-assign,assignment]

    def undo() -> None:
        if had:
            cls.__new__ = saved  # type: ignore[method-assign]
        else:
            del cls.__new__

    return undo


def _rref(value: Any, type_hint: Any = None) -> Any:
    r = TpRRef(value, type_hint)
    r.__class__ = _TorchRRef
    return r


def _dist_optimizer(optimizer_class: type, params_rref: Any, *args: Any, **kwargs: Any) -> Any:
    return TpDistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)


def _remote_module(remote_device: str, module_cls: type, args: Any = None, kwargs: Any = None,
                   _module_interface_cls: Any = None) -> Any:
    if _module_interface_cls is not None:
        raise DistRuntimeError(format_message(
            "torch.distributed.nn.RemoteModule", "TorchScript module interfaces are not supported on the simulator",
            values={"_module_interface_cls": _module_interface_cls},
            fix="use tensorplay.distributed.nn.RemoteModule(..., interface=I) with an @interface class"))
    return TpRemoteModule(remote_device, module_cls, tuple(args or ()), dict(kwargs or {}))


# ---------------------------------------------------------------------------
# torch.futures.wait_all / collect_all on futures that answer later
# ---------------------------------------------------------------------------
def wait_pending(futures: Any) -> None:
    """Wait for the pending futures among ``futures`` as ``Future.wait`` does on a simulated rank (a scheduler
    wait; a program's own torch future too, completed by an RPC's callback): torch's ``collect_all`` would block
    the rank in C++, where no other rank can run."""
    wait = torch.futures.Future.wait  # (as installed: for torch's C++ futures, which have no Python wait)
    for f in futures:
        if not f.done():
            try:
                f.wait() if isinstance(f, torch.futures.Future) else wait(f)
            except BaseException:  # noqa: BLE001  torch reports it from the collected future
                pass


def _collect_all(original: Callable[..., Any]) -> Callable[..., Any]:
    def collect_all(futures: Any) -> Any:
        if _on_sim():
            wait_pending(futures)
        return original(futures)

    return collect_all


def _torch_future_wait(original: Callable[..., Any]) -> Callable[..., Any]:
    def wait(self: Any) -> Any:
        # a future a program made itself (torch.futures.Future(), completed by an RPC's callback) would block the
        # rank in C++ where no other rank can run: wait for it as for tensorplay's (a scheduler wait, named in a
        # deadlock report)
        if not self.done() and _on_sim():
            hook = tp_futures.coop_wait
            if hook is not None:
                hook(self, None)
        return original(self)

    wait.__doc__ = original.__doc__
    return wait


# ---------------------------------------------------------------------------
# installing
# ---------------------------------------------------------------------------
def _set(obj: Any, name: str, value: Any) -> None:
    """Set ``obj.name`` (a module global or attribute) and remember how to put it back."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    _undo.append(lambda: setattr(obj, name, old))


def _swap_wrapped(name: str) -> None:
    """Route what torch's ``_require_initialized`` wrapper of ``name`` calls."""
    wrapper = getattr(tapi, name)
    code = getattr(wrapper, "__code__", None)
    if code is None or code.co_freevars != ("func",) or wrapper.__closure__ is None:
        raise DistRuntimeError(format_message(
            "simulator.adapters.torch_rpc", "torch.distributed.rpc's function does not have the expected shape",
            values={"function": name, "torch": torch.__version__},
            fix="use tensorplay.distributed.rpc directly, or a supported torch release"))
    cell = wrapper.__closure__[0]
    original = cell.cell_contents
    cell.cell_contents = _dispatch(original, _OURS[name])

    def undo() -> None:
        cell.cell_contents = original

    _undo.append(undo)


def _install() -> None:
    check_torch_version()
    for name in _WRAPPED:
        _swap_wrapped(name)
    real_set = tapi._is_current_rpc_agent_set
    for module in (tapi, trpc):  # (the package holds a copy of its own, which torch's sharded tensors ask)
        _set(module, "_is_current_rpc_agent_set", lambda: (_sim_agent() is not None) if _on_sim() else real_set())
        _set(module, "_get_current_rpc_agent", _dispatch(_saved_get_agent, _get_current_rpc_agent))
    _set(tapi, "_all_gather", _dispatch(tapi._all_gather, _all_gather))
    # init_rpc, as a module attribute and through what a copy imported by name calls
    _set(trpc, "init_rpc", _dispatch(trpc.init_rpc, _init_rpc))
    _set(trpc, "_init_rpc_backend", _dispatch(trpc._init_rpc_backend, _init_rpc_backend))
    _set(trpc, "dist", _DistForInitRpc(trpc.dist))
    _set(trpc, "_set_profiler_node_id", _dispatch(trpc._set_profiler_node_id, _skip))
    _set(trpc, "get_rpc_timeout", _dispatch(trpc.get_rpc_timeout, _get_rpc_timeout))
    _set(tautograd, "_init", _dispatch(tautograd._init, _skip))
    # distributed autograd
    _set(tautograd, "_new_context", _dispatch(tautograd._new_context, _new_context))
    _set(tautograd, "_release_context", _dispatch(tautograd._release_context, _release_context))
    _set(tautograd, "backward", _dispatch(tautograd.backward, _autograd_backward))
    _set(tautograd, "get_gradients", _dispatch(tautograd.get_gradients, _autograd_get_gradients))
    # constructors
    _undo.append(_route_new(tapi.RRef, _rref))
    # DistributedOptimizer and RemoteModule live in modules that take about 2 s to import: route them now when
    # the program imported them already, else the moment it does (a program that never uses them never pays);
    # the post-import hook (adapters/after_import.py) serves several adapters
    _undo.append(when_imported("torch.distributed.optim.optimizer",
                                             lambda m: _route_new(m.DistributedOptimizer, _dist_optimizer)))
    _undo.append(when_imported("torch.distributed.nn.api.remote_module",
                                             lambda m: _route_new(m.RemoteModule, _remote_module)))
    _set(torch._C, "_collect_all", _collect_all(torch._C._collect_all))
    _set(torch.futures.Future, "wait", _torch_future_wait(torch.futures.Future.wait))


def _uninstall() -> None:
    while _undo:
        _undo.pop()()


_INSTALLATION = Installation(_install, _uninstall)


def enabled() -> ContextManager[None]:
    """While active, torch's RPC API on simulated rank threads runs on the simulator's RPC transport.

    Nested and concurrent worlds share one installation (counted); the last
    one to leave restores torch's objects exactly.
    """
    return _INSTALLATION.enabled()
