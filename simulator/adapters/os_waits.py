"""Waits in the kernel that a coop rank makes for another rank, or for a thread of its own: sockets and ``select``.

In ``coop`` mode only the holder of the turn runs.  A rank blocked in the kernel while it holds the turn
(``conn.recv()`` on a connection whose peer is another rank, ``select`` on a pipe that a thread of its own
writes after a collective) keeps that peer from ever running, and the run hangs where real processes finish.

So such a wait first asks the kernel whether it would block (``select`` with a zero timeout).  If not, it runs
as it is and the seeded schedule is untouched.  If it would, the rank steps out of the schedule for the wait, as a
sleeping rank does (:func:`simulator.core.actors.sleep_out`; in a rank process, the proxy's ``wait_in_os``), and
the run is marked as not a pure function of its seed.  Calls made by the simulator, tensorplay and
``subprocess`` are left alone (see :data:`simulator.adapters.threads._OWN`).

Covered: ``select.select``, and ``recv``, ``recv_into``, ``recvfrom``, ``recvfrom_into`` and ``accept`` of blocking
``socket.socket`` objects; multiprocessing's waits between processes, which ranks that a launcher started share
with each other and with the launcher: the reads and ``poll`` of a ``Connection`` (``Pipe``, and under them
``Queue.get``, ``SimpleQueue.get``, a manager's proxies), ``Event.wait`` and ``Condition.wait`` (under them
``Barrier.wait`` and ``JoinableQueue.join``), and a lock's or semaphore's blocking ``acquire`` and ``with`` (of
those made while a launcher or world runs: ``acquire`` is set on each lock as it is made).  A wait torch makes
for its own worker processes (a ``DataLoader``'s queues) is left alone: no rank can be what it waits for.  A
blocking ``threading.Lock.acquire`` or a busy loop cannot be seen from Python: see docs/deviations.md.
"""
from __future__ import annotations

import _socket
import multiprocessing.connection as mp_connection
import multiprocessing.synchronize as mp_synchronize
import os
import select
import socket
import sys
import time
from typing import Any, Callable

from simulator.core.actors import sleep_in, sleep_out
from simulator.core.state import current_rank_state

__all__ = ["install", "uninstall", "wait_in_os"]

#: in a coop rank process (no rank state in it): ``(what, site, call)`` runs ``call`` with the main thread out of
#: the schedule (set by :mod:`simulator.isolation.rank_threads`)
wait_in_os: Callable[[str, str, Callable[[], Any]], Any] | None = None

_OWN = ("simulator", "tensorplay", "subprocess")
#: multiprocessing's waits are left alone when made for these (torch: its DataLoader's workers)
_OWN_MP = (*_OWN, "torch")
#: packages a multiprocessing wait passes through on its way from the caller who decides (Queue.get -> recv_bytes)
_THROUGH = ("multiprocessing", "threading")
_REAL: dict[str, Any] = {}
_depth = 0  # installs not yet undone (the launcher's and each world's)
#: set by a launcher run (simulator.launch): called with the (monotonic) time its wait began when the launcher itself
#: would block in a multiprocessing wait, so that the ranks it started (which may be what it waits for) begin to run;
#: it raises what ends the wait instead (a world that could not start its ranks, the run's --timeout once nothing is
#: left to answer) and answers whether to ask again: True, the wait goes on in slices of ``_SLICE`` seconds, each
#: followed by another call (a world runs in the background, or one is pending, or the wait is bounded)
launcher_wait: Callable[[float], bool] | None = None
_SLICE = 0.05
#: the OS's own getpid (thread ranks see pids of their own through os.getpid)
_real_getpid = getattr(sys.modules.get("posix") or sys.modules.get("nt"), "getpid", os.getpid)
_SOCKET_READS = ("recv", "recv_into", "recvfrom", "recvfrom_into")


def _site(depth: int) -> tuple[str, str] | None:
    """``(package, "file:line")`` of the caller ``depth`` frames up, or None when no rank could be starving."""
    if (current_rank_state() is None and wait_in_os is None) or _forked():
        return None
    f = sys._getframe(depth + 1)
    package = (f.f_globals.get("__name__") or "").split(".", 1)[0]
    if package in _OWN:
        return None
    return package, f"{f.f_code.co_filename}:{f.f_lineno}"


