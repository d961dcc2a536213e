"""The simulator's RPC transport: workers are simulated ranks (threads of one process).

Used automatically when ``init_rpc`` runs inside ``simulator.run`` or
``python -m simulator``.  What it keeps from a real transport, and how:

* **By value.**  Every request and answer is serialised: plain ``pickle``
  (``dill`` when pickle cannot, e.g. a lambda), with tensors copied out of
  band (``clone``), so no object is ever shared between two workers.
* **The callee's identity.**  A call's handler runs on a thread of the
  callee's rank (an actor of that rank in the simulator's scheduler, see
  :func:`simulator.adapters.threads.start_actor`) *as* the callee: the callee's RPC
  agent and ``tensorplay.distributed`` state are bound (``get_worker_info()``,
  ``dist.get_rank()`` and ``RRef.local_value()`` answer as the callee), the
  caller's distributed-autograd context is carried over, and in ``coop`` mode
  with per-rank RNGs the callee's torch RNG stream is used.  The caller's
  wait is a scheduler wait, so a handler may wait for later requests (an
  ``@async_execution`` future completed by them) and a wait nobody can end
  is reported as a deadlock naming the handler thread.
* **Authenticated.**  Every message is sealed by its sender and checked by
  its receiver before anything is unpickled, with the same code as on
  TensorPipe (:mod:`tensorplay.distributed.rpc._auth`): under the world's
  ``TENSORPLAY_RPC_SECRET``/``_FILE`` when set, else under a secret the run
  generates (the simulator starts every member itself).  The envelope's bytes
  are not counted in the trace's message sizes.
* **Ownership.**  RRef values live in their owner's table with a reference
  count; RRefs cross workers only inside messages; to_here copies.
* **Failures.**  A rank whose thread ended without ``shutdown`` (returned or
  raised) is dead: calls to it fail at once with
  :class:`WorkerUnavailableError`.  Remote exceptions keep their type and
  carry the remote traceback, as on TensorPipe.
* **Faults by seed.**  :class:`MessageFaults` drops or delays messages; a
  drop surfaces as the :class:`RpcTimeoutError` the caller would see after
  ``timeout``, a delay advances the rank's virtual clock.  The same seed gives
  the same faults.
* **Bounded, cooperative waits.**  ``init_rpc`` and ``shutdown`` wait for the
  other workers through the simulator's scheduler, so in ``coop`` mode the
  waiting rank hands over to the others, and a wait nobody can end is
  reported as a deadlock naming who is missing.

Limits: in ``coop`` mode a rank that waits through a ``threading`` primitive
(an ``Event`` a handler sets) while none of its threads runs keeps the baton;
run such code in ``mode="threads"``.  Collectives inside RPC handlers are not
supported.
"""
from __future__ import annotations

import io
import itertools
import pickle
import random
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from simulator.core.callsite import call_site
from simulator.core.clock import charge_compute, reach
from simulator.core.protocol import Scheduler
from simulator.core.errors import RankFailedError, SimError
from simulator.core.sched import DONE, FREE
from simulator.adapters.threads import start_actor
from simulator.core.trace import Event
from simulator.rpc import autograd
from simulator.core.state import current_rank_state
from torch import nn

from tensorplay.distributed import _state
from tensorplay.distributed.errors import DistRuntimeError, DistTypeError, DistValueError
from tensorplay.distributed.rpc import _agent, _auth
from tensorplay.distributed.rpc._agent import Agent
from tensorplay.distributed.rpc import futures as _futures
from tensorplay.distributed.rpc._call import RemoteFailure, async_outcome, dill_pickler, future_outcome, is_async, run_call, unwrap
from tensorplay.distributed.rpc.errors import RpcTimeoutError, WorkerUnavailableError, rpc_message
from tensorplay.distributed.rpc.futures import Future
from tensorplay.distributed.rpc.rref import RRef
from tensorplay.distributed.rpc.worker import WorkerInfo

__all__ = ["SimRpcBackendOptions", "MessageFaults", "SimAgent", "start", "options_from", "claims_caller",
           "default_rank_and_size", "USAGE"]


# ---------------------------------------------------------------------------
# what this transport uses of the simulator's run and rank state (its whole surface)
# ---------------------------------------------------------------------------
class _Run(Protocol):
    seed: int
    cost: Any          # CostModel: .cost("send", nbytes, 2) for a message's transfer
    events: Any        # the trace: .append(Event)
    sched: Scheduler   # the scheduler contract (simulator.core.protocol): lock, block, wake, leave used here
    exit_hooks: list   # called with a rank's state when its thread ends (declared on simulator.core.state.Run)


class _Rank(Protocol):
    rank: int
    run: _Run
    state: int                  # FREE / DONE (sched)
    vt: float                   # the rank's (or actor's) virtual clock; moved through simulator.core.clock
    cpu_mark: float             # the CPU time its last compute was charged at
    torch_rng: Any              # coop mode: the rank's own torch RNG stream
    exc: BaseException | None   # what its function raised


def _on_rank_exit(run: _Run, hook: Callable[[Any], None]) -> None:
    """Have the simulator call ``hook(rank_state)`` when a rank thread of ``run`` ends."""
    run.exit_hooks.append(hook)

#: how to get a worker onto this transport (the "Fix:" of init_rpc(backend="sim") outside the simulator)
WHERE = "inside a simulated rank"
USAGE = "run the function with simulator.run(fn, world_size) or `python -m simulator`"


def claims_caller() -> bool:
    """The calling thread is a simulated rank (or one of its threads): the simulator's transport serves it."""
    return current_rank_state() is not None and _state.current() is not None


