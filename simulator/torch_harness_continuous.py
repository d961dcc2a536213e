"""``MultiProcContinuousTest`` on simulated ranks (part of :mod:`simulator.torch_harness`).

torch's ``MultiProcContinuousTest`` starts its worker processes once per class (``_spawn_processes``); each
worker initialises a process group, then loops: it takes a test id from its task queue, runs that test and puts
the outcome on its completion queue, while the parent waits on the completion queues
(``retrieve_result_from_completion_queue``).  With the switch on, the workers are the ranks of one simulated
world per class, as torch keeps one set of workers (:class:`_ClassWorld`): thread ranks (``--sim-harness
thread``) or rank processes (``--sim-harness process``), started at the class's first test in a thread of the
parent, each running torch's own ``_worker_loop`` for every test of the class, with task and completion queues
that are pipes to the parent.  What a test leaves on a worker (its class attributes, its process group) the next
test finds, as on real workers.

Each thread rank sees a subclass of the test class of its own, so the class attributes a worker sets (``rank``,
``pg``) are its own, as a process's would be, and the class state it starts from is the module's (collected
before the parent's ``setUpClass``, which a worker process never runs).

Between two tests the ranks meet on a group of the simulator's own: a rank whose test raised while another still
waits in one of the test's operations is a deadlock the simulator reports at once (real workers hang until
torch's timeout); the parent's first read of a test's outcome waits for every rank's, so that the failure it
raises names every rank that failed.  A world that failed is replaced at the class's next test.  A failure of
thread ranks with a known sign of their sharing one process runs that test again on rank processes, in a world of
its own, whose verdict is the test's.
"""
from __future__ import annotations

import importlib
import os
import queue
import tempfile
import threading
import time
import unittest
from typing import Any, Callable

from simulator.core._actor import current_rank_state  # (light: no torch)
from simulator.torch_harness_state import own_class_state  # (light: torch is imported when it is entered)

__all__ = ["install"]


class _Worker:
    """Stands for a worker ``Process`` of the class: the rank of the class's world that runs its tests."""

    def __init__(self, world: "_ClassWorld", rank: int) -> None:
        self._world = world
        self.rank = rank
        self.name = f"process {rank}"
        self.pid = -1 - rank  # (no process of the OS has it)

    @property
    def exitcode(self) -> int | None:
        return None if self._world.alive() else 0

    def is_alive(self) -> bool:
        return self._world.alive()

    def join(self, timeout: float | None = None) -> None:
        self._world.join(timeout)

    def terminate(self) -> None:
        self._world.join(0)

    kill = terminate


class _TaskQueue:
    """The parent's side of a worker's task queue: a test id (or ``None``, the class is over) for rank ``rank``."""

    def __init__(self, world: "_ClassWorld", rank: int) -> None:
        self._world = world
        self._rank = rank

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self._world.send(self._rank, item)


class _Completion:
    """The parent's side of a worker's completion queue: what rank ``rank`` answered for the current test."""

    def __init__(self, world: "_ClassWorld", rank: int) -> None:
        self._world = world
        self._rank = rank

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        return self._world.take(self._rank, timeout if block else 0.0)

    def empty(self) -> bool:
        return not self._world.answers[self._rank]

    def put(self, item: Any) -> None:
        self._world.answers[self._rank].append(item)


def _spawn(settings: Any, isolation: str) -> Any:
    def _spawn_processes(cls: type, world_size: int) -> None:
        world = _ClassWorld(cls, int(world_size), settings, isolation)
        cls.processes = [_Worker(world, r) for r in range(world.n)]
        cls.task_queues = [_TaskQueue(world, r) for r in range(world.n)]
        cls.completion_queues = [_Completion(world, r) for r in range(world.n)]
        fd, cls.rdvz_file = tempfile.mkstemp(prefix="tp-continuous-")  # (torch removes it in tearDownClass)
        os.close(fd)

    return classmethod(_spawn_processes)


#: the longest a rank waits for the parent's next test id (pytest may run other tests between two of a class's)
_NEXT_TASK_S = 3600.0


