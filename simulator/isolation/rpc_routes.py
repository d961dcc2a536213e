"""tensorplay's RPC between rank processes, in the coordinator: the simulator's RPC world carries every message.

A rank process's worker (:class:`~simulator.isolation.rpc_process.ProcAgent`)
serialises its requests and runs the calls made to it; everything between
the two ends happens here, in the code thread ranks use
(:class:`~simulator.rpc.agent.SimAgent`): the init and shutdown barriers, the
liveness checks, message faults drawn from the seeded streams, virtual time
and the trace events, the handler count a graceful shutdown waits for, RRef
reference counts.  A :class:`RoutedAgent` is a ``SimAgent`` whose handlers,
instead of running a call, hand its request to the callee's process and serve
the thread that runs it there: the handler (an actor of the callee rank,
scheduled as on thread ranks) makes a channel, sends the request and one end
of the channel to the process's dispatcher over the worker's event socket, and
performs what that thread asks (its nested calls, its collectives, its answer,
RPC_ANSWER) as itself, holding the coop turn while the thread computes, as a
rank's proxy does for its process.  So a process-isolated RPC run follows the
seeded schedule (the same trace as thread ranks), and a deadlock through RPC
is named.  The dispatcher itself is no actor: it only starts handler threads
and completes the futures of ``rpc_async`` calls (events pushed to it).

:class:`RpcRouteHandlers` serves the messages (``handle_rpc_<kind>``; see
:mod:`.messages`); :class:`~.proxy_handlers.ProxyHandlers` includes it.
"""
from __future__ import annotations

import itertools
import os
import pickle
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from tensorplay.distributed.errors import DistRuntimeError
from tensorplay.distributed.rpc.errors import RpcTimeoutError, WorkerUnavailableError, rpc_message
from tensorplay.distributed.rpc.futures import Future
from tensorplay.distributed.rpc.worker import WorkerInfo

from simulator.core.state import current_rank_state
from simulator.isolation import _wire
from simulator.isolation.messages import FDS_REQUEST, STILL_PENDING
from simulator.rpc import autograd as rpc_autograd
from simulator.rpc import transport as sim_transport
from simulator.rpc.agent import SimAgent, answer_map
from simulator.rpc.record import RpcRecord
from simulator.rpc.rref import owner_value
from simulator.rpc.world import _on_rank_exit

__all__ = ["RoutedAgent", "RpcRouteHandlers", "Reply"]

#: the value of an RRef slot whose value its owner's process keeps
KEPT = "kept in its owner's process"


class Reply:
    """A handler's answer as its process sent it: the sealed message, and whether the call was
    ``@async_execution`` (its wait for the function's future does not count against the call's timeout)."""

    __slots__ = ("msg", "was_async")

    def __init__(self, msg: Any, was_async: bool) -> None:
        self.msg, self.was_async = msg, was_async

    @property
    def nbytes(self) -> int:
        return self.msg.nbytes


class _Slots(dict):
    """An owner's RRef table: a slot dropped with its last reference tells the owner's process to drop the value."""

    def __init__(self, agent: "RoutedAgent") -> None:
        super().__init__()
        self.agent = agent

    def __delitem__(self, rid: int) -> None:
        super().__delitem__(rid)
        self.agent.push(("drop", rid))