def default_rank_and_size() -> tuple[int, int | None]:
    """The simulated rank's own rank and the run's world size."""
    st = _state.current()
    return (st.rank, st.world_size) if st is not None else (-1, None)


@dataclass(frozen=True)
class MessageFaults:
    """Seeded message faults for the messages a worker *sends* (requests and answers).

    Args:
        drop: probability that a message is lost (the caller gets :class:`RpcTimeoutError`).
        delay: probability that a message is late by up to ``max_delay_s`` (virtual time).
        max_delay_s: upper bound of a delay, seconds.
        seed: the fault stream's seed; ``None`` derives it from the world's seed and the rank.
    """

    drop: float = 0.0
    delay: float = 0.0
    max_delay_s: float = 0.01
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("drop", "delay"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise DistValueError(rpc_message("MessageFaults", f"{name} must be a probability in [0, 1]",
                                                 values={name: p}, fix=f"pass e.g. {name}=0.1"))
        if self.max_delay_s < 0:
            raise DistValueError(rpc_message("MessageFaults", "max_delay_s must be >= 0",
                                             values={"max_delay_s": self.max_delay_s}, fix="pass e.g. 0.01"))


@dataclass
class SimRpcBackendOptions:
    """Options of the simulator's transport (the counterpart of ``TensorPipeRpcBackendOptions``).

    Args:
        rpc_timeout: default per-call timeout in seconds (the handler's run time plus injected delays).
        faults: :class:`MessageFaults` for the messages this worker sends, or ``None``.
        device_maps: ``{worker name: {local device: remote device}}``, as in TensorPipe: a tensor this
            worker sends to that worker on a mapped device arrives on the remote device (answers
            travel back through the inverse map).  Tensors on unmapped devices keep their device.
    """

    rpc_timeout: float = 60.0
    faults: MessageFaults | None = None
    init_method: str = field(default="sim://", repr=False)
    device_maps: dict[str, dict[torch.device, torch.device]] = field(default_factory=dict)


def options_from(options: Any) -> SimRpcBackendOptions:
    """The simulator's options for what ``init_rpc`` was given inside a simulated rank.

    ``SimRpcBackendOptions`` pass through; a ``TensorPipeRpcBackendOptions``
    (torch's class, which tensorplay re-exports) written for a real run is
    mapped: ``rpc_timeout`` is kept (``0``, torch's "no timeout", becomes
    unbounded: the run's own timeout and deadlock detection still apply) and
    ``device_maps`` are applied to tensors crossing between workers.
    ``init_method`` is not used (every worker is in this process),
    ``num_worker_threads``, ``devices`` and the transport/channel lists have
    no meaning here (every handler gets a thread of its own on the callee's rank).
    """
    if options is None or isinstance(options, SimRpcBackendOptions):
        return options or SimRpcBackendOptions()
    import torch.distributed.rpc as trpc

    if not isinstance(options, trpc.RpcBackendOptions):
        raise DistTypeError(rpc_message(
            "init_rpc", "rpc_backend_options must be TensorPipeRpcBackendOptions or SimRpcBackendOptions",
            values={"rpc_backend_options": type(options).__name__},
            fix="pass rpc.TensorPipeRpcBackendOptions(rpc_timeout=...) (mapped inside the simulator), "
                "SimRpcBackendOptions(...), or None"))
    timeout = float(options.rpc_timeout)
    if timeout == 0:
        timeout = float("inf")
    maps: dict[str, dict[torch.device, torch.device]] = {}
    for worker, m in dict(getattr(options, "device_maps", {}) or {}).items():
        maps[str(worker)] = {torch.device(k): torch.device(v) for k, v in dict(m).items()}
    return SimRpcBackendOptions(rpc_timeout=timeout, device_maps=maps)


# ---------------------------------------------------------------------------
# serialisation: by value, tensors cloned out of band
# ---------------------------------------------------------------------------
_codec = threading.local()  # .depth > 0 while a message is being encoded (RRefs may only pickle then)


def _copy_tensor(t: torch.Tensor) -> torch.Tensor:
    dmap = getattr(_codec, "device_map", None)
    dev = dmap.get(t.device) if dmap else None
    c = t.detach().clone() if dev is None or dev == t.device else t.detach().to(dev, copy=True)
    if type(t) is nn.Parameter:
        return nn.Parameter(c, requires_grad=t.requires_grad)
    if t.requires_grad:
        c.requires_grad_(True)
    return c


class _Pickler(pickle.Pickler):
    def __init__(self, f: io.BytesIO, tensors: list, grad_sends: list) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors
        self.grad_sends = grad_sends

    def persistent_id(self, obj: Any) -> Any:
        t = type(obj)
        if t is torch.Tensor or t is nn.Parameter:
            return _tensor_pid(obj, self.tensors, self.grad_sends)
        return None


def _autograd() -> Any:
    return rpc_autograd


def _tensor_pid(obj: torch.Tensor, tensors: list, grad_sends: list) -> int:
    i = len(tensors)
    sid = None
    if obj.requires_grad:
        ag = _autograd()
        if ag.current_context_id() is not None:
            sid = ag.on_send(obj)
    if sid is not None:  # recorded for distributed autograd: the receiver gets a fresh leaf
        tensors.append(_copy_tensor(obj).detach())
        grad_sends.append((i, sid))
    else:
        tensors.append(_copy_tensor(obj))
    return i


def _dill_pickler(f: io.BytesIO, tensors: list, grad_sends: list) -> Any:
    def pid(obj: Any) -> Any:
        t = type(obj)
        if t is torch.Tensor or t is nn.Parameter:
            return _tensor_pid(obj, tensors, grad_sends)
        return None

    return dill_pickler(f, pid)


class _Message:
    """A serialised message: bytes (sealed when the world is authenticated), the out-of-band tensor copies,
    and the sender (for autograd)."""

    __slots__ = ("data", "tensors", "grad_sends", "sender", "dill", "sealed")

    def __init__(self, data: bytes, tensors: list, grad_sends: list, sender: str, dill: bool) -> None:
        self.data, self.tensors, self.grad_sends, self.sender, self.dill = data, tensors, grad_sends, sender, dill
        self.sealed = False

    def seal(self, auth: "_auth.Authenticator | None") -> "_Message":
        if auth is not None:
            self.data = auth.seal(self.data)
            self.sealed = True
        return self

    @property
    def nbytes(self) -> int:
        """What crosses the wire: the pickle plus the tensors' bytes (the authentication envelope left out, so
        virtual times do not depend on whether a world is authenticated)."""
        n = len(self.data) - (_auth.HEADER_LEN if self.sealed else 0)
        for t in self.tensors:
            n += t.numel() * t.element_size()
        return n


def _encode(obj: Any, sender: str, device_map: dict | None = None) -> _Message:
    prev_map = getattr(_codec, "device_map", None)
    _codec.device_map = device_map
    try:
        return _encode_mapped(obj, sender)
    finally:
        _codec.device_map = prev_map


def _encode_mapped(obj: Any, sender: str) -> _Message:
    tensors: list = []
    grad_sends: list = []
    f = io.BytesIO()
    outer = getattr(_codec, "retained", None)
    _codec.depth = getattr(_codec, "depth", 0) + 1
    _codec.retained = []
    try:
        try:
            _Pickler(f, tensors, grad_sends).dump(obj)
            used_dill = False
        except (pickle.PicklingError, AttributeError, TypeError):
            _rollback()
            tensors.clear()
            grad_sends.clear()
            f = io.BytesIO()
            _dill_pickler(f, tensors, grad_sends).dump(obj)
            used_dill = True
    except BaseException:
        _rollback()
        raise
    finally:
        _codec.depth -= 1
        _codec.retained = outer
    return _Message(f.getvalue(), tensors, grad_sends, sender, used_dill)


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: io.BytesIO, tensors: list) -> None:
        super().__init__(f)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self.tensors[pid]


