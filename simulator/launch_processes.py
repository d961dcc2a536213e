"""The processes a launcher starts (:mod:`simulator.launch`): which become ranks, and what stands in for them.

A process whose code is the program's own (its target, or the class its target is bound to) becomes a
simulated rank; a library's worker (DataLoader workers, pools, managers) is started for real.  A rank gets
its own copy of the arguments, as a child process does (what a real child shares, it shares), and a
:class:`_SimPopen` in place of multiprocessing's ``Popen``: waiting on it runs the launcher's pending ranks.
The multiprocessing internals these read and set are listed in :mod:`simulator.adapters.torch_private`.
"""
from __future__ import annotations

import contextlib
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.process as mp_process
import os
import pickle
import signal
import sys
import sysconfig
import threading
import types
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from tensorplay.distributed.errors import format_message

from simulator.core.errors import RankFailedError, SimTimeoutError
from simulator.core.tracebacks import format_rank_traceback

if TYPE_CHECKING:  # (annotations only: the launcher imports this module)
    from simulator.launch import _Launcher
    from simulator.world import World

__all__: list[str] = []  # the launcher's parts (simulator.launch is the door)


# ---------------------------------------------------------------------------
# which processes become ranks
# ---------------------------------------------------------------------------
_LIB_DIRS = tuple({os.path.realpath(p) for key in ("stdlib", "platstdlib", "purelib", "platlib")
                   if (p := sysconfig.get_paths().get(key))})
_OWN_PACKAGES = ("simulator", "tensorplay", "conformance")


def _entry_function(proc: mp_process.BaseProcess) -> Any:
    """What the process runs: its ``run`` override, else its target (partials and methods unwrapped)."""
    run = type(proc).run
    fn: Any = run if run is not mp_process.BaseProcess.run else getattr(proc, "_target", None)
    for _ in range(8):  # functools.partial / bound methods, nested a few levels at most
        inner = getattr(fn, "func", None) or getattr(fn, "__func__", None)
        if inner is None:
            break
        fn = inner
    return fn


def continuous_worker_refusal(proc: mp_process.BaseProcess) -> str | None:
    """The refusal for a process that runs a worker of torch's ``MultiProcContinuousTest`` started by a launcher run
    (the test file driven by other means than its own main), else None: its workers loop on a task queue that only
    torch's harness feeds as pytest or the file's own ``run_tests()`` runs it, and thread ranks would share the
    class's ``rank``."""
    harness = sys.modules.get("torch.testing._internal.common_distributed")  # (imported by such a file already)
    base, owner = getattr(harness, "MultiProcContinuousTest", None), _bound_owner(proc)
    if base is None or owner is None or not issubclass(owner, base):
        return None
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "FILE"
    return format_message(
        "simulator.launch", f"the launcher started the workers of {owner.__name__}, a MultiProcContinuousTest of "
        f"torch's test harness: a launcher run cannot simulate them (they wait for tests the harness hands them)",
        values={"class": owner.__qualname__},
        fix=f"run its tests on simulated ranks with python -m simulator pytest {script}, or end the file with "
            f"torch's run_tests() (or unittest.main()) under if __name__ == '__main__' and run python -m simulator "
            f"{script}")


def _bound_owner(proc: mp_process.BaseProcess) -> type | None:
    """The class of the object the process's target is bound to (``Cls._run``, ``obj.method``: ``Cls``), or None."""
    fn: Any = getattr(proc, "_target", None) if type(proc).run is mp_process.BaseProcess.run else None
    for _ in range(8):  # functools.partial wrappers, nested a few levels at most
        owner = getattr(fn, "__self__", None)
        if owner is not None and not isinstance(owner, types.ModuleType):
            return owner if isinstance(owner, type) else type(owner)
        fn = getattr(fn, "func", None)
    return None


def _is_user_process(proc: mp_process.BaseProcess) -> bool:
    """True when the process runs the program's own code (a rank), not a library's worker.

    DataLoader workers, multiprocessing pools and executors start processes
    whose code lives in the standard library or site-packages; those stay real.
    A target that is a library's method bound to a class of the program (torch's
    ``MultiProcessTestCase`` starts ``UserTestClass._run``) is the program's: a rank.
    The standard library's methods stay real even then (a program's ``BaseManager``
    subclass starts its server as ``MyManager._run_server``).
    """
    fn = _entry_function(proc)
    if fn is None:
        return False
    if _in_program(getattr(fn, "__module__", None) or ""):
        return True
    owner = _bound_owner(proc)
    if owner is None or (getattr(fn, "__module__", None) or "").split(".", 1)[0] in sys.stdlib_module_names:
        return False
    owner_mod = getattr(owner, "__module__", None) or ""
    return owner_mod not in sys.builtin_module_names and _in_program(owner_mod)


