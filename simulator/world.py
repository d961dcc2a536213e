"""A simulated world: N ranks as threads of this process, each with tensorplay.distributed on ``"sim"``.

:func:`run` is the entry point; :class:`World` keeps the settings for repeated
runs and the trace of the last one.

Example::

    >>> import simulator, tensorplay as tp, tensorplay.distributed as dist
    >>> def f():
    ...     x = tp.arange(3.) + dist.get_rank()
    ...     dist.all_reduce(x)
    ...     return x
    >>> outs = simulator.run(f, 4)
    >>> all(out.tolist() == [6., 10., 14.] for out in outs)   # one result per rank
    True
    >>> simulator.last_trace()                                 # the timeline of the run
    Trace(4 events, world_size=4, seed=0, mode='coop')
    >>> doc = simulator.last_trace().to_chrome("f.json")       # written for Perfetto / chrome://tracing

Failures are reported once: when rank ``r`` raises, the others are released
with :class:`RankFailedError` and ``run`` re-raises rank ``r``'s exception
(its own type and traceback, with ``.rank`` set and a note naming the rank
and the seed).  When several ranks fail independently (only possible in
``mode="threads"``, or when ranks raise before their first operation), ``run``
raises an ``ExceptionGroup`` of them.
"""
from __future__ import annotations

import collections.abc
import contextlib
import math
import os
import queue
import random
import re
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from tensorplay.distributed import state as dist_state
from tensorplay.distributed.state import install_backend
from tensorplay.distributed.errors import DistTypeError, DistValueError, format_message

from simulator.adapters import _environ, installed, torch_native
from simulator.adapters.threads import RankOsExit, join_non_daemon_threads, run_exit_handlers
from simulator.core.backend import SimBackend
from simulator.core.collector import gc_for_world
from simulator.core.errors import RankFailedError, SimError
from simulator.core.faults import Fault, FaultPlan
from simulator.core.hash_seeds import torchrun_defaults
from simulator.core.report import describe_world, held_turn_warning, needs_cuda, per_process_state
from simulator.core.progress import (DEFAULT_STALL_TIMEOUT, PYTHON, BoundNames, check_seconds, check_stall, expire,
                                     poll_interval, watch_turn)
from simulator.core.sched import make_scheduler
from simulator.core.seeds import _initial_rng_states, rank_seed  # noqa: F401  (rank_seed re-exported)
from simulator.core.state import (NUDGE, Incident, RankState, Run, SimGroup, _local,  # noqa: F401  (re-exported)
                                  current_rank_state, rank_device)
from simulator.timing.cost import CostModel, resolve_cost
from simulator.world_ends import exit_error, exit_status, refused_thread, warn_still_running, warn_unmatched_p2p
from simulator.world_devices import check_devices, device_context
from simulator.core.trace import DEFAULT_TRACE_LIMIT, EventLog, Trace
from simulator.isolation import check_isolation, run_processes

__all__ = ["World", "run", "last_trace", "RankState", "Incident", "current_rank_state", "rank_device"]

_last_trace: Trace | None = None


def last_trace() -> Trace | None:
    """The trace of the most recent :func:`run` in this process (``None`` before the first)."""
    return _last_trace


