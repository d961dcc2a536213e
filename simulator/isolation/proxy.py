"""The coordinator's side of process isolation: start the rank processes, serve each from a proxy rank thread.

Each simulated rank of the world is, as in thread mode, a thread of the
coordinator that the scheduler runs; in process mode that thread runs
:meth:`ProcessRanks.proxy_main`, which performs the calls its rank process
forwards (see :mod:`.child`) on the real simulator backend.  Matching, the
agreement checks, deadlock detection, faults, virtual time and the trace are
therefore the very code thread ranks use.  While the rank process computes,
its proxy waits on the socket (the rank is *running* for the scheduler, as a
computing thread rank is); a process that dies is a failed rank.  A thread the
rank process starts gets an actor of the rank and a proxy thread of its own
(:meth:`ProcessRanks._adopt`, see :mod:`.rank_threads`), as a thread a thread
rank starts does.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

import torch

from tensorplay.distributed import _state
from tensorplay.distributed.errors import DistRuntimeError, DistTypeError, format_message
from tensorplay.distributed.group import ProcessGroup

from simulator.adapters.clock_hooks import mark_step
from simulator.core.errors import RankExitError, SimTimeoutError
from simulator.adapters import threads
from simulator.core.sched import CoopScheduler
from simulator.core.state import current_rank_state
from simulator.isolation import _wire, cleanup, pickling, warm
from simulator.isolation._wire import OUTPUTS, SHARED_BASE, Arena, GroupRef, SharedStorage, TensorRef

__all__ = ["ProcessRanks", "hash_seed"]

_CHILD = warm.PROLOGUE + "from simulator.isolation.child import main\nmain()\n"  # a rank process spawned afresh
_GRACE_S = 3.0  # how long a rank process may take to exit after the world ended, before it is killed
_STARTUP_S = 300.0  # bound on the rank processes' start-up (an interpreter and ``import torch`` each)


def hash_seed(run_seed: int, rank: int) -> int:
    """The ``PYTHONHASHSEED`` of rank ``rank``'s process: distinct per rank, a pure function of the run's seed (1..2**32-1)."""
    digest = hashlib.blake2b(f"tensorplay-simulator-hash:{run_seed}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 4294967295 + 1  # 0 would switch hash randomisation off


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _template(f, a):  # noqa: ANN001,ANN202  (its code object is re-labelled with the rank's call site)
    return f(*a)


_site_runners: dict[str, Callable[[Callable[..., Any], Sequence[Any]], Any]] = {}


def _at(site: str) -> Callable[[Callable[..., Any], Sequence[Any]], Any]:
    """A caller whose frame is ``site`` (``"file.py:12"`` in the rank process) for the simulator's call-site lookup.

    The simulator names a call by the first frame outside the library; in the
    coordinator that frame is this one, so its code object carries the rank
    process's file name and line.
    """
    fn = _site_runners.get(site)
    if fn is None:
        name, _, line = site.rpartition(":")
        if not name or not line.isdigit():
            fn = _template
        else:
            # the body line of _template is one below its first line
            code = _template.__code__.replace(co_filename=name, co_firstlineno=int(line) - 1,
                                              co_name="<rank process>")
            fn = types.FunctionType(code, {})
        _site_runners[site] = fn
    return fn


def _dumps(obj: Any, what: str = "") -> bytes:
    return pickling.dumps(obj, what)  # (closures keep their file names; a main script that is no file: by value)


class _ThreadGone(Exception):
    """A thread of a rank process can no longer be answered (its process is ending)."""


class _Channel:
    """One thread of a rank process, as its actor's proxy sees it: a socket, and a duplicate for descriptors."""

    __slots__ = ("conn", "fd_sock", "replied", "deferred")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.fd_sock: socket.socket | None = None
        self.replied = False  # the request being performed was answered already (see ProcessRanks._early)
        self.deferred: BaseException | None = None  # its failure, which came after that answer

    def recv_fds(self, n: int) -> list[int]:
        """The ``n`` descriptors the process sent right after its last message (see child._exchange)."""
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


