"""Threads a simulated rank starts belong to that rank, as threads of a real rank process do.

A rank that starts a ``threading.Thread`` (a communication thread overlapping
compute, a background all_reduce, a ``ThreadPoolExecutor`` worker) expects the
thread to see the rank's process group: on gloo every thread of the process
does.  While a simulated world runs, :func:`enabled` makes a thread started by a
rank inherit that rank's state (tensorplay's process group, torch's c10d state,
the rank's environment and device) and gives it an actor of its own in the
scheduler (``RankState.child``), so its operations are matched, traced and
diagnosed like the rank's and its waits are its own.

Two waits of a rank are invisible to the scheduler and could stall a coop run
(only the baton holder runs): ``Thread.join`` of a thread the rank started, and
``threading.Condition.wait`` (under ``Event.wait``, ``Queue.get``,
``Future.result``...).  While the calling rank has live threads of its own, it
steps out of the schedule around those waits (``sched.leave``/``rejoin``), so
its threads can take their turn.

A rank that waits outside torch.distributed, sleeping in a loop until a file
appears (PyTorch's own test harness does), would starve the others in a coop
run, where only the baton holder runs: ``time.sleep`` on a rank steps out of the
schedule for its duration, and the run is no longer a pure function of its seed
(``Run.deterministic`` becomes False; a run that never sleeps keeps its seeded
schedule).  In a world started by a launcher (simulator/launch.py), where each
rank stands for a process, ``os.getpid()`` on a rank (and its threads) returns
the pid of that rank's ``Process`` object, as in the process itself; the
standard library's ``multiprocessing`` keeps seeing the real pid.  ``os._exit(code)``
on a rank's own thread ends that rank, as it would end the rank's process, not
the one process every thread rank shares (the rank's ``finally`` blocks do run;
docs/simulator.md, "A rank that exits").  ``signal.signal`` on a rank's own thread
installs the rank's handler, as a process's main thread may (``getsignal``
answers it): the handlers are kept per rank and never called, since the signals
the process gets are the simulator's (a program that must receive them runs
with ``isolation="process"``); ``signal.alarm``/``setitimer`` on a rank, whose timer signal would end every
rank, are refused naming that fix.  ``atexit.register`` on a rank registers a handler
the rank runs when its function ends (last first, its process group still
there), as a process runs its handlers at exit; ``os._exit`` skips them.
``os.chdir`` on a rank changes that rank's working directory: in ``coop`` mode,
where one rank runs at a time, each hand-off puts the process in the directory of
the rank that runs next (:class:`simulator.core._handoff.CwdSwap`); free-running
thread ranks share one, so the first time their directories part the run warns
and names the fix (``mode="coop"`` or ``isolation="process"``).  The process's
directory is back where it was when the last world ends.

Example (2 ranks, each with a communication thread)::

    import threading, torch, simulator, tensorplay.distributed as dist

    def rank_fn():
        x = torch.ones(2) * (dist.get_rank() + 1)
        t = threading.Thread(target=dist.all_reduce, args=(x,))
        t.start()
        t.join()
        return x

    simulator.run(rank_fn, 2)   # [tensor([3., 3.]), tensor([3., 3.])]
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import sysconfig
import threading
import time
import traceback
import warnings
from typing import Any, Callable, ContextManager, Iterator

from tensorplay.distributed import state as dist_state
from tensorplay.distributed.errors import format_message

from simulator.adapters import _environ, os_waits
from simulator.adapters._patch import Installation
from simulator.core._handoff import _CWD
from simulator.core._actor import DONE
from simulator.core._actor import quiet as _quiet
from simulator.core.actors import condition_wait, join_actor, sleep_in, sleep_out, start_actor, start_plain, step_in, step_out
from simulator.core.state import RankState, _local, current_rank_state

#: (start_actor ... sleep_in are simulator.core.actors', re-exported for the rank-process proxy)
__all__ = ["enabled", "adopt", "adopt_c10d", "run_adopted", "start_actor", "join_actor", "step_out", "step_in", "start_plain",
           "sleep_out", "sleep_in", "run_exit_handlers", "join_non_daemon_threads"]

# the originals, kept for good: a thread may still be inside a patched call when the last world's adapters go
_ORIGINAL = {"start": threading.Thread.start, "bootstrap_inner": threading.Thread._bootstrap_inner,  # type: ignore[attr-defined]
             "join": threading.Thread.join, "cond_wait": threading.Condition.wait}
_lock = threading.Lock()
_active = 0


class _Inherited:
    """What a thread takes over from the rank that started it."""

    __slots__ = ("actor", "dist_state", "c10d_world", "cuda")

    def __init__(self, parent: RankState, thread: threading.Thread) -> None:
        self.actor = parent.child(thread)
        self.dist_state = dist_state.current()
        self.c10d_world = _c10d_world()
        self.cuda = parent.device if parent.device.type == "cuda" else None


def _c10d_world() -> Any:
    """The calling rank thread's own torch c10d state, when the torch-native adapter gave it one."""
    try:
        import torch.distributed.distributed_c10d as c10d
    except ImportError:  # pragma: no cover  (torch built without distributed)
        return None
    local = getattr(c10d._world, "_local", None)
    return getattr(local, "world", None) if local is not None else None


