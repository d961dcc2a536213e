"""The rank process's backend: every call of tensorplay.distributed is performed by the rank's proxy.

tensorplay.distributed in a rank process is bound to :class:`ClientBackend`
(named ``"sim"``, so ``init_process_group()`` returns at once and the
torch.distributed adapter binds torch to it as on thread ranks).  Each
collective stages its tensors in shared memory (:mod:`.staging`), sends a CALL
(:mod:`.messages`) with its call site, and waits for the proxy's answer: the
simulator in the coordinator does the matching, the checks and the arithmetic.
The collectives are not written out here: one forwarder per entry of
``spec.BACKEND_COLLECTIVES``, with the table's parameters, is generated at
import (:func:`_forwarder`), and a collective the client cannot forward fails
the import.
"""
from __future__ import annotations

import inspect
import os
import socket
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional, Sequence

import torch

from tensorplay.distributed import state as dist_state
from tensorplay.distributed.backends.base import Backend, Work
from tensorplay.distributed.errors import DistRuntimeError, format_message
from tensorplay.distributed.spec import BACKEND_COLLECTIVES, BackendCollective

from simulator.core.backend import SimBackend
from simulator.core.callsite import call_site
from simulator.core.works import timeout_arg
from simulator.isolation import _wire
from simulator.isolation._wire import OUTPUTS
from simulator.isolation.messages import (
    ANSWERS, CALL, COMPLETED, FDS_REQUEST, GROUP, RENDEZVOUS, SHARE, SOURCE, STEP, SUCCESS, UNSHARE, WAIT,
    handler_table,
)
from simulator.isolation.remote_errors import rebuild
from simulator.isolation.staging import Staged, Staging, install_resize_hooks

__all__ = ["ClientBackend", "ClientWork", "Completions"]


def _result_tensors(name: str, args: tuple) -> list[torch.Tensor]:
    """What ``Work.result()`` gives for this call (the tensors it writes), as on thread ranks."""
    pos = OUTPUTS[name]
    out = args[pos[0]] if pos else None
    if out is None:
        return []
    return [out] if isinstance(out, torch.Tensor) else list(out)


