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
``socket.socket`` objects.  A blocking ``Lock.acquire`` or a busy loop cannot be seen from Python: see
docs/deviations.md.
"""
from __future__ import annotations

import _socket
import select
import socket
import sys
from typing import Any, Callable

from simulator.core.actors import sleep_in, sleep_out
from simulator.core.state import current_rank_state

__all__ = ["install", "uninstall", "wait_in_os"]

#: in a coop rank process (no rank state in it): ``(what, site, call)`` runs ``call`` with the main thread out of
#: the schedule (set by :mod:`simulator.isolation.rank_threads`)
wait_in_os: Callable[[str, str, Callable[[], Any]], Any] | None = None

_OWN = ("simulator", "tensorplay", "subprocess")
_REAL: dict[str, Any] = {}
_SOCKET_READS = ("recv", "recv_into", "recvfrom", "recvfrom_into")


def _site(depth: int) -> tuple[str, str] | None:
    """``(package, "file:line")`` of the caller ``depth`` frames up, or None when no rank could be starving."""
    if current_rank_state() is None and wait_in_os is None:
        return None
    f = sys._getframe(depth + 1)
    package = (f.f_globals.get("__name__") or "").split(".", 1)[0]
    if package in _OWN:
        return None
    return package, f"{f.f_code.co_filename}:{f.f_lineno}"


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


def install() -> None:
    """Patch ``select.select`` and the blocking reads of ``socket.socket`` (idempotent)."""
    if "select" in _REAL:
        return
    _REAL["select"] = select.select
    select.select = _select  # type: ignore[assignment]
    for name in _SOCKET_READS:
        setattr(socket.socket, name, _socket_wait(name, getattr(_socket.socket, name)))
    _REAL["accept"] = socket.socket.__dict__["accept"]
    socket.socket.accept = _socket_wait("accept", _REAL["accept"])  # type: ignore[method-assign]


def uninstall() -> None:
    """Put back what :func:`install` patched."""
    if "select" not in _REAL:
        return
    select.select = _REAL.pop("select")
    for name in _SOCKET_READS:
        delattr(socket.socket, name)  # (inherited from _socket.socket again)
    socket.socket.accept = _REAL.pop("accept")  # type: ignore[method-assign]
