"""What a coop hand-off carries besides the baton: the ``random`` module's state, moved to and from each rank's own
generator, and the CPU the next rank should wake on (see :mod:`simulator.core.sched`)."""
from __future__ import annotations

import os
import random
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from simulator.core.state import RankState

__all__ = ["_PY_RNG", "_STEER", "_PyRngSwap"]


class _PyRngSwap:
    """Moves the state of the ``random`` module's generator to and from a rank's own ``random.Random``.

    ``getstate``/``setstate`` build and parse a 625-int tuple: at every coop hand-off
    that was a third of a small collective's cost (the ints also drive the cyclic
    GC).  On CPython the Mersenne Twister state is a fixed block of the C object
    (``int index; uint32_t state[624]``, ending the base type), so it is copied with
    one memmove.  The copy is checked once against getstate/setstate semantics;
    on any other layout or interpreter the tuple path is used.
    """

    _STATE_BYTES = 4 + 624 * 4

    def __init__(self) -> None:
        self._offset = self._probe()

    def _probe(self) -> int | None:
        try:
            import _random
            import ctypes

            if sys.implementation.name != "cpython":  # id() is an address only on CPython
                return None
            offset = object.__basicsize__  # the state block follows the object header
            if offset + self._STATE_BYTES > _random.Random.__basicsize__:
                return None
            self._memmove = ctypes.memmove
            a, b = random.Random(1), random.Random(2)
            a.random()
            self._copy(b, a, offset)
            if [b.random() for _ in range(700)] != [a.random() for _ in range(700)]:
                return None
            return offset
        except Exception:  # noqa: BLE001  any surprise means: use the portable path
            return None

    def _copy(self, dst: random.Random, src: random.Random, offset: int) -> None:
        self._memmove(id(dst) + offset, id(src) + offset, self._STATE_BYTES)
        dst.gauss_next = src.gauss_next  # type: ignore[attr-defined]  # Python-level half of the state

    def save(self, mine: random.Random | None) -> None:
        """The module generator's state into ``mine``."""
        if mine is None:
            return
        g = random._inst  # type: ignore[attr-defined]  # the instance behind random.random() & co.
        if self._offset is None:
            mine.setstate(g.getstate())
        else:
            self._copy(mine, g, self._offset)

    def load(self, mine: random.Random) -> None:
        """``mine``'s state into the module generator."""
        g = random._inst  # type: ignore[attr-defined]
        if self._offset is None:
            g.setstate(mine.getstate())
        else:
            self._copy(g, mine, self._offset)


_PY_RNG = _PyRngSwap()


class _Steer:
    """Coop hand-offs wake the next rank on the CPU of the rank that hands over (Linux).

    Only one rank runs at a time, yet the kernel tends to wake the next rank on
    another CPU, where it first waits for the GIL the old rank still holds: a
    cross-CPU wake-up plus a GIL hand-off, about 40 us per switch on a 2-CPU VM.
    Pinning the woken thread to the waker's CPU until it holds the baton makes a
    switch a same-CPU wake-up (small collectives at W=4: about 2.5x faster).  The
    woken rank restores the run's CPU set at once, so a rank's own compute (and
    the intra-op threads it starts) keeps every CPU.  Any OS refusal turns the
    steering off; it never changes what runs, only where.
    """

    def __init__(self) -> None:
        self.on = False
        try:
            import ctypes

            self._getcpu = ctypes.CDLL(None).sched_getcpu
            self._getcpu.restype = ctypes.c_int
            self._set = os.sched_setaffinity
            self.cpus = os.sched_getaffinity(0)
            self.on = len(self.cpus) > 1 and self._getcpu() >= 0
        except (AttributeError, OSError):  # no Linux affinity API here: nothing to steer
            self.on = False

    def refresh(self) -> None:
        """At the start of a coop run: the CPU set the woken ranks get back (the caller's, now)."""
        if self.on:
            try:
                self.cpus = os.sched_getaffinity(0)
            except OSError:
                self.on = False

    def towards_me(self, nxt: "RankState") -> None:
        """Before waking ``nxt``: make it run on this thread's CPU."""
        if self.on and nxt.tid:
            try:
                self._set(nxt.tid, (self._getcpu(),))
                nxt.steered = True
            except OSError:
                self.on = False

    def free(self, rs: "RankState") -> None:
        """``rs`` holds the baton: give it back every CPU of the run."""
        if rs.steered:
            rs.steered = False
            try:
                self._set(0, self.cpus)
            except OSError:
                self.on = False


_STEER = _Steer()
