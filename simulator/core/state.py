"""The simulator's state: one module that the scheduler, the backend, the reports and the adapters import.

* :class:`Run` - one execution of a world: its ranks, scheduler, clocks, p2p mailboxes, trace and fatal incident;
* :class:`RankState` - everything kept per rank (and per thread a rank starts: an extra *actor* of that rank);
* :class:`Incident` - one event several ranks learn about (each gets its own exception object);
* :class:`SimGroup`, :class:`Slot`, :class:`RankCall`, :class:`P2PRecord` - the matching state: a group's open
  collective slots, one rank's part in a collective, one posted send or receive.

Nothing here imports the backend or the reports at module level (the reports import this module), so the
simulator's modules form no import cycle: state <- sched, report <- backend, world <- adapters.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from typing import Any, Callable

import torch

from tensorplay.distributed import state as dist_state
from tensorplay.distributed.errors import DistRuntimeError, format_message
from tensorplay.distributed.spec import CallKey

from simulator.core import progress
from simulator.core.errors import DeadlockError, RankFailedError, SimTimeoutError
from simulator.core.faults import Fault
from simulator.core._actor import BLOCKED, DONE
from simulator.core.protocol import Scheduler
from simulator.core.trace import EventLog
from simulator.core._actor import _local, current_rank_state  # noqa: F401  (re-exported: the state's public door)

__all__ = ["on_simulated_rank", "Run", "RankState", "Incident", "SimGroup", "Slot", "RankCall", "P2PRecord", "CallKey",
           "current_rank_state", "rank_device", "OVER_TEXT"]

_perf = time.perf_counter


def rank_device() -> torch.device:
    """The device of the calling rank (``cuda:<rank % device_count>`` under ``device="cuda"``, else cpu)."""
    rs = current_rank_state()
    return torch.device("cpu") if rs is None else rs.device



class Incident:
    """One event several ranks learn about; :meth:`make` builds each rank's own exception object."""

    __slots__ = ("cls", "message", "cause", "failed_rank", "attrs")

    def __init__(self, cls: type, message: str, cause: BaseException | None = None,
                 failed_rank: int | None = None, attrs: dict[str, Any] | None = None) -> None:
        self.cls = cls
        self.message = message
        self.cause = cause
        self.failed_rank = failed_rank
        self.attrs = attrs  # more attributes of each exception (e.g. SimTimeoutError.bound)

    def make(self, rank: int) -> BaseException:
        exc = self.cls(self.message)
        exc.incident = self
        exc.rank = rank
        if self.failed_rank is not None:
            exc.failed_rank = self.failed_rank
        if self.cause is not None:
            exc.__cause__ = self.cause
        if self.attrs:
            for k, v in self.attrs.items():
                setattr(exc, k, v)
        return exc


class RankState:
    """Everything the simulator keeps per rank (one per rank thread)."""

    __slots__ = (
        "rank", "run", "backend", "wake", "state", "sleeping", "waiting", "pending", "pos",
        "vt", "cpu_mark", "ops", "faults", "torch_gen", "py_rng", "np_rng", "result", "exc", "env", "device",
        "unflushed", "p2p_seq", "last_site", "thread", "where", "tid", "steered", "parent", "waits_exit",
        "on_complete", "stamp", "store_polls", "own_globals",
    )

    def __init__(self, rank: int, run: "Run") -> None:
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
        #: the rank's own torch CPU generator (coop mode swaps it with the default one at hand-offs)
        self.torch_gen: torch.Generator | None = None
        self.py_rng: Any = None
        self.np_rng: Any = None  # numpy's global generator's state for this rank (coop mode; core._handoff)
        self.result: Any = None
        self.exc: BaseException | None = None
        self.env: dict[str, str] | None = None
        self.device = torch.device("cpu")
        self.unflushed: list[Any] = []
        self.p2p_seq = 0
        self.last_site = "?"
        self.thread: threading.Thread | None = None
        #: where the rank's program is now, as ``(file, line, function)`` frames, when it runs outside ``thread``
        #: (a rank process: its proxy asks it); None: look at ``thread``
        self.where: Callable[[], list[tuple[str, int, str]]] | None = None
        self.tid = 0  # the OS thread id, once the rank's thread runs (coop mode steers it by this id)
        self.steered = False
        #: for a thread the rank started: the rank's own state (this object is then an extra actor of that rank)
        self.parent: RankState | None = None
        #: the run ends only after this actor ended (ranks, and the non-daemon threads they start)
        self.waits_exit = True
        #: ``(error incident or None, recv source or None)`` when the operation this actor is blocked on
        #: completes, before it resumes (a rank process's proxy answers its process there: see
        #: simulator.isolation.proxy)
        self.on_complete: Any = None
        #: ``run.clock()`` when this actor last entered an operation or ended a wait (see simulator.core.progress)
        self.stamp = run.clock()
        #: ``(call, count)``: the rank's last store call and how many times in a row it was made (a spin-poll)
        self.store_polls: tuple[Any, int] | None = None
        #: what this thread rank keeps of a process's own (see :meth:`own`); made on first use
        self.own_globals: dict[tuple[int, str], Any] | None = None

    def own(self) -> dict[tuple[int, str], Any]:
        """What this rank keeps of a process's own, shared by the threads it started: ``sys.stdout``, warning
        filters, logger settings (adapters.per_rank_streams), signal and atexit handlers (adapters.threads)."""
        root = self.parent or self
        if root.own_globals is None:
            # a world may say what each rank starts with (a test runner's launched ranks: a new process's view,
            # without the runner's own warning filters and log handlers; see simulator.torch_harness)
            start = getattr(root.run.world, "rank_start", None) or {}
            root.own_globals = {key: list(v) if type(v) is list else v for key, v in start.items()}
        return root.own_globals

    @property
    def torch_rng(self) -> torch.Tensor | None:
        """The rank's torch RNG state as ``torch.get_rng_state()`` gives it (None before the world set it)."""
        return None if self.torch_gen is None else self.torch_gen.get_state()

    @torch_rng.setter
    def torch_rng(self, state: torch.Tensor) -> None:
        if self.torch_gen is None:
            self.torch_gen = torch.Generator()
        self.torch_gen.set_state(state)

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


