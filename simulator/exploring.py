"""Run a function under many schedules, and check that one schedule replays bit for bit.

Example::

    def race():
        x = tp.zeros(1)
        if dist.get_rank() == 0:
            return [dist.recv(x) for _ in range(2)]      # any-source: who comes first?
        dist.send(tp.ones(1), dst=0)

    simulator.explore(race, 3, seeds=range(50))          # raises ExploreError naming the failing seed
    simulator.check_reproducible(race, 3, seed=7)        # two runs, identical traces and results
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch

from simulator.core.errors import ExploreError, NotReproducibleError
from simulator.core.trace import Trace
from simulator.world import World

__all__ = ["explore", "check_reproducible", "ExploreReport"]


class ExploreReport:
    """What :func:`explore` saw: the seeds run, their results and how many distinct schedules."""

    def __init__(self) -> None:
        self.seeds: list[int] = []
        self.results: dict[int, list[Any]] = {}
        self.signatures: dict[int, tuple] = {}

    @property
    def distinct_schedules(self) -> int:
        return len(set(self.signatures.values()))

    def __repr__(self) -> str:
        return f"ExploreReport(seeds={len(self.seeds)}, distinct_schedules={self.distinct_schedules})"


def explore(fn: Callable[..., Any], world_size: int, seeds: Iterable[int] = range(20), *,
            args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
            check: Callable[[list[Any]], Any] | None = None, **world_kw: Any) -> ExploreReport:
    """Run ``fn`` once per seed (coop mode) and stop at the first seed that fails.

    ``check(results)`` may assert on the per-rank results; an exception from
    it counts as a failure.  On failure raises :class:`ExploreError` whose
    message names the seed and the call that replays it; ``__cause__`` is the
    original error.
    """
    world_kw.setdefault("mode", "coop")
    report = ExploreReport()
    for seed in seeds:
        w = World(world_size, seed=seed, **world_kw)
        try:
            results = w.run(fn, args, kwargs)
            if check is not None:
                check(results)
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            err = ExploreError(
                f"seed {seed} failed after {len(report.seeds)} passing seeds: {type(e).__name__}: {e}\n"
                f"Replay: simulator.run({getattr(fn, '__name__', 'fn')}, {world_size}, seed={seed}, "
                f"mode={world_kw['mode']!r})")
            err.seed = seed
            raise err from e
        report.seeds.append(seed)
        report.results[seed] = results
        report.signatures[seed] = w.trace.signature()
    return report


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b) or
                                                                    (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and
                                                                     torch.equal(a.nan_to_num(), b.nan_to_num())))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return a is b


def check_reproducible(fn: Callable[..., Any], world_size: int, seed: int = 0, *, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None, **world_kw: Any) -> Trace:
    """Run ``fn`` twice with the same seed (coop mode); raise :class:`NotReproducibleError` on any difference.

    Compares every event's schedule-determined fields (rank, op, group,
    sequence number, bytes, call site, peer) in order, and the per-rank
    results bit for bit.  Returns the first run's trace.
    """
    world_kw.setdefault("mode", "coop")
    traces, results = [], []
    for _ in range(2):
        w = World(world_size, seed=seed, **world_kw)
        results.append(w.run(fn, args, kwargs))
        traces.append(w.trace)
    a, b = traces[0].signature(), traces[1].signature()
    if a != b:
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first = a[i] if i < len(a) else "<end of trace>"
        second = b[i] if i < len(b) else "<end of trace>"
        raise NotReproducibleError(
            f"seed {seed}: the traces of two runs differ at event {i} ({len(a)} vs {len(b)} events):\n"
            f"  run 1: {first}\n  run 2: {second}\n"
            "Fix: make fn depend only on its rank and its own RNG (no wall-clock time, no shared mutable state "
            "between ranks, no thread-dependent ordering) and use mode='coop'")
    for r, (x, y) in enumerate(zip(results[0], results[1])):
        if not _same(x, y):
            raise NotReproducibleError(f"seed {seed}: rank {r} returned different results in two runs: {x!r} vs {y!r}")
    return traces[0]
