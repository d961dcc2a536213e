"""Threads of a rank process: each one the program starts is an actor of its rank, as on thread ranks.

On thread ranks, :mod:`simulator.adapters.threads` gives a thread a rank starts an actor
of that rank in the scheduler.  In a rank process the same happens across the
process boundary, so one program behaves the same in both isolations:

* ``Thread.start`` asks the proxy for an actor (THREAD, see :mod:`.messages`; with one end of a
  new socket pair): the proxy adopts it with :func:`simulator.adapters.threads.adopt`
  and serves the thread's own channel from a thread of its own.  The thread's
  calls go over that channel, so two threads of one process communicate at
  once, as on gloo (one shared channel would let a blocked call hold up the
  call that unblocks it).
* ``Thread.join`` without a timeout is a scheduler wait (JOIN), so a
  deadlock through a join is named, not timed out.
* ``Condition.wait`` (``Event.wait``, ``Queue.get``, ``Future.result``) of the
  rank's main thread, while threads it started live, steps out of the schedule
  (LEAVE/REJOIN), so in ``coop`` mode those threads can take the
  turn the waiting rank would otherwise hold.

Threads the process did not start during the run (an RPC agent's native
threads) share the main thread's channel, one request at a time.

A sleep-polling loop of the main thread in ``coop`` mode steps out of the
schedule too (SLEEP/WAKE, with the sleep's length and place; see
:func:`simulator.adapters.threads.sleep_out`), so a rank that polls a file or a store
between sleeps lets the rank it waits for run.  A rank process computes at once
with the others, so a single sleep between two calls (a stand-in for compute)
keeps the seeded schedule; the second sleep with no call into the simulator
since the first is a poll, and steps out.
"""
from __future__ import annotations

import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from simulator.adapters import os_waits, threads, torch_globals
from simulator.isolation import _wire
from simulator.isolation.messages import END, FREE, JOIN, LEAVE, REJOIN, SLEEP, THREAD, WAKE

__all__ = ["install", "free_running", "stepped_out", "start_service", "start_served"]

_ORIGINAL = {"start": threading.Thread.start, "bootstrap_inner": threading.Thread._bootstrap_inner,  # type: ignore[attr-defined]
             "join": threading.Thread.join, "cond_wait": threading.Condition.wait}
_backend: Any = None  # the rank's ClientBackend
_quiet = threading.local()  # depth > 0: inside Thread.start, whose short wait is not the rank's
_live: set[threading.Thread] = set()  # threads started by the program that have not ended
#: the process serves tensorplay's RPC (set by .rpc_process): see :func:`stepped_out`
rpc_serving = False


def install(backend: Any, coop: bool) -> None:
    """Make the threads the program starts from now on actors of the rank (for the rest of this process); in coop
    mode (``coop``), the main thread's ``time.sleep`` steps out of the schedule."""
    global _backend
    _backend = backend
    if coop:
        _ORIGINAL["sleep"] = time.sleep
        time.sleep = _sleep
        torch_globals.wait_in_os = os_waits.wait_in_os = _wait_in_os
        threads.poll_in_os = _poll_in_os
        os_waits.install()
    threading.Thread.start = _start  # type: ignore[method-assign]
    threading.Thread._bootstrap_inner = _bootstrap_inner  # type: ignore[attr-defined]
    threading.Thread.join = _join  # type: ignore[method-assign]
    threading.Condition.wait = _cond_wait  # type: ignore[method-assign]


def free_running() -> None:
    """From now on the rank's compute runs outside the coop schedule (its waits on RPC answers are invisible to
    the scheduler; see :mod:`.rpc_process`)."""
    if _backend is not None:
        _backend._request((FREE,))


def start_service(t: threading.Thread) -> None:
    """Start ``t``, a thread of the simulator's own in the rank process (RPC's dispatcher): no actor of the rank."""
    _ORIGINAL["start"](t)


def start_served(t: threading.Thread, chan: Connection) -> None:
    """Start ``t`` with ``chan`` as its channel, whose other end an actor of the rank in the coordinator already
    serves (an RPC handler thread, see :mod:`.rpc_routes`)."""
    t._tp_chan = chan  # type: ignore[attr-defined]
    t._tp_tid = None  # type: ignore[attr-defined]  (its actor is the coordinator's: not joined through JOIN)
    _live.add(t)
    try:
        _ORIGINAL["start"](t)
    except BaseException:
        _ended(t)
        raise


def _start(self: threading.Thread) -> None:
    b = _backend
    if b is not None and b.has_channel():
        _register(self, b)
    _quiet.depth = getattr(_quiet, "depth", 0) + 1
    try:
        _ORIGINAL["start"](self)
    except BaseException:
        _ended(self)  # it never ran: its actor must not wait for it
        raise
    finally:
        _quiet.depth -= 1


