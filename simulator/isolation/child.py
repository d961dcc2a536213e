"""The rank process: runs the program's function with a client backend that forwards every call to its proxy.

Started by :mod:`simulator.isolation.proxy` as ``python -c ... <fd>`` with its
own ``PYTHONHASHSEED``; ``fd`` is its end of a socket pair to the coordinator.
tensorplay.distributed in this process is bound to :class:`ClientBackend`
(named ``"sim"``, so ``init_process_group()`` returns at once and the
torch.distributed adapter binds torch to it as on thread ranks).  Each call
stages its tensors in shared memory (:mod:`._wire`), sends its arguments and
call site, and waits for the proxy's answer: the simulator in the coordinator
does the matching, the checks and the arithmetic.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

import torch

from tensorplay.distributed import _state
from tensorplay.distributed.backends.base import Backend, Work
from tensorplay.distributed.errors import DistRuntimeError, format_message
from tensorplay.distributed.group import ProcessGroup

from simulator.core.backend import SimBackend
from simulator.core.callsite import call_site
from simulator.isolation import _wire, pickling, warm
from simulator.isolation._wire import OUTPUTS, SHARED_BASE, GroupRef, TensorRef, align_down, align_up, flatten, span_of, storage_bytes
from simulator.isolation.staging import ClientWork, Completions, Staged, Staging

__all__ = ["ClientBackend", "ClientWork", "main", "serve", "library_modules"]

def _result_tensors(name: str, args: tuple) -> list[torch.Tensor]:
    """What ``Work.result()`` gives for this call (the tensors it writes), as on thread ranks."""
    if name in ("barrier", "send"):
        return []
    pos = OUTPUTS[name]
    out = args[pos[0]] if pos else None
    if out is None:
        return []
    return [out] if isinstance(out, torch.Tensor) else list(out)


class ClientBackend(SimBackend):
    """tensorplay.distributed's backend in a rank process: every call is run by the rank's proxy in the coordinator.

    A :class:`~simulator.core.backend.SimBackend` for everything that asks whether the calling rank is simulated
    (the torch adapter binds torch.distributed to it); it overrides every operation and shares no state with
    the simulator's own backend.
    """

    name = "sim"

    def __init__(self, conn: Connection, rank: int, world_size: int, arena_dir: str) -> None:
        Backend.__init__(self, rank, world_size)  # not SimBackend's: no rank state lives in this process
        self._conn = conn
        self._arena_dir = arena_dir
        self._staging = Staging(arena_dir, rank)  # arena regions (the copies themselves run unlocked)
        self._works = Completions()  # async operations whose completion the coordinator has not reported yet
        # the main channel: the rank's main thread, and threads this process did not start during the run
        # (an RPC agent's native threads) share it, one request at a time; every thread the program starts
        # has a channel of its own (see .rank_threads)
        self._lock = threading.RLock()
        self._main_ident = threading.get_ident()
        self._pid = os.getpid()  # a process forked from this one (a DataLoader worker) is not the rank
        self._tl = threading.local()  # .chan: the calling thread's own channel
        self.exchanges = 0  # requests sent so far (a sleep-polling loop is two sleeps with none between)
        self._cpu = threading.local()
        self._world_key = object()
        #: the program's shared-memory storages the proxy has mapped: address -> (id, weak ref, bytes)
        self._shared: dict[int, tuple[int, Any, int]] = {}
        self._slock = threading.Lock()
        self._next_sid = 0

    # -- life cycle -------------------------------------------------------
    @classmethod
    def create(cls, *, rank: int, world_size: int, init_method: str | None, store: Any,
               timeout: timedelta) -> "ClientBackend":
        raise DistRuntimeError(format_message(
            "init_process_group", "the 'sim' backend only runs inside a simulated world", values={"backend": "sim"},
            fix="run the code with simulator.run(fn, world_size, isolation='process')"))

    def world_handle(self) -> int:
        return 0

    def new_group_handle(self, ranks: tuple[int, ...], timeout: timedelta) -> int | None:
        return self._forward("new_group_handle", (tuple(ranks),))

    def member_group_handle(self, ranks: tuple[int, ...]) -> int:
        return self._forward("member_group_handle", (tuple(ranks),))

    def world_key(self) -> object:
        """One object per simulated world; this process holds one rank of one world."""
        return self._world_key

    def shutdown(self) -> None:
        return None

    def supports_device(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def device_for(self, kind: str) -> torch.device:
        return torch.device(kind)  # a rank process has no simulated device of its own (CPU ranks only)

    # -- the channel ------------------------------------------------------
    def _request(self, msg: tuple, fds: Sequence[int] = ()) -> Any:
        """Send ``msg`` (and ``fds``) on the calling thread's channel; return the proxy's answer or raise its error."""
        self._own_process("torch.distributed")
        return self._exchange(msg, fds)

    def _exchange(self, msg: tuple, fds: Sequence[int] = ()) -> Any:
        """:meth:`_request` from a caller that has checked it runs in the rank process."""
        self.exchanges += 1
        chan = getattr(self._tl, "chan", None)
        if chan is not None:
            reply = _exchange(chan, msg, fds)
        else:
            with self._lock:
                reply = _exchange(self._conn, msg, fds)
        # every answer names the async operations completed since the last one: their outputs are the
        # program's now, waited or not (as on gloo), and their staging is free
        self._works.done(reply[-1])
        return _answer(reply)

    def _own_process(self, call: str) -> None:
        """Refuse a call from a process forked from the rank process (before it touches the rank's arenas)."""
        if os.getpid() != self._pid:
            raise DistRuntimeError(format_message(
                call, "a process forked from a rank process is not a "
                "rank: its inherited channel belongs to the rank (as on torchrun, where a forked child cannot use "
                "its parent's process group)", rank=self.rank, values={"pid": os.getpid(), "rank_pid": self._pid},
                fix="communicate from the rank process itself; pass data to its workers through queues or pipes"))

    def has_channel(self) -> bool:
        """Whether the calling thread is an actor of this rank: the main thread, or one the program started."""
        if os.getpid() != self._pid:
            return False
        return threading.get_ident() == self._main_ident or getattr(self._tl, "chan", None) is not None

    def main_returned(self) -> None:
        """The rank's function has ended: the main thread is no longer an actor of the rank."""
        self._main_ident = None

    def on_main_thread(self) -> bool:
        return threading.get_ident() == self._main_ident and os.getpid() == self._pid

    def bind_channel(self, chan: Connection | None) -> None:
        """The calling thread talks to its own actor over ``chan`` (``None``: unbind)."""
        self._tl.chan = chan

    def _cpu_delta(self) -> float:
        now = time.thread_time()
        last = getattr(self._cpu, "mark", None)
        self._cpu.mark = now
        return 0.0 if last is None else now - last

    def start_clock(self) -> None:
        """The rank's compute starts counting now (its CPU time is sent with each call)."""
        self._cpu.mark = time.thread_time()

    def exclude_cpu(self, seconds: float) -> None:
        """CPU time that is not the program's compute (an import) moves the calling thread's mark past it."""
        mark = getattr(self._cpu, "mark", None)
        if mark is not None:
            self._cpu.mark = mark + seconds

    def optimizer_step(self, optimizer: Any) -> None:
        """A ``torch.optim`` step ended: the proxy marks the end of a training step on the rank's clock."""
        self._request(("step", id(optimizer), self._cpu_delta()))
        self._cpu.mark = time.thread_time()

    def _stage(self, name: str, args: tuple, staged: Staged) -> list[Any]:
        """Copy the tensors of ``args`` into an arena; return the arguments with tensors replaced by places."""
        tensors = [t for a in args for t in flatten(a)]
        spans: dict[int, list[int]] = {}  # storage address -> [lo, hi)
        shared: dict[int, int] = {}  # storage address -> id, for storages already in shared memory (not copied)
        for t in tensors:
            if t.device.type != "cpu":
                raise DistRuntimeError(format_message(
                    name, "process-isolated ranks take CPU tensors only", rank=self.rank,
                    values={"device": str(t.device)}, fix="move the tensor to the CPU, or use isolation='thread'"))
            if t.numel() == 0:
                continue
            key = t.untyped_storage().data_ptr()
            if key in shared or self._shared_id(t, key, shared):
                continue
            lo, hi = span_of(t)
            s = spans.get(key)
            if s is None:
                spans[key] = [align_down(lo), hi]
            else:
                s[0], s[1] = min(s[0], align_down(lo)), max(s[1], hi)
        need = sum(align_up(hi - lo) for lo, hi in spans.values())
        arena, top = None, 0
        if need:  # the call's region; the copies below run unlocked
            arena, top = self._staging.alloc(need, name)
            staged.regions.append((arena, top))
        base: dict[int, int] = {}
        for t in tensors:
            if t.numel() == 0:
                continue
            key = t.untyped_storage().data_ptr()
            if key in base or key in shared:
                continue
            lo, hi = spans[key]
            off = top
            top += align_up(hi - lo)
            arena.bytes[off:off + hi - lo].copy_(storage_bytes(t)[lo:hi])
            base[key] = off - lo  # arena byte offset of the storage's byte 0
        out_pos = set(OUTPUTS.get(name, ()))

        def ref(t: torch.Tensor, is_out: bool) -> TensorRef:
            es = t.element_size()
            if t.numel() == 0:
                r = TensorRef((-1, 0, t.dtype, tuple(t.shape), tuple(t.stride()), t.requires_grad))
                return r
            key = t.untyped_storage().data_ptr()
            sid = shared.get(key)
            if sid is not None:  # the simulator works on the program's own shared bytes: nothing to copy back
                return TensorRef((sid, t.storage_offset(), t.dtype, tuple(t.shape), tuple(t.stride()),
                                  t.requires_grad))
            off = (base[key] + t.storage_offset() * es) // es
            r = TensorRef((arena.aid, off, t.dtype, tuple(t.shape), tuple(t.stride()), t.requires_grad))
            if is_out:
                staged.outputs.append((t, arena.view(off, t.dtype, tuple(t.shape), tuple(t.stride()))))
            return r

        enc: list[Any] = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                enc.append(ref(a, i in out_pos))
            elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
                enc.append([ref(x, i in out_pos) if isinstance(x, torch.Tensor) else x for x in a])
            elif isinstance(a, ProcessGroup):
                enc.append(GroupRef((a.handle,)))
            else:
                enc.append(a)
        return enc

    def _shared_id(self, t: torch.Tensor, key: int, shared: dict[int, int]) -> bool:
        """Whether ``t``'s storage is in shared memory (then ``shared[key]`` is its id, mapped by the proxy)."""
        st = t.untyped_storage()
        if not st.is_shared() or st.data_ptr() % 64:
            return False
        sid = self._known_sid(key, st)
        if sid is not None:
            shared[key] = sid
            return True
        try:
            fd, size = st._share_fd_cpu_()
        except Exception:  # noqa: BLE001  shared another way (a file name): staged like any tensor
            return False
        from torch.multiprocessing.reductions import StorageWeakRef

        # registered before any call names it (and under a lock, so no other thread of this rank names it first)
        with self._slock:
            sid = self._known_sid(key, st)  # (another thread of the rank may have registered it meanwhile)
            if sid is None:
                sid = SHARED_BASE + self._next_sid
                self._next_sid += 1
                self._exchange(("share", sid, size), (fd,))
                self._shared[key] = (sid, StorageWeakRef(st), st.nbytes())
        shared[key] = sid
        return True

    def _known_sid(self, key: int, st: torch.UntypedStorage) -> int | None:
        """The id the proxy knows the shared storage ``st`` (at address ``key``) by, if it still is that storage."""
        known = self._shared.get(key)
        if known is not None and not known[1].expired() and known[2] == st.nbytes():
            return known[0]
        return None

    def _forward(self, name: str, args: tuple, async_op: bool = False) -> Any:
        self._own_process(name)
        site = call_site(1)
        staged = Staged(self._staging)
        try:
            enc = self._stage(name, args, staged) if name in OUTPUTS else list(args)
            value = self._exchange(("call", name, enc, site, _state.current_backward(), self._cpu_delta()))
        except BaseException:
            staged.release()
            self._cpu.mark = time.thread_time()
            raise
        self._cpu.mark = time.thread_time()
        if async_op:
            return self._works.track(ClientWork(self, value, staged, _result_tensors(name, args)))
        try:
            staged.copy_out()
        finally:
            staged.release()
        return value

    # -- collectives and point to point (validated by tensorplay's API in this process) --------------
    def barrier(self, group: ProcessGroup, async_op: bool) -> Work | None:
        return self._forward("barrier", (group, async_op), async_op)

    def broadcast(self, tensor: torch.Tensor, root: int, group: ProcessGroup, async_op: bool) -> Work | None:
        return self._forward("broadcast", (tensor, root, group, async_op), async_op)

    def all_reduce(self, tensor: torch.Tensor, op: Any, group: ProcessGroup, async_op: bool) -> Work | None:
        return self._forward("all_reduce", (tensor, op, group, async_op), async_op)

    def reduce(self, tensor: torch.Tensor, root: int, op: Any, group: ProcessGroup, async_op: bool) -> Work | None:
        return self._forward("reduce", (tensor, root, op, group, async_op), async_op)

    def all_gather(self, output_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup,
                   async_op: bool) -> Work | None:
        return self._forward("all_gather", (output_list, tensor, group, async_op), async_op)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: ProcessGroup,
                               async_op: bool) -> Work | None:
        return self._forward("all_gather_into_tensor", (output, input, group, async_op), async_op)

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, root: int, group: ProcessGroup,
               async_op: bool) -> Work | None:
        return self._forward("gather", (tensor, gather_list, root, group, async_op), async_op)

    def scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, root: int, group: ProcessGroup,
                async_op: bool) -> Work | None:
        return self._forward("scatter", (tensor, scatter_list, root, group, async_op), async_op)

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: Any, group: ProcessGroup,
                       async_op: bool) -> Work | None:
        return self._forward("reduce_scatter", (output, input_list, op, group, async_op), async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: Any, group: ProcessGroup,
                              async_op: bool) -> Work | None:
        return self._forward("reduce_scatter_tensor", (output, input, op, group, async_op), async_op)

    def all_to_all(self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], group: ProcessGroup,
                   async_op: bool) -> Work | None:
        return self._forward("all_to_all", (output_list, input_list, group, async_op), async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], group: ProcessGroup, async_op: bool) -> Work | None:
        return self._forward("all_to_all_single", (output, input, list(output_split_sizes), list(input_split_sizes),
                                                   group, async_op), async_op)

    def send(self, tensor: torch.Tensor, peer: int, group: ProcessGroup, tag: int, async_op: bool) -> Work | None:
        return self._forward("send", (tensor, peer, group, tag, async_op), async_op)

    def recv(self, tensor: torch.Tensor, peer: int | None, group: ProcessGroup, tag: int,
             async_op: bool) -> Work | int:
        return self._forward("recv", (tensor, peer, group, tag, async_op), async_op)


