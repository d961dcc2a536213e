"""The two schedulers: ``coop`` (one rank at a time, seeded) and ``threads`` (free-running).

Both implement :class:`simulator.core.protocol.Scheduler`, the calls the backend and the world use:

* ``lock``  - context manager guarding the shared matching state;
* ``point(rs)`` - a scheduling point at the start of every operation;
* ``block(rs, waitable)`` - wait until ``waitable.done`` (or an incident for this rank);
* ``wake(rs)`` - called (under ``lock``) by whoever completed something ``rs`` may wait for;
* ``exit(rs)`` - the rank's function returned or raised (or a thread it started ended);
* ``add_thread(rs)`` - a rank started a thread (an actor of the same rank, see below);
* ``leave(rs)`` / ``rejoin(rs)`` - an actor steps out of the schedule around a wait the
  scheduler cannot see (a rank joining its own threads), and back in;
* ``prepare``, ``kick``, ``enter_rank`` - start-up.

Threads a rank starts belong to that rank (as in a process): each is an extra
*actor* with the rank's identity.  In ``coop`` mode it runs FREE, outside the
schedule, and takes the baton only for its own operations; while any FREE
thread lives, "nobody is runnable" parks the baton instead of declaring a
deadlock, since that thread may still act.  The schedule of such a run is no
longer a pure function of the seed.

Every rank owns a ``threading.Lock`` kept locked; releasing it lets the rank
through its next acquire.  In ``coop`` mode that lock is the *baton*: only the
rank that holds it runs, and at every scheduling point a ``random.Random(seed)``
picks who runs next among the runnable ranks, so a seed fixes the schedule.
In ``threads`` mode the lock is just a wake-up signal.

Deadlock detection is a counter, not a timeout: when the last live rank
blocks (threads: ``blocked == live``; coop: no rank is runnable) nothing can
ever complete, so the world reports a :class:`DeadlockError` at once.
"""
from __future__ import annotations

import os
import random
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import torch

from simulator.core._actor import BLOCKED, DONE, FREE, NOT_STARTED, RUNNABLE
from simulator.core.progress import poll_interval
from simulator.core._handoff import _CWD, _NP_RNG, _PY_RNG, _STEER, _TORCH_RNG, _PyRngSwap  # noqa: F401  (_PyRngSwap: the determinism tests check it)

if TYPE_CHECKING:  # pragma: no cover
    from simulator.core.state import RankState, Run

__all__ = ["CoopScheduler", "ThreadScheduler", "make_scheduler", "RUNNABLE", "BLOCKED", "DONE", "NOT_STARTED", "FREE"]


class _NoLock:
    """Coop mode needs no lock: only the baton holder touches shared state."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _SchedulerBase:
    #: whether a hand-off moves the process to the next rank's working directory (only one rank runs at a time)
    swaps_cwd = False

    def __init__(self, run: "Run") -> None:
        self.run = run
        self.clock = run.clock  # progress stamps (see simulator.core.progress): one read and one store per call
        # the first sleep of a wait before it checks the run's bounds (later ones: Run.wait_slice), fixed per run
        # so that the common wait, a short one, computes nothing
        self.slice0 = run.wait_slice(None)

    def _wake_joiners(self, rs: "RankState") -> None:
        """``rs`` (a thread a rank started) ended: wake whoever waits in ``Thread.join`` for it (under the lock)."""
        if rs.parent is None:
            return
        for a in self.run.actors:
            if a.state == BLOCKED and getattr(a.waiting, "actor", None) is rs:
                self.wake(a)

    def _count_exit(self, rs: "RankState") -> bool:
        """Book ``rs``'s end; True when the world is over: every rank and every non-daemon thread ended (daemon
        threads are abandoned, as at a real process's exit)."""
        run = self.run
        run.live -= 1
        if rs.waits_exit:
            run.to_exit -= 1
        return run.to_exit == 0

    def _acquire(self, rs: "RankState") -> None:
        """Take ``rs``'s own lock; every slice of the wait, check the run's bounds (a backstop: the main thread
        fails a stalled or late run first)."""
        if not rs.wake.acquire(timeout=self.slice0):
            run = self.run
            while not rs.wake.acquire(timeout=run.wait_slice(rs)):  # raises once a bound ran out
                pass

    def block_until(self, rs: "RankState", w: Any, seconds: float, timed_out: Callable[[], Any]) -> None:
        """:meth:`block`, bounded by ``seconds`` of the run's clock: past them the wait fails with the incident
        ``timed_out()`` makes (an operation's own timeout, as torch's process groups bound each operation; the
        main thread watches the deadline, see :func:`simulator.core.progress.expire`)."""
        run = self.run
        deadlines = run.deadlines
        deadlines[rs] = (self.clock() + seconds, timed_out)
        if seconds < 10 * poll_interval(run):  # the main thread may be in a slice of up to a poll interval: wake it
            run.nudge()
        try:
            self.block(rs, w)
        finally:
            deadlines.pop(rs, None)

    def poll(self, rs: "RankState") -> None:
        """``rs`` asked whether an operation that has not completed has (``while not work.is_completed(): ...``):
        a scheduling point, so in coop mode a seeded choice of who runs next (holding the baton, the loop would
        keep the ranks it waits for from ever running).  A poll is no progress: the stamp a point sets is put
        back, so a rank that polls forever is a stall."""
        stamp = rs.stamp
        self.point(rs)
        rs.stamp = stamp

    def check(self, rs: "RankState") -> None:
        """Raise the incident pending for ``rs`` or the world's failure, if any."""
        inc = rs.pending
        if inc is not None:
            rs.pending = None
            raise self.run.make_error(inc, rs)
        if self.run.fatal is not None:
            raise self.run.make_error(self.run.fatal, rs)
        if self.run.over:
            raise self.run.over_error(rs)


