"""The proxy's side of the rank-process protocol: serve a channel, one handler per message kind.

A proxy is an actor of the simulated rank (a rank thread of the coordinator,
or the actor of a thread the rank process started) that reads its channel's
messages (:mod:`.messages`) and performs each on the simulator's own backend,
as that actor: the matching, the checks, the clock and the trace are the ones
thread ranks get.  :meth:`ProxyHandlers._serve` looks each message's kind up
in a table built once at import and calls its ``handle_<kind>``; a request's
handler returns the answer, a final message's handler returns the rank's
result or raises its failure.
"""
from __future__ import annotations

import itertools
import os
import pickle
import socket
import subprocess
import threading
import time
import types
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

import torch

from tensorplay.distributed import state as dist_state
from tensorplay.distributed.errors import DistRuntimeError
from tensorplay.distributed.group import ProcessGroup

from simulator.adapters import threads, torch_groups
from simulator.adapters.clock_hooks import mark_step
from simulator.core.callsite import C10D_FILE, split_site
from simulator.core.sched import CoopScheduler
from simulator.core.works import own_checks
from simulator.isolation import _wire, warm
from simulator.isolation._wire import SHARED_BASE, Arena, GroupRef, SharedStorage, TensorRef
from simulator.isolation.messages import FINAL, OK, REQUESTS, SERVED, handler_table
from simulator.isolation.remote_errors import error_answer, program_error
from simulator.isolation.rpc_routes import RpcRouteHandlers

__all__ = ["Channel", "RankProcess", "ThreadGone", "ProxyHandlers"]


def _template(f, a):  # noqa: ANN001,ANN202  (its code object is re-labelled with the rank's call site)
    return f(*a)


_site_runners: dict[str, Callable[[Callable[..., Any], Sequence[Any]], Any]] = {}


def _relabel(filename: str, line: int, name: str) -> Callable[[Callable[..., Any], Sequence[Any]], Any]:
    """``_template`` with its frame shown at ``filename:line`` in function ``name``."""
    # the body line of _template is one below its first line
    code = _template.__code__.replace(co_filename=filename, co_firstlineno=line - 1, co_name=name)
    return types.FunctionType(code, {})


def _at(site: str) -> Callable[[Callable[..., Any], Sequence[Any]], Any]:
    """A caller whose frame is ``site`` (``"file.py:12"`` in the rank process) for the simulator's call-site lookup.

    The simulator names a call by the first frame outside the library; in the
    coordinator that frame is this one, so its code object carries the rank
    process's file name and line.  A site inside one of torch's composite calls
    (``"file.py:12 in broadcast_object_list"``) gets a second frame, torch's, named
    after that call.
    """
    fn = _site_runners.get(site)
    if fn is None:
        where, within = split_site(site)
        name, _, line = where.rpartition(":")
        if not name or not line.isdigit():
            fn = _template
        elif within:
            inner = _relabel(C10D_FILE, 2, within)
            outer = _relabel(name, int(line), "<rank process>")
            fn = lambda f, a: outer(inner, (f, a))  # noqa: E731
        else:
            fn = _relabel(name, int(line), "<rank process>")
        _site_runners[site] = fn
    return fn


class ThreadGone(Exception):
    """A thread of a rank process can no longer be answered (its process is ending)."""


class Channel:
    """One thread of a rank process, as its actor's proxy sees it: a socket, and a duplicate for descriptors."""

    __slots__ = ("conn", "fd_sock", "replied", "deferred")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.fd_sock: socket.socket | None = None
        self.replied = False  # the request being performed was answered already (see ProxyHandlers._early)
        self.deferred: BaseException | None = None  # its failure, which came after that answer

    def recv_fds(self, n: int) -> list[int]:
        """The ``n`` descriptors the process sent right after its last message (see client._exchange)."""
        if self.fd_sock is None:
            self.fd_sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        _, fds, _, _ = socket.recv_fds(self.fd_sock, 1, n)
        return fds

    def close(self) -> None:
        try:
            self.conn.close()  # a thread still waiting for an answer sees the end of its channel
            if self.fd_sock is not None:
                self.fd_sock.close()
        except OSError:
            pass


