"""Warm interpreters for rank processes: one fork server per ``PYTHONHASHSEED``, forked once per rank and run.

Starting a rank process means an interpreter and ``import torch``: about two
seconds of CPU each, which made a process-isolated world cost seconds per run.
The hash seed is fixed when an interpreter starts, so a classic fork server
(one warm parent for every child) would give every rank the same hash order.
Instead this module keeps one *warm interpreter* per hash seed and start
environment: started once (with that ``PYTHONHASHSEED``), it imports torch and
the simulator, then never runs a program; each rank process of each run is a
fresh ``fork()`` of it.  A rank process therefore starts clean — its own
globals, singletons and hash order, nothing left by an earlier run — in
milliseconds.

What differs from a freshly spawned interpreter: torch, tensorplay and the
simulator are already imported when the program starts.  The environment a
library reads when it is loaded (``OMP_NUM_THREADS`` for OpenMP, say) is the
one the warm interpreter was started with, which is why the environment is part
of its key; only the per-rank variables (``RANK``, ``MASTER_PORT``, ...) are
set after the fork.  ``TENSORPLAY_SIM_WARM=0`` spawns every rank process
afresh instead.

Lifetimes: a warm interpreter dies with the process that started it (Linux's
parent-death signal, and the end of its control socket); a rank process dies
with its warm interpreter, which reports each rank's exit status to the
coordinator (:class:`Forked` is its ``Popen``-like handle).  The warm
interpreter's loop is :func:`simulator.isolation.child.serve`; this module is the
coordinator's side.

Warm interpreters also learn: a rank process reports the libraries it imported
(:func:`~simulator.isolation.child.library_modules`: the standard library,
site-packages, tensorplay and the simulator, never the program's own modules),
and its warm interpreter imports them before its next fork, unless an import
would start a thread (a fork copies no thread and might copy a lock one held).
"""
from __future__ import annotations

import atexit
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

from simulator.core.hash_seeds import cli_options, rank_envs, torchrun_defaults
from simulator.isolation.messages import (
    WARM_EXITED, WARM_FORKED, WARM_LOADED, WARM_READY, WARM_RECORD, WARM_TAINTED,
)

__all__ = ["Forked", "WarmPool", "POOL", "PROLOGUE", "SlowStartNote", "enabled", "prestart_for_command_line"]

