"""A simulated world: N ranks as threads of this process, each with tensorplay.distributed on ``"sim"``.

:func:`run` is the entry point; :class:`World` keeps the settings for repeated
runs and the trace of the last one.

Example::

    import simulator, tensorplay as tp, tensorplay.distributed as dist

    def f():
        x = tp.arange(3.) + dist.get_rank()
        dist.all_reduce(x)
        return x

    outs = simulator.run(f, 4)                  # outs[r] == [6., 10., 14.] on every rank
    simulator.last_trace().to_chrome("f.json")  # the timeline of the run

Failures are reported once: when rank ``r`` raises, the others are released
with :class:`RankFailedError` and ``run`` re-raises rank ``r``'s exception
(its own type and traceback, with ``.rank`` set and a note naming the rank
and the seed).  When several ranks fail independently (only possible in
``mode="threads"``, or when ranks raise before their first operation), ``run``
raises an ``ExceptionGroup`` of them.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import queue
import random
import re
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from tensorplay.distributed import _state
from tensorplay.distributed.errors import DistRuntimeError, DistTypeError, DistValueError, format_message

from . import _environ
from .errors import DeadlockError, RankExitError, RankFailedError, SimError, SimTimeoutError
from .faults import Fault, FaultPlan
from .sched import BLOCKED, DONE, FREE, CoopScheduler, ThreadScheduler
from .trace import DEFAULT_TRACE_LIMIT, CostModel, Event, EventLog, Trace

__all__ = ["World", "run", "last_trace", "RankState", "Incident", "current_rank_state", "rank_device"]

#: modules of this package whose ``enabled()`` context routes one of torch's own APIs to the running world
_ADAPTERS: tuple[str, ...] = ("threads", "torch_native", "torch_rpc")
#: torch's seed when the simulator was imported: a fresh process draws a random 64-bit one
_BOOT_SEED = torch.initial_seed()
_last_trace: Trace | None = None
_local = threading.local()


def _program_seeded() -> bool:
    """Did the program seed torch in this process before the run (e.g. a module-level ``torch.manual_seed``)?

    Every real process would have run that seeding, so every rank starts from
    the same state.  torch 2.13 gives a fresh process a random 64-bit seed; a
    seed set since import, or a small one (what programs pass), is the program's.
    """
    s = torch.initial_seed()
    return s != _BOOT_SEED or s < 2**32


def rank_seed(run_seed: int, rank: int) -> int:
    """The torch seed a rank of an unseeded program starts from: distinct per rank, a pure function of the run's seed."""
    digest = hashlib.blake2b(f"tensorplay-simulator:{run_seed}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | (1 << 63)  # 64-bit, like the random seed of a fresh process


def _initial_rng_states(run_seed: int, n: int) -> tuple[list[torch.Tensor], list[int]]:
    """Each rank's starting torch RNG state and seed (see :func:`_program_seeded` and :func:`rank_seed`)."""
    if _program_seeded():
        state = torch.get_rng_state()
        return [state] * n, [torch.initial_seed()] * n
    seeds = [rank_seed(run_seed, r) for r in range(n)]
    g = torch.Generator()
    states = []
    for s in seeds:
        g.manual_seed(s)
        states.append(g.get_state())
    return states, seeds


def last_trace() -> Trace | None:
    """The trace of the most recent :func:`run` in this process (``None`` before the first)."""
    return _last_trace


def current_rank_state() -> "RankState | None":
    """The calling rank thread's state, or ``None`` outside a simulated world."""
    return getattr(_local, "rs", None)


def rank_device() -> torch.device:
    """The device of the calling rank (``cuda:<rank % device_count>`` under ``device="cuda"``, else cpu)."""
    rs = current_rank_state()
    return torch.device("cpu") if rs is None else rs.device


class Incident:
    """One event several ranks learn about; :meth:`make` builds each rank's own exception object."""

    __slots__ = ("cls", "message", "cause", "failed_rank")

    def __init__(self, cls: type, message: str, cause: BaseException | None = None,
                 failed_rank: int | None = None) -> None:
        self.cls = cls
        self.message = message
        self.cause = cause
        self.failed_rank = failed_rank

    def make(self, rank: int) -> BaseException:
        exc = self.cls(self.message)
        exc.incident = self
        exc.rank = rank
        if self.failed_rank is not None:
            exc.failed_rank = self.failed_rank
        if self.cause is not None:
            exc.__cause__ = self.cause
        return exc


class RankState:
    """Everything the simulator keeps per rank (one per rank thread)."""

    __slots__ = (
        "rank", "run", "backend", "wake", "state", "sleeping", "waiting", "pending", "pos",
        "vt", "cpu_mark", "ops", "faults", "torch_rng", "py_rng", "result", "exc", "env", "device",
        "unflushed", "p2p_seq", "last_site", "thread", "tid", "steered", "parent", "waits_exit",
    )

    def __init__(self, rank: int, run: "_Run") -> None:
        self.rank = rank
        self.run = run
        self.backend: Any = None
        self.wake = threading.Lock()
        self.wake.acquire()
        self.state = 0
        self.sleeping = False
        self.waiting: Any = None
        self.pending: Incident | None = None
        self.pos = -1
        self.vt = 0.0
        self.cpu_mark = 0.0
        self.ops = 0
        self.faults: list[Fault] | None = None
        self.torch_rng: torch.Tensor | None = None
        self.py_rng: Any = None
        self.result: Any = None
        self.exc: BaseException | None = None
        self.env: dict[str, str] | None = None
        self.device = torch.device("cpu")
        self.unflushed: list[Any] = []
        self.p2p_seq = 0
        self.last_site = "?"
        self.thread: threading.Thread | None = None
        self.tid = 0  # the OS thread id, once the rank's thread runs (coop mode steers it by this id)
        self.steered = False
        #: for a thread the rank started: the rank's own state (this object is then an extra actor of that rank)
        self.parent: RankState | None = None
        #: the run ends only after this actor ended (ranks, and the non-daemon threads they start)
        self.waits_exit = True

    @property
    def label(self) -> str:
        """``rank 2``, or ``rank 2 (thread 'comm')`` for a thread the rank started."""
        if self.parent is None:
            return f"rank {self.rank}"
        name = self.thread.name if self.thread is not None else "?"
        return f"rank {self.rank} (thread {name!r})"

    def child(self, thread: threading.Thread) -> "RankState":
        """A new actor of this rank for ``thread``, which the rank starts: same identity, own waits and clock."""
        root = self.parent or self
        c = RankState(self.rank, self.run)
        c.parent = root
        c.backend = root.backend
        c.env = root.env
        c.device = root.device
        c.vt = self.vt
        c.last_site = self.last_site
        c.thread = thread
        c.waits_exit = not thread.daemon
        return c

class _Run:
    """The shared state of one execution of a world."""

    def __init__(self, world: "World") -> None:
        self.world = world
        self.n = world.world_size
        self.seed = world.seed
        self.mode = world.mode
        self.cost = world.cost
        self.p2p = world.p2p
        self.deadline = time.monotonic() + world.timeout
        self.aborted = False
        self.fatal: Incident | None = None
        self.live = self.n  # actors not yet ended (ranks and the threads they started)
        self.to_exit = self.n  # actors the run waits for (ranks and their non-daemon threads)
        self.over = False  # every rank and non-daemon thread ended; a daemon thread's later call fails
        self.children: list[RankState] = []  # threads the ranks started, in start order
        self.all_done = threading.Event()
        self.events = EventLog(self.n, world.trace_limit)
        self.wall_origin = time.perf_counter()
        self.ranks = [RankState(r, self) for r in range(self.n)]
        if world.mode == "coop":
            self.sched: Any = CoopScheduler(self, world.seed, swap_rng=world.per_rank_rng)
        else:
            self.sched = ThreadScheduler(self)
        # p2p mailboxes, keyed by destination global rank (lists created on first use)
        self.sends: dict[int, list] = {}
        self.recvs: dict[int, list] = {}
        self.next_gid = 1
        # large kernels run on the thread that called run() (see execute())
        self.jobs: "queue.SimpleQueue[Any]" = queue.SimpleQueue()

    # -- big kernels on one thread -------------------------------------------
    def execute(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the thread that called :meth:`World.run` and return its result.

        torch's intra-op thread pool is per calling OS thread: big kernels
        issued from many rank threads each spin up their own pool and fight
        over the cores (measured 2-3x slower), so heavy work is funnelled to
        one thread, which is idle anyway while the world runs.
        """
        box: list[Any] = [None, None]
        # a plain lock, not an Event: a rank's Condition waits may step out of the schedule (simulator/threads.py),
        # and this wait happens inside a collective, with the schedule's state half-updated
        done = threading.Lock()
        done.acquire()

        def job() -> None:
            try:
                box[0] = fn()
            except BaseException as e:  # noqa: BLE001  (re-raised on the rank)
                box[1] = e
            finally:
                done.release()

        self.jobs.put(job)
        while not done.acquire(timeout=0.25):
            if self.aborted or time.monotonic() > self.deadline + 5.0:
                raise self.make_error(self.fatal, self.ranks[0]) if self.fatal else RuntimeError("run aborted")
        if box[1] is not None:
            raise box[1]
        return box[0]

    def finished(self) -> None:
        """The last rank (or non-daemon thread) has exited (called under the scheduler lock)."""
        self.over = True
        self.all_done.set()
        self.jobs.put(None)
        # daemon threads still waiting in an operation are abandoned, as at a process's exit: release them
        for c in self.children:
            if c.state == BLOCKED:
                c.pending = Incident(DistRuntimeError, _OVER_TEXT)
                self.sched.wake(c)
                if self.mode == "coop":  # coop's wake only marks it runnable; nobody will hand it the baton
                    c.wake.release()

    def over_error(self, rs: RankState) -> BaseException:
        return Incident(DistRuntimeError, _OVER_TEXT).make(rs.rank)

    @property
    def actors(self) -> list[RankState]:
        """Every rank, then every thread the ranks started."""
        return self.ranks + self.children if self.children else self.ranks

    # -- incidents ----------------------------------------------------------
    def make_error(self, inc: Incident, rs: RankState) -> BaseException:
        return inc.make(rs.rank)

    def _blocked(self) -> list[RankState]:
        return [rs for rs in self.actors if rs.state == BLOCKED]

    def deadlock(self) -> None:
        """Every live rank is blocked: give each a DeadlockError and wake it (called under the lock)."""
        from .report import describe_world

        blocked = self._blocked()
        text = describe_world(self, headline="deadlock: every live rank is blocked and none can make progress")
        inc = Incident(DeadlockError, text)
        if self.fatal is None:
            self.fatal = inc
        for rs in blocked:
            rs.pending = inc
        self.sched.wake_all_blocked(blocked)

    def rank_failed(self, rs: RankState, exc: BaseException) -> None:
        """``rs``'s function raised: release every other rank with RankFailedError."""
        with self.sched.lock:
            if isinstance(exc, RankFailedError) or self.fatal is not None:
                return
            msg = (f"rank {rs.rank} failed with {type(exc).__name__}: {exc}; this rank was released "
                   f"from its current wait. The original error and traceback are on rank {rs.rank} "
                   f"(simulator.run re-raises it)")
            inc = Incident(RankFailedError, msg, cause=exc, failed_rank=rs.rank)
            self.fatal = inc
            blocked = self._blocked()
            for b in blocked:
                b.pending = inc
            self.sched.wake_all_blocked(blocked)

    def local_timeout(self, rs: RankState) -> None:
        """A rank's own bound ran out (the main thread normally aborts first)."""
        raise SimTimeoutError(format_message(
            "simulator.run", f"rank {rs.rank} waited past the run's timeout of {self.world.timeout} s",
            fix="raise timeout= or look for a rank stuck in a long computation"))

    def abort_timeout(self) -> SimTimeoutError:
        """Main thread: the global timeout ran out; fail every rank that is still waiting."""
        from .report import describe_world

        with self.sched.lock:
            text = describe_world(self, headline=f"timeout: the run did not finish within {self.world.timeout} s",
                                  timeout=True)
            inc = Incident(SimTimeoutError, text)
            self.fatal = inc
            self.aborted = True
            for rs in self.actors:
                if rs.state != DONE:
                    rs.pending = inc
                    rs.sleeping = False
                    try:
                        rs.wake.release()
                    except RuntimeError:
                        pass  # already released
        return inc.make(-1)  # type: ignore[return-value]


_OVER_TEXT = format_message(
    "simulator.run", "the simulated world has ended (every rank returned): a daemon thread a rank started made "
    "a distributed call afterwards", fix="join the thread before the rank returns, or stop it from communicating")


class World:
    """Settings of a simulated world; :meth:`run` executes a function on every rank.

    Args:
        world_size: number of ranks (threads).
        seed: picks the schedule in ``coop`` mode (and seeds each rank's ``random`` module).
        mode: ``"coop"`` (one rank at a time, reproducible) or ``"threads"`` (free-running, faster).
        timeout: seconds before the whole run is aborted with :class:`SimTimeoutError`.
        device: ``"cpu"`` or ``"cuda"`` (ranks share the GPUs round-robin).
        faults: :class:`Crash` / :class:`Delay` objects.
        cost: the :class:`CostModel` for virtual time.
        env: extra per-rank environment variables (torchrun-style ``RANK`` & co. are always set while
            ``torchrun_env=True``).
        per_rank_rng: in coop mode, give each rank its own torch and ``random`` state (default True).
        stack_size: thread stack size in bytes (default 256 KiB above 64 ranks, else the platform's).
        trace_limit: events the trace keeps (the last ones: a ring buffer); ``None`` keeps all, ``0`` none.
            Per-rank totals (the summary) always cover every event. Default 100,000 (about 30 MB).
        p2p: what a blocking ``send`` waits for: ``"rendezvous"`` (default: until the receiver posted its recv,
            as on gloo and NCCL) or ``"eager"`` (the message is buffered and the send returns at once, like MPI's
            buffered sends; a program that needs this deadlocks on gloo and NCCL).

    After a run, ``world.trace`` is its trace, ``world.errors[r]`` the exception rank ``r`` raised (or
    ``None``) and ``world.results[r]`` its return value.
    """

    def __init__(self, world_size: int, *, seed: int = 0, mode: str = "coop", timeout: float = 60.0,
                 device: str = "cpu", faults: Sequence[Fault] = (), cost: CostModel | None = None,
                 env: dict[str, str] | None = None, torchrun_env: bool = False, per_rank_rng: bool = True,
                 stack_size: int | None = None, p2p: str = "rendezvous",
                 trace_limit: int | None = DEFAULT_TRACE_LIMIT) -> None:
        EventLog(1, trace_limit)  # validates it (a clear error before anything runs)
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise DistTypeError(format_message("simulator.run", "world_size must be an int",
                                               values={"world_size": world_size}, fix="pass e.g. world_size=4"))
        if world_size < 1:
            raise DistValueError(format_message("simulator.run", "world_size must be at least 1",
                                                values={"world_size": world_size}, fix="pass world_size >= 1"))
        if mode not in ("coop", "threads"):
            raise DistValueError(format_message("simulator.run", "unknown mode", values={"mode": mode},
                                                fix="pass mode='coop' (deterministic) or mode='threads' (fast)"))
        if p2p not in ("rendezvous", "eager"):
            raise DistValueError(format_message(
                "simulator.run", "unknown point-to-point model", values={"p2p": p2p},
                fix="pass p2p='rendezvous' (a send waits for its recv, as on gloo and NCCL) or p2p='eager' "
                    "(buffered sends)"))
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise DistTypeError(format_message("simulator.run", "seed must be an int", values={"seed": seed},
                                               fix="pass e.g. seed=0"))
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise DistValueError(format_message("simulator.run", "timeout must be a positive number of seconds",
                                                values={"timeout": timeout}, fix="pass e.g. timeout=60.0"))
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise DistValueError(format_message("simulator.run", "device must be 'cpu' or 'cuda'",
                                                values={"device": device}, fix="pass device='cpu' or 'cuda'"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise DistValueError(format_message("simulator.run", "device='cuda' but no GPU is available",
                                                values={"device": device}, fix="pass device='cpu'"))
        self.world_size = world_size
        self.seed = seed
        self.mode = mode
        self.timeout = float(timeout)
        self.device = dev
        self.faults = FaultPlan(list(faults), world_size)
        self.cost = cost if cost is not None else CostModel()
        self.env = dict(env or {})
        self.torchrun_env = torchrun_env
        self.per_rank_rng = per_rank_rng
        self.p2p = p2p
        self.trace_limit = trace_limit
        self.stack_size = stack_size if stack_size is not None else (256 * 1024 if world_size > 64 else 0)
        #: after a run: the torch seed each rank started from (the program's own seed when it seeded torch
        #: before the run, else :func:`rank_seed` of the run's seed)
        self.rank_seeds: list[int] = []
        #: how to replay a failure, shown in its note (the CLI sets its own command line here)
        self.replay_hint: str | None = None
        #: after a run: the trace, and each rank's exception (None where it returned) and result
        self.trace: Trace | None = None
        self.errors: list[BaseException | None] = []
        self.results: list[Any] = []

    def __repr__(self) -> str:
        return f"World(world_size={self.world_size}, seed={self.seed}, mode={self.mode!r})"

    # ---------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        global _last_trace
        if not callable(fn):
            raise DistTypeError(format_message("simulator.run", "fn must be callable",
                                               values={"fn": type(fn).__name__}, fix="pass a function"))
        if current_rank_state() is not None:
            raise DistValueError(format_message("simulator.run", "cannot start a simulated world inside a rank",
                                                fix="call simulator.run from the main program, not from a rank"))
        from .backend import SimBackend, _Group

        kwargs = dict(kwargs or {})
        run = _Run(self)
        world_group = _Group(0, tuple(range(self.world_size)))
        ndev = torch.cuda.device_count() if self.device.type == "cuda" else 0
        rng_states, self.rank_seeds = _initial_rng_states(self.seed, self.world_size)
        for rs in run.ranks:
            rs.backend = SimBackend(rs, world_group)
            rs.faults = self.faults.get(rs.rank)
            rs.torch_rng = rng_states[rs.rank]
            if ndev:
                rs.device = torch.device("cuda", rs.rank % ndev)
            if self.torchrun_env or self.env:
                rs.env = self._rank_env(rs.rank)
        td = timedelta(seconds=self.timeout)
        saved_torch = torch.get_rng_state()
        saved_py = random.getstate()
        env_installed = any(rs.env is not None for rs in run.ranks)
        if env_installed:
            _environ.install()
        run.sched.prepare(run.ranks)
        threads = []
        old_stack = threading.stack_size(self.stack_size) if self.stack_size else None
        try:
            for rs in run.ranks:
                t = threading.Thread(target=_rank_main, args=(rs, fn, args, kwargs, td),
                                     name=f"sim-rank-{rs.rank}", daemon=True)
                rs.thread = t
                threads.append(t)
        finally:
            if old_stack is not None:
                threading.stack_size(old_stack)
        adapters = contextlib.ExitStack()
        for name in _ADAPTERS:  # torch's own APIs in the ranks run on this world too
            adapters.enter_context(importlib.import_module(f"{__package__}.{name}").enabled())
        try:
            for t in threads:
                t.start()
            run.sched.kick()
            finished = _serve(run)
            timeout_exc = None
            if not finished:
                timeout_exc = run.abort_timeout()
                run.all_done.wait(2.0)
                _warn_still_running(run)
            else:
                for t in threads:
                    t.join(timeout=5.0)
        finally:
            adapters.close()
            if env_installed:
                _environ.uninstall()
            torch.set_rng_state(saved_torch)
            random.setstate(saved_py)
        trace = Trace(run.events, self.world_size, seed=self.seed, mode=self.mode, cost=self.cost,
                      wall_origin=run.wall_origin, end_vtime=[rs.vt for rs in run.ranks])
        self.trace = trace
        self.errors = [rs.exc for rs in run.ranks]
        self.results = [rs.result for rs in run.ranks]
        _last_trace = trace
        if timeout_exc is not None:
            raise timeout_exc
        _raise_failures(self, run.ranks)
        return [rs.result for rs in run.ranks]

    def _rank_env(self, rank: int) -> dict[str, str]:
        import os

        real = os.environ._real if isinstance(os.environ, _environ.RankEnviron) else os.environ  # type: ignore[attr-defined]
        env = dict(real)
        if self.torchrun_env:
            n = str(self.world_size)
            env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": n, "LOCAL_WORLD_SIZE": n,
                        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": n,
                        "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                        "TORCHELASTIC_RUN_ID": "simulator", "TORCHELASTIC_RESTART_COUNT": "0",
                        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
            if self.world_size > 1 and "OMP_NUM_THREADS" not in real:
                env["OMP_NUM_THREADS"] = "1"  # torchrun's default for several processes per node
        env.update(self.env)
        return env


def _warn_still_running(run: _Run) -> None:
    """After a timeout: name the rank threads that are still executing (a computation that does not end)."""
    from .report import _where

    alive = [rs for rs in run.actors if rs.thread is not None and rs.thread.is_alive() and rs.state != DONE]
    if alive:
        import warnings

        where = "; ".join(f"{rs.label} at {_where(rs)}" for rs in alive[:8])
        warnings.warn(format_message(
            "simulator.run", f"{len(alive)} rank thread(s) still running after the run timed out (threads cannot be "
            f"stopped from outside; they are daemons and end when their computation does): {where}",
            fix="make the stuck computation end (it is shown above), or run the program in a separate process"),
            RuntimeWarning, stacklevel=3)


def _serve(run: _Run) -> bool:
    """Main thread: run offloaded kernels until every rank exited (True) or the deadline passed (False)."""
    while True:
        remaining = run.deadline - time.monotonic()
        if remaining <= 0:
            return run.all_done.is_set()
        try:
            job = run.jobs.get(timeout=remaining)
        except queue.Empty:
            return run.all_done.is_set()
        if job is None:
            return True
        job()


def _rank_main(rs: RankState, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
               td: timedelta) -> None:
    from tensorplay.distributed.api import _install_backend

    from . import torch_native

    run = rs.run
    sched = run.sched
    _local.rs = rs
    try:
        sched.enter_rank(rs)
    except BaseException as e:  # the run was aborted before this rank got to start
        rs.exc = e
        sched.exit(rs)
        return
    if rs.env is not None:
        _environ.bind(rs.env)
    if rs.device.type == "cuda":
        torch.cuda.set_device(rs.device)
    try:
        _install_backend(rs.backend, td, thread_local=True)
        rs.cpu_mark = time.thread_time()
        with torch_native.rank_thread():
            rs.result = fn(*args, **kwargs)
    except SystemExit as e:
        if e.code not in (None, 0):  # a process that exits non-zero has failed; 0 is a normal return
            exc = _exit_error(rs, e)
            rs.exc = exc
            run.rank_failed(rs, exc)
    except BaseException as e:  # noqa: BLE001  (every failure is reported by run())
        rs.exc = e
        run.rank_failed(rs, e)
    finally:
        try:
            rs.backend._flush_unobserved()
        except BaseException:  # pragma: no cover  (never lose the rank's own outcome)
            pass
        _state.unbind_thread()
        if rs.env is not None:
            _environ.unbind()
        _local.rs = None
        for hook in getattr(run, "exit_hooks", ()):  # e.g. the RPC transport's barriers (a rank ended)
            hook(rs)
        sched.exit(rs)


def _exit_error(rs: RankState, e: SystemExit) -> RankExitError:
    code = e.code
    err = RankExitError(format_message(
        "simulator.run", f"rank {rs.rank} exited with code {code!r} (sys.exit / SystemExit); a process that exits "
        f"non-zero is a failed rank, as under torchrun", rank=rs.rank,
        values={"exit_code": code, "last_call": rs.last_site},
        fix="return normally (or sys.exit(0)) from every rank, or handle the condition that made this rank exit"))
    err.exit_code = code
    err.rank = rs.rank
    err.__cause__ = e
    return err


def _annotate(exc: BaseException, rank: int, world: World) -> BaseException:
    try:
        exc.rank = rank  # type: ignore[attr-defined]
    except Exception:  # pragma: no cover
        pass
    replay = world.replay_hint or (f"simulator.run(fn, {world.world_size}, seed={world.seed}, "
                                   f"mode={world.mode!r})")
    torch_seed = f", torch seed {world.rank_seeds[rank]}" if 0 <= rank < len(world.rank_seeds) else ""
    note = (f"[simulator] raised on rank {rank} of {world.world_size} (mode={world.mode!r}, seed={world.seed}"
            f"{torch_seed}); "
            f"replay with {replay}")
    if note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)
    return exc


def _raise_failures(world: World, ranks: list[RankState]) -> None:
    failed = [rs for rs in ranks if rs.exc is not None]
    if not failed:
        return
    primary = [rs for rs in failed if not isinstance(rs.exc, RankFailedError)]
    if not primary:
        rs = failed[0]
        raise _annotate(rs.exc, rs.rank, world)  # type: ignore[arg-type]
    seen: dict[int, RankState] = {}
    for rs in primary:
        key = id(getattr(rs.exc, "incident", None) or rs.exc)
        seen.setdefault(key, rs)
    firsts = list(seen.values())
    # ranks that raised the same error independently (same class and text up to the rank's own number, e.g. the
    # same bad argument on every rank) report it once, as the lowest rank's own exception: that is what each real process would raise
    same = len({(type(rs.exc), re.sub(rf"(rank[ =]){rs.rank}\b", r"\1<r>", str(rs.exc))) for rs in firsts}) == 1
    if len(firsts) == 1 or same:
        rs = firsts[0]
        exc = rs.exc
        if same and len(firsts) > 1:
            ranks = [r.rank for r in firsts]
        elif isinstance(exc, SimError) and exc.incident is not None:
            ranks = [r.rank for r in primary if r.exc is not None and getattr(r.exc, "incident", None) is exc.incident]
        else:
            ranks = [rs.rank]
        if len(ranks) > 1:
            exc.add_note(f"[simulator] the same error was raised on ranks {ranks}")
        try:
            exc.ranks = ranks  # type: ignore[union-attr]
        except Exception:  # pragma: no cover  (an exception type that refuses attributes)
            pass
        raise _annotate(exc, rs.rank, world)  # type: ignore[arg-type]
    excs = [_annotate(rs.exc, rs.rank, world) for rs in firsts]  # type: ignore[arg-type]
    ranks_txt = ", ".join(str(rs.rank) for rs in firsts)
    if all(isinstance(e, Exception) for e in excs):
        raise ExceptionGroup(f"{len(firsts)} ranks failed independently (ranks {ranks_txt})", excs)  # type: ignore[arg-type]
    raise BaseExceptionGroup(f"{len(firsts)} ranks failed independently (ranks {ranks_txt})", excs)


def run(fn: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
        seed: int = 0, mode: str = "coop", timeout: float = 60.0, device: str = "cpu",
        faults: Sequence[Fault] = (), cost: CostModel | None = None, env: dict[str, str] | None = None,
        torchrun_env: bool = False, per_rank_rng: bool = True, stack_size: int | None = None,
        p2p: str = "rendezvous", trace_limit: int | None = DEFAULT_TRACE_LIMIT) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` simulated ranks; return the results in rank order.

    Each rank is a thread with tensorplay.distributed initialised on ``"sim"``
    (``init_process_group()`` inside is allowed and returns at once).  The
    trace of the run is available afterwards from :func:`last_trace`.

    Example::

        def f():
            x = tp.arange(3.) + dist.get_rank()
            dist.all_reduce(x)
            return x

        simulator.run(f, 4)                    # 4 x tensor([ 6., 10., 14.])
        simulator.run(f, 4, mode="threads")    # same result, ranks run freely
    """
    w = World(world_size, seed=seed, mode=mode, timeout=timeout, device=device, faults=faults, cost=cost,
              env=env, torchrun_env=torchrun_env, per_rank_rng=per_rank_rng, stack_size=stack_size, p2p=p2p,
              trace_limit=trace_limit)
    return w.run(fn, args, kwargs)
