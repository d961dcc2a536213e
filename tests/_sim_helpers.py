"""Shared helpers for the simulator tests: group cases and per-rank distinct inputs."""
from __future__ import annotations

import torch

WORLD_SIZES = list(range(1, 9))


def group_cases(w: int) -> list[tuple[int, ...] | None]:
    """The world (None) plus the subgroups [2, 0] and [3, 1, 2] where the world is large enough."""
    cases: list[tuple[int, ...] | None] = [None]
    if w >= 3:
        cases.append((2, 0))
    if w >= 4:
        cases.append((3, 1, 2))
    return cases


def cases() -> list[tuple[int, tuple[int, ...] | None]]:
    return [(w, g) for w in WORLD_SIZES for g in group_cases(w)]


def case_id(c: tuple[int, tuple[int, ...] | None]) -> str:
    w, g = c
    return f"W{w}-" + ("world" if g is None else "g" + "_".join(map(str, g)))


def members(w: int, g: tuple[int, ...] | None) -> list[int]:
    """Global ranks in group-rank order (new_group sorts its ranks)."""
    return list(range(w)) if g is None else sorted(g)


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