class CoopScheduler(_SchedulerBase):
    """One rank runs at a time; a seeded RNG picks the next one at every scheduling point."""

    lock = _NoLock()
    #: only the baton holder runs: an actor that waits outside the schedule must hand the baton on
    baton = True
    swaps_cwd = True

    def __init__(self, run: "Run", seed: int, swap_rng: bool = True) -> None:
        super().__init__(run)
        self.rng = random.Random(seed)
        self.runnable: list["RankState"] = []
        self.swap_rng = swap_rng
        self.blocked = 0
        self.current: "RankState | None" = None  # the baton holder
        # threads a rank started run FREE; they join the schedule for their operations only
        self.free = 0
        self.requests: list["RankState"] = []  # FREE threads asking for the baton
        self.timeouts: list["RankState"] = []  # blocked actors whose operation timed out (see time_out)
        self.parked = False  # nobody holds the baton: every actor is blocked or done, some FREE thread may act
        self.flock = threading.Lock()  # guards free/requests/parked (FREE threads touch them without the baton)
        self.turn_seen: tuple | None = None  # the main thread's watch on the baton holder (progress.watch_turn)
        _STEER.refresh()

    # runnable set with O(1) add/remove; its order is a pure function of the history
    def _add(self, rs: "RankState") -> None:
        rs.pos = len(self.runnable)
        self.runnable.append(rs)

    def _remove(self, rs: "RankState") -> None:
        lst = self.runnable
        last = lst.pop()
        if last is not rs:
            lst[rs.pos] = last
            last.pos = rs.pos
        rs.pos = -1

    def _pick(self) -> "RankState":
        lst = self.runnable
        if len(lst) == 1:
            return lst[0]
        return lst[self.rng.randrange(len(lst))]

    # -- life cycle ---------------------------------------------------------
    def prepare(self, ranks: list["RankState"]) -> None:
        for rs in ranks:
            rs.state = RUNNABLE
            self._add(rs)

    def kick(self) -> None:
        """Main thread: hand the baton to the first rank."""
        if self.runnable:
            self._release(self._pick())

    def enter_rank(self, rs: "RankState") -> None:
        """A rank thread's first step: wait for the baton, then load the rank's RNG state."""
        rs.tid = threading.get_native_id()
        self._acquire(rs)
        _STEER.free(rs)
        self.current = rs
        rs.stamp = self.clock()  # it starts computing now
        self._load_rng(rs)
        if rs.pending is not None:  # the run was aborted before this rank started
            self.check(rs)

    def _save_rng(self, rs: "RankState") -> None:
        if self.swap_rng and rs.parent is None:  # a rank's threads share its generator, as in a process
            if rs.torch_gen is not None:
                _TORCH_RNG.save(rs.torch_gen)
            _PY_RNG.save(rs.py_rng)
            _NP_RNG.save(rs)

    def _load_rng(self, rs: "RankState") -> None:
        if _CWD.active:  # a rank changed its working directory: each has its own (see _handoff.CwdSwap)
            _CWD.load(rs)
        if self.swap_rng and rs.parent is None:
            if rs.py_rng is None:  # built on first use: 2.5 KB per rank
                rs.py_rng = random.Random(f"simulator:{self.run.seed}:{rs.rank}")
            if rs.torch_gen is None:  # (a world sets every rank's stream before it starts)
                rs.torch_rng = torch.get_rng_state()
            _TORCH_RNG.load(rs.torch_gen)
            _PY_RNG.load(rs.py_rng)
            _NP_RNG.load(rs)

    def _handoff(self, rs: "RankState", nxt: "RankState") -> None:
        self._save_rng(rs)
        _STEER.towards_me(nxt)
        self._release(nxt)
        self._acquire(rs)
        _STEER.free(rs)
        self.current = rs
        self._load_rng(rs)

    def _release(self, nxt: "RankState") -> None:  # hand the baton to nxt
        try:
            nxt.wake.release()
        except RuntimeError:  # released already: an aborted run releases every actor that waits for its turn
            if not self.run.aborted:
                raise

    def _take(self, rs: "RankState") -> None:
        """Holding the baton: take it over (after a wake-up or from the parked state)."""
        _STEER.free(rs)
        self.current = rs
        self._load_rng(rs)

    # -- threads a rank started (FREE actors) -----------------------------------
    def add_thread(self, rs: "RankState") -> None:
        with self.flock:
            rs.state = FREE
            self.free += 1
            self.run.live += 1
            if rs.waits_exit:
                self.run.to_exit += 1

    def _drain(self) -> None:
        """Baton holder: FREE actors that asked for the baton become runnable."""
        with self.flock:
            for r in self.requests:
                r.state = RUNNABLE
                self.free -= 1
                self._add(r)
            self.requests.clear()
            for r in self.timeouts:
                self.wake(r)
            self.timeouts.clear()

    def time_out(self, rs: "RankState", inc: Any) -> None:
        """Main thread: ``rs``'s operation ran past its deadline: fail its wait with ``inc`` (at the holder's next
        scheduling point, or at once with a parked baton)."""
        with self.flock:
            if rs.state != BLOCKED or rs.pending is not None or self.run.aborted:
                return
            rs.pending = inc
            if self.parked:  # nobody holds the baton: rs takes it
                self.parked = False
                self.wake(rs)
                self._release(rs)
            else:
                self.timeouts.append(rs)

    def serve_timeouts(self, rs: "RankState") -> None:
        """Baton holder ``rs`` waits in the OS (its rank process computes): hand the baton to an actor whose operation
        ran past its own timeout, so it fails now, as on real processes (a wall-clock event: not seeded anyway)."""
        late = self.timeouts[0] if self.timeouts else None
        self._drain()
        if late is not None and late is not rs and late.state == RUNNABLE:
            self._handoff(rs, late)
            rs.stamp = self.clock()
        self.check(rs)

    def _join(self, rs: "RankState") -> None:
        """A FREE actor enters the schedule: wait for the baton (or take it when parked)."""
        with self.flock:
            if self.run.over:
                raise self.run.over_error(rs)
            if self.parked:
                self.parked = False
                self.free -= 1
                rs.state = RUNNABLE
                self._add(rs)
                self._take(rs)
                return
            self.requests.append(rs)
        self._acquire(rs)
        self._take(rs)

    def _park_or_deadlock(self) -> str:
        """No runnable actor: park the baton if a FREE actor may still act (``"parked"``: the caller no longer holds
        it and must not read the runnable set again), run on when one became runnable (``"run"``), or ``"deadlock"``."""
        self._drain()
        if self.runnable:
            return "run"
        with self.flock:
            if self.requests or self.timeouts:
                pass  # raced in after the drain: handled by the caller's next pick
            elif self.free > 0:
                self.parked = True
                return "parked"
        if self.requests or self.timeouts:
            self._drain()
            return "run"
        return "deadlock"

    def leave(self, rs: "RankState") -> None:
        """``rs`` (holding the baton) goes back to running outside the schedule (a thread after its operation,
        or a rank about to wait for its threads)."""
        if rs.state == FREE:
            return
        self._save_rng(rs)
        if rs.state == RUNNABLE:
            self._remove(rs)
        with self.flock:
            rs.state = FREE
            self.free += 1
        self._pass_on()

    def _pass_on(self) -> None:
        """The caller gives the baton up: wake the next runnable actor, or park the baton for a FREE one."""
        while True:
            if self.requests or self.timeouts:
                self._drain()
            if self.runnable:
                nxt = self._pick()
                _STEER.towards_me(nxt)
                self._release(nxt)
                return
            with self.flock:
                if not self.requests:  # checked under the lock: a FREE actor asking now finds the baton parked
                    self.parked = True
                    return

    def rejoin(self, rs: "RankState") -> None:
        """A rank that left the schedule (:meth:`leave`) takes part again."""
        if rs.state == FREE:
            self._join(rs)

    # -- scheduling points ------------------------------------------------
    def point(self, rs: "RankState", switch: bool = True) -> None:
        """A scheduling point.  ``switch=False`` (a blocking collective's entry): the baton holder runs on, since
        who enters first cannot change the outcome and the member waits right after, where the next actor is drawn
        anyway (a hand-off at the entry too doubled them: 0.1 ms each at 1024 ranks).  Every other entry
        (point-to-point, whose any-source matches follow the interleaving; an async collective) is a seeded choice."""
        rs.stamp = self.clock()
        if rs.state == FREE:
            self._join(rs)
        if self.requests or self.timeouts:
            self._drain()
        if switch and len(self.runnable) > 1:
            nxt = self._pick()
            if nxt is not rs:
                self._handoff(rs, nxt)
                rs.stamp = self.clock()  # it computes again from now (a rank waiting for its turn is not computing)
        self.check(rs)

    def block(self, rs: "RankState", w: Any) -> None:
        if rs.state == FREE and not w.done:
            self._join(rs)
        while not w.done:
            if rs.pending is not None or self.run.aborted:
                break
            rs.state = BLOCKED
            rs.waiting = w
            self.blocked += 1
            self._remove(rs)
            if not self.runnable:
                # saved before the baton is parked: a FREE thread may take a parked baton at once and load its own
                # streams, which a save after the parking would record as this rank's
                self._save_rng(rs)
                how = self._park_or_deadlock()
                if how == "deadlock":
                    self.run.deadlock()  # makes every blocked rank runnable with a DeadlockError pending
                elif how == "parked":  # a FREE thread takes the baton and wakes us when it can
                    self._acquire(rs)
                    self._take(rs)
                    continue
            nxt = self._pick()
            if nxt is not rs:
                self._handoff(rs, nxt)
        rs.waiting = None
        rs.stamp = self.clock()  # the wait ended
        if not w.done or rs.pending is not None:
            self.check(rs)
            if not w.done:  # aborted without a pending error of our own
                raise self.run.make_error(self.run.fatal, rs)

    def wake(self, rs: "RankState") -> None:
        if rs.state == BLOCKED:
            rs.state = RUNNABLE
            self.blocked -= 1
            self._add(rs)

    def wake_all_blocked(self, ranks: list["RankState"]) -> None:
        for rs in ranks:
            self.wake(rs)

    def exit(self, rs: "RankState") -> None:
        run = self.run
        rs.stamp = self.clock()
        if rs.state == FREE:
            if not (run.aborted or run.over):
                try:
                    self._join(rs)  # a thread ends inside the schedule: its joiners are woken by the baton holder
                except BaseException:  # noqa: BLE001  the world ended meanwhile: end outside it
                    pass
            if rs.state == FREE:
                with self.flock:
                    self.free -= 1
                    rs.state = DONE
                    over = self._count_exit(rs)
                if over:
                    run.finished()
                return
        self._save_rng(rs)
        if rs.state == RUNNABLE:
            self._remove(rs)
        rs.state = DONE
        over = self._count_exit(rs)
        if run.aborted:
            if over:
                run.finished()
            return
        self._wake_joiners(rs)
        how = self._park_or_deadlock() if not self.runnable and self.blocked else "run"
        if how == "deadlock":
            run.deadlock()
        if over and not self.runnable and not self.requests:
            run.finished()
        elif how != "parked":  # (parked: the baton is no longer ours to pass)
            self._pass_on()


