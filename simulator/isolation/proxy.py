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
rank starts does.  How a proxy serves its channel, one handler per message
kind, is :mod:`.proxy_handlers`.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

from tensorplay.distributed import state as dist_state
from tensorplay.distributed.errors import DistRuntimeError, DistTypeError, format_message

from simulator.adapters import _environ
from simulator.core.errors import RankExitError, SimTimeoutError
from simulator.core._actor import RUNNABLE
from simulator.core.state import current_rank_state
from simulator.core.hash_seeds import hash_seed
from simulator.isolation import _wire, cleanup, pickling, warm
from simulator.isolation.messages import END, EXIT, FDS_PASSED, FDS_WHERE, READY, Setup
from simulator.isolation.proxy_handlers import Channel, ProxyHandlers, RankProcess

__all__ = ["ProcessRanks", "hash_seed"]

_CHILD = warm.PROLOGUE + "from simulator.isolation.child import main\nmain()\n"  # a rank process spawned afresh
_GRACE_S = 3.0  # how long a rank process may take to exit after the world ended, before it is killed
_STARTUP_S = 300.0  # bound on the rank processes' start-up (an interpreter and ``import torch`` each)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj: Any, what: str = "") -> bytes:
    return pickling.dumps(obj, what)  # (closures keep their file names; a main script that is no file: by value)