class _ClassWorld:
    """The simulated ranks that stand for a class's worker processes: one world for all the class's tests, as torch
    keeps its workers (a world that failed is replaced at the class's next test).

    It runs in a thread of its own from the class's first task on; the ranks run torch's ``_worker_loop`` with
    task and completion queues that are pipes to this object (:class:`_Tasks`).  The parent's first read of a
    test's outcome waits for every rank's (or the world's end), so that a failure names the ranks that failed."""

    def __init__(self, cls: type, n: int, settings: Any, isolation: str) -> None:
        self.cls, self.n, self.settings, self.isolation = cls, n, settings, isolation
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.tasks: list[Any] = []  # the parent's ends of the ranks' task pipes
        self.done: list[Any] = []  # ... and of their completion pipes
        self.current: list[Any] = [None] * n  # the test id each rank was sent last
        self.answers: list[list[Any]] = [[] for _ in range(n)]  # outcomes read and not yet taken

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def send(self, rank: int, item: Any) -> None:
        if item is None and not self.alive():
            return  # the class is over and its world ended already
        if not self.alive():
            self._start()
        self.current[rank] = item
        try:
            self.tasks[rank].send(item)
        except OSError:  # the world ended meanwhile: take() reports it
            pass

    def join(self, timeout: float | None) -> None:
        if self.thread is not None:
            self.thread.join(60.0 if timeout is None else timeout)

    def _start(self) -> None:
        import multiprocessing

        self.join(5.0)  # (a failed world's thread ends with its ranks)
        ranks_ends = []
        self.tasks, self.done = [], []
        for _ in range(self.n):
            task_in, task_out = multiprocessing.Pipe(duplex=False)
            done_in, done_out = multiprocessing.Pipe(duplex=False)
            self.tasks.append(task_out)
            self.done.append(done_in)
            ranks_ends.append((task_in, done_out))
        self.error = None
        self.answers = [[] for _ in range(self.n)]
        fd, rdvz = tempfile.mkstemp(prefix="tp-continuous-")  # a fresh rendezvous for each world
        os.close(fd)
        os.unlink(rdvz)
        self.thread = threading.Thread(target=self._run, args=(ranks_ends, rdvz), daemon=True,
                                       name=f"tensorplay-sim-{self.cls.__name__}-workers")
        self.thread.start()

    def _run(self, ranks_ends: list[tuple[Any, Any]], rdvz: str) -> None:
        import simulator  # (imports torch: this module loads with the plugin)

        s, cls, n = self.settings, self.cls, self.n
        try:
            if self.isolation == "process":
                from simulator.isolation import run_processes  # (imports torch: this module loads with the plugin)

                cls._tp_sim_before_processes()

                world = simulator.World(n, seed=s.seed, mode=s.mode, timeout=None, stall_timeout=s.stall_timeout,
                                        isolation="process")
                run_processes(world, _rank_process_serves, (), {},
                              [(cls.__module__, cls.__qualname__, n, rdvz, t, d) for t, d in ranks_ends])
            else:  # each rank: its own copy of the parent's environment, as a spawned worker has (_init_pg sets
                # LOCAL_RANK), and the class state a worker process has of its own (thread-local precision...)
                def rank_main() -> None:
                    rank = current_rank_state().rank
                    _serve(cls, rank, n, rdvz, *ranks_ends[rank])

                with own_class_state():
                    simulator.run(rank_main, n, seed=s.seed, mode=s.mode, timeout=None,
                                  stall_timeout=s.stall_timeout, env=dict(os.environ))
        except BaseException as e:  # noqa: BLE001  a deadlock, a rank that raised: the ranks without an outcome
            self.error = e
        finally:
            for ends in ranks_ends:
                for end in ends:
                    end.close()
            if os.path.exists(rdvz):
                os.unlink(rdvz)

    def take(self, rank: int, timeout: float | None) -> Any:
        """Rank ``rank``'s outcome of the current test (``queue.Empty`` after ``timeout`` s, as a queue's get)."""
        if not self.answers[rank]:
            self._collect(timeout)
        if not self.answers[rank]:
            raise queue.Empty
        return self.answers[rank].pop(0)

    def _collect(self, timeout: float | None) -> None:
        """Wait until every rank answered the current test, or the world ended (then a rank without an answer gets
        the world's error); then every failure is named in the first, and thread-only failures run again."""
        # (a get without a timeout waits as long as a rank waits for its next test id: bounded all the same)
        deadline = time.monotonic() + (_NEXT_TASK_S if timeout is None else timeout)
        for r in range(self.n):
            while not self.answers[r]:
                if self._read(r, 0.05):
                    continue
                if not self.alive() and not self._read(r, 0.0):
                    self.answers[r].append(RuntimeError(
                        f"Exception in worker process (simulated rank {r}):\n{self.error}"))
                elif time.monotonic() > deadline:
                    return
        if any(_failed(item) for items in self.answers for item in items):
            self.join(1.0)  # a world that a failure ended is gone before the next test is sent (it starts a new one)
        if self.isolation == "thread":
            self._moved_to_processes()
        _name_every_failure(self.cls, self.answers)

    def _read(self, rank: int, wait: float) -> bool:
        conn = self.done[rank]
        try:
            if conn.poll(wait):
                self.answers[rank].append(conn.recv())
                return True
        except (EOFError, OSError):
            pass
        return False

    def _moved_to_processes(self) -> None:
        """A failure of thread ranks sharing one process (named by the plugin): the test runs again on rank
        processes, in a world of its own, whose outcome the parent reads."""
        text = "\n".join(str(item) for items in self.answers for item in items if isinstance(item, BaseException))
        why = self.cls._tp_sim_thread_only(text) if text else None
        if why is None:
            return
        tasks = list(self.current)
        self.cls._tp_sim_moved(next(t for t in tasks if t is not None), why)
        done: list[list[Any]] = [[] for _ in range(self.n)]
        _run_world(self.cls, tasks, "process", self.settings, done)
        self.answers = done