def _register(t: threading.Thread, b: Any) -> None:
    """Give ``t`` an actor of the rank and a channel of its own to it (before ``t`` runs)."""
    mine, theirs = socket.socketpair()
    try:
        tid = b._request((THREAD, t.name, t.daemon), (theirs.fileno(),))
    except (EOFError, OSError):  # the world has ended (a daemon thread starting one): a plain thread, as on
        mine.close()             # thread ranks once the run is over
        return
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    t._tp_chan = Connection(mine.detach())  # type: ignore[attr-defined]
    t._tp_tid = tid  # type: ignore[attr-defined]
    _live.add(t)


def _ended(self: threading.Thread) -> None:
    """The thread is over: tell its actor (which exits) and close its channel."""
    _live.discard(self)
    chan: Connection | None = self.__dict__.pop("_tp_chan", None)
    if chan is None:
        return
    try:
        _wire.send(chan, (END,))
    except OSError:
        pass
    chan.close()


def _bootstrap_inner(self: threading.Thread) -> None:
    chan = getattr(self, "_tp_chan", None)
    if chan is None or _backend is None:
        return _ORIGINAL["bootstrap_inner"](self)
    _backend.bind_channel(chan)
    _backend.start_clock()
    try:
        _ORIGINAL["bootstrap_inner"](self)  # runs the target; an exception goes to threading.excepthook, as usual
    finally:
        _backend.bind_channel(None)
        _ended(self)


def _join(self: threading.Thread, timeout: float | None = None) -> None:
    b = _backend
    tid = getattr(self, "_tp_tid", None)
    if tid is None or b is None or self is threading.current_thread() or not b.has_channel():
        return _ORIGINAL["join"](self, timeout)
    if timeout is None:  # the scheduler sees this wait; the real join below then returns at once
        b._request((JOIN, tid))
        return _ORIGINAL["join"](self, None)
    return stepped_out(lambda: _ORIGINAL["join"](self, timeout))


def _cond_wait(self: threading.Condition, timeout: float | None = None) -> bool:
    if timeout is not None and timeout <= 0:  # a poll never waits
        return _ORIGINAL["cond_wait"](self, timeout)
    return stepped_out(lambda: _ORIGINAL["cond_wait"](self, timeout))


def stepped_out(wait: Any, others: bool = False) -> Any:
    """Run ``wait`` (a wait the scheduler cannot see) outside the schedule if other actors may need the turn.

    Only the main thread's actor and those of RPC handler threads hold the turn while their thread computes (the
    actors of the threads the program starts leave the schedule after each call), so only their waits step out:
    the main thread's while threads it started live, or while the process serves RPC (a future it waits for may
    be completed by an answer that other ranks compute); a handler thread's always.  The coordinator lets it out
    when the rank's own threads may end the wait, or, ``others`` (a wait for a future of the program's own, which
    an RPC answer's callback completes), when any actor may.
    """
    b = _backend
    if b is None or getattr(_quiet, "depth", 0):
        return wait()
    if not ((b.on_main_thread() and (_live or rpc_serving)) or (rpc_serving and b.has_channel())):
        return wait()
    left = b._request((LEAVE, others and rpc_serving))
    try:
        return wait()
    finally:
        if left:
            b._request((REJOIN,))


#: the simulator's own modules: their sleeps (a Delay fault, a retry inside an operation) stay in the schedule
_OWN = ("simulator", "tensorplay")
_last_sleep = -1  # the backend's request count at the main thread's last sleep


def _sleep(seconds: float) -> None:
    b = _backend
    frame = sys._getframe(1)
    if (b is None or not isinstance(seconds, (int, float)) or seconds <= 0 or not b.on_main_thread()
            or (frame.f_globals.get("__name__") or "").split(".", 1)[0] in _OWN):
        return _ORIGINAL["sleep"](seconds)
    global _last_sleep
    polling, _last_sleep = _last_sleep == b.exchanges, b.exchanges
    if not polling:  # one sleep between two calls: compute, at once with the other rank processes
        return _ORIGINAL["sleep"](seconds)
    left = b._request((SLEEP, seconds, f"{frame.f_code.co_filename}:{frame.f_lineno}"))
    try:
        _ORIGINAL["sleep"](seconds)
    finally:
        if left:
            b._request((WAKE,))
        _last_sleep = b.exchanges  # (its own two requests are no call of the program's)


def _poll_in_os(what: str, site: str) -> None:
    """The main thread polls a store in a loop (``while store.add(key, 0) < n``; see
    :func:`simulator.adapters.threads.store_poll`): a millisecond out of the schedule, so the rank it waits for runs."""
    _wait_in_os(what, site, lambda: _ORIGINAL["sleep"](0.001), seconds=0.001)


def _wait_in_os(what: str, site: str, call: Any, seconds: float = 1.0) -> Any:
    """A wait of the main thread in the OS that the scheduler cannot see (a store's ``get`` of a key no rank has
    set yet; see :func:`simulator.adapters.torch_globals._store_wait`): step out of the schedule for it."""
    b = _backend
    if b is None or not b.on_main_thread():
        return call()
    left = b._request((SLEEP, seconds, site, what))
    try:
        return call()
    finally:
        if left:
            b._request((WAKE,))

