"""The two schedulers: ``coop`` (one rank at a time, seeded) and ``threads`` (free-running).

Both expose the same five calls, used by the backend and the world:

* ``lock``  - context manager guarding the shared matching state;
* ``point(rs)`` - a scheduling point at the start of every operation;
* ``block(rs, waitable)`` - wait until ``waitable.done`` (or an incident for this rank);
* ``wake(rs)`` - called (under ``lock``) by whoever completed something ``rs`` may wait for;
* ``exit(rs)`` - the rank's function returned or raised.

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

import random
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .world import RankState, _Run

__all__ = ["CoopScheduler", "ThreadScheduler", "RUNNABLE", "BLOCKED", "DONE", "NOT_STARTED"]

NOT_STARTED, RUNNABLE, BLOCKED, DONE = 0, 1, 2, 3
_GRACE_S = 5.0  # a rank's own bound on a wait, beyond the run's deadline (the main thread aborts first)


class _NoLock:
    """Coop mode needs no lock: only the baton holder touches shared state."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _SchedulerBase:
    def __init__(self, run: "_Run") -> None:
        self.run = run

    def _acquire(self, rs: "RankState") -> None:
        """Take ``rs``'s own lock, bounded by the run's deadline (plus grace)."""
        run = self.run
        while True:
            remaining = run.deadline - time.monotonic() + _GRACE_S
            if remaining <= 0:
                run.local_timeout(rs)  # raises
            if rs.wake.acquire(timeout=min(remaining, 3600.0)):
                return

    def check(self, rs: "RankState") -> None:
        """Raise the incident pending for ``rs`` or the world's failure, if any."""
        inc = rs.pending
        if inc is not None:
            rs.pending = None
            raise self.run.make_error(inc, rs)
        if self.run.fatal is not None:
            raise self.run.make_error(self.run.fatal, rs)


class CoopScheduler(_SchedulerBase):
    """One rank runs at a time; a seeded RNG picks the next one at every scheduling point."""

    lock = _NoLock()

    def __init__(self, run: "_Run", seed: int, swap_rng: bool = True) -> None:
        super().__init__(run)
        self.rng = random.Random(seed)
        self.runnable: list["RankState"] = []
        self.swap_rng = swap_rng
        self.blocked = 0
        self.current: "RankState | None" = None  # the baton holder

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
            self._pick().wake.release()

    def enter_rank(self, rs: "RankState") -> None:
        """A rank thread's first step: wait for the baton, then load the rank's RNG state."""
        self._acquire(rs)
        self.current = rs
        self._load_rng(rs)
        if rs.pending is not None:  # the run was aborted before this rank started
            self.check(rs)

    def _save_rng(self, rs: "RankState") -> None:
        if self.swap_rng:
            rs.torch_rng = torch.get_rng_state()
            rs.py_rng = random.getstate()

    def _load_rng(self, rs: "RankState") -> None:
        if self.swap_rng:
            if rs.py_rng is None:  # built on first use: ~20 KB per rank
                rs.py_rng = random.Random(f"simulator:{self.run.seed}:{rs.rank}").getstate()
            torch.set_rng_state(rs.torch_rng)
            random.setstate(rs.py_rng)

    def _handoff(self, rs: "RankState", nxt: "RankState") -> None:
        self._save_rng(rs)
        nxt.wake.release()
        self._acquire(rs)
        self.current = rs
        self._load_rng(rs)

    # -- scheduling points ------------------------------------------------
    def point(self, rs: "RankState") -> None:
        if len(self.runnable) > 1:
            nxt = self._pick()
            if nxt is not rs:
                self._handoff(rs, nxt)
        self.check(rs)

    def block(self, rs: "RankState", w: Any) -> None:
        while not w.done:
            if rs.pending is not None or self.run.aborted:
                break
            rs.state = BLOCKED
            rs.waiting = w
            self.blocked += 1
            self._remove(rs)
            if not self.runnable:
                self.run.deadlock()  # makes every blocked rank runnable with a DeadlockError pending
            nxt = self._pick()
            if nxt is not rs:
                self._handoff(rs, nxt)
        rs.waiting = None
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
        self._save_rng(rs)
        if rs.state == RUNNABLE:
            self._remove(rs)
        rs.state = DONE
        run = self.run
        run.live -= 1
        if run.aborted:
            if run.live == 0:
                run.finished()
            return
        if not self.runnable and self.blocked:
            run.deadlock()
        if self.runnable:
            self._pick().wake.release()
        elif run.live == 0:
            run.finished()


class ThreadScheduler(_SchedulerBase):
    """Ranks run freely; shared state is guarded by one lock; blocked ranks sleep on their own lock."""

    def __init__(self, run: "_Run") -> None:
        super().__init__(run)
        self.lock = threading.Lock()
        self.blocked = 0

    def prepare(self, ranks: list["RankState"]) -> None:
        for rs in ranks:
            rs.state = RUNNABLE

    def kick(self) -> None:
        return None

    def enter_rank(self, rs: "RankState") -> None:
        return None

    def point(self, rs: "RankState") -> None:
        if rs.pending is not None or self.run.fatal is not None:
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
                    run.deadlock()  # wakes every sleeping rank, this one included
                if not rs.sleeping:
                    continue
                lock.release()
                try:
                    remaining = run.deadline - time.monotonic() + _GRACE_S
                    got = rs.wake.acquire(timeout=max(min(remaining, 3600.0), 0.0)) if remaining > 0 else False
                finally:
                    lock.acquire()
                if rs.sleeping:  # our own bound ran out (the main thread should have aborted first)
                    rs.sleeping = False
                    rs.state = RUNNABLE
                    self.blocked -= 1
                    rs.waiting = None
                    lock.release()
                    try:
                        run.local_timeout(rs)
                    finally:
                        lock.acquire()
                elif not got:
                    rs.wake.acquire(False)  # consume the wake-up that raced our timeout
            rs.waiting = None
        if not w.done or rs.pending is not None:
            self.check(rs)
            if not w.done:
                raise run.make_error(run.fatal, rs)

    def wake(self, rs: "RankState") -> None:
        # caller holds self.lock
        if rs.sleeping:
            rs.sleeping = False
            rs.state = RUNNABLE
            self.blocked -= 1
            rs.wake.release()

    def wake_all_blocked(self, ranks: list["RankState"]) -> None:
        for rs in ranks:
            self.wake(rs)

    def exit(self, rs: "RankState") -> None:
        run = self.run
        with self.lock:
            rs.state = DONE
            run.live -= 1
            if run.live == 0:
                run.finished()
            elif self.blocked == run.live and not run.aborted:
                run.deadlock()