def _rollback() -> None:
    """A message that failed to serialise gives back the RRef references it took."""
    for world, owner, rid in _codec.retained:
        world.release(owner, rid)
    _codec.retained = []


def _decode(msg: _Message, auth: "_auth.Authenticator | None" = None) -> Any:
    """The message's object as its receiver (whose authenticator is ``auth``) sees it.

    With ``auth``, the envelope is checked first: a message that is not authentic (or a replay) raises
    :class:`~tensorplay.distributed.rpc._auth.AuthenticationError` before anything is unpickled.
    """
    data: Any = msg.data
    if auth is not None:
        data = auth.open(data, f"simulated worker {msg.sender!r}")
    tensors = msg.tensors
    if msg.grad_sends:
        ag = _autograd()
        for i, sid in msg.grad_sends:
            leaf = tensors[i].requires_grad_(True)
            ag.on_recv(leaf, msg.sender, sid)
    f = io.BytesIO(data)
    if msg.dill:
        import dill

        class _DillUnpickler(dill.Unpickler):  # type: ignore[misc]
            def persistent_load(self, pid: Any) -> Any:
                return tensors[pid]

        return _DillUnpickler(f).load()
    return _Unpickler(f, tensors).load()


def in_message() -> bool:
    """Whether the calling thread is serialising a simulated RPC message right now."""
    return getattr(_codec, "depth", 0) > 0


# ---------------------------------------------------------------------------
# RRefs
# ---------------------------------------------------------------------------
class _Slot:
    __slots__ = ("value", "count")

    def __init__(self, value: Any, count: int) -> None:
        self.value = value
        self.count = count