class RankProcess:
    """The coordinator's handle on one rank process (shared by the actors serving its threads)."""

    __slots__ = ("rank", "proc", "conn", "main", "hash_seed", "arenas", "groups", "works", "errors", "wids",
                 "optimizers", "pending", "server", "where", "asked", "lock", "threads", "tids", "chans",
                 "free_running", "unreported", "rpc_agent")

    def __init__(self, rank: int, proc: "subprocess.Popen | warm.Forked", conn: Connection, hseed: int) -> None:
        self.rank = rank
        self.proc = proc
        self.conn = conn
        self.main = Channel(conn)  # the process's main thread (the rank)
        self.hash_seed = hseed
        self.lock = threading.Lock()  # what the actors of its threads update together
        self.arenas: dict[int, Arena | SharedStorage] = {}
        self.groups: dict[int, ProcessGroup] = {}
        self.works: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.wids = itertools.count(1)
        self.optimizers: dict[int, object] = {}  # the rank process's optimizers, by id there
        self.pending: tuple | None = None  # a message that arrived instead of READY
        self.server: Any = None  # the warm interpreter it was forked from (None: spawned afresh)
        self.where: Connection | None = None  # asks the process where its program is (see child._answer_where)
        self.asked = 0
        self.threads: dict[int, Any] = {}  # the actors of the threads the process started, by id
        self.tids = itertools.count(1)
        self.chans: set[Channel] = {self.main}  # open channels (a thread's closes when the thread ends)
        self.free_running = False  # after init_rpc in coop mode: its compute runs outside the schedule
        self.unreported: dict[int, Any] = {}  # async works whose completion the process has not been told yet
        self.rpc_agent: Any = None  # its worker in the run's RPC world, between init_rpc and shutdown (.rpc_routes)


_REQUEST, _NOTE, _FINAL = 0, 1, 2  # what the serving loop does with a message of each kind


