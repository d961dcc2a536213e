"""Fault injection: crash or slow down a rank at a chosen operation, so a scenario replays exactly.

Operations are counted per rank from 1, across every collective and p2p call
the rank issues (``new_group`` included).

Example::

    simulator.run(step, 4, faults=[simulator.Crash(rank=2, at=3),
                                   simulator.Delay(rank=1, seconds=0.01)])
    # rank 2 raises InjectedFault in its third operation; ranks 0, 1, 3 get RankFailedError

Random scenarios come from a seed, so they replay too::

    faults = simulator.random_faults(seed=7, world_size=4, max_at=10)
"""
from __future__ import annotations

import numbers
import random
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

from tensorplay.distributed.errors import DistTypeError, DistValueError, format_message

__all__ = ["Fault", "Crash", "Delay", "random_faults"]


class Fault:
    """Base class of injected faults."""

    rank: int


@dataclass(frozen=True)
class Crash(Fault):
    """Raise :class:`simulator.InjectedFault` on ``rank`` when it issues its ``at``-th operation (1-based)."""

    rank: int
    at: int = 1


@dataclass(frozen=True)
class Delay(Fault):
    """Make ``rank`` late by ``seconds`` before each operation (or only its ``at``-th, when given).

    ``virtual=True`` adds the delay to the rank's virtual clock (the cost model
    sees a straggler); ``real=True`` also sleeps, which perturbs real thread
    interleavings in ``mode="threads"``.
    """

    rank: int
    seconds: float
    at: int | None = None
    virtual: bool = True
    real: bool = False


def random_faults(seed: int, world_size: int, *, max_at: int = 10, crashes: int = 1,
                  delays: int = 0, max_delay_s: float = 1e-3) -> list[Fault]:
    """A reproducible list of faults drawn from ``seed``."""
    rng = random.Random(seed)
    out: list[Fault] = []
    for _ in range(crashes):
        out.append(Crash(rank=rng.randrange(world_size), at=rng.randint(1, max_at)))
    for _ in range(delays):
        out.append(Delay(rank=rng.randrange(world_size), seconds=rng.uniform(0, max_delay_s),
                         at=rng.randint(1, max_at)))
    return out


#: the longest a Delay may last (seconds): beyond any real stall, and far from a clock that overflows to inf
MAX_DELAY_S = 1e6


def _check(f: Any, world_size: int) -> None:
    """Refuse a fault that names no rank of the world or that could never fire, before the run starts."""
    if not isinstance(f, Fault):
        raise DistTypeError(format_message("simulator.run", "faults must be simulator.Crash / simulator.Delay "
                                           "objects", values={"fault": f},
                                           fix="pass faults=[simulator.Crash(rank=1, at=3)]"))

    def bad(what: str, fix: str) -> DistValueError:
        return DistValueError(format_message("simulator.run", f"a fault {what}", values={"fault": f}, fix=fix))

    if isinstance(f.rank, bool) or not isinstance(f.rank, numbers.Integral) or not 0 <= f.rank < world_size:
        raise bad(f"names rank {f.rank!r}, not a rank of the world of {world_size}",
                  f"name a rank in 0..{world_size - 1}, or run a larger world")
    at = getattr(f, "at", None)
    if (at is not None or isinstance(f, Crash)) and (isinstance(at, bool) or not isinstance(at, numbers.Integral)
                                                     or at < 1):
        raise bad(f"has at={at!r}, which is not an operation number (they count from 1)",
                  "pass at=1 for the rank's first operation, at=3 for its third")
    if isinstance(f, Delay):
        s = f.seconds
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or not 0 <= s <= MAX_DELAY_S:
            raise bad(f"has seconds={s!r}: a delay is a number of seconds in [0, {MAX_DELAY_S:g}]",
                      "pass e.g. Delay(rank=1, seconds=0.01)")


class FaultPlan:
    """Faults indexed by rank for the hot path: ``plan.get(rank)`` is ``None`` for most ranks."""

    def __init__(self, faults: Sequence[Fault], world_size: int) -> None:
        self.by_rank: dict[int, list[Fault]] = {}
        for f in faults:
            _check(f, world_size)
            self.by_rank.setdefault(f.rank, []).append(f)

    def get(self, rank: int) -> list[Fault] | None:
        return self.by_rank.get(rank)

    def unfired(self, ops: Sequence[int], returned: Sequence[bool]) -> list[tuple[Fault, int]]:
        """The faults that never fired on a rank that returned: ``(fault, operations the rank issued)``.

        ``ops[r]``: operations rank ``r`` issued (its own, which faults count); ``returned[r]``: whether it
        returned normally (a rank that failed, or was stopped, may have been stopped before the fault's
        operation, which is no mistake of the fault's).  A fault fires at operation ``at`` (a Delay without
        ``at``: at every operation, so from the first).
        """
        out = []
        for rank, faults in sorted(self.by_rank.items()):
            if rank < len(returned) and returned[rank]:
                out += [(f, ops[rank]) for f in faults if (getattr(f, "at", None) or 1) > ops[rank]]
        return out

    def warn_unfired(self, ranks: Sequence[Any], children: Sequence[Any] = ()) -> None:
        """After a run: warn (RuntimeWarning) about each fault that never fired (:meth:`unfired`).

        ``ranks`` are the run's rank states (``.rank``, ``.ops``, ``.exc``), ``children`` the actors of threads
        the ranks started (their operations are not counted by faults; the warning says how many there were).
        """
        if not self.by_rank:
            return
        found = self.unfired([rs.ops for rs in ranks], [rs.exc is None for rs in ranks])
        for f, n in found:
            threads = sum(c.ops for c in children if c.rank == f.rank)
            note = (f" (the {threads} operation(s) of threads it started are not counted)" if threads > 0 else "")
            if threads:
                fix = "faults count the operations of a rank's main thread only: place the fault on one of those"
            elif n:
                fix = (f"pass at={n} or less (operations are counted per rank from 1 over every collective and "
                       f"point-to-point call of the rank, new_group included), or make rank {f.rank} issue more")
            else:
                fix = f"name a rank that communicates: rank {f.rank} issued no operation"
            warnings.warn(format_message(
                "simulator.run", f"a fault never fired: rank {f.rank} returned after {n} operation(s){note}, "
                f"before operation {getattr(f, 'at', None) or 1}", values={"fault": f, "operations": n}, fix=fix),
                RuntimeWarning, stacklevel=3)