def adopt_c10d(world: Any) -> None:
    """Give this thread the rank's c10d state, and its groups in torch's per-thread name registry."""
    import torch.distributed.distributed_c10d as c10d

    local = getattr(c10d._world, "_local", None)
    if local is None:
        return
    local.world = world
    try:  # functional collectives find groups by name in a per-thread registry (thread isolation mode)
        from torch._C._distributed_c10d import _register_process_group

        for pg, name in list(world.pg_names.items()):
            _register_process_group(name, pg)
    except Exception:  # noqa: BLE001  a group torch refuses to re-register is one the thread cannot name anyway
        pass


def adopt(parent: RankState, thread: threading.Thread) -> _Inherited:
    """``parent``'s rank starts ``thread``: give it an actor of the rank (FREE in coop mode) and what it inherits.

    Called by the starting thread (a thread rank's ``Thread.start``, or a rank process's proxy when the
    process starts one); the new thread then runs its target through :func:`run_adopted`.
    """
    inh = _Inherited(parent, thread)
    parent.run.children.append(inh.actor)
    parent.run.sched.add_thread(inh.actor)
    return inh


def _start(self: threading.Thread) -> None:
    parent = current_rank_state()
    if parent is not None and parent.run.sched is not None and not parent.run.over:
        self._tp_sim_inherited = adopt(parent, self)  # type: ignore[attr-defined]
    # start() waits for the new thread to signal that it runs, holding locks of the caller's (e.g. the
    # executor's shutdown lock): a short wait the rank must not step out of the schedule for
    _quiet.depth = getattr(_quiet, "depth", 0) + 1
    try:
        _ORIGINAL["start"](self)
    finally:
        _quiet.depth -= 1


def run_adopted(inh: _Inherited, target: Callable[[], None]) -> None:
    """On the adopted thread: run ``target`` as the rank's actor (its state, environment and c10d state bound);
    the actor exits when ``target`` ends, however it ends."""
    actor = inh.actor
    actor.tid = threading.get_native_id()
    actor.cpu_mark = time.thread_time()
    _local.rs = actor
    dist_state.bind_thread(inh.dist_state)
    if actor.env is not None:
        _environ.bind(actor.env)
    if inh.c10d_world is not None:
        adopt_c10d(inh.c10d_world)
    if inh.cuda is not None:
        import torch

        torch.cuda.set_device(inh.cuda)
    try:
        target()
    finally:
        try:
            actor.backend._flush_unobserved(actor)
        except BaseException:  # noqa: BLE001  (pragma: no cover) never lose the thread's end
            pass
        _local.rs = None
        dist_state.unbind_thread()
        if actor.env is not None:
            _environ.unbind()
        if inh.c10d_world is not None:
            import torch.distributed.distributed_c10d as c10d

            local = getattr(c10d._world, "_local", None)  # None once the world's adapters were removed
            if local is not None:
                local.world = None
        actor.run.sched.exit(actor)


def _bootstrap_inner(self: threading.Thread) -> None:
    inh: _Inherited | None = getattr(self, "_tp_sim_inherited", None)
    if inh is None:
        return _ORIGINAL["bootstrap_inner"](self)
    # runs the target; an exception goes to threading.excepthook, as usual
    run_adopted(inh, lambda: _ORIGINAL["bootstrap_inner"](self))