def _run_world(cls: type, tasks: list, isolation: str, s: Any, answers: list[list[Any]]) -> None:
    """One world of ``len(tasks)`` rank processes for one test (a thread-rank failure run again); each rank's
    outcome lands in ``answers``."""
    import simulator  # (imports torch: this module loads with the plugin)

    world_size = len(tasks)
    cls._tp_sim_before_processes()
    fd, rdvz = tempfile.mkstemp(prefix="tp-continuous-")
    os.close(fd)
    os.unlink(rdvz)
    try:
        outcomes = simulator.run(_rank_process_main, world_size, seed=s.seed, mode=s.mode, timeout=s.timeout,
                                 stall_timeout=s.stall_timeout, isolation=isolation,
                                 args=(cls.__module__, cls.__qualname__, tasks, world_size, rdvz))
        for mine, items in zip(answers, outcomes):
            mine.extend(items)
    except Exception as e:  # noqa: BLE001  the world failed (a deadlock, a rank that raised): each rank's outcome
        for r, mine in enumerate(answers):
            if not mine:
                mine.append(RuntimeError(f"Exception in worker process (simulated rank {r}):\n{e}"))
    finally:
        if os.path.exists(rdvz):
            os.unlink(rdvz)


def _failed(item: Any) -> bool:
    """A worker's outcome that is a failure (a skip is not)."""
    return isinstance(item, Exception) and not isinstance(item, unittest.SkipTest)


def _name_every_failure(cls: type, answers: list[list[Any]]) -> None:
    """The parent raises the first failed rank's outcome only; it is made to carry the other ranks' failures too.

    A rank whose test raised puts the error on its queue and goes on to the next test; the others then wait for it
    in their next collective and fail with the simulator's deadlock report (on real workers they would hang until
    the timeout).  The parent reads rank 0's outcome first: without this, the report would be the deadlock, not
    the cause."""
    failed = [(r, item) for r, items in enumerate(answers) for item in items
              if _failed(item)]
    if len(failed) < 2:
        return
    (first, reported), others = failed[0], failed[1:]
    notes = "".join(f"\n\nSimulated rank {r} failed too:\n{_tail(str(item))}" for r, item in others)
    told = RuntimeError(f"{reported}{notes}")
    told.__cause__ = reported.__cause__
    answers[first] = [told if item is reported else item for item in answers[first]]


_NOTE_CHARS = 4000  # of each other rank's failure (its traceback's end: where it raised, and what)