def _in_program(mod_name: str) -> bool:
    """True when module ``mod_name`` is the program's own code (not the standard library, site-packages, us)."""
    if mod_name in ("__main__", "__mp_main__"):
        return True
    if mod_name.split(".", 1)[0] in _OWN_PACKAGES:
        return False
    mod = sys.modules.get(mod_name)
    path = getattr(mod, "__file__", None)
    if not path:
        return True
    path = os.path.realpath(path)
    return not any(path.startswith(d + os.sep) for d in _LIB_DIRS)


def _start_method(proc: mp_process.BaseProcess) -> str:
    method = getattr(type(proc), "_start_method", None)
    if method:
        return str(method)
    method = multiprocessing.get_start_method(allow_none=True)
    if method:
        return method
    return multiprocessing.get_all_start_methods()[0]  # the platform's default comes first


# ---------------------------------------------------------------------------
# per-rank copies of the arguments
# ---------------------------------------------------------------------------
def _shared_kinds() -> tuple[type, ...]:
    """Objects that real child processes share with the launcher (or that are passed by reference)."""
    import multiprocessing.managers
    import multiprocessing.queues
    import multiprocessing.synchronize

    kinds: list[type] = [types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type,
                         multiprocessing.queues.Queue, multiprocessing.queues.SimpleQueue,
                         multiprocessing.synchronize.SemLock, multiprocessing.synchronize.Condition,
                         multiprocessing.synchronize.Event, multiprocessing.synchronize.Barrier,
                         multiprocessing.connection.Connection, multiprocessing.managers.BaseProxy,
                         io.IOBase, type(threading.Lock()), type(threading.RLock()), threading.Condition,
                         threading.Event]
    try:
        from multiprocessing.sharedctypes import Synchronized, SynchronizedArray

        kinds += [Synchronized, SynchronizedArray]
    except ImportError:  # pragma: no cover
        pass
    return tuple(kinds)


class _Transfer(pickle.Pickler):
    """Pickles a rank's arguments, passing by reference what a real child would share."""

    def __init__(self, buf: io.BytesIO, share_all_tensors: bool) -> None:
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.share_all_tensors = share_all_tensors
        self.kinds = _shared_kinds()
        self.shared: list[Any] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            # spawn/forkserver: torch moves tensors to shared memory; fork: only shared ones stay shared
            share = self.share_all_tensors or obj.device.type != "cpu" or obj.is_shared()
        else:
            share = isinstance(obj, self.kinds)
        if not share:
            return None
        self.shared.append(obj)
        return len(self.shared) - 1


class _Receive(pickle.Unpickler):
    def __init__(self, buf: io.BytesIO, shared: list[Any]) -> None:
        super().__init__(buf)
        self.shared = shared

    def persistent_load(self, pid: Any) -> Any:
        return self.shared[pid]


def _copy_for_rank(args: tuple, kwargs: dict, method: str) -> tuple[tuple, dict]:
    """The arguments as a child process would see them: its own copy, shared objects shared."""
    buf = io.BytesIO()
    p = _Transfer(buf, share_all_tensors=method != "fork")
    try:
        p.dump((args, kwargs))
        buf.seek(0)
        return _Receive(buf, p.shared).load()
    except Exception:  # noqa: BLE001  not copyable here: the rank gets the launcher's objects themselves
        return args, kwargs


# ---------------------------------------------------------------------------
# the simulated child process
# ---------------------------------------------------------------------------
def _fake_pid_base() -> int:
    # above the kernel's largest pid, so os.kill() on a simulated pid can never reach a real process
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read()) + 1
    except (OSError, ValueError):
        return 1 << 22


_no_trigger = threading.local()


class _SimPopen:
    """Stands in for multiprocessing's ``Popen``: the process is a rank of a simulated world."""

    def __init__(self, launcher: "_Launcher", pid: int) -> None:
        self.launcher = launcher
        self.pid = pid
        self.returncode: int | None = None
        self.exc: BaseException | None = None  # what the rank raised (None: it returned or exited)
        self.rank: int | None = None
        self.world: World | None = None
        self.exited = False  # the rank called sys.exit() with a non-zero status
        self.cancelled = False
        self._fd: int | None = None

    def _finish(self) -> None:
        if self.returncode is None and not getattr(_no_trigger, "on", False):
            self.launcher.run_pending(self)

    def poll(self, flag: int = 0) -> int | None:
        if not self.launcher.in_background(self):  # (a rank of a world running in the background is alive)
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        running = self.launcher.background
        if timeout is not None and running is not None and self.launcher.in_background(self):
            running.join(timeout)
            return self.returncode
        self._finish()
        return self.returncode

    def _cancel(self, sig: int) -> None:
        # a pending rank can be stopped before its world starts; a finished one has nothing left to stop
        if self.returncode is None and self.launcher.cancel(self):
            self.returncode = -sig
            self.cancelled = True

    def terminate(self) -> None:
        self._cancel(signal.SIGTERM)

    def kill(self) -> None:
        self._cancel(signal.SIGKILL)

    def sentinel(self) -> int:
        """A descriptor that is readable once the rank ended (``multiprocessing.connection.wait`` works)."""
        self._finish()
        if self._fd is None:
            r, w = os.pipe()
            os.close(w)  # end of file right away: the rank has ended
            self._fd = r
            self.launcher.fds.append(r)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            with contextlib.suppress(ValueError):
                self.launcher.fds.remove(self._fd)
            self._fd = None