# ---------------------------------------------------------------------------
# errors: the coordinator's exception, rebuilt here; this process's exception, sent there
# ---------------------------------------------------------------------------
def _exchange(conn: Connection, msg: tuple, fds: Sequence[int] = ()) -> tuple:
    """Send ``msg`` (and ``fds``) and return the raw answer (whose last item lists completed operations)."""
    _wire.send(conn, msg)
    if fds:  # descriptors follow the message they belong to (see proxy._Channel.recv_fds)
        with socket.socket(fileno=os.dup(conn.fileno())) as raw:
            socket.send_fds(raw, [b"f"], list(fds))
    return _wire.recv(conn)


def _answer(reply: tuple) -> Any:
    if reply[0] == "ok":
        return reply[1]
    _, eid, mod, qualname, message, attrs, _done = reply
    raise _rebuild(eid, mod, qualname, message, attrs)


def _rebuild(eid: int, mod: str, qualname: str, message: str, attrs: dict) -> BaseException:
    import importlib

    try:
        cls: Any = importlib.import_module(mod)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        exc = cls(message)
    except Exception:  # noqa: BLE001  a class that cannot be rebuilt here keeps its name in the text
        exc = RuntimeError(f"{qualname}: {message}")
    for k, v in attrs.items():
        try:
            setattr(exc, k, v)
        except Exception:  # noqa: BLE001
            pass
    exc._tp_forwarded = eid  # type: ignore[attr-defined]  (the proxy re-raises its own object for it)
    return exc