class RoutedAgent(SimAgent):
    """A rank process's worker as the simulator's RPC world sees it: everything but running its calls."""

    def __init__(self, world: Any, name: str, rank: int, rs: Any, dist_state: Any, options: Any,
                 secret: bytes | None = None) -> None:
        super().__init__(world, name, rank, rs, dist_state, options, secret)
        self.rrefs = _Slots(self)
        self.events: Connection | None = None  # to the process's dispatcher (set by handle_rpc_start)
        self.event_lock = threading.Lock()  # (an event and its descriptor go together)
        self.proxy: Any = None  # the ProcessRanks serving the process, and its RankProcess
        self.proc: Any = None
        self.replies: dict[int, Reply | None] = {}  # requests its process runs now, by id: their answer
        self.calls: dict[int, Future[Any]] = {}  # its async calls not answered yet, by id
        self.ids = itertools.count(1)
        self.ended = False
        _on_rank_exit(rs.run, self._rank_exited)

    def push(self, event: tuple, fd: int | None = None) -> None:
        """An event for the process's dispatcher (``fd``: a descriptor that goes with it)."""
        conn = self.events
        if conn is None or self.ended:
            return
        with self.event_lock:
            try:
                _wire.send(conn, event)
                if fd is not None:
                    with socket.socket(fileno=os.dup(conn.fileno())) as raw:
                        socket.send_fds(raw, [FDS_REQUEST], [fd])
            except OSError:  # the process has ended: its proxy reports how
                pass

    def close_events(self) -> None:
        """The worker left (shut down, or its process ended): its dispatcher stops, no event follows."""
        if self.ended:
            return
        self.push(("closed",))
        self.ended = True
        if self.events is not None:
            self.events.close()

    def _rank_exited(self, rs: Any) -> None:
        """The rank's process ended (its handlers' channels end with it)."""
        if rs is self.rs:
            self.close_events()

    # -- SimAgent's handler, run in the callee's process ------------------------------------------------
    def _serve(self, req: Any, keep_rid: int | None = None, caller: SimAgent | None = None) -> Any:
        """Run the request in this worker's process on a thread whose channel the calling handler actor serves."""
        rid = next(self.ids)
        inverse = answer_map(caller, self.name)
        mine, theirs = socket.socketpair()
        self.replies[rid] = None
        try:
            with theirs:
                infos = tuple((w.name, w.id) for w in self.worker_infos())  # (it may come before init_rpc returns)
                self.push(("serve", rid, req, rpc_autograd.current_context_id(), keep_rid, inverse, infos),
                          theirs.fileno())
            self.proxy.serve_channel(current_rank_state(), self.proc, Connection(mine.detach()))
            reply = self.replies.get(rid)
        finally:
            self.replies.pop(rid, None)
            mine.close()  # (a no-op once detached: the served channel closes itself)
        if reply is None:  # the thread ended without answering: its process died under it
            raise WorkerUnavailableError(rpc_message(
                "rpc", "the worker's process ended while running the call", worker=self.name,
                values={"rank": self.rank, "caller": caller.name if caller is not None else None},
                fix="keep every worker in RPC until all are done: end each worker's function with rpc.shutdown()"))
        return reply

    def _answer(self, value: Any, to: str) -> Any:
        return value  # (the callee's process serialised it)

    def _decode_answer(self, answer: Any) -> Any:
        return answer.msg  # (the caller's process reads it)


def _outcome(fut: Future[Any]) -> tuple[bool, Any]:
    """``(True, answer)`` or ``(False, error)`` of a completed call, as the dispatcher's event carries it."""
    e = fut.exception()
    if e is None:
        return True, fut.value()
    try:
        pickle.dumps(e)
    except Exception:  # noqa: BLE001  an error that does not cross: its text does
        e = DistRuntimeError(f"{type(e).__name__}: {e}")
    return False, e