class ClientBackend(SimBackend):
    """tensorplay.distributed's backend in a rank process: every call is run by the rank's proxy in the coordinator.

    A :class:`~simulator.core.backend.SimBackend` for everything that asks whether the calling rank is simulated
    (the torch adapter binds torch.distributed to it); it overrides every operation and shares no state with
    the simulator's own backend.
    """

    name = "sim"

    def __init__(self, conn: Connection, rank: int, world_size: int, arena_dir: str) -> None:
        Backend.__init__(self, rank, world_size)  # not SimBackend's: no rank state lives in this process
        self._joined = self._made_torch_group = False  # (SimBackend.joined, shutdown: the same rules here)
        self._conn = conn
        self._arena_dir = arena_dir
        # arena regions (the copies themselves run unlocked), and the program's large storages moved into shared memory
        self._staging = Staging(arena_dir, rank, self._share, self._unshare)
        install_resize_hooks()
        self._works = Completions()  # async operations whose completion the coordinator has not reported yet
        # the main channel: the rank's main thread, and threads this process did not start during the run
        # (an RPC agent's native threads) share it, one request at a time; every thread the program starts
        # has a channel of its own (see .rank_threads)
        self._lock = threading.RLock()
        self._main_ident = threading.get_ident()
        self._pid = os.getpid()  # a process forked from this one (a DataLoader worker) is not the rank
        self._tl = threading.local()  # .chan: the calling thread's own channel
        self.exchanges = 0  # requests sent so far (a sleep-polling loop is two sleeps with none between)
        self._cpu = threading.local()
        self._world_key = object()

    # -- life cycle -------------------------------------------------------
    @classmethod
    def create(cls, *, rank: int, world_size: int, init_method: str | None, store: Any,
               timeout: timedelta) -> "ClientBackend":
        raise DistRuntimeError(format_message(
            "init_process_group", "the 'sim' backend only runs inside a simulated world", values={"backend": "sim"},
            fix="run the code with simulator.run(fn, world_size, isolation='process')"))

    def world_handle(self) -> int:
        return 0

    def new_group_handle(self, ranks: tuple[int, ...], timeout: timedelta) -> int | None:
        return self._group("new_group_handle", ranks)

    def member_group_handle(self, ranks: tuple[int, ...], name: str | None = None) -> int:
        return self._group("member_group_handle", ranks, name)

    def rendezvous(self, key: Any, rank: int, size: int) -> tuple[int, ...]:
        """Claim ``rank`` of the ``size``-rank group over part of the world meeting at ``key``, in the coordinator
        (where the ranks meet): its members' simulated ranks, in its ranks' order."""
        self._own_process("init_process_group")
        try:
            return tuple(self._exchange((RENDEZVOUS, key, rank, size, self._cpu_delta())))
        finally:
            self._cpu.mark = time.thread_time()

    def world_key(self) -> object:
        """One object per simulated world; this process holds one rank of one world."""
        return self._world_key

    def supports_device(self, device: torch.device) -> bool:
        # (CUDA: the stand-in's devices, when the run gives ranks devices="cuda"; this build has no other)
        return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())

    def device_for(self, kind: str) -> torch.device:
        return torch.device(kind)  # a rank process has no simulated device of its own (CPU, or the stand-in's)

    # -- the channel ------------------------------------------------------
    def _request(self, msg: tuple, fds: Sequence[int] = ()) -> Any:
        """Send ``msg`` (and ``fds``) on the calling thread's channel; return the proxy's answer or raise its error."""
        self._own_process("torch.distributed")
        return self._exchange(msg, fds)

    def _exchange(self, msg: tuple, fds: Sequence[int] = ()) -> Any:
        """:meth:`_request` from a caller that has checked it runs in the rank process."""
        self.exchanges += 1
        chan = getattr(self._tl, "chan", None)
        if chan is not None:
            reply = _exchange(chan, msg, fds)
        else:
            with self._lock:
                reply = _exchange(self._conn, msg, fds)
        on = _ON_ANSWER.get(reply[0])
        if on is None:  # (a protocol error is a bug of this package)
            raise DistRuntimeError(f"simulator: unknown answer {reply[0]!r} from rank {self.rank}'s proxy")
        # every answer names the async operations completed since the last one: their outputs are the
        # program's now, waited or not (as on gloo), and their staging is free
        self._works.done(reply[-1])
        return on(reply)

    def _own_process(self, call: str) -> None:
        """Refuse a call from a process forked from the rank process (before it touches the rank's arenas)."""
        if os.getpid() != self._pid:
            raise DistRuntimeError(format_message(
                call, "a process forked from a rank process is not a "
                "rank: its inherited channel belongs to the rank (as on torchrun, where a forked child cannot use "
                "its parent's process group)", rank=self.rank, values={"pid": os.getpid(), "rank_pid": self._pid},
                fix="communicate from the rank process itself; pass data to its workers through queues or pipes"))

    def has_channel(self) -> bool:
        """Whether the calling thread is an actor of this rank: the main thread, or one the program started."""
        if os.getpid() != self._pid:
            return False
        return threading.get_ident() == self._main_ident or getattr(self._tl, "chan", None) is not None

    def main_returned(self) -> None:
        """The rank's function has ended: the main thread is no longer an actor of the rank."""
        self._main_ident = None

    def on_main_thread(self) -> bool:
        return threading.get_ident() == self._main_ident and os.getpid() == self._pid

    def bind_channel(self, chan: Connection | None) -> None:
        """The calling thread talks to its own actor over ``chan`` (``None``: unbind)."""
        self._tl.chan = chan

    def _cpu_delta(self) -> float:
        now = time.thread_time()
        last = getattr(self._cpu, "mark", None)
        self._cpu.mark = now
        return 0.0 if last is None else now - last

    def start_clock(self) -> None:
        """The rank's compute starts counting now (its CPU time is sent with each call)."""
        self._cpu.mark = time.thread_time()

    def exclude_cpu(self, seconds: float) -> None:
        """CPU time that is not the program's compute (an import) moves the calling thread's mark past it."""
        mark = getattr(self._cpu, "mark", None)
        if mark is not None:
            self._cpu.mark = mark + seconds

    def optimizer_step(self, optimizer: Any) -> None:
        """A ``torch.optim`` step ended: the proxy marks the end of a training step on the rank's clock."""
        self._request((STEP, id(optimizer), self._cpu_delta()))
        self._cpu.mark = time.thread_time()

    def _share(self, sid: int, nbytes: int, fd: int) -> None:
        """Tell the proxy of a shared storage of the program (see :meth:`.Staging.stage`)."""
        self._exchange((SHARE, sid, nbytes), (fd,))

    def _unshare(self, sids: list[int]) -> None:
        """Tell the proxy that the program no longer has the shared storages ``sids`` there."""
        self._exchange((UNSHARE, sids))

    # -- the calls ----------------------------------------------------------------------------------------------
    def _forward(self, name: str, args: tuple, async_op: bool) -> Any:
        """Collective ``name`` (validated by tensorplay's API in this process), performed by the proxy."""
        self._own_process(name)
        site = call_site(1)
        staged = Staged(self._staging)
        try:
            enc = self._staging.stage(name, args, OUTPUTS[name], staged)
            value = self._exchange((CALL, name, enc, site, dist_state.current_backward(), self._cpu_delta()))
        except BaseException:
            staged.release()
            self._cpu.mark = time.thread_time()
            raise
        self._cpu.mark = time.thread_time()
        if async_op:
            return self._works.track(ClientWork(self, value, staged, _result_tensors(name, args)))
        try:
            staged.copy_out()
        finally:
            staged.release()
        return value

    def _group(self, method: str, ranks: tuple[int, ...], name: str | None = None) -> int | None:
        """``new_group_handle``/``member_group_handle`` in the coordinator: the group's id there."""
        self._own_process(method)
        site = call_site(1)
        try:
            return self._exchange((GROUP, method, tuple(ranks), site, self._cpu_delta(), name))
        finally:
            self._cpu.mark = time.thread_time()