#: variables that differ between the ranks or the runs of one world (and pytest's name of the running test):
#: not part of a warm interpreter's key, set in the rank process after the fork
PER_RANK_ENV = frozenset({"PYTEST_CURRENT_TEST",
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"})

#: variables PyTorch's distributed test harness sets afresh for every test (distributed_test.py's temporary folder
#: and rendezvous file): not part of a warm interpreter's key either, so consecutive tests share warm interpreters;
#: a library that mentions one of them is never imported ahead (it may read it at import: see child.library_modules)
PER_RUN_ENV = frozenset({"TEMP_DIR", "INIT_METHOD"})

#: variables torch writes into the coordinator's environment as it runs and reads at each use, never at import
#: (``torch._inductor``'s cache folder, set by the first compile or test-harness import that asks for it): not part
#: of the key, or a coordinator that compiled once would start every warm interpreter again
LATE_ENV = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"})


def _key(env: dict[str, str]) -> tuple:
    """What a warm interpreter for ``env`` must have been started with (its forks get all of ``env``)."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k not in PER_RANK_ENV and k not in PER_RUN_ENV and k not in LATE_ENV))

_MAX_WARM = 16  # warm interpreters kept (each about the memory of an interpreter with torch imported)
_START_S = 300.0  # bound on a warm interpreter's start-up (an interpreter and ``import torch``)
_REPLY_S = 30.0  # bound on the answer to a fork request
MAX_REQUEST = 1 << 17  # bytes of one fork request (its environment and the libraries to import ahead)

#: the first lines of every process the simulator starts as ``python -c ... <fd> <coordinator pid>``: the
#: parent-death signal is armed before the slow imports, and the parent checked after arming it, so the process
#: never outlives the coordinator, even one that dies while it is still starting
PROLOGUE = ("import ctypes, os, signal, sys\n"
            "try:\n"
            "    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)\n"
            "except Exception:\n"
            "    pass\n"
            "if os.getppid() != int(sys.argv[2]):\n"
            "    os._exit(1)\n")
_SERVER = PROLOGUE + "from simulator.isolation.child import serve\nserve(int(sys.argv[1]))\n"


_SLOW_START_S = 2.0  # a world start-up longer than this says, once per process, why it is slow
_said_slow = False


class SlowStartNote:
    """Says on stderr, once per process, why a world's start-up is slow when it takes more than ~2 s (the first
    world pays for an interpreter and ``import torch`` per rank); silent when start-up is quick.  Cancel it when
    the rank processes have started."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._timer: threading.Timer | None = None
        if not _said_slow:
            self._timer = threading.Timer(_SLOW_START_S, self._say)
            self._timer.daemon = True
            self._timer.start()

    def _say(self) -> None:
        global _said_slow
        if _said_slow:
            return
        _said_slow = True
        why = ("first run imports torch; later runs reuse them" if enabled()
               else "TENSORPLAY_SIM_WARM=0: every run starts them afresh")
        try:
            sys.stderr.write(f"simulator: starting {self._n} rank interpreters ({why})\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001  (a closed stderr: the note is only a courtesy)
            pass

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def enabled() -> bool:
    """Whether rank processes are forked from warm interpreters (Linux, unless ``TENSORPLAY_SIM_WARM=0``)."""
    return (sys.platform.startswith("linux") and hasattr(os, "fork")
            and os.environ.get("TENSORPLAY_SIM_WARM", "1") not in ("0", "false", "no", "off"))


# ---------------------------------------------------------------------------
# the coordinator's side
# ---------------------------------------------------------------------------
class Forked:
    """A ``subprocess.Popen``-like handle on a rank process forked by a warm interpreter."""

    def __init__(self, server: "_Server", pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_status(self.pid)
        return self.returncode

    def wait(self, timeout: float) -> int:
        """Its return code once it ended; ``subprocess.TimeoutExpired`` after ``timeout`` seconds (always bounded)."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout)
            self._server.await_message(min(left, 0.05))  # (the warm interpreter says at once when it reaps one)
        return self.returncode  # type: ignore[return-value]


class _Server:
    """The coordinator's handle on one warm interpreter."""

    def __init__(self, proc: subprocess.Popen, ctrl: socket.socket) -> None:
        self.proc = proc
        self.ctrl = ctrl
        self.lock = threading.Lock()
        self.ready = False
        self.exits: dict[int, int] = {}
        self.preload: list[str] = []  # libraries its rank processes imported: imported ahead of the next fork
        self.sent = 0  # how many of them it was asked to import
        self.batch: list[str] = []  # the ones of the last request
        self.tainted = False  # an import ahead started a thread: it refused to fork and ended
        self.culprit = -1  # which of its last batch started a thread (-1: not known)
        self.loading = False  # it is importing ahead (between two runs): a fork request waits for that
        self.replies: list[int] = []  # the pids of rank processes forked and not yet claimed (see ask_fork)
        self.asked: list[float] = []  # the deadlines of the fork requests not answered yet, oldest first

    def _read(self, timeout: float) -> tuple[bytes, int, int] | None:
        """One message from the warm interpreter within ``timeout`` s (None: none yet; EOFError: it is gone)."""
        r, _, _ = select.select([self.ctrl], [], [], timeout)
        if not r:
            return None
        data = self.ctrl.recv(WARM_RECORD.size)
        if not data:
            raise EOFError
        kind, pid, status = WARM_RECORD.unpack(data)
        if kind == WARM_EXITED:
            self.exits[pid] = status
        elif kind == WARM_FORKED:
            self.replies.append(pid)
        elif kind == WARM_READY:
            self.ready = True
        elif kind == WARM_LOADED:  # (see import_ahead)
            self.loading = False
        elif kind == WARM_TAINTED:
            self.tainted = True
            self.culprit = pid  # the index in its last batch of the import that started a thread
        return kind, pid, status

    def await_ready(self, deadline: float) -> bool:
        with self.lock:
            try:
                while not self.ready and time.monotonic() < deadline:
                    if self._read(0.2) is None and self.proc.poll() is not None:
                        return False
            except (EOFError, OSError):
                return False
            return self.ready

    def _request(self, env: dict[str, str] | None) -> tuple[bytes, bool]:
        """A request for ``env`` (None: import ahead only) with the libraries not yet sent; (bytes, any?)."""
        import pickle

        preload = self.preload[self.sent:]
        data = pickle.dumps((env, preload))
        while len(data) > MAX_REQUEST and preload:  # the rest goes with the next requests
            preload = preload[:len(preload) // 2]
            data = pickle.dumps((env, preload))
        self.batch = preload
        self.sent += len(preload)
        return data, bool(preload)

    def import_ahead(self) -> None:
        """Between two runs: import the libraries learned since the last request now, not at the next fork."""
        with self.lock:
            if self.tainted or self.proc.poll() is not None:
                return
            data, any_ = self._request(None)
            if not any_:
                return
            try:
                self.ctrl.send(data)
            except OSError:
                return
            self.loading = True

    def ask_fork(self, chan: int, env: dict[str, str]) -> None:
        """Send a fork request and return at once: the ranks of one world are forked by their warm interpreters
        side by side (a fork of an interpreter with torch imported takes 10-20 ms); :meth:`forked_process`
        takes the answers in the order they were asked for."""
        with self.lock:
            data, preload = self._request(env)
            socket.send_fds(self.ctrl, [data], [chan, 0, 1, 2])
            self.asked.append(time.monotonic() + _REPLY_S + (_START_S if preload or self.loading else 0.0))

    def forked_process(self) -> Forked:
        """The rank process of the oldest fork request not claimed yet (OSError: it was not forked)."""
        with self.lock:
            deadline = self.asked.pop(0)
            while not self.replies and time.monotonic() < deadline:
                try:
                    msg = self._read(0.2)
                except (EOFError, OSError):  # it is gone: the caller starts the rank process afresh
                    break
                if (msg is not None and msg[0] == WARM_TAINTED) or self.proc.poll() is not None:
                    break
            if self.replies:
                return Forked(self, self.replies.pop(0))
            raise OSError("the warm interpreter did not fork a rank process")

    def await_message(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the next message (an exit status, most often), and keep it."""
        with self.lock:
            try:
                self._read(timeout)
            except (EOFError, OSError):
                pass

    def exit_status(self, pid: int) -> int | None:
        with self.lock:
            if not self.drain() and pid not in self.exits:
                self.exits[pid] = -9  # the warm interpreter died: so did its rank processes (parent-death signal)
            return self.exits.pop(pid, None)

    def drain(self) -> bool:
        """Read the messages already sent (caller holds ``lock``); False once the warm interpreter is gone."""
        try:
            while self._read(0) is not None:
                pass
        except (EOFError, OSError):
            return False
        return True

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.tainted

    def close(self) -> None:
        if not self.ready:
            with self.lock:
                self.drain()  # (it may have said it is ready since)
        if not self.ready:  # still importing torch, never forked (a prestarted one nobody used): no need to wait
            self.proc.kill()
        try:
            self.ctrl.close()  # the warm interpreter kills its rank processes and exits
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5.0)


class WarmPool:
    """Warm interpreters by (hash seed, start environment): at most ``_MAX_WARM`` of them, or as many as the last
    world had ranks if it had more (least recently used go)."""

    def __init__(self) -> None:
        self._servers: dict[tuple, _Server] = {}
        self._leased: dict[int, int] = {}  # id(server) -> runs using it now (never closed while used)
        self._refused: set[str] = set()  # modules whose import ahead started a thread
        self._hints: list[str] = []  # libraries every rank process will import (see hint)
        # warm interpreters kept between runs: a world of more ranks than _MAX_WARM keeps its own for the next run
        # (PyTorch's harness starts the same world for every test of a class); the peak is that world's anyway
        self._keep = _MAX_WARM
        self._lock = threading.Lock()
        self._starter: threading.Thread | None = None
        self._requests: "queue.Queue[tuple[list[str], dict[str, str], socket.socket, queue.Queue]]" = queue.Queue()

    def _start_thread(self) -> None:
        # The parent-death signal fires when the *thread* that started a process ends, so warm interpreters are
        # started by one thread that lives as long as this process.
        def starter() -> None:
            while True:
                argv, env, child, reply = self._requests.get()
                try:
                    reply.put(subprocess.Popen(argv, pass_fds=(child.fileno(),), env=env, start_new_session=True))
                except BaseException as e:  # noqa: BLE001
                    reply.put(e)

        self._starter = threading.Thread(target=starter, name="sim-warm-starter", daemon=True)
        self._starter.start()

    def _spawn(self, env: dict[str, str]) -> _Server:
        if self._starter is None:
            self._start_thread()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        reply: "queue.Queue[Any]" = queue.Queue()
        try:
            self._requests.put(([sys.executable, "-c", _SERVER, str(child.fileno()), str(os.getpid())], env, child,
                                reply))
            proc = reply.get(timeout=60.0)
        finally:
            child.close()
        if isinstance(proc, BaseException):
            parent.close()
            raise proc
        return _Server(proc, parent)

    def _live(self, key: tuple) -> tuple[_Server, bool]:
        """The warm interpreter for ``key``, started if there is none alive (caller holds ``_lock``); it becomes
        the most recently used.  (server, whether it was started now)."""
        s = self._servers.pop(key, None)
        if s is not None and not s.alive():
            with s.lock:
                s.drain()  # (its last words: WARM_TAINTED if an import ahead started a thread)
        started = s is None or not s.alive()
        if started:
            carry: list[str] = []
            if s is not None:
                if s.tainted:  # importing a module of its last batch ahead started a thread: never again
                    culprit = s.culprit
                    self._refused.update(s.batch[culprit:culprit + 1] if 0 <= culprit < len(s.batch) else s.batch)
                carry = [n for n in s.preload if n not in self._refused]
                s.close()
            s = self._spawn(dict(key))
            known = set(carry)
            s.preload = carry + [n for n in self._hints if n not in known and n not in self._refused]
        self._servers[key] = s  # most recently used last
        return s, started

    def servers(self, envs: list[dict[str, str]]) -> list[_Server | None]:
        """A ready warm interpreter for each start environment (None where one could not be started)."""
        with self._lock:
            out = [self._live(_key(env))[0] for env in envs]
            self._keep = max(_MAX_WARM, len({id(s) for s in out}))
            for s in set(out):
                self._leased[id(s)] = self._leased.get(id(s), 0) + 1
            self._trim()
        deadline = time.monotonic() + _START_S
        return [s if s.await_ready(deadline) else None for s in out]

    def prestart(self, envs: list[dict[str, str]]) -> int:
        """Start warm interpreters for ``envs`` now and return at once (how many were started): a world that
        starts later with these environments finds them importing torch already.  Callers that know a world's ranks
        before they can start it (pytest collecting a suite, the command line importing torch) overlap the two
        start-ups; a guess that misses costs only the interpreters started for it (dropped as least recently
        used)."""
        with self._lock:
            return sum(self._live(key)[1] for key in dict.fromkeys(_key(env) for env in envs))

    def release(self, servers: list["_Server | None"]) -> None:
        """A run that used ``servers`` has ended: keep at most ``_MAX_WARM`` warm interpreters, or the last world's
        if it had more (its next run, a class's next test, forks them again)."""
        with self._lock:
            for s in {id(s): s for s in servers if s is not None}.values():
                n = self._leased.get(id(s), 0) - 1
                if n > 0:
                    self._leased[id(s)] = n
                else:
                    self._leased.pop(id(s), None)
            self._trim()

    def _trim(self) -> None:
        """Close the least recently used warm interpreters no run uses, down to the number kept (holds ``_lock``)."""
        for key in list(self._servers):
            if len(self._servers) <= self._keep:
                break
            s = self._servers[key]
            if id(s) not in self._leased:
                del self._servers[key]
                s.close()

    def learn(self, server: _Server, names: list[str]) -> None:
        """Rank processes of ``server`` imported ``names``: its next fork (and new ones) imports them ahead."""
        with self._lock:
            known = set(server.preload)
            server.preload.extend(n for n in names if n not in known and n not in self._refused)
        server.import_ahead()  # while the program runs on, not when the next world starts

    def hint(self, names: list[str]) -> None:
        """Libraries the coming rank processes will import, known before any of them runs (a test file's modules,
        which the pytest process imported too): imported before the first fork, where :meth:`learn` would have
        them imported again after the first world, in every warm interpreter, while the next world waits."""
        with self._lock:
            known = set(self._hints)
            new = [n for n in names if n not in known and n not in self._refused]
            self._hints.extend(new)
            for s in self._servers.values():
                have = set(s.preload)
                s.preload.extend(n for n in new if n not in have)

    def close(self) -> None:
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for s in servers:
            s.close()

    def _forget(self) -> None:
        """In a process forked from this one: the warm interpreters are its parent's (their sockets are closed
        here, never used: one coordinator per warm interpreter); it starts its own when it needs them."""
        for s in self._servers.values():
            try:
                s.ctrl.close()
            except OSError:
                pass
        self._servers = {}
        self._leased = {}
        self._lock = threading.Lock()
        self._starter = None  # the starter thread did not survive the fork
        self._requests = queue.Queue()


def prestart_for_command_line(args: Sequence[str]) -> None:
    """``python -m simulator --isolation process --nproc-per-node N script``: start the ranks' warm interpreters
    now, before that process imports torch, so that the start-ups overlap (each imports torch: seconds).  Only for
    plainly spelled command lines of one node; a guess that misses costs the interpreters it started."""
    options = cli_options(args)
    if options is None or options.get("--isolation") != "process" or not enabled():
        return
    nproc = options.get("--nproc-per-node", options.get("--nproc_per_node", ""))
    seed = options.get("--seed", "0")
    if not nproc.isdigit() or int(nproc) < 1 or not seed.lstrip("-").isdigit() or options.get("--nnodes", "1") != "1":
        return
    n = int(nproc)
    # the environment World gives torchrun-style ranks, less the per-rank variables (not part of the key)
    POOL.prestart(rank_envs(int(seed), n, dict(os.environ, **torchrun_defaults(os.environ, n))))


#: the pool of this process (closed at exit; its warm interpreters would die with the process anyway)
POOL = WarmPool()
atexit.register(POOL.close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=POOL._forget)
