"""The rank process: its boot, and the warm interpreter's loop that forks rank processes.

Started by :mod:`simulator.isolation.proxy` as ``python -c ... <fd>`` with its
own ``PYTHONHASHSEED`` (or forked by a warm interpreter, :func:`serve`); ``fd``
is its end of a socket pair to the coordinator.  :func:`main` reads its
:class:`~.messages.Setup`, binds tensorplay.distributed to a
:class:`~.client.ClientBackend` (every call performed by the rank's proxy),
reports READY and runs the program's function; its last message is the
function's RESULT, its EXIT, or its exception (RAISE, FORWARDED).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import os
import pickle
import random
import select
import signal
import socket
import sys
import sysconfig
import threading
import traceback
import weakref
from datetime import timedelta
from multiprocessing import process as mp_process
from multiprocessing import spawn
from multiprocessing.connection import Connection
from typing import Any, Callable, ContextManager

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from tensorplay.distributed import state as dist_state
from tensorplay.distributed.state import install_backend
from tensorplay.distributed.errors import DistRuntimeError, format_message

from simulator.adapters import per_rank_main, torch_globals, torch_native, torch_rpc
from simulator.adapters.clock_hooks import timed_imports
from simulator.isolation import _wire, cleanup, mark_rank_process, pickling, rank_threads, rpc_process, warm
from simulator.core.seeds import numpy_seed
from simulator.isolation.client import ClientBackend
from simulator.isolation.messages import (
    EXIT, FORWARDED, MODULES, READY, RESULT, WARM_EXITED, WARM_FORKED, WARM_LOADED, WARM_READY, WARM_RECORD,
    WARM_TAINTED, Setup,
)
from simulator.isolation.remote_errors import exception_message, rank_traceback

__all__ = ["main", "serve", "library_modules", "ScriptMain"]


# ---------------------------------------------------------------------------
# the rank process's boot
# ---------------------------------------------------------------------------
def _honest_clock(backend: ClientBackend) -> None:
    """As on thread ranks: imports are not compute, and each optimizer step marks a training step."""
    boot = importlib.import_module("importlib._bootstrap")
    boot._find_and_load = timed_imports(boot._find_and_load, lambda: backend.exclude_cpu)
    register_optimizer_step_post_hook(lambda opt, args, kwargs: backend.optimizer_step(opt))


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the coordinator dies (no orphan ranks)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:  # noqa: BLE001  best effort: the socket's EOF ends the process too
            pass


class ScriptMain:
    """Run a program (a script, or with ``-m`` a module) as ``__main__`` with ``sys.argv = [argv0, *argv]``
    (torchrun-style ranks of ``python -m simulator``): in a rank process, or with ``thread_rank`` in a thread
    rank's own ``__main__`` (``sys.argv`` and ``sys.path`` are then the process's, set once for every rank by the
    caller)."""

    def __init__(self, program: per_rank_main.Program, argv: list[str], output: Any = None, attempt: int = 0,
                 thread_rank: bool = False) -> None:
        self.program = program
        self.argv = list(argv)
        self.output, self.attempt = output, attempt  # torchrun's --tee/--redirects (simulator.cli_output.RankOutput)
        self.thread_rank = thread_rank

    def __call__(self) -> None:
        dist_state.current().backend.awaiting_init = True  # a script initialises its group itself, as under torchrun
        restore = self.output.install(self.attempt) if self.output is not None else None
        failure = None
        try:
            if self.thread_rank:
                per_rank_main.run_path(self.program)
            else:
                per_rank_main.run_as_main(self.program, self.argv)
        except SystemExit as e:  # sys.exit(0) / sys.exit() is a normal end of a rank
            if e.code not in (None, 0):
                raise
        except BaseException as e:
            failure = e
            raise
        finally:
            if restore is not None:
                restore(failure)  # (this interpreter may serve the next world)


def _answer_where(conn: Connection, main_ident: int) -> None:
    """Answer the proxy's "where is your program now?" (a timeout report) from a daemon thread of this process.

    A request is a number; the answer is ``(number, [(file, line, function), ...])`` of the main thread's stack,
    outermost first.  A thread, not a signal handler, so the program's own handlers are left alone.
    """
    def serve() -> None:
        while True:
            try:
                n = conn.recv()
            except (EOFError, OSError):
                return
            frame = sys._current_frames().get(main_ident)
            stack = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack(frame)] if frame else []
            starts = [i for i, f in enumerate(stack) if f[0] == __file__ and f[2] in ("main", "_run")]
            if starts:  # the program's frames: those below this module's main and _run (not the start-up's)
                stack = stack[starts[-1] + 1:]
            try:
                conn.send((n, stack))
            except OSError:
                return

    threading.Thread(target=serve, name="tensorplay-sim-where", daemon=True).start()


def _seed_numpy(run_seed: int, rank: int) -> None:
    """numpy's global generator starts where a thread rank's does (core.seeds.numpy_seed), when numpy is there."""
    if "numpy" not in sys.modules:  # (torch imports it when it is installed)
        return
    import numpy.random  # (in-function: only rank processes of programs with numpy pay for it)

    numpy.random.seed(numpy_seed(run_seed, rank))


def _receive_setup(conn: Connection) -> Setup:
    """The proxy's Setup, then the descriptors that follow it; starts answering "where is the program?"."""
    setup: Setup = _wire.recv(conn)
    with socket.socket(fileno=os.dup(conn.fileno())) as raw:
        _, fds, _, _ = socket.recv_fds(raw, 1, 1)  # FDS_WHERE: the socket on which the proxy asks where this rank is
        if setup.passed:  # FDS_PASSED: the descriptors its arguments inherit (pipes, queues, shared tensors)
            _, pickling.received_fds[:], _, _ = socket.recv_fds(raw, 1, setup.passed)
    _answer_where(Connection(fds[0]), threading.get_ident())
    return setup