@contextlib.contextmanager
def _stepped_out(rs: RankState | None) -> Iterator[None]:
    """Around a wait the scheduler cannot see: let the rank's own threads run meanwhile."""
    if not step_out(rs):
        yield
        return
    try:
        yield
    finally:
        step_in(rs)  # type: ignore[arg-type]


def _join(self: threading.Thread, timeout: float | None = None) -> None:
    rs = current_rank_state()
    inh: _Inherited | None = getattr(self, "_tp_sim_inherited", None)
    if rs is None or inh is None or rs.run is not inh.actor.run or rs.run.over:
        return _ORIGINAL["join"](self, timeout)
    if timeout is None:  # the scheduler sees this wait; the real join below then returns at once
        join_actor(rs, inh.actor)
        return _ORIGINAL["join"](self, None)
    with _stepped_out(rs):  # a bounded join is a real wait: let the rank's threads run meanwhile
        return _ORIGINAL["join"](self, timeout)


def _cond_wait(self: threading.Condition, timeout: float | None = None) -> bool:
    rs = current_rank_state()
    if rs is None or (timeout is not None and timeout <= 0):  # a poll (Semaphore.acquire(timeout=0)) never waits
        return _ORIGINAL["cond_wait"](self, timeout)
    return condition_wait(rs, self, timeout, _ORIGINAL["cond_wait"])


# time.sleep, os.getpid, os._exit, signal.signal/getsignal and atexit.register/unregister as they were when the
# adapter was installed (a test may have replaced them)
_REAL: dict[str, Any] = {"sleep": time.sleep, "getpid": os.getpid, "pid": os.getpid(), "os_exit": os._exit,
                         "signal": signal.signal, "getsignal": signal.getsignal, "atexit_register": atexit.register,
                         "atexit_unregister": atexit.unregister, "chdir": os.chdir,
                         "alarm": getattr(signal, "alarm", None), "setitimer": getattr(signal, "setitimer", None)}
#: the simulator's own modules: their sleeps (a Delay fault's real sleep, inside an operation) stay in the schedule;
#: and ``subprocess``, whose polls wait for the rank's own child process (compute, waiting for no other rank): a rank
#: stepping out there while it holds a lock of the process's would hand the turn to a rank that blocks on that
#: lock for real (torch.compile: dynamo's compile lock, held while inductor runs a compiler)
_OWN = ("simulator", "tensorplay", "subprocess")
#: callers that must see the real pid: multiprocessing records it to recognise its own children and finalizers
_REAL_PID_CALLERS = ("multiprocessing", "concurrent")


def _caller_package() -> str:
    name = sys._getframe(2).f_globals.get("__name__") or ""  # 0: this helper, 1: the adapter, 2: its caller
    return name.split(".", 1)[0]


def _sleep(seconds: float) -> None:
    """``time.sleep`` while a world runs: on a coop rank, a wait outside the schedule (see the module docstring)."""
    rs = current_rank_state()
    if rs is None or _caller_package() in _OWN:
        return _REAL["sleep"](seconds)
    frame = sys._getframe(1)
    if not sleep_out(rs, seconds, f"{frame.f_code.co_filename}:{frame.f_lineno}"):
        return _REAL["sleep"](seconds)
    try:
        _REAL["sleep"](seconds)
    finally:
        sleep_in(rs)


#: consecutive calls of one store method at one call site with the same arguments that make a spin-poll
SPIN_POLLS = 32
#: in a coop rank process (no rank state in it): ``(what, site)`` steps its main thread out of the schedule for a
#: millisecond (set by :mod:`simulator.isolation.rank_threads`); its store is a real TCPStore that the other rank
#: processes serve only while they run
poll_in_os: Callable[[str, str], None] | None = None
_process_polls: list[Any] = [None]  # a rank process's last store call and its count in a row (its main thread's)


