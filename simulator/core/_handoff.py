"""What a coop hand-off carries besides the baton: the states of torch's default CPU generator, of the ``random``
module and of numpy's global generator, moved to and from each rank's own generators, and the CPU the next rank
should wake on (see :mod:`simulator.core.sched`)."""
from __future__ import annotations

import os
import random
import sys
from sys import modules as _loaded  # (bound once: while a world runs, sys's attributes are looked up in Python)
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from simulator.core.state import RankState

import torch

from simulator.core.seeds import numpy_seed

__all__ = ["_PY_RNG", "_TORCH_RNG", "_NP_RNG", "_STEER", "_CWD", "_PyRngSwap", "_TorchRngSwap", "_NumpyRngSwap",
           "CwdSwap"]


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


class _TorchRngSwap:
    """Moves the state of torch's default CPU generator to and from a rank's own ``torch.Generator``.

    ``get_rng_state()``/``set_rng_state()`` serialise the Mersenne Twister into a new 5 KB tensor and parse
    it back: at 1024 ranks that was 20-30 us of every coop hand-off (an allocation freed on another thread,
    and a cold buffer).  A CPU generator keeps its whole state in one block of its C++ object (the engine's
    seed, position and 624 words, then the two cached normal samples), so that block is copied with one
    memmove between two generators.  Where it lies is found, not assumed: a generator is given a state with
    recognisable values (a seed, the 624 words, cached normals) through ``set_state`` and its memory is
    searched for them; the copy is then checked against ``get_state`` and against draws of every kind.  Any
    surprise (another layout, another build) means the serialising path, which is always correct.
    """

    _WORDS = 624

    def __init__(self) -> None:
        self._span = self._probe()

    @staticmethod
    def _state_with(seed: int, normal: float, fnormal: float) -> torch.Tensor:
        """A valid serialised state of a generator seeded with ``seed`` whose cached normals are the given ones
        (the layout ``CPUGeneratorImpl::set_state`` reads: the legacy block, then the float sample)."""
        import struct

        g = torch.Generator()
        g.manual_seed(seed)
        raw = bytearray(g.get_state().numpy().tobytes())
        if len(raw) != 5056:
            raise ValueError("unknown state layout")
        base = 24 + 8 * _TorchRngSwap._WORDS  # normal_x, normal_y, normal_rho (double), normal_is_valid (int)
        struct.pack_into("<dddi", raw, base, normal, normal, normal, 1)
        struct.pack_into("<f?", raw, base + 32, fnormal, True)
        return torch.frombuffer(raw, dtype=torch.uint8).clone()

    def _probe(self) -> tuple[int, int] | None:
        try:
            import ctypes
            import struct

            seed = 0x5EED_1234_ABCD_0077
            normal, fnormal = 1.0000000000000002e-3 * 7919, 0.0078125 * 13
            g = torch.Generator()
            g.set_state(self._state_with(seed, normal, fnormal))
            raw = g.get_state().numpy().tobytes()
            words = struct.unpack_from(f"<{self._WORDS}Q", raw, 24)
            state = struct.pack(f"<{self._WORDS}I", *words)
            mem = ctypes.string_at(g._cdata, 512)  # the engine sits near the object's start
            start = mem.find(struct.pack("<Q", seed))
            if start < 0:
                return None
            first = ctypes.string_at(g._cdata + start, 64 + len(state))
            at = first.find(state)
            if not 0 < at <= 32:
                return None
            tail = ctypes.string_at(g._cdata + start + at + len(state), 48)  # the optional<float>, optional<double>
            f_at = tail.find(struct.pack("<f", fnormal))
            d_at = tail.find(struct.pack("<d", normal))
            if f_at < 0 or d_at < 0 or tail[f_at + 4] != 1 or tail[d_at + 8] != 1:
                return None
            span = (start, at + len(state) + max(f_at + 5, d_at + 9))
            self._memmove = ctypes.memmove
            # check: a generator moved along by every kind of draw, copied into a fresh one, is that generator
            a, b = torch.Generator(), torch.Generator()
            a.manual_seed(20261204)
            b.manual_seed(7)
            torch.randn(5, generator=a), torch.randn(3, dtype=torch.float64, generator=a)
            torch.rand(11, generator=a), torch.randint(0, 1000, (9,), generator=a)
            self._copy(b, a, span)
            if not torch.equal(a.get_state(), b.get_state()):
                return None
            for draw in (lambda x: torch.randn(33, generator=x), lambda x: torch.randn(3, dtype=torch.float64, generator=x),
                         lambda x: torch.rand(700, generator=x), lambda x: torch.randint(0, 2**40, (50,), generator=x),
                         lambda x: torch.empty(17).normal_(generator=x), lambda x: torch.randperm(40, generator=x)):
                if not torch.equal(draw(a), draw(b)):
                    return None
            return span
        except Exception:  # noqa: BLE001  any surprise means: use the serialising path
            return None

    def _copy(self, dst: torch.Generator, src: torch.Generator, span: tuple[int, int]) -> None:
        off, n = span
        self._memmove(dst._cdata + off, src._cdata + off, n)

    def save(self, mine: torch.Generator) -> None:
        """The default generator's state into ``mine``."""
        if self._span is None:
            mine.set_state(torch.default_generator.get_state())
        else:
            self._copy(mine, torch.default_generator, self._span)

    def load(self, mine: torch.Generator) -> None:
        """``mine``'s state into the default generator."""
        if self._span is None:
            torch.default_generator.set_state(mine.get_state())
        else:
            self._copy(torch.default_generator, mine, self._span)