def _forwarder(b: BackendCollective) -> Callable[..., Any]:
    """``ClientBackend.<b.name>``: forwards the call, with the table's parameters (and ``Backend``'s annotations)."""
    name, n = b.name, len(b.parameters)
    declared = inspect.signature(getattr(Backend, name))
    sig = declared.replace(parameters=[
        inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                          annotation=declared.parameters[p].annotation if p in declared.parameters else
                          inspect.Parameter.empty)
        for p in ("self", *b.parameters)])

    def forward(self: ClientBackend, *args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != n:  # (tensorplay passes every argument by position: binding is the rare way)
            args = tuple(sig.bind(self, *args, **kwargs).arguments.values())[1:]
        return self._forward(name, args, args[-1])  # (async_op is the last parameter)

    forward.__name__ = name
    forward.__qualname__ = f"ClientBackend.{name}"
    forward.__doc__ = f"``Backend.{name}``, performed by the rank's proxy in the coordinator."
    forward.__signature__ = sig  # type: ignore[attr-defined]
    return forward


def _unforwardable(cls: type, b: BackendCollective) -> str | None:
    """Why ``cls`` cannot forward the table's collective ``b`` (None: it can)."""
    declared = getattr(Backend, b.name, None)
    if declared is None:
        return "Backend has no such method"
    if b.name in vars(cls):
        return "it has a hand-written method (every forwarder is generated from the table)"
    if not b.parameters or b.parameters[-1] != "async_op" or "group" not in b.parameters:
        return f"the forwarder needs 'group' and a last 'async_op' parameter, the table says {b.parameters!r}"
    if tuple(inspect.signature(declared).parameters)[1:] != b.parameters:
        return f"Backend.{b.name} does not take the table's parameters {b.parameters!r}"
    if b.name in SimBackend.__abstractmethods__ or not callable(getattr(SimBackend, b.name, None)):
        return "the simulator's backend, which performs it in the coordinator, does not implement it"
    return None


def _install_forwarders(cls: type) -> None:
    """One generated forwarder on ``cls`` per collective of the backend table; ImportError if one cannot be."""
    for name, b in BACKEND_COLLECTIVES.items():
        why = _unforwardable(cls, b)
        if why is not None:
            raise ImportError(f"ClientBackend cannot forward spec.BACKEND_COLLECTIVES[{name!r}]: {why}")
        forward = _forwarder(b)
        if inspect.signature(forward) != inspect.signature(getattr(Backend, name)):
            raise ImportError(f"ClientBackend.{name}{inspect.signature(forward)} does not match "
                              f"Backend.{name}{inspect.signature(getattr(Backend, name))}")
        setattr(cls, name, forward)


_install_forwarders(ClientBackend)


# ---------------------------------------------------------------------------------------------------------------
# the channel: a request, its descriptors, and the answer
# ---------------------------------------------------------------------------------------------------------------
def _exchange(conn: Connection, msg: tuple, fds: Sequence[int] = ()) -> tuple:
    """Send ``msg`` (and ``fds``) and return the raw answer (whose last item lists completed operations)."""
    _wire.send(conn, msg)
    if fds:  # descriptors follow the message they belong to (see proxy_handlers.Channel.recv_fds)
        with socket.socket(fileno=os.dup(conn.fileno())) as raw:
            socket.send_fds(raw, [FDS_REQUEST], list(fds))
    return _wire.recv(conn)


class _Answers:
    """The rank process's handler of each answer of its proxy (``on_<kind>``; see :mod:`.messages`)."""

    @staticmethod
    def on_ok(reply: tuple) -> Any:
        return reply[1]

    @staticmethod
    def on_err(reply: tuple) -> Any:
        _, eid, mod, qualname, message, attrs, _done = reply
        raise rebuild(eid, mod, qualname, message, attrs)


_ON_ANSWER = handler_table(_Answers, "on_", ANSWERS)


# ---------------------------------------------------------------------------------------------------------------
# asynchronous operations
# ---------------------------------------------------------------------------------------------------------------
class ClientWork(Work):
    """An asynchronous operation issued in this process and running in the coordinator."""

    def __init__(self, backend: Any, wid: int, staged: Staged, result: list[torch.Tensor]) -> None:
        self._b = backend
        self._wid = wid
        self._staged: Staged | None = staged
        self._lock = threading.Lock()
        self._result = result
        self._waited = False
        self._error: BaseException | None = None

    def finish(self, ok: bool) -> None:
        """The operation completed (``ok``: successfully): its outputs are the program's, its regions are free."""
        with self._lock:  # (the thread that waits and the one whose answer reported it may both get here)
            staged, self._staged = self._staged, None
            if staged is None:
                return
            try:
                if ok:
                    staged.copy_out()
            finally:
                staged.release()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        timeout = timeout_arg(timeout)  # (checked here, in the rank, whether the operation is done or not)
        if not self._waited:  # the wait itself goes to the coordinator (a scheduling point, as on thread ranks)
            self._waited = True
            try:
                # (timeout: its group's, counted from now: the proxy may get its turn later, in coop mode)
                self._b._request((WAIT, self._wid, self._b._cpu_delta(), timeout, time.time()))
                self._b.start_clock()
            except BaseException as e:
                self._error = e
                self.finish(False)
                raise
            self.finish(True)  # (usually done already: the answer to the wait reported the completion)
        elif self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._waited or self._staged is None or bool(self._b._request((COMPLETED, self._wid)))

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None and (
            self._waited or bool(self._b._request((SUCCESS, self._wid))))

    def source_rank(self) -> int:
        self.wait()
        return int(self._b._request((SOURCE, self._wid)))

    def result(self) -> list[torch.Tensor]:
        return self._result


class Completions:
    """The asynchronous operations of this rank process not yet reported complete, by the coordinator's id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: dict[int, ClientWork] = {}  # issued, completion not yet reported
        self._early: dict[int, bool] = {}  # reported before the answer that names them reached their thread

    def track(self, work: ClientWork) -> ClientWork:
        with self._lock:
            ok = self._early.pop(work._wid, None)
            if ok is None:
                self._works[work._wid] = work
        if ok is not None:
            work.finish(ok)
        return work

    def done(self, notes: Any) -> None:
        """``notes``: ``[(id, ok), ...]`` of operations the coordinator saw complete since its last answer."""
        for wid, ok in notes or ():
            with self._lock:
                work = self._works.pop(wid, None)
                if work is None:
                    self._early[wid] = ok
            if work is not None:
                work.finish(ok)

    def __len__(self) -> int:
        return len(self._works)