def _own_c10d(backend: ClientBackend, setup: Setup) -> None:
    """One rank per process: torch's process-wide c10d state is this rank's (threads the program starts see it),
    and real processes serve each other over a real TCPStore (inside ``torch_native.enabled()``)."""
    host, port = setup.store
    torch_native.rank_process(backend.world_key(), host, port, setup.world_size, timedelta(seconds=setup.timeout))


def _torch_rpc(setup: Setup) -> ContextManager[None]:
    """torch's RPC API in this rank process: the simulator's transport (matched, traced, seeded, under the run's
    faults, as on thread ranks), or, for torch's RPC test fixtures, torch's own agent."""
    if setup.own_torch_rpc:
        rpc_process.torch_rpc_leaves_the_schedule(coop=setup.mode == "coop")
        return contextlib.nullcontext()
    torch_rpc.process_rank = True  # (every thread of this process is the rank's)
    torch_rpc.register_sim_agent(rpc_process.ProcAgent)
    return torch_rpc.enabled()


def main(fd: int | None = None) -> None:
    """Entry point of a rank process; ``fd`` (default ``argv[1]``) is its socket to the coordinator."""
    _die_with_parent()  # (armed already by the start-up command; again for a caller that did not)
    sock = socket.socket(fileno=int(sys.argv[1]) if fd is None else fd)
    conn = Connection(sock.detach())
    setup = _receive_setup(conn)
    mark_rank_process()
    rank = setup.rank
    before = set(sys.modules)
    # while the main module is imported and the payload loaded, this process is "inheriting", as a spawned child
    # is: a launcher without a __main__ guard that starts processes there gets multiprocessing's bootstrapping error
    mp_process.current_process()._inheriting = True
    try:
        spawn.prepare(setup.prep)  # the coordinator's sys.path, cwd and main module (as __mp_main__)
        fn, args, kwargs = pickle.loads(setup.payload)
        if "tp_forked_main" in setup.prep:  # a fork launcher's rank: the launcher's __main__, never run again
            pickling.adopt_forked_main((fn, args, kwargs), *setup.prep["tp_forked_main"])
    except BaseException as e:  # noqa: BLE001
        _wire.send(conn, exception_message(e))
        return
    finally:
        del mp_process.current_process()._inheriting
    rpc_process.RANK = (rank, setup.world_size, setup.mode)  # what init_rpc takes when the program leaves it out
    rpc_process.SECRET = setup.rpc_secret  # (the run's: RPC is authenticated by default)
    torch.set_rng_state(setup.torch_rng)
    random.seed(f"simulator:{setup.seed}:{rank}")
    _seed_numpy(setup.seed, rank)
    backend = ClientBackend(conn, rank, setup.world_size, setup.arena_dir)
    rpc_process.BACKEND = backend
    install_backend(backend, timedelta(seconds=setup.timeout))
    # (after this module's own threads: those are not the program's)
    rank_threads.install(backend, coop=setup.mode == "coop")
    with _devices(setup), torch_native.enabled(), _torch_rpc(setup):
        _own_c10d(backend, setup)
        _honest_clock(backend)
        _wire.send(conn, (READY,))  # start-up done: the run's timeout counts from every rank's READY
        msg = _run(fn, args, kwargs, backend, rank)
        if torch_globals.rendezvous_files:
            # what an interpreter's end collects: a FileStore in a reference cycle, whose destructor removes its
            # file when its last user ends, which a rank process ending by os._exit would never run
            gc.collect()
        # the rank's end: its proxy stops serving the main channel, so the interpreter's own end (atexit joins
        # of executor threads, non-daemon threads) waits as a real process does
        backend.main_returned()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        try:
            if setup.learn:  # the libraries this rank imported: its warm interpreter imports them ahead
                _wire.send(conn, (MODULES, library_modules(set(sys.modules) - before)))
            _wire.send(conn, msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass


def _devices(setup: Setup) -> ContextManager[Any]:
    """The rank's devices, as the world hands them in (devices="cuda": the stand-in's, for the whole process, one
    rank per process: the process's device state is the rank's); none: the CPU."""
    return setup.device_context() if setup.device_context is not None else contextlib.nullcontext()


def _run(fn: Callable[..., Any], args: Any, kwargs: Any, backend: ClientBackend, rank: int) -> tuple:
    """Run the rank's function; return the last message of the main channel (RESULT, EXIT, FORWARDED or RAISE)."""
    try:
        backend.start_clock()
        result = fn(*args, **kwargs)
        try:
            return (RESULT, pickling.dumps(result), backend._cpu_delta())
        except Exception as e:  # noqa: BLE001
            return exception_message(DistRuntimeError(format_message(
                "simulator.run", "the rank's function returned an object that cannot be sent back from its "
                f"process ({type(e).__name__}: {e})", rank=rank, values={"result": type(result).__name__},
                fix="return tensors, numbers, strings or other picklable objects (or None) under "
                    "isolation='process'")))
    except SystemExit as e:
        return (EXIT, e.code if e.code is None or isinstance(e.code, int) else str(e.code), rank_traceback(e))
    except BaseException as e:  # noqa: BLE001  every failure is reported by the coordinator
        eid = getattr(e, "_tp_forwarded", None)
        return (FORWARDED, eid, rank_traceback(e)) if eid is not None else exception_message(e)


# ---------------------------------------------------------------------------
# a warm interpreter (see .warm): forks rank processes
# ---------------------------------------------------------------------------
def serve(fd: int) -> None:
    """The warm interpreter's loop: fork a rank process per request, report each one's exit status."""
    # (this module's imports are the ones every rank process would pay for)
    ctrl = socket.socket(fileno=fd)
    children: set[int] = set()
    # a coordinator killed outright (SIGKILL) leaves its rank processes and arenas to this interpreter
    cleanup.on_parent_death(int(sys.argv[2]) if len(sys.argv) > 2 else os.getppid(), lambda: children)
    threads = _thread_count()

    def gone() -> None:
        """The coordinator is gone (it ended, or was killed): so are its rank processes, and this interpreter."""
        for pid in children:
            try:
                os.killpg(pid, 9)
            except OSError:
                pass
        os._exit(0)

    def tell(kind: bytes, pid: int, status: int) -> None:
        try:
            ctrl.send(WARM_RECORD.pack(kind, pid, status))
        except OSError:  # (a coordinator that ended while this interpreter imported ahead: no traceback)
            gone()

    # a rank process's end wakes this loop at once (SIGCHLD writes to the pipe): the coordinator waits for it
    woken, wake = os.pipe()
    for end in (woken, wake):
        os.set_blocking(end, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # (a handler of Python's: the wakeup fd is written)
    signal.set_wakeup_fd(wake)
    tell(WARM_READY, os.getpid(), 0)
    while True:
        ready, _, _ = select.select([ctrl, woken], [], [], 0.05)
        if woken in ready:
            while _drained(woken):
                pass
        for pid, code in _reap(children):
            tell(WARM_EXITED, pid, code)
        if ctrl not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(ctrl, warm.MAX_REQUEST, 8)
        except OSError:
            data, fds = b"", []
        if not data:
            gone()
        env, preload = pickle.loads(data)
        threads = min(threads, _thread_count())  # (a thread torch starts at import may end later)
        culprit = _preload(preload, threads, lambda: [tell(WARM_EXITED, pid, code) for pid, code in _reap(children)])
        if culprit is not None:  # an import started a thread: forking now could copy a lock it holds
            for f in fds:
                os.close(f)
            # (which one: never imported ahead again)
            tell(WARM_TAINTED, culprit, _thread_count())
            os._exit(3)
        if env is None:  # import ahead only (between two runs)
            tell(WARM_LOADED, 0, 0)
            continue
        # what this interpreter holds (torch, the simulator, the libraries imported ahead) is never garbage: frozen,
        # a rank process's collections skip it (a full one otherwise walks torch's objects, about 0.1-0.2 s)
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)  # (this loop's, not the program's)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(woken)
            os.close(wake)
            _rank_process(ctrl, env, fds)  # never returns
        for f in fds:
            os.close(f)
        children.add(pid)
        tell(WARM_FORKED, pid, 0)


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _drained(fd: int) -> bool:
    """Read what is waiting on a non-blocking pipe; False once it is empty."""
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _preload(names: list[str], threads: int, reap: Callable[[], Any]) -> int | None:
    """Import, once in the warm interpreter, the libraries earlier rank processes imported (see :func:`library_modules`).

    Returns the index in ``names`` of the first whose import left more than ``threads`` threads running (the
    interpreter must not fork any more), else None.  ``reap`` reports the rank processes that ended meanwhile (a
    long import ahead must not hold up the coordinator, which waits for their exit status).
    """
    for i, name in enumerate(names):
        reap()
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001  a rank process that needs it imports it itself (and sees why not)
                pass
            if _thread_count() > threads:
                return i
    return None


def library_modules(names: set[str] | list[str]) -> list[str]:
    """The modules of ``names`` that are libraries (the standard library, site-packages, tensorplay, the simulator).

    A warm interpreter may import these before it forks: their import does not depend on the rank.  The
    program's own modules (its script, its tests) are never imported ahead: their top level runs in each
    rank process, as under torchrun.
    """
    roots = tuple(os.path.realpath(p) + os.sep for p in {sysconfig.get_paths()[k] for k in
                                                          ("stdlib", "platstdlib", "purelib", "platlib")})
    ours = ("tensorplay", "simulator", "conformance")
    out = []
    for name in sorted(names):
        if name in ("__main__", "__mp_main__"):
            continue
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None)
        if (name.split(".")[0] in ours or (path and os.path.realpath(path).startswith(roots))) and \
                not _mentions_per_run_env(path):
            out.append(name)
    return out


