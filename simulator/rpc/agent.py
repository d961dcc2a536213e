"""One simulated worker's RPC agent: its calls, the handlers serving them, its RRef table, its shutdown.

* **The callee's identity.**  A call's handler runs on a thread of the
  callee's rank (an actor of that rank in the simulator's scheduler, see
  :func:`simulator.core.actors.start_actor`) *as* the callee: the callee's RPC
  agent and ``tensorplay.distributed`` state are bound (``get_worker_info()``,
  ``dist.get_rank()`` and ``RRef.local_value()`` answer as the callee), the
  caller's distributed-autograd context is carried over, and in ``coop`` mode
  with per-rank RNGs the callee's torch RNG stream is used.  The caller's
  wait is a scheduler wait (:mod:`simulator.rpc.waits`).
* **Failures.**  A rank whose thread ended without ``shutdown`` (returned or
  raised) is dead: calls to it fail at once with
  :class:`~tensorplay.distributed.rpc.errors.WorkerUnavailableError`.  Remote
  exceptions keep their type and carry the remote traceback, as on TensorPipe.
* **Faults by seed.**  Each worker draws the faults of the messages it sends
  (:class:`~simulator.rpc.options.MessageFaults`) from a stream per message,
  seeded by the faults' seed (else the run's), its rank, the call (caller and
  the caller's count of calls) and the leg (request or answer), so the order
  in which a worker's messages go out does not change which are lost.
"""
from __future__ import annotations

import itertools
import math
import pickle
import random
import time
import warnings
from typing import Any, Callable

import torch

from tensorplay.distributed import state as dist_state
from tensorplay.distributed.errors import DistTypeError
from tensorplay.distributed.rpc import transport as rpc_transport
from tensorplay.distributed.rpc.transport import Agent, RemoteFailure, run_call, wrap_rref
from tensorplay.distributed.rpc.errors import RpcTimeoutError, WorkerUnavailableError, rpc_message
from tensorplay.distributed.rpc.futures import Future
from tensorplay.distributed.rpc.rref import RRef
from tensorplay.distributed.rpc.worker import WorkerInfo

from simulator.adapters import torch_native, torch_rpc
from simulator.core.actors import start_actor
from simulator.core.clock import charge_compute
from simulator.core.errors import RankFailedError, SimError
from simulator.core.sched import DONE
from simulator.core.state import current_rank_state
from simulator.rpc import autograd as rpc_autograd
from simulator.rpc.codec import Message, decode, encode
from simulator.rpc.options import SimRpcBackendOptions
from simulator.rpc.record import RpcRecord
from simulator.rpc.rref import Dropped, SimRRef, Slot
from simulator.rpc.waits import Answer, Pending, resolve_async, rng_lender
from simulator.rpc.world import RpcWorld, forget_when_all_out

__all__ = ["SimAgent", "warn_missing", "seal_request", "run_request", "seal_answer", "answer_map"]


