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

import random
from dataclasses import dataclass
from typing import Sequence

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


class FaultPlan:
    """Faults indexed by rank for the hot path: ``plan.get(rank)`` is ``None`` for most ranks."""

    def __init__(self, faults: Sequence[Fault], world_size: int) -> None:
        self.by_rank: dict[int, list[Fault]] = {}
        for f in faults:
            if not isinstance(f, Fault):
                raise TypeError(f"faults must be Crash/Delay objects, got {f!r}")
            if not 0 <= f.rank < world_size:
                raise ValueError(f"fault {f!r} names rank {f.rank}, outside the world of {world_size}")
            self.by_rank.setdefault(f.rank, []).append(f)

    def get(self, rank: int) -> list[Fault] | None:
        return self.by_rank.get(rank)
