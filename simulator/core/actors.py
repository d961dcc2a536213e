"""Actors beyond a rank's own thread, and the waits the scheduler cannot see, as scheduler operations.

A rank's thread is an actor of the run; so is a thread the rank starts (:mod:`simulator.adapters.threads`
adopts it) and a thread the simulator starts *as* a rank (:func:`start_actor`: the simulated RPC transport
runs a request on one, an actor of the callee).  The waits no operation makes (joining a thread, sleeping)
are scheduler waits here: a join is a :meth:`~simulator.core.protocol.Scheduler.block` (a deadlock through it
is named), and on a baton scheduler a wait outside the schedule steps out of it so the others run meanwhile.
Nothing here patches anything: the thread adapter and a rank process's proxy call these.
"""
from __future__ import annotations

import _thread
import threading
import time
from typing import Any, Callable

from simulator.core._actor import DONE, FREE, RUNNABLE, bind_env, quiet, start_thread_plainly, unbind_env
from simulator.core.state import RankState, _local, current_rank_state

__all__ = ["start_actor", "start_plain", "join_actor", "step_out", "step_in", "sleep_out", "sleep_in", "condition_wait"]


def start_plain(t: threading.Thread) -> None:
    """Start ``t`` as a thread of the simulator's own (not adopted by the calling rank, whoever calls)."""
    start_thread_plainly(t)


def _own_live_threads(rs: RankState) -> bool:
    root = rs.parent or rs
    return any(c.parent is root and c.state != DONE for c in rs.run.children)


def step_out(rs: RankState | None, others: bool = False) -> bool:
    """Before a wait the scheduler cannot see: if the rank's own threads (or, ``others``, any actor: a future an
    RPC answer completes) may need the turn this wait holds, step out of the schedule so they can take it (True:
    call :func:`step_in` after the wait)."""
    if (rs is None or rs.state == FREE or rs.run.over or getattr(quiet, "depth", 0)
            or not (others or _own_live_threads(rs))):
        return False  # nothing of this rank's could be waiting for the baton this wait holds
    rs.run.sched.leave(rs)
    return True


def step_in(rs: RankState) -> None:
    """After the wait :func:`step_out` stepped out for: take part in the schedule again."""
    rs.run.sched.rejoin(rs)


def condition_wait(rs: RankState, cond: threading.Condition, timeout: float | None,
                   wait: Callable[[threading.Condition, float | None], bool]) -> bool:
    """``cond.wait(timeout)`` on rank actor ``rs`` (``wait``: the real ``Condition.wait``), stepped out of the
    schedule so that the rank's own threads run meanwhile.

    Waking up, the actor takes its turn *before* the condition's lock: waiting for the turn while holding the
    lock would deadlock with a baton holder about to take it (two handlers polling one ``Event``).  The lock is
    then taken at once if free; if not, the actor waits for it outside the schedule again.  The wait itself is
    ``Condition.wait``'s own protocol (a waiter lock on the condition's queue, which ``notify`` releases)."""
    c: Any = cond
    if not c._is_owned() or not step_out(rs):  # (an un-acquired lock: the real wait raises its own error)
        return wait(cond, timeout)
    waiter = _thread.allocate_lock()
    waiter.acquire()
    c._waiters.append(waiter)
    saved = c._release_save()
    got = False
    try:
        got = waiter.acquire() if timeout is None else waiter.acquire(True, timeout)
    finally:
        try:
            step_in(rs)
        finally:
            _retake(rs, c, saved)
            if not got:
                try:
                    c._waiters.remove(waiter)
                except ValueError:  # notified just as the wait timed out
                    pass
    return got


def _retake(rs: RankState, c: Any, saved: Any) -> None:
    """Holding the turn, take condition ``c``'s lock back as ``Condition.wait`` would (``saved``: what its
    ``_release_save`` gave), without ever waiting for the lock while holding the turn."""
    lock = c._lock
    while not lock.acquire(False):
        if step_out(rs):  # its holder may need the turn to get to its release
            lock.acquire()
            lock.release()
            try:
                step_in(rs)
            except BaseException:  # the run ended meanwhile: raise holding the lock, as Condition.wait would
                lock.acquire()
                _restore_depth(c, lock, saved)
                raise
        else:
            lock.acquire()  # nothing of this rank's needs the turn: wait holding it, as before
            break
    _restore_depth(c, lock, saved)


def _restore_depth(c: Any, lock: Any, saved: Any) -> None:
    """Condition ``c``'s ``lock``, held once now, back as ``_release_save`` left it (``saved``)."""
    if isinstance(saved, tuple) and isinstance(saved[0], int):
        for _ in range(saved[0] - 1):
            lock.acquire()
    elif saved is not None:  # a lock of another kind: its own restore (the lock is free for it by now)
        lock.release()
        c._acquire_restore(saved)