def _tail(text: str) -> str:
    """The end of ``text``, from a line's start, saying how much was left out."""
    if len(text) <= _NOTE_CHARS:
        return text
    cut = text.find("\n", len(text) - _NOTE_CHARS)
    cut = len(text) - _NOTE_CHARS if cut < 0 else cut + 1
    return f"[... {cut} characters of its traceback left out ...]\n{text[cut:]}"


#: class -> the data attributes of it and its bases as its module made them (collected before any setUpClass ran)
_AS_IMPORTED: dict[type, list[dict[str, Any]]] = {}


class _Absent:
    """A class attribute a worker process would not have (the parent's ``setUpClass`` set it): looking it up on a
    thread rank's class raises ``AttributeError``, as in a worker that imported the module afresh."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        what = f"type object {getattr(owner, '__name__', '?')!r}" if obj is None else f"{type(obj).__name__!r} object"
        raise AttributeError(f"{what} has no attribute {self.name!r}")


def _data(namespace: Any) -> dict[str, Any]:
    """A class's own attributes that are state, not behaviour (methods are shared, and so is what is per thread
    already: a ``threading.local``, or the per-rank state the switch put in, see own_class_state)."""
    return {k: v for k, v in namespace.items() if not (k.startswith("__") or callable(v) or hasattr(v, "__get__")
            or isinstance(v, threading.local) or type(v).__module__.startswith("simulator."))}


def remember_as_imported(cls: type) -> None:
    """Called at collection, before the parent's ``setUpClass``: ``cls``'s state as a worker process has it."""
    _AS_IMPORTED.setdefault(cls, [_data(vars(k)) for k in cls.__mro__])


def _as_a_worker_sees_it(cls: type) -> dict[str, Any]:
    """What the rank's own subclass of ``cls`` overrides so that its state is the module's, not the parent's: the
    data attributes the parent set or changed since collection (setUpClass's, _spawn_processes') as they were then,
    or absent."""
    then = _AS_IMPORTED.get(cls)
    if then is None:
        return {}
    now = [_data(vars(k)) for k in cls.__mro__]
    names = {n for d in now for n in d}
    out: dict[str, Any] = {}
    for name in names:
        current = next((d[name] for d in now if name in d), None)
        before = next((d for d in then if name in d), None)
        if before is None:
            out[name] = _Absent(name)
        elif before[name] is not current:
            out[name] = before[name]
    return out


def _own_class(cls: type) -> type:
    """A subclass of ``cls`` of the rank's own (its class attributes), whose state is the class's as its module made
    it (a worker process imports the module; the parent's setUpClass ran in the parent only)."""
    return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       **_as_a_worker_sees_it(cls)})


def _loop(cls: type, rank: int, task: Any, world_size: int, rdvz: str, completion: Any) -> None:
    """torch's worker loop for one task, on the rank's own subclass of ``cls``."""
    tq: queue.Queue = queue.Queue()
    tq.put(task)
    tq.put(None)
    _own_class(cls)._worker_loop(rank, world_size, rdvz, tq, completion)


def _class_of(module: str, qualname: str) -> Any:
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    return cls


def _rank_process_main(module: str, qualname: str, tasks: list, world_size: int, rdvz: str) -> list:
    """A rank process of a one-test world: one task of torch's loop; the completion-queue items (a test id, a
    ``SkipTest``, the worker's ``RuntimeError`` with its traceback text) are the rank's result."""
    import tensorplay.distributed as tpd  # (imports torch: this module loads with the plugin)

    done: queue.Queue = queue.Queue()
    rank = tpd.get_rank()
    try:
        _loop(_class_of(module, qualname), rank, tasks[rank], world_size, rdvz, done)
    except Exception:
        # the loop failed after the test's outcome was queued (torch's loop destroys a group its skipped _init_pg
        # never made): a worker's queued outcome reaches the parent before the worker dies, as it does here
        if done.empty():
            raise
    return [done.get() for _ in range(done.qsize())]  # (an exception pickles without its cause: its text has it)