class SimAgent(Agent):
    """One simulated worker's RPC agent."""

    kind = "sim"
    per_thread = True

    def __init__(self, world: RpcWorld, name: str, rank: int, rs: Any, dist_state: Any,
                 options: SimRpcBackendOptions, secret: bytes | None = None) -> None:
        self.world = world
        self.name, self.rank, self.world_size = name, rank, world.size
        self.timeout = float(options.rpc_timeout)
        self.device_maps = dict(options.device_maps)
        self.objects: dict[Any, Any] = {}
        self.rrefs: dict[int, Slot] = {}
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
        self.auth = rpc_transport.Authenticator(secret or world.secret)
        seed = options.faults.seed if options.faults and options.faults.seed is not None else rs.run.seed
        self.fault_seed = seed
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
        if rpc_transport.current() is self:
            return fn()
        prev_agent = rpc_transport.bind_thread(self)
        prev_state = dist_state.current()
        dist_state.bind_thread(self.dist_state)
        swap = self._swap_rng()
        prev_lender = getattr(rng_lender, "rs", None)
        if swap is not None:
            rng_lender.rs = self.rs
        try:
            with torch_native.as_rank(self.rs):  # torch's groups too: DDP in a handler uses the callee's
                return fn()
        finally:
            if swap is not None:
                rng_lender.rs = prev_lender
                self.rs.torch_rng = torch.get_rng_state()
                torch.set_rng_state(swap)
            dist_state.bind_thread(prev_state)
            rpc_transport.bind_thread(prev_agent)

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

    def _fault(self, call: str, dst: WorkerInfo, leg: str, timeout: float, rec: RpcRecord) -> float:
        """Apply this sender's message faults to one message; returns the injected delay (virtual seconds),
        which the call's clock (``rec``) takes."""
        f = self.faults
        if f is None:
            return 0.0
        # each message draws from a stream of its own, named by the call (its caller and the caller's count) and
        # the leg: a worker's answers and its own requests may be sent in any order (its handlers and its main
        # thread; a rank process computes them at once), and the faults must not depend on that order
        r = random.Random(f"tensorplay.rpc:{self.fault_seed}:{self.rank}:{rec.agent.rank}:{rec.seq}:{leg}")
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
                  timeout: float, on_peer: Callable[["SimAgent", Any], Any] | None = None, keep_rid: int | None = None
                  ) -> "tuple[Future[Any], RpcRecord]":
        """Send one request; its handler runs on a new thread of the callee's rank.

        Returns the future of the decoded answer (with ``on_peer``, for ``remote``: of ``None``
        once the callee kept the value) and the call's record.  Bad arguments and a lost request
        raise here, on the caller.  The handler runs as the callee (its agent, state and RNG
        stream) in the caller's distributed-autograd context, as torch's agent does, and may
        wait for anything a later operation completes (e.g. an ``@async_execution`` future
        completed by another request): the caller's wait is a scheduler wait, so a wait nobody
        can end is reported as a deadlock.  The call is an event on the trace
        (:class:`~simulator.rpc.record.RpcRecord`), recorded when its answer arrives.
        """
        peer = self._peer(call, dst)
        rec = RpcRecord(self, call, peer)
        req = seal_request(call, self.name, (fn, args, kwargs), self.device_maps.get(dst.name), self.auth)
        return self._send(rec, dst, req, timeout, on_peer, keep_rid), rec

    def _send(self, rec: RpcRecord, dst: WorkerInfo, req: Any, timeout: float,
              on_peer: Callable[["SimAgent", Any], Any] | None = None, keep_rid: int | None = None
              ) -> "Future[Any]":
        """The part of :meth:`_exchange` after the request is serialised: its faults, its handler, its answer.

        ``req`` is a sealed :class:`~simulator.rpc.codec.Message` (or, from a rank process, the message that
        process serialised; see :mod:`simulator.isolation.rpc_routes`); ``keep_rid``: the RRef slot a
        ``remote`` keeps its value in.  Returns the future of the answer.
        """
        call, peer = rec.call, rec.peer
        rec.transfer(req)
        try:
            late = self._fault(call, dst, "request", timeout, rec)
        finally:
            rec.sent()
        cid = rpc_autograd.current_context_id()
        fut: Future[Any] = Answer(what=call)
        if 0 < timeout < math.inf:  # the caller's wait ends at the call's timeout, wherever the handler is
            fut._bound = (time.monotonic() + timeout, fut, lambda: self._timed_out(call, dst, timeout))
        world = self.world
        sched = world.run.sched

        def handle() -> None:  # on the callee's handler thread
            me = current_rank_state()
            rpc_autograd.set_context_id(cid)
            me.vt = max(me.vt, rec.v)  # the request arrived
            delay = late
            result: Any = None
            exc: BaseException | None = None
            try:
                wall = time.perf_counter()
                value = peer._as_sender(lambda: peer._serve(req, keep_rid, self))
                took = time.perf_counter() - wall
                pending = type(value) is Pending
                if pending:  # an async function's future: its completion is the answer
                    value = value.outcome.wait()
                pending = pending or getattr(value, "was_async", False)
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
                    if not pending and delay + took > timeout:  # (a delay of the run's faults: virtual)
                        raise self._timed_out(call, dst, timeout, took_s=round(delay + took, 6))
                    result = self._decode_answer(answer)
                    if type(result) is RemoteFailure:
                        exc, result = result.to_exception(), None
            except BaseException as e:  # noqa: BLE001  the caller's future completes whatever happens
                exc = e
            finally:
                rpc_autograd.set_context_id(None)
                rec.close()
            # completed as the caller: its then() callbacks run as they would on the caller's agent
            # (dropped if the call timed out meanwhile, as torch's agent drops a late answer)
            self._as_sender(lambda: fut.complete_once(result, exc))
            with sched.lock:
                world.handlers -= 1
                world.settle(world.shutdown_barrier)

        with sched.lock:
            world.handlers += 1
        try:
            start_actor(peer.rs, handle, f"rpc-{call}-from-{self.name}-{rec.seq}")
        except BaseException:
            with sched.lock:
                world.handlers -= 1
                world.settle(world.shutdown_barrier)
            raise
        return fut

    def _timed_out(self, call: str, dst: WorkerInfo, timeout: float, **values: Any) -> RpcTimeoutError:
        """The error of a call to ``dst`` that did not finish within ``timeout`` seconds."""
        return RpcTimeoutError(rpc_message(
            call, "the call did not finish within its timeout", worker=self.name,
            values={"to": dst.name, "timeout": timeout, **values},
            fix="raise timeout=, or make the remote function faster"))

    def _serve(self, req: Message, keep_rid: int | None = None, caller: "SimAgent | None" = None) -> Any:
        """Run a request as this (callee) worker (see :func:`run_request`).

        (``keep_rid`` and ``caller``: what a worker whose requests run in another process must tell it.)"""
        return run_request(req, self.name, self.auth)

    def _decode_answer(self, answer: Message) -> Any:
        """The answer as this (calling) worker reads it."""
        return self._as_sender(lambda: decode(answer, self.auth))

    def _answer(self, value: Any, to: str) -> Message:
        """Encode ``value`` as this (callee) worker's answer to ``to``; one that does not pickle fails."""
        return seal_answer(value, self.name, answer_map(self.world.agents.get(to), self.name), self.auth)

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
        peer, rid = self._remote(dst, lambda keep, rid: self._exchange(
            "remote", dst, fn, args, kwargs, timeout, on_peer=keep, keep_rid=rid)[0])
        return wrap_rref(SimRRef(self.world, WorkerInfo(peer.name, peer.rank), rid, self.name))

    def _remote(self, dst: WorkerInfo, send: Callable[[Callable[["SimAgent", Any], None], int], Future[Any]]
                ) -> "tuple[SimAgent, int]":
        """``remote``: a slot of the owner's table for the value, filled when ``send(keep, rid)``'s handler kept
        it (``to_here`` waits for that); returns the owner and the slot's id."""
        peer = self._peer("remote", dst)
        placeholder = Pending(what="remote")  # the value, once the handler kept it (to_here waits for it)
        rid = peer.new_slot(placeholder)

        def keep(owner: "SimAgent", value: Any) -> None:
            slot = owner.rrefs.get(rid)
            if slot is not None and slot.value is placeholder:
                slot.value = value
            if not placeholder.outcome.done():
                placeholder.outcome.set_result(value)

        try:
            fut = send(keep, rid)
        except RpcTimeoutError as e:  # a lost request: to_here() reports it
            keep(peer, Dropped(e))
        except BaseException:
            self.world.release(peer.name, rid)
            raise
        else:
            def failed(f: Future[Any]) -> None:  # the handler failed before keeping a value (e.g. a deadlock)
                e = f.exception()
                if e is not None:
                    keep(peer, Dropped(e))

            fut.add_done_callback(failed)
        return peer, rid

    def new_slot(self, value: Any) -> int:
        with self.world.lock:
            rid = next(self._rid)
            self.rrefs[rid] = Slot(value, 1)
            return rid

    def local_rref(self, value: Any) -> RRef[Any]:
        rid = self.new_slot(value)
        return wrap_rref(SimRRef(self.world, WorkerInfo(self.name, self.rank), rid, self.name))

    # -- shutdown -------------------------------------------------------------
    def shutdown(self, graceful: bool, timeout: float) -> None:
        """Graceful: wait (cooperatively) until every other worker shut down or left, then close.

        ``timeout`` is not needed here: a worker that can never arrive is either gone (its
        thread ended: not waited for) or blocked elsewhere, which the simulator reports as a
        deadlock; the run's own timeout bounds the rest.
        """
        missing = self.leave(graceful)
        if missing:
            warn_missing(self.name, missing)

    def leave(self, graceful: bool) -> list[str]:
        """:meth:`shutdown` without its warning: close (graceful: after the others); returns the workers a graceful
        shutdown did not wait for because they ended without one."""
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
        self.closed = True
        with self.world.run.sched.lock:  # workers waiting in a graceful shutdown stop waiting for this one
            self.world.settle(self.world.shutdown_barrier)
        forget_when_all_out(self.world)  # everyone is out: a later init_rpc in this run starts a fresh world
        return missing