def _mentions_per_run_env(path: str | None) -> bool:
    """Whether the module's source names a variable that is set afresh for every run (:data:`.warm.PER_RUN_ENV`):
    imported ahead, it would keep the value of an earlier run."""
    if not path or not path.endswith(".py"):
        return False
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError:
        return True
    return any(var.encode() in text for var in warm.PER_RUN_ENV)


def _reap(children: set[int]) -> list[tuple[int, int]]:
    """``(pid, returncode)`` of the rank processes that ended (returncode as Popen's: -signal or the exit code)."""
    done = []
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid in children:
            children.discard(pid)
            done.append((pid, os.waitstatus_to_exitcode(status)))
    return done


def _rank_process(ctrl: socket.socket, env: dict[str, str], fds: list[int]) -> None:
    """In the forked child: become a rank process (own session, own environment, the caller's stdio) and run."""
    code = 1
    try:
        os.setsid()  # the coordinator stops a rank and what it started with one killpg
        ctrl.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (the warm interpreter's handler is not the program's)
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # dies with its warm interpreter, and so with the coordinator
        except Exception:  # noqa: BLE001
            pass
        chan, *stdio = fds
        for target, f in zip((0, 1, 2), stdio):
            os.dup2(f, target)
            os.close(f)
        os.environ.clear()
        os.environ.update(env)
        main(chan)
        code = 0
        _finalize()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _finalize() -> None:
    """What an interpreter does when its main module ends: join non-daemon threads, run atexit handlers."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    finally:
        _skip_operator_deregistration()
        atexit._run_exitfuncs()


def _skip_operator_deregistration() -> None:
    """Detach the exit-time finalizers that deregister each ``torch.library.Library`` (torch's, the program's)
    from the dispatcher.

    They were most of a rank process's end (20-80 ms: a ``torch._C`` reset for each of about 170 libraries), and
    nothing outside the process can see them: it ends by ``os._exit`` right after.  The program's atexit handlers
    and its other finalizers still run."""
    import torch.library

    deregister = getattr(torch.library, "_del_library", None)
    if deregister is None:
        return
    for fin, info in list(getattr(weakref.finalize, "_registry", {}).items()):
        if getattr(info, "func", None) is deregister:
            fin.detach()