class _Dropped:
    """An RRef value whose creating message was lost."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Pending:
    """An ``@async_execution`` call whose future has not completed yet.

    ``outcome`` completes (on whichever thread completes the function's
    future) with the result or a :class:`RemoteFailure`, as seen by the callee.
    """

    __slots__ = ("outcome",)

    def __init__(self, fut: Any = None, callee: str = "", what: str = "async_execution") -> None:
        self.outcome: Future[Any] = Future(what=what)
        out = self.outcome
        if fut is not None:  # else a placeholder (an RRef's value before its handler ran), completed by hand
            fut.add_done_callback(lambda f: out.set_result(future_outcome(f, callee)))


class _FutureWait:
    """What a simulated rank blocked in ``Future.wait`` waits for (read by the deadlock report)."""

    __slots__ = ("done", "what")

    def __init__(self, what: str) -> None:
        self.done = False
        self.what = what

    def describe(self) -> str:
        if self.what == "async_execution":
            return (f"in {self.what}.wait() (serving a request: the future the @async_execution function "
                    f"returned is not completed and nothing left running can complete it)")
        return (f"in {self.what}.wait() (the future is not completed and nothing left running can complete it; "
                f"an RPC's answer comes from its handler, which runs on a thread of the callee rank: see the "
                f"callee's threads below)")


_rng_tl = threading.local()  # .rs: the rank whose torch RNG stream this thread draws from while it serves a call


def _coop_wait(fut: Future[Any], timeout: float | None) -> bool:
    """A simulated rank waiting for a future hands over to the others until it completes."""
    rs = current_rank_state()
    if rs is None:
        return False
    sched = rs.run.sched
    w = _FutureWait(fut._what)

    def wake(_: Any) -> None:
        with sched.lock:
            w.done = True
            sched.wake(rs)

    fut.add_done_callback(wake)
    was_free = rs.state == FREE  # a thread the rank started joins the schedule for the wait, then leaves it
    lender = getattr(_rng_tl, "rs", None)  # a handler drawing from its callee's stream: others draw meanwhile
    if lender is not None:
        lender.torch_rng = torch.get_rng_state()
    try:
        sched.block(rs, w)
    finally:
        if lender is not None:
            torch.set_rng_state(lender.torch_rng)
        if was_free:
            sched.leave(rs)
    return True


_futures.coop_wait = _coop_wait


def _resolve_async(value: Any, fn: Any, callee: str) -> Any:
    """The callee's answer to a call: an async function's completed future is unwrapped, a pending one
    becomes :class:`_Pending`, anything else is the value itself."""
    if type(value) is RemoteFailure or not is_async(fn):
        return value
    value = async_outcome(value, fn, callee)
    if type(value) is RemoteFailure:
        return value
    if value.done():
        return future_outcome(value, callee)
    return _Pending(value, callee)


class _SimRRef:
    __slots__ = ("world", "owner_info", "rid", "holder", "__weakref__")

    def __init__(self, world: "_RpcWorld", owner: WorkerInfo, rid: int, holder: str) -> None:
        self.world, self.owner_info, self.rid, self.holder = world, owner, rid, holder

    def __del__(self) -> None:
        try:
            self.world.release(self.owner_info.name, self.rid)
        except Exception:  # noqa: BLE001  interpreter shutdown
            pass

    def owner(self) -> WorkerInfo:
        return self.owner_info

    def here(self) -> str:
        return self.holder

    def is_owner(self) -> bool:
        return self.holder == self.owner_info.name

    def confirmed_by_owner(self) -> bool:
        return True

    def ident(self) -> str:
        return f"{self.owner_info.id}:{self.rid}"

    def _value(self, call: str) -> Any:
        owner = self.world.agents.get(self.owner_info.name)
        if owner is None or not owner.alive():
            me = _agent.current()
            raise WorkerUnavailableError(rpc_message(
                call, "the RRef's owner is unavailable (it shut down, returned or raised)",
                worker=getattr(me, "name", None), values={"owner": self.owner_info.name},
                fix="keep the owner running (and in RPC) while others use its RRefs"))
        slot = owner.rrefs.get(self.rid)
        if slot is None:  # pragma: no cover  a live RRef always keeps its slot
            raise DistRuntimeError(rpc_message(call, "the RRef's value is gone from its owner",
                                               values={"owner": self.owner_info.name, "id": self.rid}))
        v = slot.value
        if type(v) is _Pending:  # remote() of an @async_execution function that has not answered yet
            v = v.outcome.wait()
        if type(v) is _Dropped:
            raise v.error
        return v

    def local_value(self) -> Any:
        return unwrap(self._value("RRef.local_value"))

    def to_here(self, timeout: float | None) -> Any:
        v = self._value("RRef.to_here")
        if self.is_owner():
            return unwrap(v)
        owner = self.world.agents[self.owner_info.name]
        # the value crosses from the owner to here, by value
        msg = owner._as_sender(lambda: _encode(v, owner.name).seal(owner.auth))
        holder = self.world.agents.get(self.holder)
        return unwrap(_decode(msg, holder.auth if holder is not None else owner.auth))

    def reduce(self) -> Any:
        if not in_message():
            raise DistRuntimeError(rpc_message(
                "RRef.__reduce__", "an RRef can only be pickled inside an RPC message", worker=self.holder,
                values={"rref": self.ident()},
                fix="pass the RRef as an argument or result of rpc_sync/rpc_async/remote instead of pickling it"))
        self.world.retain(self.owner_info.name, self.rid)  # the message holds one reference while in flight
        _codec.retained.append((self.world, self.owner_info.name, self.rid))
        return (_rebuild_sim_rref, (self.owner_info.name, self.owner_info.id, self.rid))


def _rebuild_sim_rref(owner_name: str, owner_id: int, rid: int) -> RRef[Any]:
    me = _agent.current()
    if not isinstance(me, SimAgent):  # pragma: no cover
        raise DistRuntimeError(rpc_message(
            "RRef", "a simulated RRef arrived outside a simulated worker",
            values={"owner": owner_name, "rref_id": rid, "agent": type(me).__name__ if me else None},
            fix="pass simulated RRefs only between workers of the same simulator.run world"))
    return RRef._wrap(_SimRRef(me.world, WorkerInfo(owner_name, owner_id), rid, me.name))


# ---------------------------------------------------------------------------
# the world and its barriers
# ---------------------------------------------------------------------------
class _Barrier:
    """A cooperative wait of several workers; ``done`` once every expected worker arrived or died."""

    __slots__ = ("what", "world", "arrived", "waiters", "done", "missing")

    def __init__(self, what: str, world: "_RpcWorld") -> None:
        self.what = what
        self.world = world
        self.arrived: set[int] = set()
        self.waiters: list[Any] = []
        self.done = False
        self.missing: list[int] = []

    def describe(self) -> str:  # read by the simulator's deadlock report
        missing = [r for r in range(self.world.size) if r not in self.arrived]
        serving = f", {self.world.handlers} request(s) still being served" if self.world.handlers else ""
        return (f"in rpc.{self.what} (RPC world of {self.world.size}: arrived {sorted(self.arrived)}, "
                f"missing {missing}{serving})")


class _RpcWorld:
    """The RPC state of one simulated run: its agents, barriers and rank handles."""

    def __init__(self, run: Any, size: int) -> None:
        self.run = run
        self.size = size
        #: the run's own secret, for members whose environment names none (never leaves this process)
        self.secret = _auth.generate_secret().encode()
        self.lock = threading.RLock()
        self.agents: dict[str, SimAgent] = {}
        self.by_rank: dict[int, SimAgent] = {}
        self.init_barrier = _Barrier("init_rpc", self)
        self.shutdown_barrier = _Barrier("shutdown", self)
        self.handlers = 0  # requests being served (handler threads running): a graceful shutdown waits for them
        self.next_context = itertools.count(1)

    # -- RRef counting ------------------------------------------------------------
    def retain(self, owner: str, rid: int) -> None:
        with self.lock:
            a = self.agents.get(owner)
            if a is not None and rid in a.rrefs:
                a.rrefs[rid].count += 1

    def release(self, owner: str, rid: int) -> None:
        with self.lock:
            a = self.agents.get(owner)
            slot = a.rrefs.get(rid) if a is not None else None
            if slot is not None:
                slot.count -= 1
                if slot.count <= 0:
                    del a.rrefs[rid]  # type: ignore[union-attr]

    # -- barriers (called with the scheduler's lock held) -----------------------
    def _settle(self, b: _Barrier) -> None:
        if b.done:
            return
        gone = {a.rank for a in self.by_rank.values() if not a.thread_alive()}
        if b is self.init_barrier:
            complete = len(b.arrived) == self.size
        else:  # a worker that left (thread ended, or shutdown(graceful=False)) is not waited for
            left = gone | {a.rank for a in self.by_rank.values() if a.closed}
            complete = (self.handlers == 0  # as TensorPipe's graceful shutdown, no request is left unanswered
                        and all(r in b.arrived or r in left or r not in self.by_rank for r in range(self.size)))
            b.missing = sorted(r for r in range(self.size) if r not in b.arrived)
        if complete:
            b.done = True
            for rs in b.waiters:
                self.run.sched.wake(rs)
            b.waiters.clear()

    def wait(self, b: _Barrier, rank: int) -> None:
        """Arrive at ``b`` as ``rank`` and wait (cooperatively) until it completes."""
        rs = current_rank_state()
        sched = self.run.sched
        with sched.lock:
            b.arrived.add(rank)
            self._settle(b)
            if not b.done:
                b.waiters.append(rs)
        if not b.done:
            sched.block(rs, b)

    def rank_exited(self, rs: Any) -> None:
        """Simulator hook: a rank thread ended; barriers waiting for it may now complete."""
        with self.run.sched.lock:
            a = self.by_rank.get(rs.rank)
            if a is not None:
                a.exited = True
            self._settle(self.shutdown_barrier)


_worlds: "weakref.WeakKeyDictionary[Any, _RpcWorld]" = weakref.WeakKeyDictionary()
_worlds_lock = threading.Lock()


def _world_of(rs: Any, size: int) -> _RpcWorld:
    run = rs.run
    with _worlds_lock:
        w = _worlds.get(run)
        if w is None:
            w = _worlds[run] = _RpcWorld(run, size)
            _on_rank_exit(run, w.rank_exited)
        elif w.size != size:
            raise DistValueError(rpc_message(
                "init_rpc", "world_size differs from the one other workers passed",
                values={"world_size": size, "others": w.size}, fix="pass the same world_size on every worker"))
        return w


# ---------------------------------------------------------------------------
# the agent
# ---------------------------------------------------------------------------
class SimAgent(Agent):
    """One simulated worker's RPC agent."""

    kind = "sim"
    per_thread = True

    def __init__(self, world: _RpcWorld, name: str, rank: int, rs: Any, dist_state: Any,
                 options: SimRpcBackendOptions, secret: bytes | None = None) -> None:
        self.world = world
        self.name, self.rank, self.world_size = name, rank, world.size
        self.timeout = float(options.rpc_timeout)
        self.device_maps = dict(options.device_maps)
        self.objects: dict[Any, Any] = {}
        self.rrefs: dict[int, _Slot] = {}
        self.autograd: dict[int, Any] = {}
        self._rid = itertools.count(1)
        self.context_ids = itertools.count(1)  # distributed autograd contexts started here
        self.rs = rs
        self.dist_state = dist_state
        self.closed = False
        self.exited = False
        self.faults = options.faults
        #: seals what this worker sends and checks what it receives (one session per worker): under the
        #: secret of this rank's environment, else the run's own (the simulator starts every member itself)
        self.auth = _auth.Authenticator(secret or world.secret)
        seed = options.faults.seed if options.faults and options.faults.seed is not None else rs.run.seed
        self.rng = random.Random(f"tensorplay.rpc:{seed}:{rank}")
        self._infos: list[WorkerInfo] | None = None
        self.rpc_seq = 0  # RPCs this worker issued (the trace's seq for them)

    # -- liveness -------------------------------------------------------------
    def thread_alive(self) -> bool:
        return not self.exited and self.rs.state != DONE

    def alive(self) -> bool:
        return not self.closed and self.thread_alive()

    def distributed_autograd(self) -> Any:
        """The simulator's engine (:mod:`simulator.rpc.autograd`)."""
        return rpc_autograd

    def worker_infos(self) -> list[WorkerInfo]:
        if self._infos is None:
            self._infos = sorted((WorkerInfo(a.name, a.rank) for a in self.world.by_rank.values()),
                                 key=lambda w: w.id)
        return list(self._infos)

    def _peer(self, call: str, dst: WorkerInfo) -> "SimAgent":
        peer = self.world.by_rank.get(dst.id)
        if peer is None or not peer.alive():
            why = ("it shut down" if peer is not None and peer.closed else
                   f"its rank raised {type(peer.rs.exc).__name__}: {peer.rs.exc}" if peer is not None and peer.rs.exc
                   else "its rank returned without rpc.shutdown()")
            raise WorkerUnavailableError(rpc_message(
                call, "the destination worker is unavailable", worker=self.name,
                values={"to": dst.name, "rank": dst.id, "reason": why},
                fix="keep every worker in RPC until all are done: end each worker's function with rpc.shutdown()"))
        return peer

    # -- running as another worker ------------------------------------------------
    def _as_sender(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` with this agent (and its rank's state) bound to the calling thread."""
        if _agent.current() is self:
            return fn()
        prev_agent = _agent.bind_thread(self)
        prev_state = _state.current()
        _state.bind_thread(self.dist_state)
        swap = self._swap_rng()
        prev_lender = getattr(_rng_tl, "rs", None)
        if swap is not None:
            _rng_tl.rs = self.rs
        try:
            return fn()
        finally:
            if swap is not None:
                _rng_tl.rs = prev_lender
                self.rs.torch_rng = torch.get_rng_state()
                torch.set_rng_state(swap)
            _state.bind_thread(prev_state)
            _agent.bind_thread(prev_agent)

    def _swap_rng(self) -> torch.Tensor | None:
        """coop mode with per-rank RNGs: run as this rank on this rank's torch RNG stream (a handler thread of
        this rank included: the scheduler loads a rank's stream for the rank's own thread only)."""
        me = current_rank_state()
        sched = self.rs.run.sched
        if me is None or me is self.rs or not getattr(sched, "swap_rng", False) or self.rs.torch_rng is None:
            return None
        mine = torch.get_rng_state()
        torch.set_rng_state(self.rs.torch_rng)
        return mine

    def _fault(self, call: str, dst: WorkerInfo, leg: str, timeout: float, rec: "_RpcRecord") -> float:
        """Apply this sender's message faults to one message; returns the injected delay (virtual seconds),
        which the call's clock (``rec``) takes."""
        f = self.faults
        if f is None:
            return 0.0
        r = self.rng
        if f.drop and r.random() < f.drop:
            rec.v += timeout
            raise RpcTimeoutError(rpc_message(
                call, "the call did not finish within its timeout", worker=self.name,
                values={"to": dst.name, "timeout": timeout, "cause": f"simulated loss of the {leg}"},
                fix="retry idempotent calls, or lower MessageFaults.drop"))
        if f.delay and r.random() < f.delay:
            d = r.uniform(0.0, f.max_delay_s)
            rec.v += d
            return d
        return 0.0

    def _exchange(self, call: str, dst: WorkerInfo, fn: Callable[..., Any], args: tuple, kwargs: dict,
                  timeout: float, on_peer: Callable[["SimAgent", Any], Any] | None = None
                  ) -> "tuple[Future[Any], _RpcRecord]":
        """Send one request; its handler runs on a new thread of the callee's rank.

        Returns the future of the decoded answer (with ``on_peer``, for ``remote``: of ``None``
        once the callee kept the value) and the call's record.  Bad arguments and a lost request
        raise here, on the caller.  The handler runs as the callee (its agent, state and RNG
        stream) in the caller's distributed-autograd context, as torch's agent does, and may
        wait for anything a later operation completes (e.g. an ``@async_execution`` future
        completed by another request): the caller's wait is a scheduler wait, so a wait nobody
        can end is reported as a deadlock.  The call is an event on the trace
        (:class:`_RpcRecord`), recorded when its answer arrives.
        """
        peer = self._peer(call, dst)
        rec = _RpcRecord(self, call, peer)
        try:
            req = _encode((fn, args, kwargs), self.name, self.device_maps.get(dst.name)).seal(self.auth)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise DistTypeError(rpc_message(
                call, "the call's arguments cannot be serialised", worker=self.name,
                values={"error": f"{type(e).__name__}: {e}"[:300]},
                fix="send tensors, numbers, strings, containers of them, and objects of importable classes")) from e
        rec.transfer(req)
        try:
            late = self._fault(call, dst, "request", timeout, rec)
        finally:
            rec.sent()
        ag = _autograd()
        cid = ag.current_context_id()
        fut: Future[Any] = Future(what=call)
        world = self.world
        sched = world.run.sched

        def handle() -> None:  # on the callee's handler thread
            me = current_rank_state()
            ag.set_context_id(cid)
            me.vt = max(me.vt, rec.v)  # the request arrived
            delay = late
            result: Any = None
            exc: BaseException | None = None
            try:
                wall = time.perf_counter()
                value = peer._as_sender(lambda: peer._serve(req))
                took = time.perf_counter() - wall
                pending = type(value) is _Pending
                if pending:  # an async function's future: its completion is the answer
                    value = value.outcome.wait()
                if on_peer is not None:
                    peer._as_sender(lambda: on_peer(peer, value))
                    answer = None
                else:
                    answer = peer._as_sender(lambda: peer._answer(value, self.name))
                charge_compute(me)  # the handler's compute, counted as the callee rank's
                rec.v = max(rec.v, me.vt)
                if answer is not None:
                    rec.transfer(answer)
                    delay += peer._fault(call, dst, "answer", timeout, rec)
                    if not pending and delay + took > timeout:
                        raise RpcTimeoutError(rpc_message(
                            call, "the call did not finish within its timeout", worker=self.name,
                            values={"to": dst.name, "timeout": timeout, "took_s": round(delay + took, 6)},
                            fix="raise timeout=, or make the remote function faster"))
                    result = self._as_sender(lambda: _decode(answer, self.auth))
                    if type(result) is RemoteFailure:
                        exc, result = result.to_exception(), None
            except BaseException as e:  # noqa: BLE001  the caller's future completes whatever happens
                exc = e
            finally:
                ag.set_context_id(None)
                rec.close()
            # completed as the caller: its then() callbacks run as they would on the caller's agent
            self._as_sender(lambda: fut.set_exception(exc) if exc is not None else fut.set_result(result))
            with sched.lock:
                world.handlers -= 1
                world._settle(world.shutdown_barrier)

        with sched.lock:
            world.handlers += 1
        try:
            start_actor(peer.rs, handle, f"rpc-{call}-from-{self.name}-{rec.seq}")
        except BaseException:
            with sched.lock:
                world.handlers -= 1
                world._settle(world.shutdown_barrier)
            raise
        return fut, rec

    def _serve(self, req: _Message) -> Any:
        """Run a request as this (callee) worker: the result, a :class:`RemoteFailure` or a :class:`_Pending`."""
        try:
            f, a, k = _decode(req, self.auth)
        except BaseException as e:  # noqa: BLE001  e.g. a class missing on the callee
            return RemoteFailure.capture(e, self.name)
        return _resolve_async(run_call(f, a, k), f, self.name)

    def _answer(self, value: Any, to: str) -> _Message:
        """Encode ``value`` as this (callee) worker's answer to ``to``; one that does not pickle fails."""
        back = self.world.agents.get(to)
        dmap = back.device_maps.get(self.name) if back is not None else None
        inverse = {v: k for k, v in dmap.items()} if dmap else None  # answers take the caller's map backwards
        try:
            return _encode(value, self.name, inverse).seal(self.auth)
        except BaseException as e:  # noqa: BLE001  an answer that does not pickle
            return _encode(RemoteFailure.capture(e, self.name), self.name).seal(self.auth)

    # -- calls ----------------------------------------------------------------
    def call_sync(self, call: str, dst: WorkerInfo, fn: Callable[..., Any], args: tuple, kwargs: dict,
                  timeout: float) -> Any:
        fut, rec = self._exchange(call, dst, fn, args, kwargs, timeout)
        try:
            return fut.wait()
        finally:
            rec.arrived()

    def call_async(self, call: str, dst: WorkerInfo, fn: Callable[..., Any], args: tuple, kwargs: dict,
                   timeout: float) -> Future[Any]:
        try:
            return self._exchange(call, dst, fn, args, kwargs, timeout)[0]
        except RpcTimeoutError as e:  # a lost request fails the future; bad arguments raise here
            fut: Future[Any] = Future(what=call)
            fut.set_exception(e)
            return fut

    def remote(self, dst: WorkerInfo, fn: Callable[..., Any], args: tuple, kwargs: dict,
               timeout: float) -> RRef[Any]:
        peer = self._peer("remote", dst)
        placeholder = _Pending(what="remote")  # the value, once the handler kept it (to_here waits for it)
        rid = peer.new_slot(placeholder)

        def keep(owner: "SimAgent", value: Any) -> None:
            slot = owner.rrefs.get(rid)
            if slot is not None and slot.value is placeholder:
                slot.value = value
            if not placeholder.outcome.done():
                placeholder.outcome.set_result(value)

        try:
            fut, _ = self._exchange("remote", dst, fn, args, kwargs, timeout, on_peer=keep)
        except RpcTimeoutError as e:  # a lost request: to_here() reports it
            keep(peer, _Dropped(e))
        except BaseException:
            self.world.release(peer.name, rid)
            raise
        else:
            def failed(f: Future[Any]) -> None:  # the handler failed before keeping a value (e.g. a deadlock)
                e = f.exception()
                if e is not None:
                    keep(peer, _Dropped(e))

            fut.add_done_callback(failed)
        return RRef._wrap(_SimRRef(self.world, WorkerInfo(peer.name, peer.rank), rid, self.name))

    def new_slot(self, value: Any) -> int:
        with self.world.lock:
            rid = next(self._rid)
            self.rrefs[rid] = _Slot(value, 1)
            return rid

    def local_rref(self, value: Any) -> RRef[Any]:
        rid = self.new_slot(value)
        return RRef._wrap(_SimRRef(self.world, WorkerInfo(self.name, self.rank), rid, self.name))

    # -- shutdown -------------------------------------------------------------
    def shutdown(self, graceful: bool, timeout: float) -> None:
        """Graceful: wait (cooperatively) until every other worker shut down or left, then close.

        ``timeout`` is not needed here: a worker that can never arrive is either gone (its
        thread ended: not waited for) or blocked elsewhere, which the simulator reports as a
        deadlock; the run's own timeout bounds the rest.
        """
        import warnings

        missing: list[str] = []
        if graceful:
            b = self.world.shutdown_barrier
            while True:
                try:
                    self.world.wait(b, self.rank)
                    break
                except RankFailedError:
                    # another rank died; the simulator woke us to tell. The barrier counts the dead
                    # as gone, so keep waiting for the live workers (as a TensorPipe survivor would).
                    continue
                except SimError:  # a deadlock or the run's timeout: leave, and let the run report it
                    self.closed = True
                    raise
            missing = [self.world.by_rank[r].name for r in b.missing  # a graceful=False exit is deliberate
                       if r in self.world.by_rank and not self.world.by_rank[r].closed]
            if missing:
                warnings.warn(rpc_message(
                    "shutdown", "graceful shutdown did not wait for workers that ended without shutdown "
                    "(they returned or raised)", worker=self.name, values={"missing": missing},
                    fix="end every worker's function with rpc.shutdown()"), RuntimeWarning, stacklevel=3)
        self.closed = True
        with self.world.run.sched.lock:  # workers waiting in a graceful shutdown stop waiting for this one
            self.world._settle(self.world.shutdown_barrier)
        with _worlds_lock:  # everyone is out: a later init_rpc in this run starts a fresh RPC world
            if all(not a.alive() for a in self.world.by_rank.values()) and _worlds.get(self.world.run) is self.world:
                del _worlds[self.world.run]


class _RpcRecord:
    """One RPC as an event on the simulator's trace, with virtual time from the run's cost model.

    The call has its own clock ``v``: it starts at the caller's clock after the
    compute since the caller's last operation (as a collective does), takes the
    request's serialisation and transfer and any injected delay (the caller's
    clock follows it that far: sending is the caller's work), then the
    callee's clock when its handler ends (the handler thread starts at the
    request's arrival and takes its own compute), then the answer's transfer.
    ``rpc_sync`` moves the caller's clock to the answer's arrival; an
    ``rpc_async`` caller goes on.  The event (``group = (caller, callee)``,
    ``peer`` the callee, ``seq`` the caller's RPC counter at the call) is
    recorded when the answer arrives.  The caller is the calling thread's actor
    when it belongs to the agent's rank (the rank, a thread of it, a handler
    thread of it), else the agent's rank, whose compute accounting is left alone.
    """

    __slots__ = ("agent", "call", "peer", "rs", "own", "seq", "wall_start", "vstart", "v", "nbytes", "site")

    def __init__(self, agent: SimAgent, call: str, peer: SimAgent) -> None:
        self.agent, self.call, self.peer = agent, call, peer
        me = current_rank_state()
        self.own = me is not None and me.run is agent.rs.run and me.rank == agent.rank
        self.rs = rs = me if self.own else agent.rs
        if self.own:
            charge_compute(rs)
        self.site = call_site(4)
        agent.rpc_seq += 1
        self.seq = agent.rpc_seq
        self.wall_start = time.perf_counter()
        self.vstart = self.v = rs.vt
        self.nbytes = 0

    def transfer(self, msg: Any) -> None:
        """A message (request or answer) crossed: its bytes and modelled transfer time."""
        if type(msg) is _Message:
            n = msg.nbytes
            self.nbytes += n
            self.v += self.rs.run.cost.cost("send", n, 2)

    def sent(self) -> None:
        """The request left: the caller's clock takes its serialisation, transfer and delay."""
        rs = self.rs
        if self.own:  # serialising is the caller's compute; the call's clock takes it too
            before = rs.vt
            charge_compute(rs)
            self.v += rs.vt - before
        reach(rs, self.v)  # the transfer (and any injected delay) the caller waited for

    def arrived(self) -> None:
        """The caller waited for the answer: its clock moves to the answer's arrival."""
        reach(self.rs, self.v)
        if self.own:
            self.rs.cpu_mark = time.thread_time()  # the wait is not the caller's compute

    def close(self) -> None:
        rs = self.rs
        rs.run.events.append(Event(rs.rank, self.call, (self.agent.rank, self.peer.rank), self.seq,
                                   self.nbytes, self.site, self.peer.rank, self.wall_start, time.perf_counter(),
                                   self.vstart, self.v, None))


def start(name: str, rank: int, world_size: int, options: SimRpcBackendOptions | None, *,
          default_timeout: float | None = None) -> SimAgent:
    """Register this simulated rank as worker ``name`` and wait until the whole RPC world has.

    ``default_timeout`` is not used: ``SimRpcBackendOptions.rpc_timeout`` is the default here.
    """
    rs = current_rank_state()
    if rs is None:  # pragma: no cover  checked by init_rpc
        raise DistRuntimeError(rpc_message("init_rpc", "not inside a simulated rank"))
    secret = _auth.load_secret("init_rpc")  # a bad secret file fails here, as it would on TensorPipe
    options = options_from(options)
    if not options.rpc_timeout or options.rpc_timeout <= 0:
        raise DistValueError(rpc_message("init_rpc", "rpc_timeout must be a positive number of seconds",
                                         values={"rpc_timeout": options.rpc_timeout}, fix="pass e.g. 60"))
    world = _world_of(rs, world_size)
    agent = SimAgent(world, name, rank, rs, _state.current(), options, secret)
    with world.lock:
        clash = world.agents.get(name)
        if clash is not None or rank in world.by_rank:
            other = clash.rank if clash is not None else world.by_rank[rank].name
            raise DistValueError(rpc_message(
                "init_rpc", "worker name or rank already taken", values={"name": name, "rank": rank, "taken_by": other},
                fix="give every worker a distinct name and rank"))
        world.agents[name] = agent
        world.by_rank[rank] = agent
    world.wait(world.init_barrier, rank)
    _check_one_secret(world, agent)
    return agent


def _check_one_secret(world: _RpcWorld, agent: SimAgent) -> None:
    """As on TensorPipe, members that do not share one secret (their environments name different ones, or
    only some name one) cannot start: every one of them fails init_rpc, saying so."""
    groups: list[tuple[SimAgent, list[int]]] = []
    for a in sorted(world.by_rank.values(), key=lambda a: a.rank):
        for first, ranks in groups:
            if first.auth.same_key(a.auth):
                ranks.append(a.rank)
                break
        else:
            groups.append((a, [a.rank]))
    if len(groups) > 1:
        raise DistRuntimeError(rpc_message(
            "init_rpc", "the workers do not share one RPC secret", worker=agent.name,
            values={"ranks_by_secret": [ranks for _, ranks in groups]},
            fix=f"set the same {_auth.ENV_SECRET} (or {_auth.ENV_SECRET_FILE}) on every worker, or on none of them"))