def _dumps(obj: Any) -> bytes:
    """Pickle ``obj``; what plain pickle refuses (lambdas, closures) goes by value (see :mod:`.pickling`)."""
    from simulator.isolation import pickling

    return pickling.dumps(obj)


def _rank_traceback(e: BaseException) -> str:
    """``e``'s traceback as the program's: without the simulator's frames (nor runpy's, for a script)."""
    from simulator.core.tracebacks import format_rank_traceback

    return format_rank_traceback(e)


def _exception_message(e: BaseException) -> tuple:
    """``("raise", pickled or None, class name, text, traceback text)`` for an exception of the program."""
    tb = _rank_traceback(e)
    try:
        data = _dumps(e)
        pickle.loads(data)
    except Exception:  # noqa: BLE001  an exception that cannot cross processes is sent as its text
        data = None
    return ("raise", data, type(e).__qualname__, str(e), tb)


# ---------------------------------------------------------------------------
# the process's main
# ---------------------------------------------------------------------------
def _honest_clock(backend: ClientBackend) -> None:
    """As on thread ranks: imports are not compute, and each optimizer step marks a training step."""
    import importlib

    from simulator.adapters.clock_hooks import timed_imports

    boot = importlib.import_module("importlib._bootstrap")
    boot._find_and_load = timed_imports(boot._find_and_load, lambda: backend.exclude_cpu)
    from torch.optim.optimizer import register_optimizer_step_post_hook

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
    """Run a script as ``__main__`` with ``sys.argv = [path, *argv]`` (torchrun-style ranks of ``python -m simulator``)."""

    def __init__(self, path: str, argv: list[str]) -> None:
        self.path = path
        self.argv = list(argv)

    def __call__(self) -> None:
        import runpy

        sys.argv = [self.path, *self.argv]
        sys.path.insert(0, os.path.dirname(self.path))
        try:
            runpy.run_path(self.path, run_name="__main__")
        except SystemExit as e:  # sys.exit(0) / sys.exit() is a normal end of a rank
            if e.code not in (None, 0):
                raise


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
            starts = [i for i, f in enumerate(stack) if f[0] == __file__ and f[2] == "main"]
            if starts:  # the program's frames: those below this module's main (not the start-up's)
                stack = stack[starts[-1] + 1:]
            try:
                conn.send((n, stack))
            except OSError:
                return

    threading.Thread(target=serve, name="tensorplay-sim-where", daemon=True).start()