_TORCH_RNG = _TorchRngSwap()


class _NumpyRngSwap:
    """Moves the state of numpy's legacy global generator (``np.random.seed``, ``np.random.rand``...) to and from
    a rank's own ``numpy.random.RandomState``, once a program has imported ``numpy.random``.

    Each process has its own; data pipelines seed it per rank (``np.random.seed(seed + rank)``).  Its
    ``get_state``/``set_state`` cost about 50 us each, so the state is copied: the Mersenne Twister block
    (``uint32 key[624]; int pos``) at the bit generator's ``ctypes.state_address``, and the cached normal
    sample (``int has_gauss; double gauss``) of the ``RandomState`` object, found by giving one a recognisable
    cached value and searching its memory.  The copy is checked once against draws of every kind; on any
    surprise the ``get_state``/``set_state`` path is used.
    """

    _KEY_BYTES = 624 * 4 + 4
    _MARK = 0.6180339887498949

    def __init__(self) -> None:
        self._gauss: int | None = -1  # -1: not probed yet (numpy.random may never be imported)

    @staticmethod
    def module_generator() -> Any:
        """numpy's global RandomState, if the program imported ``numpy.random`` (None otherwise)."""
        mtrand = _loaded.get("numpy.random.mtrand")
        return getattr(mtrand, "_rand", None)

    def _probe(self, cls: type) -> int | None:
        try:
            import ctypes
            import struct

            if sys.implementation.name != "cpython":
                return None
            self._memmove = ctypes.memmove
            a = cls(1)
            _, key, pos, _, _ = a.get_state()
            a.set_state(("MT19937", key, pos, 1, self._MARK))
            raw = ctypes.string_at(id(a), cls.__basicsize__)
            at = raw.find(struct.pack("d", self._MARK))
            if at < 8 or raw.find(struct.pack("d", self._MARK), at + 1) != -1 or \
                    struct.unpack_from("i", raw, at - 8)[0] != 1:
                return None
            src, dst = cls(3), cls(4)
            src.standard_normal()  # leaves a cached normal sample
            self._copy(dst, src, at - 8)
            draws = [lambda g: g.standard_normal(5), lambda g: g.rand(700), lambda g: g.randint(0, 1000, 50),
                     lambda g: g.permutation(20), lambda g: g.uniform(size=3)]
            if any(not (f(dst) == f(src)).all() for f in draws):
                return None
            return at - 8
        except Exception:  # noqa: BLE001  any surprise means: use the portable path
            return None

    def _copy(self, dst: Any, src: Any, gauss: int) -> None:
        # (the bit generator keeps its ctypes view: asking each time costs about 0.1 us, and an address kept by
        # id() could outlive its generator)
        self._memmove(dst._bit_generator.ctypes.state_address, src._bit_generator.ctypes.state_address,
                      self._KEY_BYTES)
        self._memmove(id(dst) + gauss, id(src) + gauss, 16)  # has_gauss (an int, padded) and gauss

    def _move(self, rs: "RankState", into_rank: bool) -> None:
        g = self.module_generator()
        if g is None:
            return
        if self._gauss == -1:
            self._gauss = self._probe(type(g))
        if rs.np_rng is None:  # (seeded here, once per rank: not on every hand-off)
            rs.np_rng = type(g)(numpy_seed(rs.run.seed, rs.rank))
        dst, src = (rs.np_rng, g) if into_rank else (g, rs.np_rng)
        if self._gauss is None:
            dst.set_state(src.get_state())
        else:
            self._copy(dst, src, self._gauss)

    def save(self, rs: "RankState") -> None:
        """The global generator's state into the rank's own (made now if the rank had none)."""
        self._move(rs, into_rank=True)

    def load(self, rs: "RankState") -> None:
        """The rank's own state (at first one seeded by :func:`~simulator.core.seeds.numpy_seed`) into the global
        generator."""
        self._move(rs, into_rank=False)


_NP_RNG = _NumpyRngSwap()


class CwdSwap:
    """Each rank's working directory in coop mode, where one rank runs at a time: a process has its own.

    Inactive (one attribute test per hand-off) until a rank calls ``os.chdir``
    (:mod:`simulator.adapters.threads`); from then on a hand-off changes the
    process's directory to the next rank's when the two differ.  ``base`` is the
    directory the world started in: a rank that never changed its own is there.
    """

    __slots__ = ("active", "base", "now", "chdir")

    KEY = (0, "cwd")  # the rank's own directory, in RankState.own()

    def __init__(self) -> None:
        self.active = False
        self.base = ""
        self.now = ""
        self.chdir = os.chdir  # the real one (the adapter replaces os.chdir while a world runs)

    def start(self, base: str) -> None:
        """A rank changed directory for the first time in this world (``base``: where every rank was)."""
        if not self.active:
            self.active, self.base, self.now = True, base, base

    def moved(self, path: str) -> None:
        """The process's directory is ``path`` now (the calling rank's ``os.chdir``)."""
        self.now = path

    def load(self, rs: "RankState") -> None:
        """``rs`` holds the baton: the process's directory becomes its own."""
        want = rs.own().get(self.KEY, self.base)
        if want != self.now:
            try:
                self.chdir(want)
            except OSError:  # removed meanwhile: the rank finds out on its next relative path, as a process would
                return
            self.now = want

    def stop(self) -> None:
        """The last world ended: the process is back where it started."""
        if self.active:
            self.active = False
            try:
                self.chdir(self.base)
            except OSError:
                pass


_CWD = CwdSwap()


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