class ProcessRanks(ProxyHandlers):
    """The rank processes of one run of a world and the proxy loop that serves them."""

    @staticmethod
    def _inherited(world: Any, fn: Any, rank_args: Sequence[Sequence[Any]], kwargs: dict[str, Any],
                   what: str) -> list[tuple[bytes, list[int]]]:
        """Each rank's payload as a spawned child inherits it; a world that does not import the main script (fork
        children) sends its code by value, and imports the script after all when that cannot be done."""
        def payloads(by_value: bool) -> list[tuple[bytes, list[int]]]:
            return [pickling.dumps_inherited((fn, tuple(a), dict(kwargs)), what, by_value) for a in rank_args]

        if getattr(world, "import_main", True):
            return payloads(False)
        try:
            return payloads(True)
        except Exception:  # noqa: BLE001  (e.g. a global of the script that only travels by reference)
            world.import_main = True
            return payloads(False)

    def __init__(self, world: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                 rank_args: Sequence[Sequence[Any]] | None = None) -> None:
        """``rank_args``: rank ``r`` calls ``fn(*rank_args[r], **kwargs)`` instead, its arguments passed as a spawned
        child inherits them (pipes, queues and shared tensors stay shared; see :func:`.pickling.dumps_inherited`)."""
        # (imported at first use: seeds notes torch's seed when it is first imported, which the world's import
        # does; importing the isolation wing must not move that moment earlier)
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
                payloads = self._inherited(world, fn, rank_args, kwargs, what)
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
        rng_states, _ = _initial_rng_states(world.seed, self.n, getattr(world, "rng_origin", None))
        cleanup.sweep()  # the arenas of coordinators that died without cleaning up
        self.arena_dir = cleanup.arena_dir()
        cleanup.register(self, self.arena_dir, lambda: self.pids)  # (a SIGTERM kills the ranks, drops the arenas)
        import torch.distributed as tdist

        # the rendezvous store of torch.distributed in the rank processes (they are real processes: a real store)
        self.store = tdist.TCPStore("127.0.0.1", 0, self.n, True, timedelta(seconds=world.pg_timeout),
                                    wait_for_workers=False)
        prep = pickling.fix_preparation(spawn.get_preparation_data("simulated-rank"))
        prep.pop("authkey", None)
        if not getattr(world, "import_main", True):  # (fork children, and ranks that run a program of their own)
            # not imported again: a fork child has its parent's __main__ as it is (see pickling.adopt_forked_main)
            prep["tp_forked_main"] = (prep.pop("init_main_from_path", None), prep.pop("init_main_from_name", None))
        master_port = str(_free_port())
        rpc_secret = secrets.token_hex(32)  # the workers' shared RPC secret, unless the program sets its own
        self.ranks: list[RankProcess] = []
        slow = warm.SlowStartNote(self.n)  # (a first world takes seconds: said once, on stderr, if it does)
        pairs: list[tuple[socket.socket, socket.socket]] = []
        asked: list[bool] = []
        try:
            envs = [self._env(r, master_port) for r in range(self.n)]
            servers = self._servers = warm.POOL.servers(envs) if warm.enabled() else [None] * self.n
            pairs = [socket.socketpair() for _ in range(self.n)]
            asked = [False] * self.n
            for r in range(self.n):  # every fork asked for first: the warm interpreters fork side by side
                if servers[r] is not None:  # a fork of the warm interpreter of this hash seed (see .warm)
                    try:
                        servers[r].ask_fork(pairs[r][1].fileno(), envs[r])  # type: ignore[union-attr]
                        asked[r] = True
                    except OSError:
                        pass
            for r in range(self.n):
                env = envs[r]
                parent, child = pairs[r]
                try:
                    proc: Any = None
                    if asked[r]:
                        asked[r] = False
                        try:
                            proc = servers[r].forked_process()  # type: ignore[union-attr]
                        except OSError:
                            proc = None
                    if proc is None:
                        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(child.fileno()), str(os.getpid())],
                                                pass_fds=(child.fileno(),), env=env, start_new_session=True)
                finally:
                    child.close()
                conn = Connection(parent.detach())
                self.ranks.append(RankProcess(r, proc, conn, self.hash_seeds[r]))
                if isinstance(proc, warm.Forked):
                    self.ranks[-1].server = servers[r]
                payload, passed = payloads[r]
                _wire.send(conn, Setup(rank=r, world_size=self.n, seed=world.seed, prep=prep, payload=payload,
                                       passed=len(passed), torch_rng=rng_states[r], arena_dir=self.arena_dir,
                                       timeout=world.pg_timeout, store=("127.0.0.1", self.store.port),
                                       learn=isinstance(proc, warm.Forked), mode=world.mode,
                                       rpc_secret=rpc_secret,
                                       device_context=getattr(world, "device_context", None),
                                       own_torch_rpc=getattr(world, "own_torch_rpc", False)))
                ask, answer = socket.socketpair()
                with answer, socket.socket(fileno=os.dup(conn.fileno())) as raw:
                    socket.send_fds(raw, [FDS_WHERE], [answer.fileno()])
                    if passed:  # what the rank inherits (its pipes, queues, shared tensors; see pickling)
                        socket.send_fds(raw, [FDS_PASSED], passed)
                self.ranks[-1].where = Connection(ask.detach())
            self._await_ready()
        except BaseException:
            # forks asked for and not taken: their answers are not left for the next world, and their channels
            # close (so the processes stop at once)
            for r in range(len(self.ranks), len(pairs)):
                if asked[r]:
                    try:
                        servers[r].forked_process()  # type: ignore[union-attr]
                    except OSError:
                        pass
                for end in pairs[r]:
                    end.close()
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
                if msg[0] != READY:  # e.g. the function could not be unpickled there: its proxy reports it
                    me.pending = msg
            for c, me in list(waiting.items()):
                if me.proc.poll() is not None:
                    waiting.pop(c)

    def _env(self, rank: int, master_port: str) -> dict[str, str]:
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
        me.groups[0] = dist_state.current().world  # type: ignore[union-attr]
        rs.where = lambda: self._where(me)  # type: ignore[union-attr]  (a timeout report shows the process's stack)
        return self._serve(rs, me, me.main)

    @staticmethod
    def _where(me: RankProcess) -> list[tuple[str, int, str]]:
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

    def _recv(self, rs: Any, me: RankProcess, chan: Channel) -> tuple:
        conn, run, main = chan.conn, rs.run, chan is me.main
        failed_at = None  # when this rank process was first seen silent after another rank failed
        while True:
            try:
                if conn.poll(0.1):
                    return _wire.recv(conn)
            except (EOFError, ConnectionResetError, OSError):
                return self._ended(me) if main else (END,)
            if getattr(run.sched, "timeouts", None) and run.fatal is None and rs.state == RUNNABLE:
                # coop: this rank's process computes while another actor's operation ran past its own timeout;
                # the computation is a scheduling point, so the timed-out actor fails now, as on real processes
                run.sched.serve_timeouts(rs)
            if me.proc.poll() is not None:
                try:
                    if conn.poll(0):
                        return _wire.recv(conn)
                except (EOFError, ConnectionResetError, OSError):
                    pass
                return self._ended(me) if main else (END,)  # (a daemon thread ends with its process)
            if not main and (run.aborted or run.over):
                return (END,)
            if main and run.fatal is not None and not run.aborted:
                # another rank failed and this process stays silent: it waits where the simulator cannot release
                # it (a wait in C++, e.g. torch's own RPC shutdown). torchrun and mp.spawn end the other processes
                # when one fails; so does the run, after a grace for a rank that is only finishing its computation
                failed_at = failed_at if failed_at is not None else time.monotonic()
                if time.monotonic() - failed_at > _GRACE_S:
                    self._kill(me)
                    raise run.fatal.make(me.rank)
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

    def _ended(self, me: RankProcess) -> tuple:
        """The rank process's channel ended without a last message: a normal exit (``os._exit(0)``) or a death."""
        try:
            code = me.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        if code == 0:  # the process ended successfully, as torchrun sees it: the rank has returned (None)
            return (EXIT, 0, None)
        raise self._death(me) from None

    def _death(self, me: RankProcess) -> RankExitError:
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
    def _kill(me: RankProcess) -> None:
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