def _forked() -> bool:
    """A process forked from the one the world runs in (a pool worker a rank started): no schedule there, its
    waits are its own."""
    return _real_getpid() != _REAL.get("pid", _real_getpid())


def _mp_wait(caller: Any, what: str, would_block: Callable[[], bool], call: Callable[[float | None], Any],
             timeout: float | None = None, ready: Callable[[float], bool] | None = None) -> Any:
    """A multiprocessing wait made by the frame ``caller`` (``call(t)``: the real wait, bounded by ``t`` seconds
    where it takes a bound; ``timeout``: the caller's): out of the schedule if it would block a rank's turn; in the
    launcher (no rank), the ranks it started first begin to run (:func:`_launcher_side`)."""
    if _forked():
        return call(timeout)
    while caller is not None and (caller.f_globals.get("__name__") or "").split(".", 1)[0] in _THROUGH:
        caller = caller.f_back  # (Queue.get -> recv_bytes: the code that called the queue decides)
    if caller is None or (caller.f_globals.get("__name__") or "").split(".", 1)[0] in _OWN_MP:
        return call(timeout)
    if current_rank_state() is None and wait_in_os is None:  # not a rank: the launcher, or a thread of it
        return _launcher_side(would_block, call, timeout, ready)
    if not would_block():
        return call(timeout)
    return _out_of_turn(what, f"{caller.f_code.co_filename}:{caller.f_lineno}", lambda: call(timeout))


def _launcher_side(would_block: Callable[[], bool], call: Callable[[float | None], Any], timeout: float | None,
                   ready: Callable[[float], bool] | None) -> Any:
    """The launcher's wait: while :data:`launcher_wait` asks for it, in slices (a wait that ends at a slice's end
    with nothing is no answer: its bound falls, a read's ``ready(t)`` says whether it can go on), so that a world
    that could not start, or a bound, ends it with its error; then the rest of it at once."""
    start = time.monotonic()
    end = None if timeout is None else start + timeout
    while launcher_wait is not None and would_block() and launcher_wait(start):
        left = _SLICE if end is None else min(_SLICE, end - time.monotonic())
        if left <= 0:
            break
        if ready is not None:
            if ready(left):
                break
        elif got := call(left):
            return got
    return call(None if end is None else max(0.0, end - time.monotonic()))


def _out_of_turn(what: str, site: str, call: Callable[[], Any]) -> Any:
    """Run ``call`` (a wait in the kernel) out of the schedule, so that the others run meanwhile."""
    rs = current_rank_state()
    if rs is None:  # the main thread of a coop rank process: its proxy steps out (threads of it: as they are)
        return call() if wait_in_os is None else wait_in_os(what, site, call)
    if not sleep_out(rs, 1.0, site, what=what):
        return call()
    try:
        return call()
    finally:
        sleep_in(rs)


def _select(rlist: Any, wlist: Any, xlist: Any, timeout: float | None = None) -> Any:
    real = _REAL["select"]
    at = _site(1) if timeout != 0 else None
    if at is None:
        return real(rlist, wlist, xlist, timeout)
    ready = real(rlist, wlist, xlist, 0)
    if ready[0] or ready[1] or ready[2]:
        return ready
    return _out_of_turn(f"select.select(timeout={timeout}) with nothing ready yet", at[1],
                        lambda: real(rlist, wlist, xlist, timeout))


def _would_block(sock: Any) -> bool:
    try:
        return not _REAL["select"]([sock], [], [], 0)[0]
    except (OSError, ValueError):  # a closed socket: the real call raises its own error
        return False


def _socket_wait(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: socket.socket, *args: Any, **kwargs: Any) -> Any:
        if self.gettimeout() == 0.0:  # non-blocking: never waits
            return real(self, *args, **kwargs)
        at = _site(1)
        if at is None or not _would_block(self):
            return real(self, *args, **kwargs)
        return _out_of_turn(f"socket.{name}() with nothing to read yet", at[1], lambda: real(self, *args, **kwargs))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = real.__doc__
    return method