def main(fd: int | None = None) -> None:
    """Entry point of a rank process; ``fd`` (default ``argv[1]``) is its socket to the coordinator."""
    _die_with_parent()  # (armed already by the start-up command; again for a caller that did not)
    sock = socket.socket(fileno=int(sys.argv[1]) if fd is None else fd)
    conn = Connection(sock.detach())
    setup = _wire.recv(conn)
    with socket.socket(fileno=os.dup(conn.fileno())) as raw:
        _, fds, _, _ = socket.recv_fds(raw, 1, 1)  # the socket on which the proxy asks where this rank is
        if setup.get("passed"):  # the descriptors its arguments inherit (pipes, queues, shared tensors)
            _, pickling.received_fds[:], _, _ = socket.recv_fds(raw, 1, setup["passed"])
    _answer_where(Connection(fds[0]), threading.get_ident())
    from multiprocessing import spawn

    from simulator import isolation

    isolation._in_rank_process = True
    rank = setup["rank"]
    before = set(sys.modules)
    try:
        spawn.prepare(setup["prep"])  # the coordinator's sys.path, cwd and main module (as __mp_main__)
        fn, args, kwargs = pickle.loads(setup["payload"])
    except BaseException as e:  # noqa: BLE001
        _wire.send(conn, _exception_message(e))
        return
    from simulator.isolation import rpc_process

    rpc_process.RANK = (rank, setup["world_size"], setup["rpc_port"], setup["mode"])  # init_rpc's rendezvous
    rpc_process.SECRET = setup.get("rpc_secret")  # (the run's: RPC is authenticated by default)
    torch.set_rng_state(setup["torch_rng"])
    random.seed(f"simulator:{setup['seed']}:{rank}")
    backend = ClientBackend(conn, rank, setup["world_size"], setup["arena_dir"])
    from tensorplay.distributed.api import _install_backend

    from simulator.adapters import torch_native

    _install_backend(backend, timedelta(seconds=setup["timeout"]))
    from simulator.isolation import rank_threads

    rank_threads.install(backend, coop=setup["mode"] == "coop")  # (after this module's own threads: those are not the program's)
    with torch_native.enabled():
        # one rank per process: torch's process-wide c10d state is this rank's (threads the program starts see it)
        import torch.distributed.distributed_c10d as c10d
        from torch._C._distributed_c10d import _set_thread_isolation_mode

        c10d._world = torch_native._saved["world"]
        _set_thread_isolation_mode(False)
        import torch.distributed as tdist

        tdist.TCPStore = torch_native._saved["TCPStore"]  # real processes serve each other over a real store
        host, port = setup["store"]
        torch_native._stores[id(backend.world_key())] = tdist.TCPStore(
            host, port, setup["world_size"], False, timedelta(seconds=setup["timeout"]), wait_for_workers=False)
        msg: tuple
        _honest_clock(backend)
        _wire.send(conn, ("ready",))  # start-up done: the run's timeout counts from every rank's ready
        try:
            backend.start_clock()
            result = fn(*args, **kwargs)
            try:
                msg = ("result", _dumps(result), backend._cpu_delta())
            except Exception as e:  # noqa: BLE001
                msg = _exception_message(DistRuntimeError(format_message(
                    "simulator.run", "the rank's function returned an object that cannot be sent back from its "
                    f"process ({type(e).__name__}: {e})", rank=rank, values={"result": type(result).__name__},
                    fix="return tensors, numbers, strings or other picklable objects (or None) under "
                        "isolation='process'")))
        except SystemExit as e:
            msg = ("exit", e.code if e.code is None or isinstance(e.code, int) else str(e.code), _rank_traceback(e))
        except BaseException as e:  # noqa: BLE001  every failure is reported by the coordinator
            eid = getattr(e, "_tp_forwarded", None)
            msg = ("forwarded", eid) if eid is not None else _exception_message(e)
        # the rank's end: its proxy stops serving the main channel, so the interpreter's own end (atexit joins
        # of executor threads, non-daemon threads) waits as a real process does
        backend.main_returned()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        try:
            if setup.get("learn"):  # the libraries this rank imported: its warm interpreter imports them ahead
                _wire.send(conn, ("modules", library_modules(set(sys.modules) - before)))
            _wire.send(conn, msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass


# ---------------------------------------------------------------------------
# a warm interpreter (see .warm): forks rank processes
# ---------------------------------------------------------------------------
def serve(fd: int) -> None:
    """The warm interpreter's loop: fork a rank process per request, report each one's exit status."""
    # (this module's imports are the ones every rank process would pay for)
    ctrl = socket.socket(fileno=fd)
    children: set[int] = set()
    from simulator.isolation import cleanup

    # a coordinator killed outright (SIGKILL) leaves its rank processes and arenas to this interpreter
    cleanup.on_parent_death(int(sys.argv[2]) if len(sys.argv) > 2 else os.getppid(), lambda: children)
    threads = _thread_count()
    ctrl.send(warm.MSG.pack(b"R", os.getpid(), 0))
    while True:
        ready, _, _ = select.select([ctrl], [], [], 0.05)
        for pid, code in _reap(children):
            ctrl.send(warm.MSG.pack(b"X", pid, code))
        if not ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(ctrl, warm.MAX_REQUEST, 8)
        except OSError:
            data, fds = b"", []
        if not data:  # the coordinator is gone: so are its rank processes
            for pid in children:
                try:
                    os.killpg(pid, 9)
                except OSError:
                    pass
            os._exit(0)
        env, preload = pickle.loads(data)
        threads = min(threads, _thread_count())  # (a thread torch starts at import may end later)
        culprit = _preload(preload, threads, lambda: [ctrl.send(warm.MSG.pack(b"X", pid, code))
                                                     for pid, code in _reap(children)])
        if culprit is not None:  # an import started a thread: forking now could copy a lock it holds
            for f in fds:
                os.close(f)
            ctrl.send(warm.MSG.pack(b"T", culprit, _thread_count()))  # (which one: never imported ahead again)
            os._exit(3)
        if env is None:  # import ahead only (between two runs)
            ctrl.send(warm.MSG.pack(b"L", 0, 0))
            continue
        pid = os.fork()
        if pid == 0:
            _rank_process(ctrl, env, fds)  # never returns
        for f in fds:
            os.close(f)
        children.add(pid)
        ctrl.send(warm.MSG.pack(b"P", pid, 0))


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _preload(names: list[str], threads: int, reap: Callable[[], Any]) -> int | None:
    """Import, once in the warm interpreter, the libraries earlier rank processes imported (see :func:`library_modules`).

    Returns the index in ``names`` of the first whose import left more than ``threads`` threads running (the
    interpreter must not fork any more), else None.  ``reap`` reports the rank processes that ended meanwhile (a
    long import ahead must not hold up the coordinator, which waits for their exit status).
    """
    import importlib

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
    import sysconfig

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
        import ctypes
        import signal

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
        import traceback

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
    import atexit as _atexit

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    finally:
        _atexit._run_exitfuncs()