def on_simulated_rank() -> bool:
    """The calling thread is a simulated rank (or one of its threads) with tensorplay.distributed bound to it:
    the test the simulated RPC transport and the torch RPC adapter both make."""
    return current_rank_state() is not None and dist_state.current() is not None


#: a no-op on the main thread's job queue: wakes it to look at the deadlines again (see :meth:`Run.nudge`)
NUDGE = object()


class Run:
    """The shared state of one execution of a world."""

    def __init__(self, world: Any, describe_world: Callable[..., str],
                 scheduler: Callable[["Run"], Scheduler]) -> None:
        #: the report's text of the world's situation (passed in: the reports import this module, not vice versa)
        self.describe_world = describe_world
        self.world = world
        self.n = world.world_size
        self.seed = world.seed
        self.mode = world.mode
        self.cost = world.cost
        self.p2p = world.p2p
        # the bounds (see simulator.core.progress), on a clock a test may replace
        self.clock: Callable[[], float] = progress.clock
        self.started = self.clock()
        self.deadline = self.started + (math.inf if world.timeout is None else world.timeout)
        self.stall = world.stall_timeout
        #: actors waiting in an operation that has a timeout of its own: actor -> (deadline, its incident's maker)
        self.deadlines: dict[RankState, tuple[float, Callable[[], Incident]]] = {}
        #: the latest stamp the main thread has seen (taken lazily: see progress.check_stall)
        self.progress_seen = self.started
        #: when the main thread started the offloaded kernel it runs now (None: none; it is progress)
        self.job_since: float | None = None
        self.aborted = False
        #: False once a coop rank waited on the wall clock outside the schedule (time.sleep: simulator/adapters/threads.py)
        self.deterministic = True
        self.nondeterminism: str | None = None  # where that first happened
        self.fatal: Incident | None = None
        self.live = self.n  # actors not yet ended (ranks and the threads they started)
        self.to_exit = self.n  # actors the run waits for (ranks and their non-daemon threads)
        self.over = False  # every rank and non-daemon thread ended; a daemon thread's later call fails
        self.children: list[RankState] = []  # threads the ranks started, in start order
        self.all_done = threading.Event()
        self.events = EventLog(self.n, world.trace_limit)
        self.wall_origin = time.perf_counter()
        self.ranks = [RankState(r, self) for r in range(self.n)]
        #: the world chose it (simulator.core.sched.make_scheduler); every wait of the run goes through it
        self.sched: Scheduler = scheduler(self)
        # p2p mailboxes, keyed by destination global rank (lists created on first use)
        self.sends: dict[int, list] = {}
        #: async collectives a rank never waited for and that were open when it ended (see world_ends)
        self.unwaited: list[Any] = []
        self.recvs: dict[int, list] = {}
        self.next_gid = 1
        # large kernels run on the thread that called run() (see execute())
        self.jobs: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        #: called with a rank's state when its thread ends (e.g. the RPC transport releases its barriers)
        self.exit_hooks: list[Callable[[RankState], None]] = []
        #: groups created by their members only, by (ranks, k-th request for those ranks)
        self.member_groups: dict[tuple[tuple[int, ...], int], SimGroup] = {}
        #: per rank [outgoing link free at, incoming link free at] (virtual seconds), flattened (see clock.py)
        self.links: list[float] = [0.0] * (2 * self.n)

    # -- big kernels on one thread -------------------------------------------
    def execute(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the thread that called :meth:`World.run` and return its result.

        torch's intra-op thread pool is per calling OS thread: big kernels
        issued from many rank threads each spin up their own pool and fight
        over the cores (measured 2-3x slower), so heavy work is funnelled to
        one thread, which is idle anyway while the world runs.
        """
        box: list[Any] = [None, None]
        # a plain lock, not an Event: a rank's Condition waits may step out of the schedule (simulator/adapters/threads.py),
        # and this wait happens inside a collective, with the schedule's state half-updated
        done = threading.Lock()
        done.acquire()

        def job() -> None:
            try:
                box[0] = fn()
            except BaseException as e:  # noqa: BLE001  (re-raised on the rank)
                box[1] = e
                if isinstance(e, KeyboardInterrupt):  # Ctrl-C reached this (main) thread during the kernel: it is
                    raise                             # the run's to stop (World.run releases every rank), not the rank's
            finally:
                done.release()

        self.jobs.put(job)
        while not done.acquire(timeout=0.25):
            if self.aborted or self.clock() > self.deadline + progress.GRACE_S:
                raise self.make_error(self.fatal, self.ranks[0]) if self.fatal else RuntimeError("run aborted")
        if box[1] is not None:
            raise box[1]
        return box[0]

    def nudge(self) -> None:
        """Have the main thread look at the deadlines now (one sooner than its current slice was added)."""
        self.jobs.put(NUDGE)

    def finished(self) -> None:
        """The last rank (or non-daemon thread) has exited (called under the scheduler lock)."""
        self.over = True
        self.all_done.set()
        self.jobs.put(None)
        # daemon threads still waiting in an operation are abandoned, as at a process's exit: release them
        for c in self.children:
            if c.state == BLOCKED:
                c.pending = Incident(DistRuntimeError, OVER_TEXT)
                self.sched.wake(c)
                if self.sched.baton:  # coop's wake only marks it runnable; nobody will hand it the baton
                    c.wake.release()

    def over_error(self, rs: RankState) -> BaseException:
        return Incident(DistRuntimeError, OVER_TEXT).make(rs.rank)

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
        blocked = self._blocked()
        if self.fatal is not None:  # a rank failed first (free-running ranks may block after its release went out):
            inc = self.fatal        # they wait on that rank, not on each other
        else:
            text = self.describe_world(self, headline="deadlock: every live rank is blocked and none can make progress")
            inc = self.fatal = Incident(DeadlockError, text)
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

    def wait_slice(self, rs: RankState) -> float:
        """Seconds ``rs`` may sleep in a wait before checking the bounds itself (raises once one ran out)."""
        return progress.wait_slice(self, rs)

    def local_timeout(self, rs: RankState, bound: str) -> None:
        """A rank's own backstop on a bound ran out (the main thread normally acts first)."""
        names = self.world.bound_names
        if bound == "stall":
            what = (f"{rs.label} waited {self.stall:g} s while nothing progressed "
                    f"({names.spell('stall', self.stall)})")
        else:
            what = f"{rs.label} waited past the run's timeout of {self.world.timeout:g} s " \
                   f"({names.spell('timeout', self.world.timeout)})"
        err = SimTimeoutError(format_message(
            "simulator.run", what, fix=f"raise {names.knob(bound)} or look for a rank stuck in a long computation"))
        err.bound = "stall_timeout" if bound == "stall" else "timeout"
        raise err

    def abort_bound(self, bound: str, waiting: list[RankState] | None = None) -> SimTimeoutError:
        """Main thread: a bound ran out (``"stall"`` or ``"timeout"``); fail every actor that has not ended."""
        with self.sched.lock:
            text = self.describe_world(self, bound=bound, waiting=waiting or ())
            inc = Incident(SimTimeoutError, text, attrs={"bound": "stall_timeout" if bound == "stall" else "timeout"})
            self.abort(inc)
        return inc.make(-1)  # type: ignore[return-value]

    def abort(self, inc: Incident) -> None:
        """Fail every actor that has not ended with ``inc`` and wake it (under the scheduler's lock)."""
        self.fatal = inc
        self.aborted = True
        relay = getattr(self.sched, "relay", None)  # threads mode: every actor is released below, none by its relay
        if relay:
            relay.clear()
        for rs in self.actors:
            if rs.state != DONE:
                rs.pending = inc
                rs.sleeping = False
                try:
                    rs.wake.release()
                except RuntimeError:
                    pass  # already released


OVER_TEXT = format_message(
    "simulator.run", "the simulated world has ended (every rank returned): a daemon thread a rank started made "
    "a distributed call afterwards (a thread rank is itself a daemon thread, so a thread it starts is a daemon "
    "unless it passes daemon=False; a process's main thread is not, and its threads are not daemons by default)",
    fix="join the thread before the rank returns; or pass daemon=False, and the run waits for the thread as a "
        "process waits for its non-daemon threads; or run with isolation='process'")



class SimGroup:
    """The world-wide identity of a group: its ranks and its open slots."""

    __slots__ = ("gid", "ranks", "size", "index", "slots", "rule", "torch_name")

    def __init__(self, gid: int, ranks: tuple[int, ...]) -> None:
        self.gid = gid
        self.ranks = ranks
        self.size = len(ranks)
        self.index = {g: i for i, g in enumerate(ranks)}
        self.slots: dict[int, Slot] = {}
        self.torch_name: str | None = None  # torch's name of the group, where torch made it
        #: a rule of the backend the program named for this group (NCCL's one device per rank): its ``tag(data)``
        #: runs on each member's thread as it issues a call (the call keeps the result as ``tag``), its
        #: ``check(name, calls)`` once all members' calls of collective ``name`` arrived, giving an
        #: :class:`Incident` every member raises, or None
        self.rule: Any = None

    def __repr__(self) -> str:
        return f"<sim group {self.gid} ranks={list(self.ranks)}>"


class RankCall:
    """One rank's part in a collective."""

    __slots__ = ("rs", "key", "data", "site", "vstart", "wall_start", "backward", "nbytes", "detail", "async_op",
                 "observed", "tag")

    def __init__(self, rs: RankState, key: CallKey, data: Any, site: str, nbytes: int, async_op: bool,
                 detail: str | None = None) -> None:
        self.rs = rs
        self.key = key
        self.data = data
        self.site = site
        self.vstart = rs.vt
        self.wall_start = _perf()
        self.backward = dist_state.current_backward()
        self.nbytes = nbytes
        self.detail = detail
        self.async_op = async_op
        self.observed = False
        self.tag: Any = None  # what the group's rule noted of the call as it was issued (see SimGroup.rule)


class Slot:
    """Collective number ``seq`` of a group: filled by the members' calls, completed by the last one."""

    __slots__ = ("group", "seq", "name", "calls", "arrived", "waiters", "others", "done", "error", "vend", "result")

    def __init__(self, group: SimGroup, seq: int, name: str) -> None:
        self.group = group
        self.seq = seq
        self.name = name
        self.calls: list[RankCall | None] = [None] * group.size
        self.arrived = 0
        self.waiters: list[RankState] = []
        self.others: list[RankState] | None = None  # actors waiting on a work another actor of their rank issued
        self.done = False
        self.error: Incident | None = None
        self.vend = 0.0
        self.result: Any = None


class P2PRecord:
    """One posted send or receive."""

    __slots__ = ("kind", "rs", "src", "dst", "group", "tag", "tensor", "site", "vstart", "wall_start", "done",
                 "error", "source", "vend", "backward", "seq", "observed", "key", "detail", "async_op", "others")

    def __init__(self, kind: str, rs: RankState, src: int | None, dst: int, group: SimGroup, tag: int,
                 tensor: torch.Tensor, site: str, async_op: bool) -> None:
        self.kind = kind
        self.rs = rs
        self.src = src
        self.dst = dst
        self.group = group
        self.tag = tag
        self.tensor = tensor
        self.site = site
        self.vstart = rs.vt
        self.wall_start = _perf()
        self.done = False
        self.error: Incident | None = None
        self.source: int | None = None  # sender's group rank, for receives
        self.vend = 0.0
        self.backward = dist_state.current_backward()
        rs.p2p_seq += 1
        self.seq = rs.p2p_seq
        self.observed = False
        self.key = CallKey(kind, None, None, tensor.dtype, tuple(tensor.shape))
        self.detail = None
        self.async_op = async_op
        self.others: list[RankState] | None = None  # as Slot.others