class _ThreadEnd:
    """What ``Thread.join`` waits for, as a scheduler wait: a deadlock through a join is named, not timed out."""

    __slots__ = ("actor",)

    def __init__(self, actor: RankState) -> None:
        self.actor = actor

    @property
    def done(self) -> bool:
        return self.actor.state == DONE

    def describe(self) -> str:
        a = self.actor
        return f"in Thread.join of its thread {a.thread.name if a.thread else '?'!r} (started at {a.last_site})"


def join_actor(rs: RankState, actor: RankState) -> None:
    """``rs`` joins the thread of ``actor`` without a timeout: a scheduler wait, so a deadlock through it is named."""
    end = _ThreadEnd(actor)
    if not end.done:
        sched = rs.run.sched
        sched.block(rs, end)
        if rs.parent is not None:
            sched.leave(rs)


def sleep_out(rs: RankState, seconds: Any, site: str, what: str | None = None) -> bool:
    """Before a real ``time.sleep(seconds)`` at ``site`` on rank actor ``rs``: in coop mode, step out of the schedule
    so that the other ranks run meanwhile (True: call :func:`sleep_in` after the sleep).  ``what`` names another
    wait outside the schedule that blocks in the OS (a store's ``get`` of a key no rank has set yet).

    Threads mode, an actor outside the schedule, a bad argument and ``sleep(0)`` step out of nothing: a program that
    only yields keeps its seeded schedule (the same on thread and process ranks).
    """
    run = rs.run
    if not (run.sched.baton and rs.state != FREE and not run.over
            and not getattr(quiet, "depth", 0) and isinstance(seconds, (int, float)) and seconds > 0):
        return False
    if run.deterministic:
        run.deterministic = False  # the order the ranks come back in depends on the wall clock now
        run.nondeterminism = f"{rs.label} called {what or f'time.sleep({seconds:g})'} at {site}"
    run.sched.leave(rs)
    return True


def sleep_in(rs: RankState) -> None:
    """After the sleep :func:`sleep_out` stepped out for: back in the schedule; a sleep-polling rank whose run has
    failed (another rank failed, the world deadlocked or timed out) ends like one released from a wait."""
    run = rs.run
    run.sched.rejoin(rs)
    if rs.parent is None and run.fatal is not None:
        raise run.make_error(run.fatal, rs)


def start_actor(owner: RankState, target: Callable[[], None], name: str) -> RankState:
    """Run ``target`` on a new thread that belongs to ``owner``'s rank, whoever starts it; returns its actor.

    This is the thread a simulated RPC agent runs a request on: started by the
    *caller*, but an actor of the *callee* rank (``RankState.child`` of it), so
    its waits are scheduler waits of that rank and a deadlock through it is
    named.  Unlike a thread a rank starts itself (FREE, see the module
    docstring), it is scheduled like a rank: in ``coop`` mode it joins the
    runnable set at once and runs only while it holds the baton, so a run
    stays a function of its seed.  In ``coop`` mode the caller must be the
    baton holder; a FREE caller joins the schedule for the start and leaves it
    again.  The run waits for the actor as for a non-daemon thread (the OS
    thread itself is a daemon, so it never holds up the interpreter).
    ``target`` must not raise: report failures through what it completes.
    """
    root = owner.parent or owner
    run = root.run
    sched = run.sched
    if run.over or run.aborted:  # nobody would schedule the thread: fail the start instead of losing it
        me = current_rank_state() or root
        raise run.make_error(run.fatal, me) if run.fatal is not None else run.over_error(me)
    t = threading.Thread(name=name, daemon=True)
    actor = root.child(t)
    actor.waits_exit = True
    coop = sched.baton
    me = current_rank_state()
    was_free = me is not None and me.state == FREE
    if coop and was_free:
        sched.rejoin(me)  # take the baton: the runnable set is the baton holder's
    sched.add_thread(actor)
    if coop:
        with sched.flock:
            actor.state = RUNNABLE
            sched.free -= 1
        sched._add(actor)
    run.children.append(actor)

    def body() -> None:
        actor.tid = threading.get_native_id()
        _local.rs = actor
        try:
            if coop:
                sched._acquire(actor)  # the baton, when the seeded schedule picks this actor
                sched._take(actor)
            actor.cpu_mark = time.thread_time()
            if actor.env is not None:
                bind_env(actor.env)
            if not run.aborted:
                target()
        finally:
            if actor.env is not None:
                unbind_env()
            _local.rs = None
            sched.exit(actor)

    t.run = body  # type: ignore[method-assign]
    start_plain(t)  # (start()'s short wait for the thread is not a rank's wait)
    if coop and was_free:
        sched.leave(me)
    return actor
