"""Test helper: the groups every collective/p2p test uses, and per-rank distinct inputs (no tests here).

Groups: the world (``None``), at ``W >= 3`` ``new_group([2, 0])`` (group ranks
0, 1 -> global 0, 2) and at ``W >= 4`` ``new_group([3, 1, 2])`` (group ranks
0, 1, 2 -> global 1, 2, 3), so global and group ranks differ.  A rank gets
them from :func:`group`, which creates all of them once per world, in one
order on every rank (``new_group`` is collective), whether or not the rank is
a member.  The cache is per rank *and* per world: simulated ranks are threads
sharing this module, and a gloo pool rank lives across many tests.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch

import tensorplay.distributed as dist
from tensorplay.distributed import _state

def group_specs(world_size: int) -> list[tuple[int, ...] | None]:
    """``None`` is the world; a tuple is the (deliberately unsorted) argument of new_group."""
    specs: list[tuple[int, ...] | None] = [None]
    if world_size >= 3:
        specs.append((2, 0))
    if world_size >= 4:
        specs.append((3, 1, 2))
    return specs


def members(world_size: int, spec: tuple[int, ...] | None) -> list[int]:
    """Global ranks in group-rank order (new_group sorts, as torch does)."""
    return list(range(world_size)) if spec is None else sorted(spec)


def gname(spec: tuple[int, ...] | None) -> str:
    """``world``, ``g20``, ``g312``: the group's part of a test or case id."""
    return "world" if spec is None else "g" + "".join(map(str, spec))


def world_cases(worlds: Any) -> list[tuple[int, tuple[int, ...] | None]]:
    """Every ``(world size, group spec)`` pair for the given world sizes."""
    return [(w, s) for w in worlds for s in group_specs(w)]


# id(rank state) -> (weak reference to it, {key: object}); the weak reference tells a reused id apart
_PER_WORLD: dict[int, tuple[Any, dict[Any, Any]]] = {}
_LOCK = threading.Lock()  # rank threads of a free-running simulated world share the cache


def once_per_world(key: Any, make: Callable[[], Any]) -> Any:
    """``make()`` the first time the calling rank asks for ``key`` in its current world, then the same object.

    ``make`` may call collectives (``new_group``): it runs outside any lock, and every rank must ask
    for the same keys in the same order, as for any collective.
    """
    st = _state.current()
    with _LOCK:
        entry = _PER_WORLD.get(id(st))
        if entry is None or entry[0]() is not st:
            for k in [k for k, (ref, _) in _PER_WORLD.items() if ref() is None]:  # forget finished worlds
                del _PER_WORLD[k]
            entry = _PER_WORLD[id(st)] = (weakref.ref(st), {})
        cache = entry[1]
        if key in cache:
            return cache[key]
    made = make()
    with _LOCK:
        return cache.setdefault(key, made)


def group(spec: tuple[int, ...] | None) -> Any:
    """The calling rank's group for ``spec`` (``None``: the world), creating all of them on first use."""
    if spec is None:
        return None
    groups = once_per_world("worlds.group_specs", lambda: {
        s: dist.new_group(list(s)) for s in group_specs(dist.get_world_size())[1:]})
    return groups[spec]


def value(rank: int, n: int = 5, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A tensor that differs per rank and per element."""
    if dtype == torch.bool:
        return torch.tensor([(rank * 7 + i * 3) % 5 < 2 for i in range(n)])
    if dtype.is_floating_point:
        return (torch.arange(n, dtype=dtype) * 0.5 + 1.25 * rank + 0.125) * (-1) ** rank
    return torch.arange(n, dtype=dtype) * 3 + 11 * rank + 1


def fold(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """Independent reference reduction: a plain left fold with Python-level ops, in rank order."""
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in ("sum", "avg"):
            acc = (acc | x) if acc.dtype == torch.bool else acc + x
        elif op == "product":
            acc = (acc & x) if acc.dtype == torch.bool else acc * x
        elif op == "min":
            acc = torch.where(x < acc, x, acc)
        elif op == "max":
            acc = torch.where(x > acc, x, acc)
        elif op == "band":
            acc = acc & x
        elif op == "bor":
            acc = acc | x
        elif op == "bxor":
            acc = acc ^ x
    if op == "avg":
        acc = acc / len(xs)
    return acc


def _noop() -> None:
    return None


def warm_rank_processes(world_size: int = 4, fn: Callable[[], Any] | None = None) -> None:
    """Start the warm interpreters of rank processes (seed 0) before a test times detection, not start-up.

    ``fn`` (default: a no-op here) should be a no-op of the calling test module, so that the warm
    interpreters learn the libraries that module imports.  Twice: the second world's forks find those
    libraries imported ahead (see simulator/isolation/warm.py).
    """
    import simulator

    for _ in range(2):
        simulator.run(fn or _noop, world_size, isolation="process")