class ThreadScheduler(_SchedulerBase):
    """Ranks run freely; shared state is guarded by one lock; blocked ranks sleep on their own lock."""

    baton = False

    def __init__(self, run: "Run") -> None:
        super().__init__(run)
        self.lock = threading.Lock()
        self.blocked = 0
        #: woken actors whose threads are not released yet (see wake): each released one releases the next
        self.relay: deque["RankState"] = deque()
        self.released = 0  # released threads that have not resumed yet: at most `width` at a time
        self.width = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        self.awake: "RankState | None" = None  # the actor that wakes the others while it has not slept yet

    def prepare(self, ranks: list["RankState"]) -> None:
        for rs in ranks:
            rs.state = RUNNABLE

    def add_thread(self, rs: "RankState") -> None:
        with self.lock:
            rs.state = RUNNABLE
            self.run.live += 1
            if rs.waits_exit:
                self.run.to_exit += 1

    def leave(self, rs: "RankState") -> None:
        return None  # free-running: there is no baton to give back

    def rejoin(self, rs: "RankState") -> None:
        return None

    def kick(self) -> None:
        return None

    def enter_rank(self, rs: "RankState") -> None:
        return None

    def point(self, rs: "RankState", switch: bool = True) -> None:
        rs.stamp = self.clock()
        if rs.pending is not None or self.run.fatal is not None or self.run.over:
            self.check(rs)

    def block(self, rs: "RankState", w: Any) -> None:
        run = self.run
        lock = self.lock
        with lock:
            while not w.done and rs.pending is None and not run.aborted:
                rs.sleeping = True
                rs.waiting = w
                rs.state = BLOCKED
                self.blocked += 1
                if self.blocked == run.live:
                    self.awake = rs  # (not sleeping on its lock yet: its wake needs no release)
                    try:
                        run.deadlock()  # wakes every sleeping rank, this one included
                    finally:
                        self.awake = None
                if not rs.sleeping:
                    continue
                lock.release()
                over: BaseException | None = None
                try:
                    got = rs.wake.acquire(timeout=self.slice0)
                    while not got and rs.sleeping:  # every slice: check the run's bounds (see simulator.core.progress)
                        try:
                            slice_s = run.wait_slice(rs)
                        except BaseException as e:  # noqa: BLE001  our own bound ran out: raised below, unblocked
                            over = e
                            break
                        got = rs.wake.acquire(timeout=slice_s)
                finally:
                    lock.acquire()
                if not rs.sleeping:  # woken
                    if got or rs not in self.relay:  # released (its release may have raced the slice's end)
                        if not got:
                            rs.wake.acquire(False)  # consume the release that raced our timeout
                        self._pass_relay()
                    else:  # woken while its slice ran out, before the relay reached it: take it out of the relay
                        self.relay.remove(rs)
                rs.stamp = self.clock()
                if rs.sleeping and over is not None:  # (the main thread should have aborted first)
                    rs.sleeping = False
                    rs.state = RUNNABLE
                    self.blocked -= 1
                    rs.waiting = None
                    raise over  # (the with-block releases the lock)
            rs.waiting = None
        if not w.done or rs.pending is not None:
            self.check(rs)
            if not w.done:
                raise run.make_error(run.fatal, rs)

    def wake(self, rs: "RankState") -> None:
        """``rs`` may run (the caller holds ``lock``).

        It counts as running at once, but its thread is released by a relay: at most ``width`` (the CPUs)
        released threads are on their way back at a time, and each one that resumes releases the next.  A
        collective's completion wakes every member; releasing them all at once had them all wake on the OS
        and fight for the GIL, one winning at a time (a 1024-rank all_reduce: 0.28 s, 0.09 s with the relay).
        """
        if rs.sleeping:
            rs.sleeping = False
            rs.state = RUNNABLE
            self.blocked -= 1
            if rs is self.awake:
                return
            if self.released < self.width:
                self.released += 1
                rs.wake.release()
            else:
                self.relay.append(rs)

    def _pass_relay(self) -> None:
        """A released thread resumes (under ``lock``): release the next woken one, if any."""
        if self.released > 0:
            self.released -= 1
        relay = self.relay
        while relay and self.released < self.width:
            try:
                relay.popleft().wake.release()
                self.released += 1
            except RuntimeError:  # released already (an abort releases every actor itself)
                continue

    def wake_all_blocked(self, ranks: list["RankState"]) -> None:
        for rs in ranks:
            self.wake(rs)

    def time_out(self, rs: "RankState", inc: Any) -> None:
        """Main thread: ``rs``'s operation ran past its deadline: fail its wait with ``inc``."""
        with self.lock:
            if rs.state == BLOCKED and rs.pending is None and not self.run.aborted:
                rs.pending = inc
                self.wake(rs)

    def exit(self, rs: "RankState") -> None:
        run = self.run
        rs.stamp = self.clock()
        with self.lock:
            rs.state = DONE
            self._wake_joiners(rs)
            if self._count_exit(rs):
                run.finished()
            elif self.blocked == run.live and run.live and not run.aborted:
                run.deadlock()


def make_scheduler(mode: str, seed: int, swap_rng: bool = True) -> Callable[["Run"], Any]:
    """The scheduler of a world's ``mode``, as a factory the run calls with itself (the world passes it in)."""
    if mode == "coop":
        return lambda run: CoopScheduler(run, seed, swap_rng=swap_rng)
    return ThreadScheduler
