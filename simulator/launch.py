"""Scripts that start their own ranks (``torch.multiprocessing.spawn``, ``multiprocessing.Process``, and torch's
elastic agent called from Python: :mod:`simulator.launch_elastic`).

Most PyTorch tutorials are *launchers*: the script's main process starts N
processes itself, each of which joins a process group::

    def run(rank, world_size):
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        ...

    if __name__ == "__main__":
        mp.spawn(run, args=(4,), nprocs=4, join=True)

:func:`launch` runs such a script (or a launcher function) unmodified in the
calling thread, with the launch APIs patched: every process the launcher
starts becomes a simulated rank instead (rank ``i`` = the ``i``-th process
started, so ``fn(i, ...)`` of ``spawn`` runs on rank ``i``).  The ranks started
before the launcher first waits for one of them (``join``, ``is_alive``,
``exitcode``, ``sentinel``, ``ProcessContext.join``) form one simulated world,
which runs to completion inside that wait; processes started later form the
next world.  Ranks still pending when the launcher returns run then, as
Python joins non-daemon children at exit.

What the launcher sees is what a real run shows: ``Process.exitcode`` is 0, 1
when the rank raised, or the ``sys.exit`` code; ``spawn`` raises torch's own
``ProcessRaisedException`` (the rank's traceback in the message) or
``ProcessExitedException``.  Each rank gets its own copy of the arguments
(tensors are shared, as torch's multiprocessing shares them, except tensors
not in shared memory under the ``fork`` start method, which are copied like
the rest) and its own ``os.environ``, a copy of the launcher's.

Example (the Python API; the command line is ``python -m simulator script.py``)::

    from simulator.launch import launch

    worlds = launch("ddp_tutorial.py", argv=["--epochs", "1"], seed=3)
    worlds[0].trace.format_summary()

Inside a simulated rank, starting more ranks (``spawn``, or a ``Process``
whose target is the script's own code) is refused with
:class:`LaunchStyleError`; library processes (``DataLoader`` workers, pools)
are started for real.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.process as mp_process
import os
import shlex
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d
import torch.distributed.launcher.api as launcher_api
import torch.multiprocessing as tmp

import tensorplay.distributed as tpd
import tensorplay.distributed.api as tpd_api
from tensorplay.distributed.errors import format_message

from simulator.adapters import os_waits, per_rank_streams
from simulator.adapters.per_rank_main import Program, run_as_main
from simulator.core.errors import SimError
from simulator.core.progress import DEFAULT_STALL_TIMEOUT, PYTHON, BoundNames
from simulator.core.tracebacks import format_rank_traceback
from simulator.isolation import launched
from simulator.isolation.launched import exit_status as _exit_status
from simulator.launch_seeds import SeedWatch
# (the processes it starts: which become ranks, their arguments' copies, the Popen standing in for a rank)
from simulator.launch_processes import (SimProcessContext, _copy_for_rank, _fake_pid_base, _Held, _is_user_process,
                                        _launcher_timeout, _no_trigger, _print_failure, _SimPopen, _sim_popen,
                                        _start_method, continuous_worker_refusal)
from simulator.world import World, current_rank_state

__all__ = ["launch", "LaunchStyleError", "patched", "format_rank_traceback"]  # (the last from core.tracebacks)


#: torch's backends whose group lives in one process (its test harness's: a FakeStore group, MultiThreadedTestCase's)
_ONE_PROCESS_BACKENDS = ("fake", "threaded")


def _alone(a: tuple, k: dict) -> bool:
    """An ``init_process_group(*a, **k)`` that meets no other process: a one-process backend, or a world of one."""
    backend = k.get("backend", a[0] if a else None)
    world_size = k.get("world_size", a[3] if len(a) > 3 else -1)
    return str(backend).lower() in _ONE_PROCESS_BACKENDS or world_size == 1


class LaunchStyleError(SimError):
    """The script starts ranks in a way the current run cannot simulate (the message says how to run it)."""


# ---------------------------------------------------------------------------
# the launcher: the processes it started, run as simulated worlds
# ---------------------------------------------------------------------------
def _rank_entry(procs: list[mp_process.BaseProcess], clean_codes: frozenset[int], background: bool = False) -> None:
    """Body of every rank of a launched world: run the process the launcher started as this rank (``background``:
    while the launcher waits on something else, which a failure's traceback is printed for at once)."""
    rs = current_rank_state()
    proc = procs[rs.rank]  # type: ignore[union-attr]
    popen = _sim_popen(proc)
    assert popen is not None  # noqa: S101  (internal invariant: only simulated processes are in a batch)
    try:
        proc.run()
    except SystemExit as e:
        popen.returncode = _exit_status(e.code)
        if popen.returncode != 0 and popen.returncode not in clean_codes:
            popen.exited = True
            raise  # a non-zero exit is a rank failure, as under torchrun
        return
    except BaseException as e:  # noqa: BLE001  recorded for the launcher, then reported by the world
        popen.returncode = 1
        popen.exc = e
        if background:
            _print_failure(proc)
        raise
    popen.returncode = 0


class _Launcher:
    """One launcher run: the processes it started that have not run yet, and the worlds that ran."""

    def __init__(self, *, seed: int, mode: str, timeout: float | None, device: str, replay_hint: str | None,
                 p2p: str = "rendezvous", stall_timeout: float = DEFAULT_STALL_TIMEOUT,
                 bound_names: BoundNames = PYTHON, isolation: str = "thread",
                 clean_exit_codes: frozenset[int] = frozenset()) -> None:
        self.seed = seed
        self.p2p = p2p
        self.mode = mode
        self.timeout = timeout
        self.stall_timeout = stall_timeout
        self.bound_names = bound_names  # how reports name the bounds (the command line: its flags)
        self.device = device
        #: "thread": a started process is a thread of this process; "process": a rank process of its own
        self.isolation = isolation
        #: exit codes after which the other ranks go on (a launcher's "skipped"; e.g. torch harness's TEST_SKIPS)
        self.clean_exit_codes = clean_exit_codes
        #: exit codes of the launcher's own protocol: what each means and the fix (see World.exit_codes)
        self.exit_codes: dict[int, tuple[str, str]] = {}
        #: the worlds' CUDA stand-in (World's devices= and gpus_per_node=; the command line sets them)
        self.devices = "cpu"
        self.gpus_per_node: int | None = None
        #: the count was not chosen: a world of more ranks than GPUs gets a GPU per rank (a script that starts N
        #: processes and puts rank r on cuda:r was written for a machine of at least N GPUs)
        self.gpus_follow_ranks = False
        #: rank processes keep torch's own RPC agent (TensorPipe) rather than the simulator's: torch's RPC test
        #: fixtures test that agent itself (set by simulator.torch_harness)
        self.own_torch_rpc = False
        #: () -> what each rank starts with of its own (World.rank_start), asked as each world starts; None: the
        #: launcher's own process state (set by simulator.torch_harness: a test runner's filters are its own)
        self.rank_start: Callable[[], dict] | None = None
        self.seeds: SeedWatch | None = None  # where the script seeded torch (a launcher script only)
        self.replay_hint = replay_hint
        self.pending: list[mp_process.BaseProcess] = []
        self.worlds: list[World] = []
        self.failures: list[BaseException] = []  # per world that failed: what World.run raised
        self.failure_of: dict[int, BaseException] = {}  # id(world) -> what its run raised
        self.fds: list[int] = []
        self.thread = threading.current_thread()
        self.lock = threading.Lock()  # the pending processes
        self.run_lock = threading.Lock()  # held while a world runs (released by the thread that ran it)
        self.background: threading.Thread | None = None  # the thread of the last world run in the background
        self.unstarted: BaseException | None = None  # why the last world that could not start its ranks failed
        self.held = _Held()  # what stays installed until the launcher ends (finish)
        self.ended = 0.0  # when the last world ended (monotonic): a launcher's wait after it is bounded by timeout
        self.next_pid = _fake_pid_base()

    def add(self, proc: mp_process.BaseProcess) -> None:
        with self.lock:
            proc._popen = _SimPopen(self, self.next_pid)  # type: ignore[attr-defined]
            self.next_pid += 1
            proc._sentinel = None  # type: ignore[attr-defined]  # close() deletes it; the property makes one
            if self.isolation == "thread":  # (a rank process gets its own copy as a spawned child does: pickled)
                method = _start_method(proc)
                # a child gets the arguments as they were at start(), in its own copy
                proc._args, proc._kwargs = _copy_for_rank(proc._args, proc._kwargs, method)  # type: ignore[attr-defined]
            self.pending.append(proc)

    def cancel(self, popen: _SimPopen) -> bool:
        with self.lock:
            for i, p in enumerate(self.pending):
                if p._popen is popen:  # type: ignore[attr-defined]
                    del self.pending[i]
                    return True
        return False

    def run_pending(self, popen: _SimPopen | None = None, background: bool = False) -> None:
        """Run the processes started so far as one simulated world (waits end up here), to its end; with
        ``background``, on a thread of its own while the launcher goes on (it is about to wait for them in
        another way: a queue, a pipe, an event), the world a later wait waits for."""
        if current_rank_state() is not None:
            raise LaunchStyleError(format_message(
                "simulator.launch", "a simulated rank waited for a process that the launcher started",
                rank=current_rank_state().rank,  # type: ignore[union-attr]
                fix="join/wait for the launched processes in the launcher (the script's main code), not in a rank"))
        if background:
            if not self.run_lock.acquire(blocking=False):
                return  # (one world at a time: the next starts when the launcher waits for its processes)
            with self.lock:
                batch, self.pending = self.pending, []
                world = self._world(batch) if batch else None
            if world is None:
                self.run_lock.release()
                return
            if not self.held:
                # the launcher prints while a world ends in the background: the ranks' own streams stay installed
                # until the launcher ends, so its print never meets them half removed
                self.held.enter_context(per_rank_streams.enabled())
            self.background = threading.Thread(target=self._run, args=(world, batch, True), daemon=True,
                                               name="tensorplay-sim-launched-world")
            self.background.start()
            return
        with self.run_lock:  # (a world in the background ends first, as its processes would)
            with self.lock:
                if popen is not None and popen.returncode is not None:
                    return
                batch, self.pending = self.pending, []
                if not batch:
                    return
                world = self._world(batch)
            self._run(world, batch)

    def waits(self, since: float) -> bool:
        """The launcher is blocked (since ``since``, monotonic) on a queue, pipe, event or lock its ranks may answer:
        the pending ranks start in the background (once the world running there ends); a world that could not
        start its ranks fails the wait (nothing would answer), and so does ``timeout`` once every world ended.
        True: call again after a slice of the wait (os_waits.launcher_wait)."""
        self.run_pending(background=True)
        if self.unstarted is not None:
            raise self.unstarted
        running = self.background
        if (running is not None and running.is_alive()) or self.pending:
            return True
        if self.timeout is None or self.timeout == float("inf") or not self.worlds:
            return False
        waited = time.monotonic() - max(since, self.ended)
        if waited < self.timeout:
            return True
        raise _launcher_timeout(waited, self.timeout, self.bound_names.timeout, self.failures)

    def in_background(self, popen: _SimPopen) -> bool:
        """Whether ``popen``'s world is running in the background now (its process is alive)."""
        running = self.background
        return running is not None and running.is_alive() and popen.world is not None and popen.returncode is None

    def _world(self, batch: list[mp_process.BaseProcess]) -> World:
        gpus = self.gpus_per_node
        if self.devices == "cuda" and self.gpus_follow_ranks and gpus is not None and len(batch) > gpus:
            gpus = len(batch)
            print(f"simulator: --devices cuda: the program started {gpus} processes, so its ranks see {gpus} "
                  f"stand-in GPUs each (pass --gpus-per-node N to choose)", file=sys.stderr, flush=True)
        world = World(len(batch), seed=self.seed, mode=self.mode, timeout=self.timeout,
                      stall_timeout=self.stall_timeout, device=self.device, devices=self.devices,
                      gpus_per_node=gpus, env=dict(os.environ), p2p=self.p2p,
                      isolation=self.isolation)  # each rank: its own copy of the launcher's environment
        world.bound_names = self.bound_names
        world.exit_codes = self.exit_codes
        world.own_torch_rpc = self.own_torch_rpc
        if self.rank_start is not None:
            world.rank_start = self.rank_start()
        if self.seeds is not None:  # (a script: where its children's torch RNGs start)
            world.rng_origin = self.seeds.origin(_start_method(batch[0]), len(self.worlds))
        world.launched = True  # ranks for processes the program started (adapters.started_processes)
        # a fork child never runs the script's top-level code again (its functions travel by value), and the
        # elastic agent's command workers are subprocesses: neither imports the launcher's script
        world.import_main = not (_start_method(batch[0]) == "fork"
                                 or all(getattr(p, "_sim_own_program", False) for p in batch))
        if self.replay_hint and hasattr(world, "replay_hint"):
            world.replay_hint = self.replay_hint  # type: ignore[attr-defined]
        for r, p in enumerate(batch):
            p._popen.rank, p._popen.world = r, world  # type: ignore[attr-defined]
        world.rank_pids = [p.pid for p in batch]  # os.getpid() on rank r (simulator/adapters/threads.py)
        self.worlds.append(world)
        return world

    def _run(self, world: World, batch: list[mp_process.BaseProcess], release: bool = False) -> None:
        try:
            self._run_world(world, batch, release)
        finally:
            self.ended = time.monotonic()
            if release:  # (the background thread holds the run lock for the launcher)
                self.run_lock.release()

    def _run_world(self, world: World, batch: list[mp_process.BaseProcess], background: bool) -> None:
        hook = sys.excepthook
        try:
            if self.isolation == "process":
                launched.run_batch(world, batch, self.clean_exit_codes)
            else:
                world.run(_rank_entry, args=(batch, self.clean_exit_codes, background))
        except BaseException as e:  # noqa: BLE001  delivered as exit codes (and by spawn as torch's errors)
            if isinstance(e, KeyboardInterrupt):
                raise
            self.failures.append(e)
            self.failure_of[id(world)] = e
            if not world.errors:  # (no rank ran: e.g. an argument that cannot reach a rank process)
                self.unstarted = e
        finally:
            sys.excepthook = hook  # torch's init_process_group wraps it once per rank
        for r, p in enumerate(batch):
            po = p._popen  # type: ignore[attr-defined]
            if po.returncode is None:  # released by another rank's failure, or never got to run
                po.returncode = 1  # (a world that failed to start has no errors of its ranks: its own)
                po.exc = world.errors[r] if r < len(world.errors) else self.failure_of.get(id(world))
                if background and self.isolation == "process" and r < len(world.errors):
                    _print_failure(p)  # (a rank process's failure is known here, as its world ends)

    def finish(self) -> None:
        """The launcher ended: run what is still pending (Python joins children at exit), free descriptors."""
        try:
            self.run_pending()
        finally:
            self.held.close()
            for fd in self.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.fds.clear()


# ---------------------------------------------------------------------------
# torch.multiprocessing.spawn / start_processes
# ---------------------------------------------------------------------------
def _start_processes(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1, join: bool = True,
                     daemon: bool = False, start_method: str = "spawn") -> SimProcessContext | None:
    ctx = multiprocessing.get_context(start_method)
    procs = [ctx.Process(target=fn, args=(i, *tuple(args)), daemon=daemon) for i in range(nprocs)]
    for p in procs:
        p._sim_rank_process = True  # type: ignore[attr-defined]  # every spawned process is a rank
        p.start()  # the patched start: refused inside a rank, a pending rank in the launcher
    context = SimProcessContext(procs)
    if not join:
        return context
    while not context.join():
        pass
    return None


def _spawn(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1, join: bool = True,
           daemon: bool = False, start_method: str = "spawn") -> SimProcessContext | None:
    return _start_processes(fn, args, nprocs, join, daemon, start_method="spawn")  # (torch's spawn: always spawn)


# ---------------------------------------------------------------------------
# the patches
# ---------------------------------------------------------------------------
_active: "_Patches | None" = None
_patch_lock = threading.Lock()


class _Patches:
    """The launch APIs while a launcher (``launcher`` set) or a torchrun-style run (``launcher=None``) runs."""

    def __init__(self, launcher: _Launcher | None, hint: str) -> None:
        self.launcher, self.hint = launcher, hint  # (hint: how to run this script the other way, for refusals)
        self.saved: list[tuple[Any, str, Any]] = []

    # -- the refusals ------------------------------------------------------------
    def refuse_in_rank(self, call: str) -> None:
        rs = current_rank_state()
        if rs is None:
            return
        if self.launcher is None:
            problem = (f"{call} was called on a simulated thread rank (the script was run torchrun-style, every "
                       f"rank running the whole script, because --nproc-per-node was given): a thread rank cannot "
                       f"start a process of its own")
            fix = (f"if the process is a helper of the rank (a producer, a server), run with --isolation process, "
                   f"where each rank is a real process and starts its own; if the script starts its ranks itself, "
                   f"run it as a launcher, without --nproc-per-node: {self.hint}")
        else:
            problem = f"{call} was called inside a simulated rank: a rank cannot start more ranks"
            fix = "start every rank from the launcher (the script's main code)"
        raise LaunchStyleError(format_message("simulator.launch", problem, rank=rs.rank, fix=fix))

    def refuse_init_in_launcher(self, call: str) -> None:
        if self.launcher is None or current_rank_state() is not None:
            return
        raise LaunchStyleError(format_message(
            "simulator.launch",
            f"{call} was called by the launcher (the script's main code, outside any rank it started): without "
            f"--nproc-per-node `python -m simulator` runs a script once as a launcher, and only the processes it "
            f"starts with torch.multiprocessing.spawn or multiprocessing.Process are simulated ranks",
            fix=f"this looks like a torchrun-style script: run it with N ranks as {self.hint}"))

    # -- installing ---------------------------------------------------------
    def _set(self, owner: Any, name: str, value: Any) -> None:
        self.saved.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, value)

    def install(self) -> None:
        patches = self
        spawn_mod = sys.modules["torch.multiprocessing.spawn"]
        orig_start = mp_process.BaseProcess.start
        orig_repr = mp_process.BaseProcess.__repr__
        orig_sentinel = mp_process.BaseProcess.__dict__["sentinel"]

        def start(proc: mp_process.BaseProcess) -> None:
            if not (getattr(proc, "_sim_rank_process", False) or _is_user_process(proc)):
                return orig_start(proc)
            patches.refuse_in_rank(f"multiprocessing {type(proc).__name__}.start()")
            if patches.launcher is None:
                return orig_start(proc)
            if (refusal := continuous_worker_refusal(proc)) is not None:
                raise LaunchStyleError(refusal)
            proc._check_closed()  # type: ignore[attr-defined]
            if proc._popen is not None:  # type: ignore[attr-defined]
                raise AssertionError("cannot start a process twice")  # multiprocessing's own message
            patches.launcher.add(proc)

        def repr_(proc: mp_process.BaseProcess) -> str:
            _no_trigger.on = True  # printing a process is no reason to start its world
            try:
                return orig_repr(proc)
            finally:
                _no_trigger.on = False

        def sentinel(proc: mp_process.BaseProcess) -> Any:
            popen = _sim_popen(proc)
            if popen is None:
                return orig_sentinel.__get__(proc)
            proc._check_closed()  # type: ignore[attr-defined]
            return popen.sentinel()

        def spawn(*a: Any, **k: Any) -> Any:
            patches.refuse_in_rank("torch.multiprocessing.spawn")
            if patches.launcher is None:
                return patches.orig_spawn(*a, **k)
            return _spawn(*a, **k)

        def start_processes(*a: Any, **k: Any) -> Any:
            patches.refuse_in_rank("torch.multiprocessing.start_processes")
            if patches.launcher is None:
                return patches.orig_start_processes(*a, **k)
            return _start_processes(*a, **k)

        self.orig_spawn = spawn_mod.spawn
        self.orig_start_processes = spawn_mod.start_processes
        self._set(mp_process.BaseProcess, "start", start)
        self._set(mp_process.BaseProcess, "__repr__", repr_)
        self._set(mp_process.BaseProcess, "sentinel", property(sentinel))
        for owner in (spawn_mod, tmp):
            self._set(owner, "spawn", spawn)
            self._set(owner, "start_processes", start_processes)
        from simulator import launch_elastic  # (in-function: it imports torch's elastic agent, launchers only)

        def launch_agent(*a: Any, **k: Any) -> Any:  # elastic_launch(...)(...) and torch.distributed.run.run
            patches.refuse_in_rank("torch.distributed.launcher.api.launch_agent")
            if patches.launcher is None:
                return orig_launch_agent(*a, **k)
            return launch_elastic.launch_agent(patches.launcher, *a, **k)

        orig_launch_agent = launcher_api.launch_agent
        self._set(launcher_api, "launch_agent", launch_agent)
        if self.launcher is None:
            return
        # the launcher itself must not join a process group: that would wait for peers that never come
        orig_init = c10d.init_process_group
        orig_tp_init = tpd_api.init_process_group

        def init_process_group(*a: Any, **k: Any) -> Any:
            if not _alone(a, k):
                patches.refuse_init_in_launcher("torch.distributed.init_process_group")
            return orig_init(*a, **k)

        def tp_init_process_group(*a: Any, **k: Any) -> Any:
            if not _alone(a, k):
                patches.refuse_init_in_launcher("tensorplay.distributed.init_process_group")
            return orig_tp_init(*a, **k)

        for owner in (c10d, tdist):
            self._set(owner, "init_process_group", init_process_group)
        for owner in (tpd, tpd_api):
            self._set(owner, "init_process_group", tp_init_process_group)
        # and the rendezvous, which torch's own modules reach through names bound before this patch
        handlers = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
        for scheme, handler in list(handlers.items()):
            def guarded(url: str, *a: Any, _h: Any = handler, _s: str = scheme, **k: Any) -> Any:
                patches.refuse_init_in_launcher(f"the {_s}:// rendezvous of init_process_group")
                return _h(url, *a, **k)

            self.saved.append((handlers, scheme, handler))
            handlers[scheme] = guarded
        # the launcher about to wait on a queue, pipe or event its ranks may fill: they start running meanwhile
        launcher = self.launcher
        os_waits.install()
        self._set(os_waits, "launcher_wait", launcher.waits)
        self.waits = True

    def uninstall(self) -> None:
        for owner, name, value in reversed(self.saved):
            if isinstance(owner, dict):
                owner[name] = value
            else:
                setattr(owner, name, value)
        self.saved.clear()
        if getattr(self, "waits", False):
            self.waits = False
            os_waits.uninstall()