def store_poll(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``Store.<name>`` (``add``, ``check``, ``compare_set``) while a world runs: a coop rank that calls it in a
    loop with the same arguments (``while store.add(key, 0) < n: pass``, as torch's c10d tests do) is polling
    for another rank, which only runs if this one lets it; from the ``SPIN_POLLS``-th call on, each such call
    sleeps a millisecond outside the schedule, as a sleep-polling rank does.  A program that does not spin
    keeps its seeded schedule."""
    def call(self: Any, *args: Any) -> Any:
        rs = current_rank_state()
        if rs is None and poll_in_os is None:
            return original(self, *args)
        frame = sys._getframe(1)
        spot = (name, frame.f_code, frame.f_lineno, repr(args)[:200])
        last = rs.store_polls if rs is not None else _process_polls[0]
        n = last[1] + 1 if last is not None and last[0] == spot else 1
        if rs is not None:
            rs.store_polls = (spot, n)
        else:
            _process_polls[0] = (spot, n)
        if n >= SPIN_POLLS:
            site = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            what = f"Store.{name}{args!r} in a polling loop"
            if rs is None:
                poll_in_os(what, site)  # type: ignore[misc]
            elif sleep_out(rs, 0.001, site, what=what):
                try:
                    _REAL["sleep"](0.001)
                finally:
                    sleep_in(rs)
        return original(self, *args)

    call.__name__ = name
    return call


def _getpid() -> int:
    """``os.getpid`` while a world runs: a launched rank's own pid on its threads (see the module docstring)."""
    real = _REAL["getpid"]()
    rs = current_rank_state()
    if rs is None or real != _REAL["pid"]:  # not a rank, or a process forked from one (it has a pid of its own)
        return real
    pids = getattr(rs.run.world, "rank_pids", None)
    if pids is None or _caller_package() in _REAL_PID_CALLERS:
        return real
    return pids[rs.rank]


class RankOsExit(SystemExit):
    """``os._exit(code)`` called on a thread rank: that rank's "process" ends with ``code`` (the world ends it as
    a ``SystemExit``: 0 is a normal return, anything else a failed rank), not the process every rank shares."""


def _forked() -> bool:
    """The calling process was forked from the one the world runs in (a DataLoader worker of a rank, say)."""
    return _REAL["getpid"]() != _REAL["pid"]


def _os_exit(code: int) -> None:
    """``os._exit`` while a world runs: on a thread rank's own thread, ends that rank only (see
    :class:`RankOsExit`); anywhere else (a thread the rank started, a process forked from a rank, the launcher,
    a rank process) the real call."""
    rs = current_rank_state()
    if rs is None or rs.parent is not None or _forked():
        _REAL["os_exit"](code)
    raise RankOsExit(code)


_chdir_lock = threading.Lock()


def _chdir(path: Any) -> None:
    """``os.chdir`` while a world runs: on a thread rank (or a thread it started), that rank's working directory
    (see the module docstring); anywhere else, and in a process forked from a rank, the real call."""
    rs = current_rank_state()
    if rs is None or _forked():
        return _REAL["chdir"](path)
    with _chdir_lock:  # (free-running ranks: the first change must read the directory every rank started in)
        before = os.getcwd()
        _REAL["chdir"](path)
        now = os.getcwd()
        _CWD.start(before)
        _CWD.moved(now)
    own = rs.own()
    own[_CWD.KEY] = now
    run = rs.run
    if run.sched.swaps_cwd or getattr(run, "cwd_warned", False):
        return
    others = {}
    for other in run.ranks:
        if other.parent is None and other is not (rs.parent or rs):
            where = other.own().get(_CWD.KEY, _CWD.base)
            if where != now:
                others[other.rank] = where
    if others:
        run.cwd_warned = True
        warnings.warn(format_message(
            "os.chdir", "free-running thread ranks share one working directory: this rank changed it, so the "
            "relative paths of the others now resolve under the new one", rank=rs.rank,
            values={"cwd": now, "others": others},
            fix="run with mode='coop' (python -m simulator --mode coop: each rank keeps its own directory) or "
                "isolation='process' (a process each)"), RuntimeWarning, stacklevel=2)


def _own_signals(rs: RankState | None) -> bool:
    """Whether the calling thread is a thread rank's own (where its process's main thread would run it)."""
    return rs is not None and rs.parent is None and threading.current_thread() is not threading.main_thread()


def _signal(signalnum: Any, handler: Any) -> Any:
    """``signal.signal`` while a world runs: on a thread rank's own thread, the rank's handler (see the module
    docstring), checked as the real call checks it; anywhere else the real call."""
    rs = current_rank_state()
    if not _own_signals(rs):
        return _REAL["signal"](signalnum, handler)
    signum = int(signalnum)
    if not 0 < signum < signal.NSIG:
        raise ValueError("signal number out of range")
    if signum in (signal.SIGKILL, signal.SIGSTOP):
        raise OSError(22, "Invalid argument")
    if not callable(handler) and handler not in (signal.SIG_IGN, signal.SIG_DFL):
        raise TypeError("signal handler must be signal.SIG_IGN, signal.SIG_DFL, or a callable object")
    table = rs.own().setdefault((0, "signals"), {})
    previous = table[signum] if signum in table else _REAL["getsignal"](signum)
    table[signum] = handler
    return previous


def _getsignal(signalnum: Any) -> Any:
    """``signal.getsignal`` while a world runs: a thread rank's own handler where it installed one."""
    rs = current_rank_state()
    own = rs.own().get((0, "signals"), {}) if _own_signals(rs) else {}
    return own[int(signalnum)] if int(signalnum) in own else _REAL["getsignal"](signalnum)


def _on_a_thread_rank() -> RankState | None:
    rs = current_rank_state()
    return rs if rs is not None and threading.current_thread() is not threading.main_thread() else None


def _timer_refused(call: str, rs: RankState, values: dict[str, Any]) -> Exception:
    from simulator.core.errors import SimError  # (here: the errors module imports torch, this one must not early)

    return SimError(format_message(
        call, "a timer signal (SIGALRM, SIGVTALRM, SIGPROF) goes to the process, which every thread rank shares: "
        "the rank's handler is its own and would never run, and the signal's default action ends every rank at "
        "once", rank=rs.rank, values=values,
        fix="run the ranks with a process each, which have their own signals: isolation='process' (python -m "
            "simulator --isolation process)"))


def _alarm(seconds: int) -> int:
    """``signal.alarm`` while a world runs: refused on a thread rank (``alarm(0)``, the cancel, answers 0)."""
    rs = _on_a_thread_rank()
    if rs is None:
        return _REAL["alarm"](seconds)
    if int(seconds) == 0:  # (no alarm of the rank's can be pending: setting one was refused)
        return 0
    raise _timer_refused("signal.alarm", rs, {"seconds": seconds})


def _setitimer(which: int, seconds: float, interval: float = 0.0) -> tuple[float, float]:
    """``signal.setitimer`` while a world runs: refused on a thread rank, as :func:`_alarm`."""
    rs = _on_a_thread_rank()
    if rs is None:
        return _REAL["setitimer"](which, seconds, interval)
    if seconds == 0:
        return (0.0, 0.0)
    raise _timer_refused("signal.setitimer", rs, {"which": which, "seconds": seconds, "interval": interval})


#: where installed code lives (the standard library, site-packages): its atexit handlers stay the process's
_INSTALLED = tuple(sorted({os.path.join(p, "") for key in ("stdlib", "platstdlib", "purelib", "platlib")
                           if (p := sysconfig.get_paths().get(key))}))


def _exit_handlers(rs: RankState) -> list[tuple[Callable[..., Any], tuple, dict]]:
    return rs.own().setdefault((0, "atexit"), [])


def _atexit_register(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """``atexit.register`` while a world runs: called by the program's code on a thread rank (or a thread it
    started), a handler the rank runs when its function ends, as a process runs its handlers at exit (see
    :func:`run_exit_handlers`); called by installed code, the process's."""
    rs = current_rank_state()
    caller = sys._getframe(1)
    if rs is None or _forked() or caller.f_code.co_filename.startswith(_INSTALLED) or \
            (caller.f_globals.get("__name__") or "").split(".", 1)[0] in (*_OWN, "conformance"):
        # a library's (multiprocessing's, say, imported first by some rank; tensorplay's) stays the process's:
        # thread ranks share the library, and its handler cleans up for every rank
        return _REAL["atexit_register"](func, *args, **kwargs)
    _exit_handlers(rs).append((func, args, kwargs))
    return func


def _atexit_unregister(func: Callable[..., Any]) -> None:
    """``atexit.unregister`` while a world runs: a thread rank's own handlers (every registration of ``func``)."""
    rs = current_rank_state()
    if rs is None or _forked():
        return _REAL["atexit_unregister"](func)
    handlers = _exit_handlers(rs)
    handlers[:] = [h for h in handlers if h[0] != func]
    return None


def join_non_daemon_threads(rs: RankState) -> None:
    """At a thread rank's return: wait for the non-daemon threads the rank started (and theirs), as a process's
    interpreter does before its exit handlers, while the rank's process group is still there; scheduler waits, so
    a thread that never ends is named as a deadlock or a stall."""
    run = rs.run
    while True:
        live = [c for c in run.children if c.parent is rs and c.waits_exit and c.state != DONE]
        if not live:
            return
        for c in live:
            join_actor(rs, c)


def run_exit_handlers(rs: RankState) -> None:
    """Run the handlers a thread rank registered with ``atexit``, last first, on the rank's thread while its
    process group is still there (an interpreter runs them after the main module, before it tears down); one that
    raises is reported as CPython reports it and the next one runs."""
    handlers = _exit_handlers(rs)
    while handlers:
        func, args, kwargs = handlers.pop()
        try:
            func(*args, **kwargs)
        except BaseException:  # noqa: BLE001  (as the interpreter: reported, never the rank's outcome)
            print(f"Exception ignored in atexit callback: {func!r}", file=sys.stderr)
            traceback.print_exc()


def _install() -> None:
    threading.Thread.start = _start  # type: ignore[method-assign]
    threading.Thread._bootstrap_inner = _bootstrap_inner  # type: ignore[attr-defined]
    threading.Thread.join = _join  # type: ignore[method-assign]
    threading.Condition.wait = _cond_wait  # type: ignore[method-assign]
    if time.sleep is not _sleep:
        _REAL["sleep"] = time.sleep
    if os.getpid is not _getpid:
        _REAL["getpid"] = os.getpid
        _REAL["pid"] = os.getpid()
    if os._exit is not _os_exit:
        _REAL["os_exit"] = os._exit
    if signal.signal is not _signal:
        _REAL["signal"], _REAL["getsignal"] = signal.signal, signal.getsignal
    if _REAL["alarm"] is not None:  # (POSIX)
        if signal.alarm is not _alarm:
            _REAL["alarm"], _REAL["setitimer"] = signal.alarm, signal.setitimer
        signal.alarm, signal.setitimer = _alarm, _setitimer
    if atexit.register is not _atexit_register:
        _REAL["atexit_register"], _REAL["atexit_unregister"] = atexit.register, atexit.unregister
    if os.chdir is not _chdir:
        _REAL["chdir"] = _CWD.chdir = os.chdir
    os.chdir = _chdir
    signal.signal, signal.getsignal = _signal, _getsignal
    atexit.register, atexit.unregister = _atexit_register, _atexit_unregister
    time.sleep = _sleep
    os.getpid = _getpid
    os._exit = _os_exit
    os_waits.install()


def _uninstall() -> None:
    threading.Thread.start = _ORIGINAL["start"]  # type: ignore[method-assign]
    threading.Thread._bootstrap_inner = _ORIGINAL["bootstrap_inner"]  # type: ignore[attr-defined]
    threading.Thread.join = _ORIGINAL["join"]  # type: ignore[method-assign]
    threading.Condition.wait = _ORIGINAL["cond_wait"]  # type: ignore[method-assign]
    time.sleep = _REAL["sleep"]
    os.getpid = _REAL["getpid"]
    os._exit = _REAL["os_exit"]
    signal.signal, signal.getsignal = _REAL["signal"], _REAL["getsignal"]
    if _REAL["alarm"] is not None:
        signal.alarm, signal.setitimer = _REAL["alarm"], _REAL["setitimer"]
    atexit.register, atexit.unregister = _REAL["atexit_register"], _REAL["atexit_unregister"]
    os.chdir = _REAL["chdir"]
    os_waits.uninstall()
    _CWD.stop()  # the process is back in the directory the first rank left


_INSTALLATION = Installation(_install, _uninstall)


def enabled() -> ContextManager[None]:
    """While active, threads started by simulated ranks belong to their rank (see the module docstring)."""
    return _INSTALLATION.enabled()