class _Rank:
    """The coordinator's handle on one rank process (shared by the actors serving its threads)."""

    __slots__ = ("rank", "proc", "conn", "main", "hash_seed", "arenas", "groups", "works", "errors", "wids",
                 "optimizers", "pending", "server", "where", "asked", "lock", "threads", "tids", "chans",
                 "free_running", "unreported")

    def __init__(self, rank: int, proc: "subprocess.Popen | warm.Forked", conn: Connection, hseed: int) -> None:
        self.rank = rank
        self.proc = proc
        self.conn = conn
        self.main = _Channel(conn)  # the process's main thread (the rank)
        self.hash_seed = hseed
        self.lock = threading.Lock()  # what the actors of its threads update together
        self.arenas: dict[int, Arena | SharedStorage] = {}
        self.groups: dict[int, ProcessGroup] = {}
        self.works: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.wids = itertools.count(1)
        self.optimizers: dict[int, object] = {}  # the rank process's optimizers, by id there
        self.pending: tuple | None = None  # a message that arrived instead of "ready"
        self.server: Any = None  # the warm interpreter it was forked from (None: spawned afresh)
        self.where: Connection | None = None  # asks the process where its program is (see child._answer_where)
        self.asked = 0
        self.threads: dict[int, Any] = {}  # the actors of the threads the process started, by id
        self.tids = itertools.count(1)
        self.chans: set[_Channel] = {self.main}  # open channels (a thread's closes when the thread ends)
        self.free_running = False  # after init_rpc in coop mode: its compute runs outside the schedule
        self.unreported: dict[int, Any] = {}  # async works whose completion the process has not been told yet