@contextlib.contextmanager
def patched(launcher: _Launcher | None = None, *, hint: str = "python -m simulator script.py") -> Iterator[None]:
    """Patch the launch APIs for the duration of a launcher run (``launcher``) or a torchrun-style run (None).

    In a torchrun-style run, ``spawn`` and script-defined processes are refused
    on the ranks with :class:`LaunchStyleError` naming ``hint``, the command
    that runs the script as a launcher instead.
    """
    global _active
    with _patch_lock:
        if _active is not None:
            raise LaunchStyleError(format_message(
                "simulator.launch", "a launcher run is already in progress in this process",
                fix="run one launcher at a time"))
        p = _Patches(launcher, hint)
        p.install()
        _active = p
    try:
        yield
    finally:
        with _patch_lock:
            p.uninstall()
            _active = None


# ---------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------
def launch(target: str | os.PathLike[str] | Callable[..., Any], *, args: Sequence[Any] = (),
           argv: Sequence[str] = (), seed: int = 0, mode: str = "coop", timeout: float | None = None,
           stall_timeout: float = DEFAULT_STALL_TIMEOUT, device: str = "cpu",
           replay_hint: str | None = None) -> list[World]:
    """Run a launcher with its ranks simulated; return the worlds that ran, in order.

    Args:
        target: a script path (run as ``__main__`` with ``sys.argv = [path, *argv]``, its folder first on
            ``sys.path``, as ``python script.py`` would) or a callable (called as ``target(*args)``).
        args: arguments of a callable ``target``.
        argv: command-line arguments of a script ``target``.
        seed, mode, timeout, stall_timeout, device: settings of every world (see :class:`simulator.World`);
            ``timeout`` (default none) bounds each world's whole run and ``stall_timeout`` (default 1800 s, torch's
            default process-group timeout) each world's waits without progress, not the launcher's own code.
        replay_hint: the command that replays a failure, shown in rank failures instead of the
            ``simulator.run`` hint (where :class:`World` supports it).

    Raises:
        whatever the launcher raised (e.g. torch's ``ProcessRaisedException`` from ``spawn``), re-raised after
        pending ranks ran; else, when a rank failed and the launcher carried on, what the first failed world
        raised (the rank's exception, with ``.rank``), so a rank failure never goes unnoticed.
    """
    World(1, seed=seed, mode=mode, timeout=timeout, stall_timeout=stall_timeout, device=device)  # checked first
    launcher = _Launcher(seed=seed, mode=mode, timeout=timeout, stall_timeout=stall_timeout, device=device,
                         replay_hint=replay_hint)
    other = "python -m simulator --nproc-per-node N " + (
        shlex.join([os.fspath(target), *argv]) if not callable(target) else "script.py")
    exc = _execute(launcher, target if callable(target) else Program(os.fspath(target)), args, argv,
                   other_style=other)
    if exc is not None:
        raise exc
    return launcher.worlds