class _Tasks:
    """A worker's task queue on a simulated rank: the test ids the parent sends down a pipe.

    Before each test but the first, the ranks meet (:func:`_every_rank_ended_the_test`); then the rank waits in the
    OS for the parent's next test id.  In coop mode it keeps the baton meanwhile, so every rank starts the next
    test where the schedule left it, and a run stays a function of its seed."""

    def __init__(self, conn: Any, group: Any, cls: type, rank: int) -> None:
        self._conn = conn
        self._group = group
        self._cls = cls
        self._rank = rank
        self._first = True

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if not self._first:
            _every_rank_ended_the_test(self._group)
        self._first = False
        try:
            if not self._conn.poll(_NEXT_TASK_S):
                from tensorplay.distributed.errors import format_message  # (imports torch: see the module)

                raise RuntimeError(format_message(
                    "MultiProcContinuousTest._worker_loop", "no next test id came from the test process",
                    rank=self._rank, values={"class": self._cls.__qualname__, "waited_s": _NEXT_TASK_S},
                    fix="let pytest run the class's tests to their end (tearDownClass sends the workers' end), "
                        "or run them without pausing the test process for an hour"))
            return self._conn.recv()
        except (EOFError, OSError):
            return None  # the parent is gone: the class is over


class _Done:
    """A worker's completion queue on a simulated rank: each outcome goes up a pipe to the parent."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def put(self, item: Any) -> None:
        try:
            self._conn.send(item)
        except Exception:  # noqa: BLE001  (an outcome that does not pickle: its text does)
            self._conn.send(RuntimeError(str(item)))


def _every_rank_ended_the_test(group: Any) -> None:
    """Every rank has finished the test it was given and put its outcome: the world's ranks meet here before the
    next one, on a group of the simulator's own (``group``: no operation of the tests can match this barrier).

    A rank whose test raised comes here while the others may still wait in one of the test's operations for it:
    the simulator reports that as a deadlock at once (naming who waits where), as it would if the rank had ended
    in a world of its own; worker processes would hang until torch's timeout."""
    import tensorplay.distributed as tpd  # (imports torch: this module loads with the plugin)

    tpd.barrier(group=group)


def _serve(cls: type, rank: int, world_size: int, rdvz: str, tasks: Any, done: Any) -> None:
    """A rank of a class's world: torch's worker loop for every test of the class, on the rank's own subclass."""
    import tensorplay.distributed as tpd  # (imports torch: this module loads with the plugin)

    between_tests = tpd.new_group(list(range(world_size)))  # (every rank makes it first: before any test's group)
    _own_class(cls)._worker_loop(rank, world_size, rdvz, _Tasks(tasks, between_tests, cls, rank), _Done(done))


def _rank_process_serves(module: str, qualname: str, world_size: int, rdvz: str, tasks: Any, done: Any) -> None:
    """A rank process of a class's world: the class from its module, then :func:`_serve`."""
    import tensorplay.distributed as tpd  # (imports torch: this module loads with the plugin)

    _serve(_class_of(module, qualname), tpd.get_rank(), world_size, rdvz, tasks, done)


def install(harness: Any, settings: Any, isolation: str = "thread",
            thread_only: Callable[[str], str | None] = lambda text: None,
            moved: Callable[[str, str], None] = lambda test_id, why: None,
            before_processes: Callable[[], None] = lambda: None) -> Any:
    """Make ``MultiProcContinuousTest``'s workers simulated ranks (``isolation``: threads or rank processes);
    returns the undo.

    ``thread_only(text)``: why the failures ``text`` of thread ranks come from their sharing one process, or
    None; such a test runs again on rank processes, whose outcome the parent reads, and ``moved(test_id, why)``
    is told; ``before_processes()`` runs before a world of rank processes starts."""
    base = harness.MultiProcContinuousTest
    saved = base.__dict__["_spawn_processes"]
    base._spawn_processes = _spawn(settings, isolation)
    base._tp_sim_thread_only = staticmethod(thread_only)
    base._tp_sim_moved = staticmethod(moved)
    base._tp_sim_before_processes = staticmethod(before_processes)

    def undo() -> None:
        base._spawn_processes = saved
        del base._tp_sim_thread_only, base._tp_sim_moved, base._tp_sim_before_processes

    return undo