class RpcRouteHandlers:
    """The proxy's handlers of the RPC messages of a rank process (a mixin of
    :class:`.proxy_handlers.ProxyHandlers`)."""

    @staticmethod
    def _rpc_agent(rs: Any, me: Any, books: Any, cpu: float, call: str) -> RoutedAgent:
        rs.cpu_mark = time.thread_time() - cpu
        agent = me.rpc_agent
        if agent is None:  # pragma: no cover  (the process's API checks init_rpc first)
            raise DistRuntimeError(rpc_message(call, "RPC is not initialised on this worker"))
        if books is not None:
            released, contexts = books
            for owner, rid in released:
                agent.world.release(owner, rid)
            for cid in contexts:  # the context ends on every process it may have reached
                for other in list(agent.world.by_rank.values()):
                    if other is not agent and isinstance(other, RoutedAgent):
                        other.push(("context", cid))
        return agent

    def handle_rpc_start(self, rs: Any, me: Any, chan: Any, msg: tuple) -> list[tuple[str, int]]:
        _, name, rank, size, options, secret, _books, cpu = msg
        events = Connection(chan.recv_fds(1)[0])  # the dispatcher's end of the events
        rs.cpu_mark = time.thread_time() - cpu

        def make(*args: Any) -> RoutedAgent:  # (served as soon as it exists: others may call before start returns)
            agent = me.rpc_agent = RoutedAgent(*args)
            agent.events, agent.proxy, agent.proc = events, self, me
            return agent

        try:
            agent = sim_transport.start(name, rank, size, options, make=make, secret=secret)
        except BaseException:
            events.close()
            me.rpc_agent = None
            raise
        return [(w.name, w.id) for w in agent.worker_infos()]

    def handle_rpc_call(self, rs: Any, me: Any, chan: Any, msg: tuple) -> Any:
        _, call, dst_id, req, timeout, mode, retains, site, cid, books, cpu = msg
        agent = self._rpc_agent(rs, me, books, cpu, call)
        dst = next((w for w in agent.worker_infos() if w.id == dst_id), WorkerInfo(str(dst_id), dst_id))
        peer = agent._peer(call, dst)
        if mode == "fetch":  # RRef.to_here: the owner's value copied here, as on thread ranks (no event, no fault)
            return peer._serve(req, None, agent).msg
        for owner, rid in retains:  # the message holds these references while in flight
            agent.world.retain(owner, rid)
        rec = RpcRecord(agent, call, peer)
        rec.site = site  # (the line of the rank process's program)
        rpc_autograd.set_context_id(cid)
        try:
            if mode == "remote":
                return agent._remote(dst, lambda keep, rid: agent._send(rec, dst, req, timeout, keep, rid))[1]
            fut = agent._send(rec, dst, req, timeout)
        finally:
            rpc_autograd.set_context_id(None)
        if mode == "sync":
            try:
                return fut.wait()
            finally:
                rec.arrived()
        call_id = next(agent.ids)
        agent.calls[call_id] = fut

        def answered(f: Future[Any]) -> None:
            if agent.calls.pop(call_id, None) is not None:
                agent.push(("answer", call_id, *_outcome(f)))

        fut.add_done_callback(answered)
        return call_id

    def handle_rpc_wait(self, rs: Any, me: Any, chan: Any, msg: tuple) -> Any:
        _, call_id, timeout, books, cpu = msg
        agent = self._rpc_agent(rs, me, books, cpu, "Future.wait")
        fut = agent.calls.get(call_id)
        if fut is None:
            return None  # its answer went to the dispatcher: it completes the future
        try:
            fut.wait(timeout)  # (the call's failure fails this request: the waiting thread raises it)
        except RpcTimeoutError:
            if not fut.done():
                return STILL_PENDING  # the waiter's own bound passed: the call goes on
            raise
        return _outcome(fut)

    def handle_rpc_answer(self, rs: Any, me: Any, chan: Any, msg: tuple) -> None:
        _, rid, answer, was_async, retains, books, cpu = msg
        agent = self._rpc_agent(rs, me, books, cpu, "rpc")
        for owner, ref in retains:  # the answer holds these references while in flight
            agent.world.retain(owner, ref)
        if rid in agent.replies:  # (the handler actor serving this thread reads it when the thread ends)
            agent.replies[rid] = Reply(answer, was_async)

    def handle_rpc_ref(self, rs: Any, me: Any, chan: Any, msg: tuple) -> int:
        _, books, cpu = msg
        return self._rpc_agent(rs, me, books, cpu, "RRef").new_slot(KEPT)

    def handle_rpc_ready(self, rs: Any, me: Any, chan: Any, msg: tuple) -> None:
        _, owner, rid, timeout, books, cpu = msg
        agent = self._rpc_agent(rs, me, books, cpu, "RRef.to_here")
        # (its value is in the owner's process; timeout: to_here's)
        owner_value(agent.world, owner, rid, "RRef.to_here", agent.name, timeout)

    def handle_rpc_shutdown(self, rs: Any, me: Any, chan: Any, msg: tuple) -> list[str]:
        _, graceful, books, cpu = msg
        agent = self._rpc_agent(rs, me, books, cpu, "shutdown")
        try:
            return agent.leave(graceful)
        finally:
            agent.close_events()
            me.rpc_agent = None