def _execute(launcher: _Launcher, target: Any, args: Sequence[Any], argv: Sequence[str], *,
             other_style: str) -> BaseException | None:
    """Run the launcher; return what :func:`launch` raises (None on success). ``launcher.worlds`` holds the runs.

    ``other_style`` is the torchrun-style command named when the launcher itself initialises a process group.
    """
    default_ctx = multiprocessing.context._default_context  # type: ignore[attr-defined]
    saved_method = getattr(default_ctx, "_actual_context", None)
    hook = sys.excepthook
    own_exc: BaseException | None = None
    try:
        with patched(launcher, hint=other_style):
            try:
                if callable(target):
                    target(*args)
                else:  # a Program: python -m simulator's launcher-style script or module
                    def watch(path: str) -> SeedWatch:
                        launcher.seeds = SeedWatch(path)
                        return launcher.seeds

                    run_as_main(target, argv, watch)
            except BaseException as e:  # noqa: BLE001  returned below, after the pending ranks ran
                if isinstance(e, KeyboardInterrupt):
                    raise
                own_exc = e
            launcher.finish()
    finally:
        sys.excepthook = hook
        if hasattr(default_ctx, "_actual_context"):
            default_ctx._actual_context = saved_method  # set_start_method() belongs to this launcher run
    if own_exc is not None and not (isinstance(own_exc, SystemExit) and own_exc.code in (None, 0)):
        return own_exc
    if launcher.failures:
        return launcher.failures[0]
    return None