class ProxyHandlers(RpcRouteHandlers):
    """The serving loop of a rank process's channels and a ``handle_<kind>`` per message kind it serves.

    A mixin of :class:`.proxy.ProcessRanks`, which provides ``world``, ``arena_dir``, ``ranks``, ``_recv(rs, me,
    chan)`` (the channel's next message, or what its process's end means) and ``_death(me)`` (the error of a
    process that died).  Each handler is called ``handle_<kind>(rs, me, chan, msg)``: ``rs`` the actor of the
    channel's thread, ``me`` its :class:`RankProcess`, ``chan`` its :class:`Channel`, ``msg`` the message.
    """

    world: Any
    arena_dir: str
    ranks: list[RankProcess]
    _recv: Callable[[Any, RankProcess, Channel], tuple]
    _death: Callable[[RankProcess], BaseException]

    def _serve(self, rs: Any, me: RankProcess, chan: Channel) -> Any:
        """Serve one thread of the rank process as the actor ``rs`` until the thread ends.

        The main thread's channel ends with the rank's result (returned) or its failure (raised); the channel of a
        thread the program started ends with the thread.
        """
        main = chan is me.main
        while True:
            if main and me.pending is not None:
                msg, me.pending = me.pending, None
            else:
                msg = self._recv(rs, me, chan)
            entry = _DISPATCH.get(msg[0])
            if entry is None:  # pragma: no cover  (a protocol error is a bug of this package)
                raise DistRuntimeError(f"simulator: unknown message {msg[0]!r} from rank {me.rank}'s process")
            role, handle = entry
            if role == _REQUEST:
                if chan.deferred is not None:  # the previous request failed after its early answer: fail this one
                    e, chan.deferred = chan.deferred, None
                    self._send(me, chan, self._error_answer(me, e))
                    continue
                try:
                    value = handle(self, rs, me, chan, msg)
                except BaseException as e:  # noqa: BLE001  (sent to the rank process's thread, which raises it)
                    if chan.replied:
                        chan.deferred = e
                    else:
                        self._send(me, chan, self._error_answer(me, e))
                else:
                    if not chan.replied:
                        self._send(me, chan, (OK, value))
                chan.replied = False
                if main and me.free_running:
                    rs.run.sched.leave(rs)  # (a no-op while it is outside the schedule already)
            elif role == _FINAL:
                return handle(self, rs, me, chan, msg)
            else:
                handle(self, rs, me, chan, msg)

    # -- requests: each handler returns the answer ------------------------------------------------------------
    def handle_call(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> Any:
        _, name, enc, site, backward, cpu = msg
        # the thread's own compute since its last call: charged by the call's first step, as the CPU time
        # of a thread rank is
        rs.cpu_mark = time.thread_time() - cpu
        if enc[-1] is not False:  # an async_op call: answered with its work's id
            return self._perform(me, rs.backend, name, enc, site, backward)
        # a blocking collective or send/recv (whose answer is None, or the source rank for recv)
        recv = name == "recv"
        return self._answering_early(rs, chan, lambda src: src if recv else None,
                                     lambda: self._perform(me, rs.backend, name, enc, site, backward))

    def handle_group(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> int | None:
        _, method, ranks, site, cpu, name = msg
        rs.cpu_mark = time.thread_time() - cpu
        backend = rs.backend
        args: tuple = (ranks, timedelta(seconds=self.world.pg_timeout)) if method == "new_group_handle" else (ranks,
                                                                                                          name)
        h = _at(site)(getattr(backend, method), args)
        if h is None:
            return None
        if h.gid not in me.groups:
            me.groups[h.gid] = ProcessGroup(h.ranks, backend, h, group_id=h.gid)
        return h.gid

    def handle_rendezvous(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> tuple[int, ...]:
        _, key, rank, size, cpu = msg
        rs.cpu_mark = time.thread_time() - cpu
        return torch_groups.join(rs.backend.world_key(), key, rank, size, me.rank, len(self.ranks))

    def handle_wait(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> bool:
        _, wid, cpu, bound, asked = msg
        work = me.works[wid]
        rs.cpu_mark = time.thread_time() - cpu  # computed while the operation ran
        if bound is not None:  # what is left of it: it started when the process asked
            bound = type(bound)(seconds=bound.total_seconds() - (time.time() - asked))  # (keeps GroupTimeout)
        return self._answering_early(rs, chan, lambda src: True, lambda: work.wait(bound))

    def handle_completed(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> bool:
        return me.works[msg[1]].is_completed()

    def handle_success(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> bool:
        return me.works[msg[1]].is_success()

    def handle_source(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> int:
        return me.works[msg[1]].source_rank()

    def handle_step(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> None:
        # an optimizer step of the rank process (see simulator.adapters.clock_hooks on thread ranks)
        rs.cpu_mark = time.thread_time() - msg[2]
        mark_step(me.optimizers.setdefault(msg[1], object()), (), {})

    def handle_share(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> None:
        _, sid, size = msg
        fds = chan.recv_fds(1)
        try:
            me.arenas[sid] = SharedStorage(fds[0], size)
        finally:
            for fd in fds:
                os.close(fd)

    def handle_unshare(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> None:
        for sid in msg[1]:  # (an operation still in flight holds its own views of the storage)
            me.arenas.pop(sid, None)

    def handle_thread(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> int:
        return self._adopt(rs, me, chan, msg[1], msg[2])

    def handle_join(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> None:
        actor = me.threads.get(msg[1])
        if actor is not None:  # (gone: its thread has ended and its actor exited)
            threads.join_actor(rs, actor)

    def handle_leave(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> bool:
        return threads.step_out(rs, others=len(msg) > 1 and msg[1])

    def handle_rejoin(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> None:
        threads.step_in(rs)

    def handle_sleep(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> bool:
        return threads.sleep_out(rs, msg[1], msg[2], *msg[3:])

    def handle_wake(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> None:
        threads.sleep_in(rs)

    def handle_free(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> None:
        # the process started torch's own RPC agent, whose waits the scheduler cannot see (see .rpc_process)
        me.free_running = isinstance(rs.run.sched, CoopScheduler)

    # -- notes -------------------------------------------------------------------------------------------------
    def handle_modules(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> None:
        if me.server is not None:
            warm.POOL.learn(me.server, msg[1])

    # -- the last message of a channel ---------------------------------------------------------------------------
    def handle_end(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> None:
        return None  # a thread the program started has ended

    def handle_result(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> Any:
        if chan.deferred is not None:
            raise chan.deferred
        rs.cpu_mark = time.thread_time() - msg[2]  # the compute after the last operation: charged at exit
        return pickle.loads(msg[1])

    def handle_exit(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> Any:
        exit_ = SystemExit(msg[1])
        if msg[2] is not None:  # where the rank process exited (a CLI shows it as the rank's traceback)
            exit_._tp_rank_traceback = msg[2]  # type: ignore[attr-defined]
        raise exit_

    def handle_forwarded(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> Any:
        error = me.errors[msg[1]]
        error._tp_rank_traceback = msg[2]  # type: ignore[attr-defined]  (the program's frames, not this proxy's)
        raise error

    def handle_raise(self, rs: Any, me: RankProcess, chan: Channel, msg: tuple) -> Any:
        raise program_error(msg, me.rank, me.proc.pid, me.hash_seed)

    # -- what the handlers share ---------------------------------------------------------------------------------
    def _answering_early(self, rs: Any, chan: Channel, answer: Callable[[Any], Any], block: Callable[[], Any]) -> Any:
        """Run ``block`` (an operation the thread waits for) as the actor ``rs``; in coop mode the thread is answered
        with ``answer(source)`` as soon as the operation completes (see :meth:`_early`)."""
        if not isinstance(rs.run.sched, CoopScheduler):
            return block()
        rs.on_complete = lambda error, src: self._early(rs, chan, error, answer(src), self.ranks[rs.rank])
        try:
            return block()
        finally:
            rs.on_complete = None

    def _early(self, rs: Any, chan: Channel, error: Any, value: Any, me: RankProcess) -> None:
        """The operation ``chan``'s thread waits for completed: answer the thread now with ``value`` (coop mode).

        Its outputs are in the arena already and its outcome is final, so the process computes on while its
        actor waits for the seeded schedule to give it the turn back; the schedule, and so the trace and every
        result, stay those of thread ranks, but the rank processes compute in parallel instead of one at a
        time.  A failure that reaches the actor after this answer fails the thread's next request instead.
        """
        run = rs.run
        if error is not None or rs.pending is not None or run.fatal is not None or run.aborted or run.over:
            return  # the actor raises when it resumes: the process waits for that answer
        try:
            _wire.send(chan.conn, (OK, value, self._completed(me)))
        except OSError:
            return  # the process is gone: its proxy finds out when it reads
        chan.replied = True

    def _adopt(self, rs: Any, me: RankProcess, chan: Channel, name: str, daemon: bool) -> int:
        """The thread of ``chan`` starts a thread ``name``: give it an actor of the rank and a proxy serving it."""
        fds = chan.recv_fds(1)
        child = Channel(Connection(fds[0]))
        with me.lock:
            me.chans.add(child)
            tid = next(me.tids)
        # the thread object only names the actor (reports say "rank 0 (thread 'comm')"); it never runs
        inh = threads.adopt(rs, threading.Thread(name=name, daemon=daemon))
        me.threads[tid] = inh.actor

        def serve() -> None:
            try:
                self._serve(inh.actor, me, child)
            except ThreadGone:
                pass
            except BaseException:  # noqa: BLE001  the world ended under it: the main proxy reports why
                if not (rs.run.over or rs.run.aborted):
                    raise

        def body() -> None:
            try:
                threads.run_adopted(inh, serve)
            finally:  # the thread is over: its channel and entry go (a program may start threads without end)
                child.close()
                with me.lock:
                    me.chans.discard(child)
                    me.threads.pop(tid, None)

        t = threading.Thread(target=body, name=f"tp-sim-rank{me.rank}-{name}", daemon=True)
        threads.start_plain(t)
        return tid

    def serve_channel(self, rs: Any, me: RankProcess, conn: Connection) -> None:
        """Serve a thread of the process whose channel is ``conn`` as the calling actor ``rs``, until the thread ends
        (an RPC handler thread, whose actor is the coordinator's handler of the request: see .rpc_routes)."""
        chan = Channel(conn)
        with me.lock:
            me.chans.add(chan)
        try:
            self._serve(rs, me, chan)
        except ThreadGone:
            pass
        finally:
            chan.close()
            with me.lock:
                me.chans.discard(chan)

    def _perform(self, me: RankProcess, backend: Any, name: str, enc: list[Any], site: str,
                 backward: str | None) -> Any:
        """Collective ``name`` on the simulator's backend, called from the rank process's ``site``."""
        dec = [self._decode(me, a) for a in enc]
        method = getattr(backend, name)
        if backward is not None:
            with dist_state.backward_of(backward):
                value = _at(site)(method, dec)
        else:
            value = _at(site)(method, dec)
        if value is not None and not isinstance(value, int):  # a work of an async_op call
            with me.lock:
                wid = next(me.wids)
                me.works[wid] = me.unreported[wid] = value
            return wid
        return value

    def _arena(self, me: RankProcess, aid: int) -> Arena | SharedStorage:
        """Arena ``aid`` of the rank process, mapped here the first time a call names it."""
        a = me.arenas.get(aid)
        if a is None:
            if aid >= SHARED_BASE:  # pragma: no cover  (registered by a SHARE before any call names it)
                raise DistRuntimeError(f"simulator: rank {me.rank}'s process named an unknown shared storage {aid}")
            with me.lock:  # (two of its threads may name a new arena at once)
                a = me.arenas.get(aid)
                if a is None:
                    path = _wire.arena_path(self.arena_dir, me.rank, aid)
                    a = me.arenas[aid] = Arena(aid, path, os.path.getsize(path), create=False)
        return a

    def _decode(self, me: RankProcess, a: Any) -> Any:
        """An argument of a CALL as the simulator takes it: places become tensors on the arenas, groups groups."""
        if isinstance(a, TensorRef):
            aid, off, dtype, size, stride, _ = a
            if aid < 0:
                return torch.empty_strided(size, stride, dtype=dtype)
            return self._arena(me, aid).view(off, dtype, size, stride)
        if isinstance(a, GroupRef):
            return me.groups[a[0]]
        if isinstance(a, list):
            return [self._decode(me, x) for x in a]
        return a

    @staticmethod
    def _completed(me: RankProcess) -> list[tuple[int, bool]]:
        """``[(id, ok), ...]`` of the rank's async works completed since the last answer (sent with each answer:
        the process then copies their outputs back and frees their staging, waited or not)."""
        with me.lock, own_checks():
            done = [(wid, w.is_success()) for wid, w in me.unreported.items() if w.is_completed()]
            for wid, _ in done:
                del me.unreported[wid]
        return done

    def _send(self, me: RankProcess, chan: Channel, msg: tuple) -> None:
        """Send an answer (OK or ERR) with the works completed since the last one."""
        try:
            _wire.send(chan.conn, msg + (self._completed(me),))
        except (BrokenPipeError, ConnectionResetError, OSError):
            if chan is me.main:
                raise self._death(me) from None
            raise ThreadGone from None  # the process is going: its main proxy reports how

    @staticmethod
    def _error_answer(me: RankProcess, e: BaseException) -> tuple:
        """ERR for the coordinator's error ``e``, kept (the rank process may end with it: FORWARDED)."""
        with me.lock:
            eid = len(me.errors)
            me.errors[eid] = e
        return error_answer(eid, e)


#: kind -> (what the loop does with it, its handler): built once, so serving a message is one lookup
_DISPATCH: dict[str, tuple[int, Callable[..., Any]]] = {
    kind: (_REQUEST if kind in REQUESTS else _FINAL if kind in FINAL else _NOTE, handle)
    for kind, handle in handler_table(ProxyHandlers, "handle_", SERVED).items()
}