def _sim_popen(proc: Any) -> _SimPopen | None:
    popen = getattr(proc, "_popen", None)
    return popen if isinstance(popen, _SimPopen) else None


def _print_failure(proc: mp_process.BaseProcess) -> None:
    """What a real child process prints on its stderr as it dies of an exception (multiprocessing's
    ``BaseProcess._bootstrap``): its name and traceback.  torch's spawn and elastic workers catch it (no print)."""
    popen = _sim_popen(proc)
    exc = popen.exc if popen is not None else None
    if (exc is None or popen.exited or isinstance(exc, RankFailedError)  # type: ignore[union-attr]
            or getattr(proc, "_sim_rank_process", False) or getattr(proc, "_sim_own_program", False)):
        return
    sys.stderr.write(f"Process {proc.name}:\n{format_rank_traceback(exc)}")
    sys.stderr.flush()


class _Held(contextlib.ExitStack):
    """An exit stack that says whether it holds anything."""

    def __bool__(self) -> bool:
        return bool(self._exit_callbacks)  # type: ignore[attr-defined]


def _launcher_timeout(waited: float, timeout: float, name: str, failures: list[BaseException]) -> SimTimeoutError:
    """The error of a launcher's wait that outlasted ``timeout`` (its spelling: ``name``) after its worlds ended."""
    failed = "; ".join(f"rank {getattr(e, 'rank', '?')} failed ({type(e).__name__}: "
                       f"{(str(e).splitlines() or [''])[0]})" for e in failures)
    err = SimTimeoutError(format_message(
        "simulator.launch", f"the launcher has waited {waited:.0f} s on a multiprocessing queue, pipe, event or "
        f"lock since every process it started had ended: none is left to answer it",
        values={name: timeout, **({"failed": failed} if failed else {})},
        fix="a process it waits for failed or never sent: see its traceback above (real processes hang here)"))
    err.bound = "timeout"
    return err


def _first_failed(failed: list[mp_process.BaseProcess]) -> mp_process.BaseProcess:
    """The process whose failure stopped its world (a real join reports the first process that died)."""
    for p in failed:
        po = _sim_popen(p)
        failure = po.launcher.failure_of.get(id(po.world)) if po is not None else None
        if po is not None and failure is not None and getattr(failure, "rank", None) == po.rank:
            return p

    def released(p: mp_process.BaseProcess) -> bool:
        po = _sim_popen(p)
        return po is None or not (po.exited or (po.exc is not None and not isinstance(po.exc, RankFailedError)))

    return min(failed, key=released)  # min keeps the first of equals: the lowest index


# ---------------------------------------------------------------------------
# what spawn(..., join=False) returns, and the errors its join raises
# ---------------------------------------------------------------------------
class SimProcessContext:
    """What the simulated ``start_processes(..., join=False)`` returns (torch's ``ProcessContext`` API)."""

    def __init__(self, processes: list[mp_process.BaseProcess]) -> None:
        self.processes = processes
        self.error_files = [None] * len(processes)
        self._reported = False

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.processes]

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Run the ranks (if not yet); raise torch's error for a failed one, as a real join does."""
        for p in self.processes:
            p.join()
        failed = [p for p in self.processes if p.exitcode != 0]
        if not failed or self._reported:
            return True
        self._reported = True
        raise _process_error(self.processes.index(_first_failed(failed)), _first_failed(failed))


def _process_error(index: int, proc: mp_process.BaseProcess) -> BaseException:
    popen = _sim_popen(proc)
    code = proc.exitcode
    exc = popen.exc if popen is not None else None
    if exc is not None and not popen.exited:  # type: ignore[union-attr]
        msg = f"\n\n-- Process {index:d} terminated with the following error:\n" + format_rank_traceback(exc)
        err: BaseException = ProcessRaisedException(msg, index, proc.pid)
    elif code is not None and code < 0:
        name = signal.Signals(-code).name
        err = ProcessExitedException(f"process {index:d} terminated with signal {name}", error_index=index,
                                     error_pid=proc.pid, exit_code=code, signal_name=name)
    else:
        err = ProcessExitedException(f"process {index:d} terminated with exit code {code:d}", error_index=index,
                                     error_pid=proc.pid, exit_code=code)
    err.rank = popen.rank if popen is not None else index  # type: ignore[attr-defined]
    err.rank_exception = exc  # type: ignore[attr-defined]
    failure = popen.launcher.failure_of.get(id(popen.world)) if popen is not None else None
    if failure is not None and exc is None and getattr(failure, "rank", None) == err.rank:
        for note in getattr(failure, "__notes__", ()):  # the replay hint of the world that ran the rank
            err.add_note(note)
    return err
