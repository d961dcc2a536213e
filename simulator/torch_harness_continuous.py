"""``MultiProcContinuousTest`` on simulated thread ranks (part of :mod:`simulator.torch_harness`).

torch's ``MultiProcContinuousTest`` starts its worker processes once per class (``_spawn_processes``); each
worker initialises a process group, then loops: it takes a test id from its task queue, runs that test and puts
the outcome on its completion queue, while the parent waits on the completion queues
(``retrieve_result_from_completion_queue``).  With the switch on (``--sim-harness thread``), the workers are
ranks of a simulated world instead, one world per test: when the parent first waits for a test's outcome, every
rank runs torch's own ``_worker_loop`` for that test (its process group set up, the test run, the outcome put on
its completion queue, the group destroyed).  Each rank sees a subclass of the test class of its own, so the
class attributes a worker sets (``rank``, ``pg``) are its own, as a process's would be, and the class state it
starts from is the module's (collected before the parent's ``setUpClass``, which a worker process never runs).

With ``--sim-harness process`` the ranks are rank processes (``isolation="process"``): each imports the test's
module and runs the same loop, and hands its completion-queue items back as its result.

What differs from real workers: the process group is set up afresh for each test rather than once per class (a
test that relies on state an earlier test of the class left on the workers sees none).
"""
from __future__ import annotations

import importlib
import os
import queue
import tempfile
import threading
import unittest
from typing import Any, Callable

from simulator.core._actor import current_rank_state  # (light: no torch)
from simulator.torch_harness_state import own_class_state  # (light: torch is imported when it is entered)

__all__ = ["install"]


class _Worker:
    """Stands for a worker ``Process`` of the class: the world that runs its tests lives in the parent."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.name = f"process {rank}"
        self.exitcode: int | None = None
        self.pid = -1 - rank  # (no process of the OS has it)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        self.exitcode = 0

    def terminate(self) -> None:
        self.exitcode = 0

    kill = terminate


class _Completion:
    """A worker's completion queue: the parent's first wait for a test's outcome runs the world for that test."""

    def __init__(self, cls: type, rank: int) -> None:
        self._cls = cls
        self._rank = rank
        self.results: queue.Queue = queue.Queue()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self.results.empty():
            _run_pending(self._cls)
        return self.results.get(block, timeout)

    def empty(self) -> bool:
        return self.results.empty()

    def put(self, item: Any) -> None:
        self.results.put(item)


def _spawn(settings: Any, isolation: str) -> Any:
    def _spawn_processes(cls: type, world_size: int) -> None:
        cls.processes = [_Worker(r) for r in range(int(world_size))]
        cls.task_queues = [queue.Queue() for _ in range(int(world_size))]
        cls.completion_queues = [_Completion(cls, r) for r in range(int(world_size))]
        cls._tp_sim_settings = settings
        cls._tp_sim_isolation = isolation
        fd, cls.rdvz_file = tempfile.mkstemp(prefix="tp-continuous-")
        os.close(fd)

    return classmethod(_spawn_processes)


def _run_pending(cls: type) -> None:
    """Run the world for the test id each rank's task queue holds (a ``None`` task: the class is over)."""
    tasks = []
    for q in cls.task_queues:
        try:
            tasks.append(q.get_nowait())
        except queue.Empty:
            tasks.append(None)
    if all(t is None for t in tasks):
        return
    isolation = cls._tp_sim_isolation
    _run_world(cls, tasks, isolation)
    if isolation == "thread":
        text = "\n".join(str(item) for c in cls.completion_queues for item in list(c.results.queue)
                         if isinstance(item, BaseException))
        why = cls._tp_sim_thread_only(text) if text else None
        if why is not None:  # a failure of ranks sharing one process: the verdict is that of rank processes
            cls._tp_sim_moved(next(t for t in tasks if t is not None), why)
            for c in cls.completion_queues:
                c.results.queue.clear()
            _run_world(cls, tasks, "process")