def _connection_read(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _mp_wait(sys._getframe(1), f"multiprocessing Connection.{name}() with nothing to read yet",
                        lambda: not _REAL["poll"](self, 0), lambda _t: real(self, *args, **kwargs),
                        ready=lambda t: _REAL["poll"](self, t))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = real.__doc__
    return method


def _connection_poll(self: Any, timeout: float | None = 0.0) -> bool:
    real = _REAL["poll"]
    if timeout is not None and timeout <= 0:
        return real(self, timeout)
    return _mp_wait(sys._getframe(1), f"multiprocessing Connection.poll({timeout}) with nothing to read yet",
                    lambda: not real(self, 0), lambda t: real(self, t), timeout)


def _event_wait(self: Any, timeout: float | None = None) -> bool:
    return _mp_wait(sys._getframe(1), "multiprocessing Event.wait() of an event not set yet",
                    lambda: not self.is_set(), lambda t: _REAL["event_wait"](self, t), timeout)


def _condition_wait(self: Any, timeout: float | None = None) -> bool:
    return _mp_wait(sys._getframe(1), "multiprocessing Condition.wait()", lambda: True,
                    lambda t: _REAL["condition_wait"](self, t), timeout)


def _acquire(real: Callable[..., bool], caller: Any, block: bool = True, timeout: float | None = None) -> bool:
    """A multiprocessing lock's (or semaphore's) acquire by ``caller``: one that would block waits out of turn."""
    if real(False):
        return True
    if not block:
        return False
    return _mp_wait(caller, "multiprocessing lock acquire() of a lock another process holds", lambda: True,
                    lambda t: real(True, t), timeout)


def _make_methods(self: Any) -> None:
    _REAL["make_methods"](self)
    real = self._semlock.acquire
    # (an instance attribute: set as each lock is made)
    self.acquire = lambda block=True, timeout=None: _acquire(real, sys._getframe(1), block, timeout)


def _semlock_enter(self: Any) -> bool:  # ``with lock:`` (and ``with condition:``)
    return _acquire(self._semlock.acquire, sys._getframe(1))


_MP = ((mp_connection._ConnectionBase, "poll", "poll", _connection_poll),
       (mp_synchronize.Event, "wait", "event_wait", _event_wait),
       (mp_synchronize.Condition, "wait", "condition_wait", _condition_wait),
       (mp_synchronize.SemLock, "_make_methods", "make_methods", _make_methods),
       (mp_synchronize.SemLock, "__enter__", "semlock_enter", _semlock_enter))
_MP_READS = ("recv", "recv_bytes", "recv_bytes_into")


def install() -> None:
    """Patch ``select.select``, the blocking reads of ``socket.socket`` and multiprocessing's waits (counted: the
    last :func:`uninstall` puts them back)."""
    global _depth
    _depth += 1
    if "select" in _REAL:
        return
    _REAL["pid"] = _real_getpid()
    for owner, name, key, replacement in _MP:
        _REAL[key] = owner.__dict__[name]
        setattr(owner, name, replacement)
    for name in _MP_READS:
        _REAL[name] = mp_connection._ConnectionBase.__dict__[name]
        setattr(mp_connection._ConnectionBase, name, _connection_read(name, _REAL[name]))
    _REAL["select"] = select.select
    select.select = _select  # type: ignore[assignment]
    for name in _SOCKET_READS:
        setattr(socket.socket, name, _socket_wait(name, getattr(_socket.socket, name)))
    _REAL["accept"] = socket.socket.__dict__["accept"]
    socket.socket.accept = _socket_wait("accept", _REAL["accept"])  # type: ignore[method-assign]


def uninstall() -> None:
    """Put back what :func:`install` patched, when every install is undone."""
    global _depth
    _depth = max(0, _depth - 1)
    if _depth or "select" not in _REAL:
        return
    select.select = _REAL.pop("select")
    for owner, name, key, _ in _MP:
        setattr(owner, name, _REAL.pop(key))
    for name in _MP_READS:
        setattr(mp_connection._ConnectionBase, name, _REAL.pop(name))
    for name in _SOCKET_READS:
        delattr(socket.socket, name)  # (inherited from _socket.socket again)
    socket.socket.accept = _REAL.pop("accept")  # type: ignore[method-assign]
    _REAL.pop("pid", None)