class ProcessRanks:
    """The rank processes of one run of a world and the proxy loop that serves them."""

    def __init__(self, world: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                 rank_args: Sequence[Sequence[Any]] | None = None) -> None:
        """``rank_args``: rank ``r`` calls ``fn(*rank_args[r], **kwargs)`` instead, its arguments passed as a spawned
        child inherits them (pipes, queues and shared tensors stay shared; see :func:`.pickling.dumps_inherited`)."""
        from simulator.core.seeds import _initial_rng_states

        if world.device.type != "cpu":
            raise DistRuntimeError(format_message(
                "simulator.run", "process-isolated ranks run on the CPU only", values={"device": str(world.device),
                                                                                      "isolation": "process"},
                fix="pass device='cpu', or isolation='thread' for CUDA ranks"))
        what = getattr(fn, "__qualname__", repr(fn))
        try:
            if rank_args is None:
                payloads = [(_dumps((fn, tuple(args), dict(kwargs)), what), [])] * world.world_size
            else:
                payloads = [pickling.dumps_inherited((fn, tuple(a), dict(kwargs)), what) for a in rank_args]
        except DistTypeError:
            raise
        except Exception as e:  # noqa: BLE001
            raise DistTypeError(format_message(
                "simulator.run", f"the function and its arguments must be picklable to run in rank processes "
                f"({type(e).__name__}: {e})", values={"fn": getattr(fn, "__qualname__", repr(fn)),
                                                      "isolation": "process"},
                fix="define the function at module level (or install cloudpickle for closures), pass picklable "
                    "arguments, or use isolation='thread'")) from e
        from multiprocessing import spawn

        self.world = world
        self.n = world.world_size
        self.hash_seeds = [hash_seed(world.hash_seed, r) for r in range(self.n)]
        rng_states, _ = _initial_rng_states(world.seed, self.n)
        cleanup.sweep()  # the arenas of coordinators that died without cleaning up
        self.arena_dir = cleanup.arena_dir()
        cleanup.register(self, self.arena_dir, lambda: self.pids)  # (a SIGTERM kills the ranks, drops the arenas)
        import torch.distributed as tdist

        # the rendezvous store of torch.distributed in the rank processes (they are real processes: a real store)
        self.store = tdist.TCPStore("127.0.0.1", 0, self.n, True, timedelta(seconds=world.pg_timeout),
                                    wait_for_workers=False)
        prep = pickling.fix_preparation(spawn.get_preparation_data("simulated-rank"))
        prep.pop("authkey", None)
        master_port = str(_free_port())
        rpc_port = _free_port()  # where init_rpc in the rank processes meets (see .rpc_process)
        rpc_secret = secrets.token_hex(32)  # the workers' shared RPC secret, unless the program sets its own
        self.ranks: list[_Rank] = []
        slow = warm.SlowStartNote(self.n)  # (a first world takes seconds: said once, on stderr, if it does)
        try:
            envs = [self._env(r, master_port) for r in range(self.n)]
            servers = self._servers = warm.POOL.servers(envs) if warm.enabled() else [None] * self.n
            for r in range(self.n):
                env = envs[r]
                parent, child = socket.socketpair()
                try:
                    proc: Any = None
                    if servers[r] is not None:  # a fork of the warm interpreter of this hash seed (see .warm)
                        try:
                            proc = servers[r].fork(child.fileno(), env)  # type: ignore[union-attr]
                        except OSError:
                            proc = None
                    if proc is None:
                        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(child.fileno()), str(os.getpid())],
                                                pass_fds=(child.fileno(),), env=env, start_new_session=True)
                finally:
                    child.close()
                conn = Connection(parent.detach())
                self.ranks.append(_Rank(r, proc, conn, self.hash_seeds[r]))
                if isinstance(proc, warm.Forked):
                    self.ranks[-1].server = servers[r]
                payload, passed = payloads[r]
                _wire.send(conn, {"rank": r, "world_size": self.n, "seed": world.seed, "prep": prep, "payload": payload,
                           "passed": len(passed),
                           "torch_rng": rng_states[r], "arena_dir": self.arena_dir, "timeout": world.pg_timeout,
                           "store": ("127.0.0.1", self.store.port), "learn": isinstance(proc, warm.Forked),
                           "rpc_port": rpc_port, "mode": world.mode, "rpc_secret": rpc_secret})
                ask, answer = socket.socketpair()
                with answer, socket.socket(fileno=os.dup(conn.fileno())) as raw:
                    socket.send_fds(raw, [b"w"], [answer.fileno()])
                    if passed:  # what the rank inherits (its pipes, queues, shared tensors; see pickling)
                        socket.send_fds(raw, [b"p"], passed)
                self.ranks[-1].where = Connection(ask.detach())
            self._await_ready()
        except BaseException:
            self.close()
            raise
        finally:
            slow.cancel()

    def _await_ready(self) -> None:
        """Wait (bounded) until every rank process has started: start-up does not count against the run's timeout."""
        from multiprocessing.connection import wait

        deadline = time.monotonic() + max(_STARTUP_S, self.world.timeout or 0.0)  # (timeout None: no whole-run bound)
        waiting = {me.conn: me for me in self.ranks}
        while waiting and time.monotonic() < deadline:
            for c in wait(list(waiting), timeout=0.2):
                me = waiting.pop(c)  # type: ignore[call-overload]
                try:
                    msg = _wire.recv(me.conn)
                except (EOFError, OSError):
                    continue  # it died starting: its proxy reports the death
                if msg[0] != "ready":  # e.g. the function could not be unpickled there: its proxy reports it
                    me.pending = msg
            for c, me in list(waiting.items()):
                if me.proc.poll() is not None:
                    waiting.pop(c)

    def _env(self, rank: int, master_port: str) -> dict[str, str]:
        from simulator.adapters import _environ

        w = self.world
        if w.torchrun_env or w.env:
            env = w._rank_env(rank)
            if w.torchrun_env and "MASTER_PORT" not in w.env:
                env["MASTER_PORT"] = master_port  # real processes: a program's own TCPStore binds a real port
        else:
            real = os.environ._real if isinstance(os.environ, _environ.RankEnviron) else os.environ  # type: ignore[attr-defined]
            env = dict(real)
        env["PYTHONHASHSEED"] = str(self.hash_seeds[rank])
        return env

    # -- the proxy ----------------------------------------------------------
    def proxy_main(self) -> Any:
        """The function of every rank thread: serve this rank's process until its function ends."""
        rs = current_rank_state()
        me = self.ranks[rs.rank]  # type: ignore[union-attr]
        me.groups[0] = _state.current().world  # type: ignore[union-attr]
        rs.where = lambda: self._where(me)  # type: ignore[union-attr]  (a timeout report shows the process's stack)
        return self._serve(rs, me, me.main)

    #: what a thread of the rank process asks and waits for the answer to; the other messages end its thread
    _REQUESTS = frozenset(("call", "wait", "completed", "success", "source", "step", "share", "thread", "join",
                           "leave", "rejoin", "free"))

    def _serve(self, rs: Any, me: _Rank, chan: _Channel) -> Any:
        """Serve one thread of the rank process as the actor ``rs`` until the thread ends.

        The main thread's channel ends with the rank's result (returned) or its failure (raised); the channel of a
        thread the program started ends with the thread.
        """
        main = chan is me.main
        backend = rs.backend
        while True:
            if main and me.pending is not None:
                msg, me.pending = me.pending, None
            else:
                msg = self._recv(rs, me, chan)
            kind = msg[0]
            if kind in self._REQUESTS:
                if chan.deferred is not None:  # the previous request failed after its early answer: fail this one
                    e, chan.deferred = chan.deferred, None
                    self._send(me, chan, self._error_reply(me, e))
                    continue
                try:
                    value = self._request(rs, me, chan, backend, msg)
                except BaseException as e:  # noqa: BLE001  (sent to the rank process's thread, which raises it)
                    if chan.replied:
                        chan.deferred = e
                    else:
                        self._send(me, chan, self._error_reply(me, e))
                else:
                    if not chan.replied:
                        self._send(me, chan, ("ok", value))
                chan.replied = False
                if main and me.free_running:
                    rs.run.sched.leave(rs)  # (a no-op while it is outside the schedule already)
            elif kind == "modules":
                if me.server is not None:
                    warm.POOL.learn(me.server, msg[1])
            elif kind == "end":  # a thread the program started has ended
                return None
            elif kind == "result":
                if chan.deferred is not None:
                    raise chan.deferred
                rs.cpu_mark = time.thread_time() - msg[2]  # the compute after the last operation: charged at exit
                return pickle.loads(msg[1])
            elif kind == "exit":
                exit_ = SystemExit(msg[1])
                if len(msg) > 2:  # where the rank process exited (a CLI shows it as the rank's traceback)
                    exit_._tp_rank_traceback = msg[2]  # type: ignore[attr-defined]
                raise exit_
            elif kind == "forwarded":
                raise me.errors[msg[1]]
            elif kind == "raise":
                raise self._program_error(me, msg)
            else:  # pragma: no cover  (a protocol error is a bug of this module)
                raise DistRuntimeError(f"simulator: unknown message {kind!r} from rank {me.rank}'s process")

    def _request(self, rs: Any, me: _Rank, chan: _Channel, backend: Any, msg: tuple) -> Any:
        """Perform one request of a thread of the rank process, as its actor ``rs``; returns the answer."""
        kind = msg[0]
        if kind == "call":
            _, name, enc, site, backward, cpu = msg
            # the thread's own compute since its last call: charged by the call's first step, as the CPU time
            # of a thread rank is
            rs.cpu_mark = time.thread_time() - cpu
            if name not in OUTPUTS or enc[-1] is not False:  # a group's creation, or an async_op call
                return self._perform(me, backend, name, enc, site, backward)
            # a blocking collective or send/recv (whose answer is None, or the source rank for recv)
            recv = name == "recv"
            return self._answering_early(rs, chan, lambda src: src if recv else None,
                                         lambda: self._perform(me, backend, name, enc, site, backward))
        if kind in ("wait", "completed", "success", "source"):
            work = me.works[msg[1]]
            if kind == "wait":
                rs.cpu_mark = time.thread_time() - msg[2]  # computed while the operation ran
                bound = msg[3] if len(msg) > 3 else None
                if bound is not None:  # what is left of it: it started when the process asked
                    bound -= timedelta(seconds=time.time() - msg[4])
                return self._answering_early(rs, chan, lambda src: True, lambda: work.wait(bound))
            if kind == "completed":
                return work.is_completed()
            if kind == "success":
                return work.is_success()
            return work.source_rank()
        if kind == "step":  # an optimizer step of the rank process (see simulator.adapters.clock_hooks on thread ranks)
            rs.cpu_mark = time.thread_time() - msg[2]
            mark_step(me.optimizers.setdefault(msg[1], object()), (), {})
            return None
        if kind == "share":  # a storage of the program in shared memory: calls on it are not staged
            _, sid, size = msg
            fds = chan.recv_fds(1)
            try:
                me.arenas[sid] = SharedStorage(fds[0], size)
            finally:
                for fd in fds:
                    os.close(fd)
            return None
        if kind == "thread":  # the thread starts a thread: an actor of the rank, as Thread.start on thread ranks
            return self._adopt(rs, me, chan, msg[1], msg[2])
        if kind == "join":
            actor = me.threads.get(msg[1])
            if actor is not None:  # (gone: its thread has ended and its actor exited)
                threads.join_actor(rs, actor)
            return None
        if kind == "leave":  # around a wait the scheduler cannot see (an Event, a Queue, a Future; a time.sleep)
            return threads.step_out(rs) if len(msg) == 1 else threads.sleep_out(rs, msg[1], msg[2])
        if kind == "rejoin":
            if len(msg) == 1:
                threads.step_in(rs)
            else:
                threads.sleep_in(rs)
            return None
        # "free": the process started an RPC agent, whose waits the scheduler cannot see (see .rpc_process)
        me.free_running = isinstance(rs.run.sched, CoopScheduler)
        return None

    def _answering_early(self, rs: Any, chan: _Channel, answer: Callable[[Any], Any], block: Callable[[], Any]) -> Any:
        """Run ``block`` (an operation the thread waits for) as the actor ``rs``; in coop mode the thread is answered
        with ``answer(source)`` as soon as the operation completes (see :meth:`_early`)."""
        if not isinstance(rs.run.sched, CoopScheduler):
            return block()
        rs.on_complete = lambda error, src: self._early(rs, chan, error, answer(src), self.ranks[rs.rank])
        try:
            return block()
        finally:
            rs.on_complete = None

    def _early(self, rs: Any, chan: _Channel, error: Any, value: Any, me: _Rank) -> None:
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
            _wire.send(chan.conn, ("ok", value, self._completed(me)))
        except OSError:
            return  # the process is gone: its proxy finds out when it reads
        chan.replied = True

    def _adopt(self, rs: Any, me: _Rank, chan: _Channel, name: str, daemon: bool) -> int:
        """The thread of ``chan`` starts a thread ``name``: give it an actor of the rank and a proxy serving it."""
        fds = chan.recv_fds(1)
        child = _Channel(Connection(fds[0]))
        with me.lock:
            me.chans.add(child)
            tid = next(me.tids)
        # the thread object only names the actor (reports say "rank 0 (thread 'comm')"); it never runs
        inh = threads.adopt(rs, threading.Thread(name=name, daemon=daemon))
        me.threads[tid] = inh.actor

        def serve() -> None:
            try:
                self._serve(inh.actor, me, child)
            except _ThreadGone:
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

    def _perform(self, me: _Rank, backend: Any, name: str, enc: list[Any], site: str, backward: str | None) -> Any:
        if name in ("new_group_handle", "member_group_handle"):
            ranks = enc[0]
            args: tuple = (ranks, timedelta(seconds=self.world.pg_timeout)) if name == "new_group_handle" else (ranks,)
            h = _at(site)(getattr(backend, name), args)
            if h is None:
                return None
            if h.gid not in me.groups:
                me.groups[h.gid] = ProcessGroup(h.ranks, backend, h, group_id=h.gid)
            return h.gid
        dec = [self._decode(me, a) for a in enc]
        method = getattr(backend, name)
        if backward is not None:
            with _state.backward_of(backward):
                value = _at(site)(method, dec)
        else:
            value = _at(site)(method, dec)
        if value is not None and not isinstance(value, int):  # a work of an async_op call
            with me.lock:
                wid = next(me.wids)
                me.works[wid] = me.unreported[wid] = value
            return wid
        return value

    @staticmethod
    def _where(me: _Rank) -> list[tuple[str, int, str]]:
        """The rank process's main-thread stack now (empty if it does not answer within a second)."""
        if me.where is None:
            return []
        me.asked += 1
        try:
            me.where.send(me.asked)
            deadline = time.monotonic() + 1.0
            while me.where.poll(max(0.0, deadline - time.monotonic())):
                n, stack = me.where.recv()
                if n == me.asked:  # (an answer that came too late for an earlier question is dropped)
                    return stack
        except (EOFError, OSError):
            pass
        return []

    def _arena(self, me: _Rank, aid: int) -> Arena | SharedStorage:
        """Arena ``aid`` of the rank process, mapped here the first time a call names it."""
        a = me.arenas.get(aid)
        if a is None:
            if aid >= SHARED_BASE:  # pragma: no cover  (registered by a "share" before any call names it)
                raise DistRuntimeError(f"simulator: rank {me.rank}'s process named an unknown shared storage {aid}")
            with me.lock:  # (two of its threads may name a new arena at once)
                a = me.arenas.get(aid)
                if a is None:
                    path = _wire.arena_path(self.arena_dir, me.rank, aid)
                    a = me.arenas[aid] = Arena(aid, path, os.path.getsize(path), create=False)
        return a

    def _decode(self, me: _Rank, a: Any) -> Any:
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
    def _completed(me: _Rank) -> list[tuple[int, bool]]:
        """``[(id, ok), ...]`` of the rank's async works completed since the last answer (sent with each answer:
        the process then copies their outputs back and frees their staging, waited or not)."""
        with me.lock:
            done = [(wid, w.is_success()) for wid, w in me.unreported.items() if w.is_completed()]
            for wid, _ in done:
                del me.unreported[wid]
        return done

    def _send(self, me: _Rank, chan: _Channel, msg: tuple) -> None:
        """Send an answer (``("ok", value)`` or an error) with the works completed since the last one."""
        try:
            _wire.send(chan.conn, msg + (self._completed(me),))
        except (BrokenPipeError, ConnectionResetError, OSError):
            if chan is me.main:
                raise self._death(me) from None
            raise _ThreadGone from None  # the process is going: its main proxy reports how

    def _error_reply(self, me: _Rank, e: BaseException) -> tuple:
        with me.lock:
            eid = len(me.errors)
            me.errors[eid] = e
        attrs = {k: getattr(e, k) for k in ("rank", "failed_rank", "ranks", "exit_code", "seed")
                 if isinstance(getattr(e, k, None), (int, list, tuple))}
        return ("err", eid, type(e).__module__, type(e).__qualname__, str(e), attrs)

    def _program_error(self, me: _Rank, msg: tuple) -> BaseException:
        _, data, clsname, text, tb = msg
        exc: BaseException | None = None
        if data is not None:
            try:
                exc = pickle.loads(data)
            except Exception:  # noqa: BLE001
                exc = None
        if exc is None:
            exc = DistRuntimeError(f"{clsname}: {text}")
        exc.add_note(f"[simulator] traceback in rank {me.rank}'s process (pid {me.proc.pid}, "
                     f"PYTHONHASHSEED={me.hash_seed}):\n{tb.rstrip()}")
        exc._tp_rank_traceback = tb  # type: ignore[attr-defined]  (launch.format_rank_traceback shows it instead)
        return exc

    def _recv(self, rs: Any, me: _Rank, chan: _Channel) -> tuple:
        conn, run, main = chan.conn, rs.run, chan is me.main
        while True:
            try:
                if conn.poll(0.1):
                    return _wire.recv(conn)
            except (EOFError, ConnectionResetError, OSError):
                return self._ended(me) if main else ("end",)
            if me.proc.poll() is not None:
                try:
                    if conn.poll(0):
                        return _wire.recv(conn)
                except (EOFError, ConnectionResetError, OSError):
                    pass
                return self._ended(me) if main else ("end",)  # (a daemon thread ends with its process)
            if not main and (run.aborted or run.over):
                return ("end",)
            if main and (run.aborted or run.clock() > run.deadline):
                # a bound of the run ran out while this rank's process was computing: stop it (threads could not be)
                self._kill(me)
                if run.fatal is not None:
                    raise run.fatal.make(me.rank)
                names, limit = self.world.bound_names, self.world.timeout
                raise SimTimeoutError(format_message(
                    "simulator.run", f"the run did not finish within {limit:g} s ({names.spell('timeout', limit)}); "
                    f"rank {me.rank}'s process was computing and has been killed", rank=me.rank,
                    fix=f"make the stuck computation end, or raise {names.knob('timeout')}"))

    def _ended(self, me: _Rank) -> tuple:
        """The rank process's channel ended without a last message: a normal exit (``os._exit(0)``) or a death."""
        try:
            code = me.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        if code == 0:  # the process ended successfully, as torchrun sees it: the rank has returned (None)
            return ("exit", 0)
        raise self._death(me) from None

    def _death(self, me: _Rank) -> RankExitError:
        """The rank process ended without reporting (os._exit, a signal, a crash of the interpreter)."""
        try:
            code = me.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._kill(me)
            code = me.proc.poll()
        rs = current_rank_state()
        site = rs.last_site if rs is not None else "?"
        if code is not None and code < 0:
            try:
                sig = signal.Signals(-code).name
            except ValueError:
                sig = f"signal {-code}"
            what = f"was killed by {sig}"
        else:
            what = f"exited with code {code} before its function returned (os._exit, or the interpreter died)"
        err = RankExitError(format_message(
            "simulator.run", f"rank {me.rank}'s process {what}; a process that dies is a failed rank, as under "
            "torchrun", rank=me.rank,
            values={"exit_code": code, "pid": me.proc.pid, "PYTHONHASHSEED": me.hash_seed, "last_call": site},
            fix="find why the process ended (its output above; a signal: a crash in native code, the OOM killer "
                "or a kill), and return normally from every rank"))
        err.exit_code = code
        err.rank = me.rank
        return err

    # -- teardown -----------------------------------------------------------
    @staticmethod
    def _kill(me: _Rank) -> None:
        try:
            os.killpg(me.proc.pid, signal.SIGKILL)  # the process and anything it started (its own session)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        """Bounded teardown: let the rank processes exit, kill what remains, reap them, drop the shared memory."""
        for me in self.ranks:
            with me.lock:
                chans = list(me.chans)
            for chan in chans:
                chan.close()
            try:
                if me.where is not None:
                    me.where.close()
            except OSError:
                pass
        deadline = time.monotonic() + _GRACE_S
        for me in self.ranks:
            try:
                me.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for me in self.ranks:
            self._kill(me)  # also what a finished process left behind in its session
            try:
                me.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover  (SIGKILL cannot be refused)
                pass
        self.store = None
        for me in self.ranks:  # a kept exception (its frames reach this object) must not keep arenas mapped
            with me.lock:
                me.arenas.clear()
                me.works.clear()
                me.unreported.clear()
                me.errors.clear()
                me.pending = None
        shutil.rmtree(self.arena_dir, ignore_errors=True)
        cleanup.unregister(self)
        warm.POOL.release(getattr(self, "_servers", []))  # (at most the documented number stay warm)
        self._servers: list[Any] = []

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids, in rank order."""
        return [me.proc.pid for me in self.ranks]