def _run_world(cls: type, tasks: list, isolation: str) -> None:
    """One world of ``len(tasks)`` ranks (``isolation``: threads or rank processes) for one test; each rank's
    outcome lands on its completion queue."""
    import simulator  # (imports torch: this module loads with the plugin)

    world_size = len(cls.task_queues)
    fd, rdvz = tempfile.mkstemp(prefix="tp-continuous-")  # a fresh rendezvous for each test's world
    os.close(fd)
    os.unlink(rdvz)

    def rank_main() -> None:
        rank = current_rank_state().rank
        _loop(cls, rank, tasks[rank], world_size, rdvz, cls.completion_queues[rank].results)

    s = cls._tp_sim_settings
    try:
        if isolation == "process":
            outcomes = simulator.run(_rank_process_main, world_size, seed=s.seed, mode=s.mode, timeout=s.timeout,
                                     stall_timeout=s.stall_timeout, isolation="process",
                                     args=(cls.__module__, cls.__qualname__, tasks, world_size, rdvz))
            for c, items in zip(cls.completion_queues, outcomes):
                for item in items:
                    c.results.put(item)
        else:  # each rank: its own copy of the parent's environment, as a spawned worker has (_init_pg sets LOCAL_RANK),
            # and the class state a worker process has of its own (device-type tests' thread-local precision...)
            with own_class_state():
                simulator.run(rank_main, world_size, seed=s.seed, mode=s.mode, timeout=s.timeout,
                              stall_timeout=s.stall_timeout, env=dict(os.environ))
    except Exception as e:  # noqa: BLE001  the world failed (a deadlock, a rank that raised): each rank's outcome
        for c in cls.completion_queues:
            if c.results.empty():
                c.results.put(RuntimeError(f"Exception in worker process (simulated rank {c._rank}):\n{e}"))
    finally:
        if os.path.exists(rdvz):
            os.unlink(rdvz)
    _name_every_failure(cls)


def _name_every_failure(cls: type) -> None:
    """The parent raises the first failed rank's outcome only; it is made to carry the other ranks' failures too.

    A rank whose test raised puts the error on its queue and leaves; the others then wait for it in their next
    collective and fail with the simulator's deadlock report (on real workers they would hang until the timeout).
    The parent reads rank 0's outcome first: without this, the report would be the deadlock, not the cause."""
    failed = [(c, item) for c in cls.completion_queues for item in list(c.results.queue)
              if isinstance(item, Exception) and not isinstance(item, unittest.SkipTest)]
    if len(failed) < 2:
        return
    (first, reported), others = failed[0], failed[1:]
    notes = "".join(f"\n\nSimulated rank {c._rank} failed too:\n{str(item)[-_NOTE_CHARS:]}" for c, item in others)
    told = RuntimeError(f"{reported}{notes}")
    told.__cause__ = reported.__cause__
    items = list(first.results.queue)
    first.results.queue.clear()
    for item in items:
        first.results.put(told if item is reported else item)


_NOTE_CHARS = 4000  # of each other rank's failure (its traceback's end: where it raised, and what)


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


def _loop(cls: type, rank: int, task: Any, world_size: int, rdvz: str, completion: Any) -> None:
    """torch's worker loop for one task, on a subclass of ``cls`` of the rank's own (its class attributes), whose
    state is the class's as its module made it (a worker process imports the module; the parent's setUpClass ran
    in the parent only)."""
    own = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                      **_as_a_worker_sees_it(cls)})
    tq: queue.Queue = queue.Queue()
    tq.put(task)
    tq.put(None)
    own._worker_loop(rank, world_size, rdvz, tq, completion)


def _rank_process_main(module: str, qualname: str, tasks: list, world_size: int, rdvz: str) -> list:
    """A rank process: the test's class from its module, one task of torch's loop; the completion-queue items
    (a test id, a ``SkipTest``, the worker's ``RuntimeError`` with its traceback text) are the rank's result."""
    import tensorplay.distributed as tpd  # (imports torch: this module loads with the plugin)

    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    done: queue.Queue = queue.Queue()
    rank = tpd.get_rank()
    try:
        _loop(cls, rank, tasks[rank], world_size, rdvz, done)
    except Exception:
        # the loop failed after the test's outcome was queued (torch's loop destroys a group its skipped _init_pg
        # never made): a worker's queued outcome reaches the parent before the worker dies, as it does here
        if done.empty():
            raise
    return [done.get() for _ in range(done.qsize())]  # (an exception pickles without its cause: its text has it)


def install(harness: Any, settings: Any, isolation: str = "thread",
            thread_only: Callable[[str], str | None] = lambda text: None,
            moved: Callable[[str, str], None] = lambda test_id, why: None) -> Any:
    """Make ``MultiProcContinuousTest``'s workers simulated ranks (``isolation``: threads or rank processes);
    returns the undo.

    ``thread_only(text)``: why the failures ``text`` of thread ranks come from their sharing one process, or
    None; such a test runs again on rank processes, whose outcome the parent reads, and ``moved(test_id, why)``
    is told."""
    base = harness.MultiProcContinuousTest
    saved = base.__dict__["_spawn_processes"]
    base._spawn_processes = _spawn(settings, isolation)
    base._tp_sim_thread_only = staticmethod(thread_only)
    base._tp_sim_moved = staticmethod(moved)

    def undo() -> None:
        base._spawn_processes = saved
        del base._tp_sim_thread_only, base._tp_sim_moved

    return undo