class World:
    """Settings of a simulated world; :meth:`run` executes a function on every rank.

    Args:
        world_size: number of ranks (threads).
        seed: picks the schedule in ``coop`` mode (and seeds each rank's ``random`` module).
        mode: ``"coop"`` (one rank at a time, reproducible) or ``"threads"`` (free-running, faster).
        timeout: an optional bound on the whole run, in seconds (default ``None``: none; ``inf`` too): when it
            runs out, every rank that has not ended is failed with :class:`SimTimeoutError`.
        stall_timeout: the bound on progress, in seconds (default 1800, torch's default process-group timeout):
            the run fails with :class:`SimTimeoutError` when an actor (a rank or a thread it started) waits inside
            an operation and no operation completed, and no rank entered or left a call into the simulator, for
            that long (``inf``: no bound).  A rank that computes while nobody waits for it is never stopped; in
            coop mode a rank waiting for its turn counts as waiting (see :mod:`simulator.core.progress`).
        device: ``"cpu"`` or ``"cuda"`` (ranks share the GPUs round-robin).
        faults: :class:`Crash` / :class:`Delay` objects.
        cost: the :class:`CostModel` for virtual time, or the path of a profile written by ``python -m simulator
            calibrate`` (default: the uncalibrated alpha-beta model).
        compute_scale: multiplies each rank's measured CPU time between operations (overrides the cost
            model's; e.g. 0.1 for a target device ten times faster, 0 for schedule-only virtual time).
        env: extra per-rank environment variables (torchrun-style ``RANK`` & co. are always set while
            ``torchrun_env=True``).
        per_rank_rng: in coop mode, give each rank its own torch, ``random`` and numpy global state (default True).
        stack_size: thread stack size in bytes (default 256 KiB above 64 ranks, else the platform's).
        trace_limit: events the trace keeps (the last ones: a ring buffer); ``None`` keeps all, ``0`` none.
            Per-rank totals (the summary) always cover every event. Default 100,000 (about 30 MB).
        p2p: what a blocking ``send`` waits for: ``"rendezvous"`` (default: until the receiver posted its recv,
            as on gloo and NCCL) or ``"eager"`` (the message is buffered and the send returns at once, like MPI's
            buffered sends; a program that needs this deadlocks on gloo and NCCL).
        isolation: ``"thread"`` (default: ranks are threads of this process) or ``"process"`` (each rank runs
            in its own process with its own ``PYTHONHASHSEED``; see :mod:`simulator.isolation`).
        devices: ``"cpu"`` (default) or ``"cuda"``: each rank sees CUDA devices backed by the CPU
            (:mod:`simulator.standin`), so a program written for GPUs runs unmodified on a machine without one:
            ``torch.cuda.is_available()`` is True, ``set_device``, ``.to(local_rank)``, ``init_process_group("nccl")``
            and ``DDP(device_ids=[r])`` work, and every operator computes on the CPU.
        gpus_per_node: stand-in GPUs per node, ``torch.cuda.device_count()`` on each rank (default: the world
            size); ranks per node for torchrun's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``GROUP_RANK`` too.
        hash_seed: what the rank processes' ``PYTHONHASHSEED`` values derive from (default: ``seed``).  Fix it to
            explore schedules (``seed``) with the same rank interpreters: a new hash seed costs a new warm
            interpreter per rank, seconds each.

    After a run, ``world.trace`` is its trace, ``world.errors[r]`` the exception rank ``r`` raised (or
    ``None``) and ``world.results[r]`` its return value.
    """

    def __init__(self, world_size: int, *, seed: int = 0, mode: str = "coop", timeout: float | None = None,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT, device: str = "cpu", faults: Sequence[Fault] = (),
                 cost: CostModel | str | None = None,
                 env: dict[str, str] | None = None, torchrun_env: bool = False, per_rank_rng: bool = True,
                 stack_size: int | None = None, p2p: str = "rendezvous",
                 trace_limit: int | None = DEFAULT_TRACE_LIMIT, isolation: str = "thread",
                 compute_scale: float | None = None, hash_seed: int | None = None, devices: str = "cpu",
                 gpus_per_node: int | None = None) -> None:
        EventLog(1, trace_limit)  # validates it (a clear error before anything runs)
        self.isolation = check_isolation(isolation)
        #: after a process-isolated run: each rank process's PYTHONHASHSEED
        self.hash_seeds: list[int] = []
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
        whole = check_seconds(timeout, "timeout", example="600")
        stall = check_seconds(stall_timeout, "stall_timeout", example="3600")
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise DistValueError(format_message("simulator.run", "device must be 'cpu' or 'cuda'",
                                                values={"device": device}, fix="pass device='cpu' or 'cuda'"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise DistValueError(format_message("simulator.run", "device='cuda' but no GPU is available",
                                                values={"device": device}, fix="pass device='cpu'"))
        self.devices, self.gpus_per_node = check_devices(devices, gpus_per_node, world_size, dev)
        #: what a rank process runs inside (isolation='process'): the stand-in's devices with devices="cuda"
        self.device_context = device_context(self.devices, self.gpus_per_node)
        if hash_seed is not None and (isinstance(hash_seed, bool) or not isinstance(hash_seed, int)):
            raise DistTypeError(format_message("simulator.run", "hash_seed must be an int or None",
                                               values={"hash_seed": hash_seed}, fix="pass e.g. hash_seed=0"))
        if stack_size is not None and (isinstance(stack_size, bool) or not isinstance(stack_size, int)
                                       or (stack_size != 0 and stack_size < 32 * 1024)):
            raise DistValueError(format_message(  # (threading.stack_size's own error names no call and no fix)
                "simulator.run", "stack_size must be 0 (the platform's) or at least 32 KiB, in bytes",
                values={"stack_size": stack_size}, fix="pass e.g. stack_size=256 * 1024, or leave it out"))
        self.world_size = world_size
        self.seed = seed
        self.hash_seed = seed if hash_seed is None else hash_seed
        self.mode = mode
        #: the bound on the whole run in seconds (None: none) and the bound on progress (inf: none)
        self.timeout: float | None = None if whole == math.inf else whole
        self.stall_timeout = stall
        #: how the caller spells the bounds in its messages (the command line sets its flags here)
        self.bound_names: BoundNames = PYTHON
        self.exit_codes: dict[int, tuple[str, str]] = {}  # a launcher's own exit codes: (what it means, the fix)
        self.device = dev
        self.faults = FaultPlan(list(faults), world_size)
        self.cost = resolve_cost(cost, compute_scale)
        self.env = dict(env or {})
        self.torchrun_env = torchrun_env
        self.per_rank_rng = per_rank_rng
        self.p2p = p2p
        self.trace_limit = trace_limit
        self.stack_size = stack_size if stack_size is not None else (256 * 1024 if world_size > 64 else 0)
        #: after a run: the torch seed each rank started from (the program's own seed when it seeded torch
        #: before the run, else :func:`rank_seed` of the run's seed)
        self.rank_seeds: list[int] = []
        #: where the ranks' torch RNGs start, for processes a launcher started (see simulator.launch_seeds)
        self.rng_origin: tuple | None = None
        #: how to replay a failure, shown in its note (the CLI sets its own command line here)
        self.replay_hint: str | None = None
        #: after a run: the trace, and each rank's exception (None where it returned) and result
        self.trace: Trace | None = None
        self.errors: list[BaseException | None] = []
        self.results: list[Any] = []

    def __repr__(self) -> str:
        return f"World(world_size={self.world_size}, seed={self.seed}, mode={self.mode!r})"

    @property
    def pg_timeout(self) -> float:
        """The timeout the ranks' process groups report, in seconds: the bound on one operation, as in torch
        (``stall_timeout``; a year when it is off, since a process group's timeout is finite)."""
        return self.stall_timeout if self.stall_timeout < math.inf else 365 * 86400.0

    # ---------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        global _last_trace
        _check_arguments(args, kwargs)
        if self.isolation == "process" and current_rank_state() is None and callable(fn):
            return run_processes(self, fn, args, kwargs)
        if not callable(fn):
            raise DistTypeError(format_message("simulator.run", "fn must be callable",
                                               values={"fn": type(fn).__name__}, fix="pass a function"))
        if current_rank_state() is not None:
            raise DistValueError(format_message("simulator.run", "cannot start a simulated world inside a rank",
                                                fix="call simulator.run from the main program, not from a rank"))
        kwargs = dict(kwargs or {})
        run = Run(self, describe_world, make_scheduler(self.mode, self.seed, swap_rng=self.per_rank_rng))
        world_group = SimGroup(0, tuple(range(self.world_size)))
        ndev = torch.cuda.device_count() if self.device.type == "cuda" else 0
        rng_states, self.rank_seeds = _initial_rng_states(self.seed, self.world_size, self.rng_origin)
        for rs in run.ranks:
            rs.backend = SimBackend(rs, world_group)
            rs.faults = self.faults.get(rs.rank)
            rs.torch_rng = rng_states[rs.rank]
            if ndev:
                rs.device = torch.device("cuda", rs.rank % ndev)
            if self.torchrun_env or self.env:
                rs.env = self._rank_env(rs.rank)
        td = timedelta(seconds=self.pg_timeout)
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
        if self.devices == "cuda":  # CUDA devices backed by the CPU, before any adapter or rank asks torch.cuda
            from simulator import standin  # (lazy: the stand-in's import is heavy, and only devices="cuda" needs it)

            adapters.enter_context(standin.enabled(gpus_per_node=self.gpus_per_node))
        adapters.enter_context(installed.enabled())  # torch's own APIs in the ranks run on this world too
        adapters.enter_context(gc_for_world(self.world_size))
        try:
            for i, t in enumerate(threads):
                try:
                    t.start()
                except RuntimeError as e:  # the OS refused a thread: no rank runs, and the run says why
                    refused_thread(run, threads[:i], e)
            run.sched.kick()
            try:
                bound, waiting = _serve(run)
            except KeyboardInterrupt:  # release every rank (a computing one ends with its computation), re-raise
                with run.sched.lock:
                    run.abort(Incident(SimError, format_message("simulator.run", "the run was interrupted",
                                                                fix="none needed: it was stopped on purpose")))
                # a moment for the released ranks to end before the adapters go (a rank still inside torch
                # while the interpreter ends can abort it: "terminate called without an active exception")
                run.all_done.wait(2.0)
                raise
            timeout_exc = None
            if bound is not None:
                timeout_exc = run.abort_bound(bound, waiting)
                timeout_exc.add_note(f"[simulator] the run was stopped (mode={self.mode!r}, seed={self.seed}); "
                                     f"replay with {_replay(self)}")
                run.all_done.wait(2.0)
                warn_still_running(run)
            else:
                for t in threads:
                    t.join(timeout=5.0)
                _let_daemons_end(run)
        finally:
            adapters.close()
            if env_installed:
                _environ.uninstall()
            torch.set_rng_state(saved_torch)
            random.setstate(saved_py)
        trace = Trace(run.events, self.world_size, seed=self.seed, mode=self.mode, cost=self.cost,
                      wall_origin=run.wall_origin, end_vtime=[rs.vt for rs in run.ranks])
        trace.deterministic = run.deterministic  # cleared by a coop rank's time.sleep (threads.py)
        trace.nondeterminism = run.nondeterminism
        self.trace = trace
        self.errors = [rs.exc for rs in run.ranks]
        self.results = [rs.result for rs in run.ranks]
        _last_trace = trace
        self.faults.warn_unfired(run.ranks, run.children)  # a Crash/Delay whose operation never came: say so
        if timeout_exc is None and all(rs.exc is None for rs in run.ranks):
            warn_unmatched_p2p(run)
        if timeout_exc is not None:
            raise timeout_exc
        _raise_failures(self, run.ranks)
        return [rs.result for rs in run.ranks]

    def _rank_env(self, rank: int) -> dict[str, str]:
        real = os.environ._real if isinstance(os.environ, _environ.RankEnviron) else os.environ  # type: ignore[attr-defined]
        env = dict(real)
        if self.torchrun_env:
            n = str(self.world_size)
            per_node = self.gpus_per_node  # ranks per node: torchrun's --nproc-per-node on each node
            nodes = -(-self.world_size // per_node)
            env.update({"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": n,
                        "LOCAL_WORLD_SIZE": str(min(per_node, self.world_size - rank // per_node * per_node)),
                        "GROUP_RANK": str(rank // per_node), "GROUP_WORLD_SIZE": str(nodes),
                        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": n,
                        "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                        "TORCHELASTIC_RUN_ID": "simulator", "TORCHELASTIC_RESTART_COUNT": "0",
                        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
            env.update(torchrun_defaults(real, self.world_size))
        env.update(self.env)
        return env


#: how long the end of a run waits, in all, for the daemon threads its ranks started
DAEMON_GRACE_S = 1.0


def _let_daemons_end(run: Run) -> None:
    """A process's daemon threads end with it.  A rank's cannot be stopped, so the run gives those still going a
    moment (bounded) to end on their own before the launcher reports the rank's exit: a thread that was told to
    stop just before the rank ended (torch's test harness signals its pipe listener, then joins it; a rank released
    from that join by another rank's failure leaves it running) must not see what the parent does next (closing its
    end of the pipe: an ``EOFError`` in the listener, whose traceback pytest formats on that thread)."""
    deadline = time.monotonic() + DAEMON_GRACE_S
    for child in run.children:
        t = child.thread  # (None, or a stand-in never started, for a thread of a rank process)
        left = deadline - time.monotonic()
        if left <= 0:
            return
        if t is not None and t.is_alive():
            t.join(timeout=left)


def _serve(run: Run) -> tuple[str | None, list[RankState] | None]:
    """Main thread: run offloaded kernels and watch the bounds until every rank exited.

    Returns ``(None, None)`` when the world ended, ``("timeout", None)`` when the whole-run bound ran out, or
    ``("stall", waiting)`` when actors wait and nothing progressed for ``stall_timeout`` (see
    :mod:`simulator.core.progress`).  Every wait here is a short slice, bound or no bound.
    """
    poll = poll_interval(run)
    clock = run.clock
    while True:
        now = clock()
        if now >= run.deadline:
            return (None, None) if run.all_done.is_set() else ("timeout", None)
        waiting = check_stall(run, now)
        if waiting is not None:
            return (None, None) if run.all_done.is_set() else ("stall", waiting)
        nearest = expire(run, now) if run.deadlines else math.inf  # operations' own timeouts
        if run.sched.baton:
            held = watch_turn(run, now)
            if held is not None:
                print(held_turn_warning(*held), file=sys.stderr, flush=True)
        try:
            job = run.jobs.get(timeout=max(0.001, min(run.deadline - now, poll, nearest)))
        except queue.Empty:
            continue
        if job is None:
            return None, None
        if job is NUDGE:
            continue
        run.job_since = clock()  # a kernel running here is progress (its rank waits for it)
        try:
            job()
        finally:
            run.progress_seen = clock()
            run.job_since = None
            job = None  # (its closure holds the collective's tensors: they must not outlive it until the next job)


def _rank_main(rs: RankState, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
               td: timedelta) -> None:
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
        install_backend(rs.backend, td, thread_local=True)
        rs.cpu_mark = time.thread_time()
        with torch_native.rank_thread():
            try:
                rs.result = fn(*args, **kwargs)
            finally:
                ending = sys.exc_info()[1]
                if ending is None or (isinstance(ending, SystemExit) and not isinstance(ending, RankOsExit)
                                      and ending.code in (None, 0)):
                    join_non_daemon_threads(rs)  # (the interpreter's own wait, before its exit handlers)
                if not isinstance(ending, RankOsExit):  # (os._exit skips them, as in a process)
                    run_exit_handlers(rs)
    except SystemExit as e:
        if exit_status(e.code) not in (None, 0):  # a process that exits non-zero has failed; 0 is a normal return
            exc = exit_error(rs, e)
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
        dist_state.unbind_thread()
        if rs.env is not None:
            _environ.unbind()
        _local.rs = None
        for hook in run.exit_hooks:  # e.g. the RPC transport's barriers (a rank ended)
            hook(rs)
        sched.exit(rs)


def _replay(world: World) -> str:
    """How to replay this world's run: the caller's own command (``replay_hint``), else the ``simulator.run`` call;
    a ``simulator.run`` call gets the run's bounds when they are not the defaults."""
    bounds = "" if world.timeout is None else f", timeout={world.timeout:g}"
    if world.stall_timeout != DEFAULT_STALL_TIMEOUT:
        stall = f"{world.stall_timeout:g}" if world.stall_timeout < math.inf else "None"
        bounds += f", stall_timeout={stall}"
    hint = world.replay_hint
    if not hint:
        return f"simulator.run(fn, {world.world_size}, seed={world.seed}, mode={world.mode!r}{bounds})"
    if hint.startswith("simulator.run(") and hint.endswith(")") and "timeout=" not in hint:  # e.g. isolation's
        return hint[:-1] + bounds + ")"
    return hint


def _annotate(exc: BaseException, rank: int, world: World) -> BaseException:
    try:
        exc.rank = rank  # type: ignore[attr-defined]
    except Exception:  # pragma: no cover
        pass
    replay = _replay(world)
    torch_seed = f", torch seed {world.rank_seeds[rank]}" if 0 <= rank < len(world.rank_seeds) else ""
    note = (f"[simulator] raised on rank {rank} of {world.world_size} (mode={world.mode!r}, seed={world.seed}"
            f"{torch_seed}); "
            f"replay with {replay}")
    if world.devices == "cpu" and needs_cuda(exc) and not torch.cuda.is_available():
        knob = "--devices cuda" if world.bound_names is not PYTHON else "devices='cuda'"
        note += (f"\n[simulator] the program uses CUDA and this machine has no GPU: pass {knob} to give each rank "
                 f"CUDA devices backed by the CPU (the program runs unmodified)")
    if world.isolation == "thread" and per_process_state(exc):
        knob = "--isolation process" if world.bound_names is not PYTHON else "isolation='process'"
        note += (f"\n[simulator] this looks like state a real process keeps for itself, shared here by rank threads "
                 f"of one process: run with {knob} (each rank its own interpreter, as under torchrun)")
    if world.trace is not None and not world.trace.deterministic:
        note += (f" (the seed replays the schedule only up to the first wait on the wall clock: "
                 f"{world.trace.nondeterminism})")
    if note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)
    return exc


def _own_number(text: str, rank: int) -> str:
    """``text`` with the rank's own number masked where a value names it ("rank 1", "rank=1", "dst=1")."""
    return re.sub(rf"(?:(?<==)|(?<=rank )){rank}(?!\w|\.\d)", "<r>", text)


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
    # same bad argument on every rank: "rank=1", or "dst=1" for a send to itself) report it once, as the lowest
    # rank's own exception: that is what each real process would raise
    same = len({(type(rs.exc), _own_number(str(rs.exc), rs.rank)) for rs in firsts}) == 1
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


def _check_arguments(args: Any, kwargs: Any) -> None:
    """``args`` a sequence and ``kwargs`` a dict, before any rank starts (each rank unpacks them)."""
    if isinstance(args, (str, bytes)) or not isinstance(args, collections.abc.Sequence):
        plain = isinstance(args, (int, float, str))
        raise DistTypeError(format_message(
            "simulator.run", "args must be a tuple (or list) of fn's positional arguments",
            values={"args": args if plain else type(args).__name__},
            fix=f"pass args=({args!r},) for a single argument" if plain else "pass args=(a, b): each rank calls "
                "fn(*args)"))
    if kwargs is not None and not isinstance(kwargs, dict):
        raise DistTypeError(format_message(
            "simulator.run", "kwargs must be a dict of fn's keyword arguments",
            values={"kwargs": type(kwargs).__name__}, fix="pass kwargs={'name': value}"))


def run(fn: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
        seed: int = 0, mode: str = "coop", timeout: float | None = None,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT, device: str = "cpu",
        faults: Sequence[Fault] = (), cost: CostModel | str | None = None, env: dict[str, str] | None = None,
        torchrun_env: bool = False, per_rank_rng: bool = True, stack_size: int | None = None,
        p2p: str = "rendezvous", trace_limit: int | None = DEFAULT_TRACE_LIMIT,
        isolation: str = "thread", compute_scale: float | None = None, hash_seed: int | None = None,
        devices: str = "cpu", gpus_per_node: int | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` simulated ranks; return the results in rank order.

    Each rank is a thread with tensorplay.distributed initialised on ``"sim"``
    (``init_process_group()`` inside is allowed and returns at once).  The
    trace of the run is available afterwards from :func:`last_trace`.  The
    keywords are :class:`World`'s: a deadlock is reported at once; a rank that
    never comes back while others wait for it, after ``stall_timeout`` seconds
    without progress (default 1800, torch's default process-group timeout);
    ``timeout=`` (default none) bounds the whole run.

    Example::

        >>> def f():
        ...     x = tp.arange(3.) + dist.get_rank()
        ...     dist.all_reduce(x)
        ...     return x
        >>> simulator.run(f, 4)                    # the results in rank order
        [tensor([ 6., 10., 14.]), tensor([ 6., 10., 14.]), tensor([ 6., 10., 14.]), tensor([ 6., 10., 14.])]
        >>> simulator.run(f, 4, mode="threads")[3]   # the same result, ranks run freely
        tensor([ 6., 10., 14.])

    With ``isolation="process"``, ``fn`` travels to the rank processes by name, so it must be
    importable: a module-level function of a module, not one defined in a notebook, ``python -c``
    or a doctest.

    Example (each rank its own process)::

        >>> simulator.run(dist.get_rank, 4, isolation="process")
        [0, 1, 2, 3]
    """
    w = World(world_size, seed=seed, mode=mode, timeout=timeout, stall_timeout=stall_timeout, device=device,
              faults=faults, cost=cost,
              env=env, torchrun_env=torchrun_env, per_rank_rng=per_rank_rng, stack_size=stack_size, p2p=p2p,
              trace_limit=trace_limit, isolation=isolation, compute_scale=compute_scale, hash_seed=hash_seed,
              devices=devices, gpus_per_node=gpus_per_node)
    return w.run(fn, args, kwargs)