def seal_request(call: str, sender: str, request: tuple, device_map: dict | None, auth: Any) -> Message:
    """``(fn, args, kwargs)`` serialised and sealed as ``sender``'s request; one that does not pickle fails here, on
    the caller, before anything is sent."""
    try:
        return encode(request, sender, device_map).seal(auth)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise DistTypeError(rpc_message(
            call, "the call's arguments cannot be serialised", worker=sender,
            values={"error": f"{type(e).__name__}: {e}"[:300]},
            fix="send tensors, numbers, strings, containers of them, and objects of importable classes")) from e


def run_request(req: Message, callee: str, auth: Any) -> Any:
    """Run a request as worker ``callee``: the result, a :class:`RemoteFailure` or a
    :class:`~simulator.rpc.waits.Pending` (an ``@async_execution`` function's future)."""
    try:
        f, a, k = decode(req, auth)
    except BaseException as e:  # noqa: BLE001  e.g. a class missing on the callee
        return RemoteFailure.capture(e, callee)
    return resolve_async(run_call(f, a, k), f, callee)


def answer_map(caller: Any, callee: str) -> dict | None:
    """The device map an answer from ``callee`` to ``caller`` (an agent, or None) takes: the caller's, backwards."""
    dmap = caller.device_maps.get(callee) if caller is not None else None
    return {v: k for k, v in dmap.items()} if dmap else None


def seal_answer(value: Any, callee: str, device_map: dict | None, auth: Any) -> Message:
    """``value`` serialised and sealed as ``callee``'s answer; one that does not pickle answers its failure."""
    try:
        return encode(value, callee, device_map).seal(auth)
    except BaseException as e:  # noqa: BLE001  an answer that does not pickle
        try:  # (torch's agent fails here in its C++ layer: its caller gets a RuntimeError, see torch_rpc)
            e.serialising_answer = True  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001  exceptions with __slots__
            pass
        return encode(RemoteFailure.capture(e, callee), callee).seal(auth)


def warn_missing(name: str, missing: list[str]) -> None:
    """What a graceful shutdown says of the workers it did not wait for (they ended without one)."""
    warnings.warn(rpc_message(
        "shutdown", "graceful shutdown did not wait for workers that ended without shutdown "
        "(they returned or raised)", worker=name, values={"missing": missing},
        fix="end every worker's function with rpc.shutdown()"), RuntimeWarning, stacklevel=4)


# torch's RPC API, routed on simulated ranks, asks whether the rank's thread has one of these agents
torch_rpc.register_sim_agent(SimAgent)
