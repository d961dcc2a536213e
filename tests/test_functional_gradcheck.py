"""Finite differences on the whole world, and the simulator's report of a skipped backward.

gradcheck needs one differentiable function of plain tensors.  A simulated
world is that function: :class:`_World` takes every member's inputs as flat
arguments, runs the collective on ``simulator.run`` (each rank thread gets its
own slice as fresh leaves), and returns every member's outputs.  Its backward
cannot reuse the forward's graph: each rank's graph lives in that rank's
thread, and the CPU autograd engine runs a backward on the thread that calls
it (here: gradcheck's).  So the backward is *another* world run: every rank
redoes its forward and feeds its slice of the upstream gradients to
``torch.autograd.grad(create_graph=True)``, which runs the library's backward
rules across the simulated ranks.  That vector-Jacobian product is again a
:class:`_World`, so gradgradcheck differentiates the backward rules a second
time through the same mechanism.  gradcheck then compares those VJPs with
central finite differences of the forward, in float64 and complex128.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import pytest
import torch

import simulator
import tensorplay.distributed as dist
import tensorplay.distributed.nn.functional as df
from _support.functional import COLLECTIVES, REDUCING, ROOTED, Case, call, get_group, inputs

RankFn = Callable[[list[torch.Tensor], Any], list[torch.Tensor]]


@dataclass(frozen=True)
class WorldFn:
    """``fn(my_tensors, group) -> my_outputs`` on every member of a ``world``-rank world.

    ``in_counts[r]``: how many of the flat arguments belong to global rank ``r``.
    """

    world: int
    group: tuple[int, ...] | None
    in_counts: tuple[int, ...]
    fn: RankFn

    def vjp(self, out_counts: tuple[int, ...]) -> "WorldFn":
        """The world function ``(x_r, g_r) -> d<outputs, g>/dx_r`` on every rank."""
        fn, in_counts = self.fn, self.in_counts

        def vjp_fn(tensors: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
            n = in_counts[dist.get_rank()]
            xs, gs = tensors[:n], tensors[n:]
            outs = fn(xs, group)
            pairs = [(o, g) for o, g in zip(outs, gs) if o.requires_grad]
            if not xs:  # scatter's non-src ranks: nothing to differentiate, but they must join the backward
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                return []
            got = torch.autograd.grad([o for o, _ in pairs], xs, [g for _, g in pairs], create_graph=True,
                                      allow_unused=True)
            return [torch.zeros_like(x) if d is None else d for x, d in zip(xs, got)]

        counts = tuple(a + b for a, b in zip(in_counts, out_counts))
        return WorldFn(self.world, self.group, counts, vjp_fn)


def _rank_thread(wf: WorldFn, flat: list[torch.Tensor]) -> list[torch.Tensor]:
    group = get_group(wf.group)
    rank = dist.get_rank()
    if wf.group is not None and rank not in wf.group:
        return []
    start = sum(wf.in_counts[:rank])
    mine = [t.detach().clone().requires_grad_() for t in flat[start:start + wf.in_counts[rank]]]
    with torch.enable_grad():
        outs = wf.fn(mine, group)
    return [o.detach() for o in outs]


class _World(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, wf: WorldFn, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        per_rank = simulator.run(_rank_thread, wf.world, args=(wf, [t.detach() for t in flat]))
        ctx.wf = wf
        ctx.out_counts = tuple(len(o) for o in per_rank)
        ctx.save_for_backward(*flat)
        return tuple(t for outs in per_rank for t in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:  # type: ignore[override]
        wf: WorldFn = ctx.wf
        flat = ctx.saved_tensors
        args: list[torch.Tensor] = []
        xi = gi = 0
        for r in range(wf.world):  # rank r's arguments: its inputs, then its outputs' gradients
            args += flat[xi:xi + wf.in_counts[r]]
            args += grads[gi:gi + ctx.out_counts[r]]
            xi += wf.in_counts[r]
            gi += ctx.out_counts[r]
        return (None, *_World.apply(wf.vjp(ctx.out_counts), *args))


def world_function(case: Case) -> tuple[Callable[..., Any], list[torch.Tensor]]:
    """The stacked world function of ``case`` and its float64/complex128 inputs (every member's, in rank order)."""

    def fn(tensors: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
        rank = dist.get_rank()
        if case.name in ("scatter", "reduce_scatter", "all_to_all"):
            x = list(tensors) if tensors else None
        else:
            (x,) = tensors
        y = call(case, x, group, rank)
        return list(y) if isinstance(y, tuple) else [y]

    flat: list[torch.Tensor] = []
    counts = []
    for r in range(case.world):
        x = inputs(case, r) if r in case.members else None
        mine = [] if x is None else (list(x) if isinstance(x, list) else [x])
        counts.append(len(mine))
        flat += [t.detach().clone().requires_grad_() for t in mine]
    wf = WorldFn(case.world, case.group, tuple(counts), fn)
    return (lambda *ts: _World.apply(wf, *ts)), flat


def gradcheck_cases() -> list[Case]:
    out: list[Case] = []
    worlds = [(2, None), (3, (2, 0)), (4, (3, 1, 2))]
    for name in COLLECTIVES:
        for world, group in worlds:
            members = sorted(group) if group else list(range(world))
            base = Case(name, world, group, shape=(2,), values="distinct")
            if name in ROOTED:
                base = replace(base, root=members[-1])
            if name == "all_to_all":
                base = replace(base, ragged=True, shape=(2, 1))
            if name == "all_to_all_single":
                n = len(members)
                base = replace(base, shape=(0,), splits=tuple(tuple((i + j) % 3 for j in range(n)) for i in range(n)))
            ops = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"] if name in REDUCING else [None]
            for op in ops:
                out.append(replace(base, op=op))
            if name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter") and world == 3:
                out.append(replace(base, op="SUM" if name in REDUCING else None, dtype="c128", values="random"))
            if name == "all_reduce" and world == 3:
                out.append(replace(base, op="PRODUCT", dtype="c128", values="random"))
    return out


@pytest.mark.parametrize("case", gradcheck_cases(), ids=lambda c: c.id)
def test_gradcheck_world(case: Case) -> None:
    f, flat = world_function(case)
    assert torch.autograd.gradcheck(f, tuple(flat), eps=1e-6, atol=1e-6, rtol=1e-5)
    if case.name != "scatter" and case.dtype == "f64":
        # second order: the backward rules differentiated again, through the same collectives; exact
        # for the linear cases, and for PRODUCT/MIN/MAX away from ties ("distinct" values).  scatter's
        # non-src ranks have no input, so a second-order backward cannot reach them (docs/api-functional.md)
        assert torch.autograd.gradgradcheck(f, tuple(flat), eps=1e-6, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------
# 7. a rank that skips a backward the others wait in
# ---------------------------------------------------------------------------
def _skip_reduce_backward() -> None:
    x = torch.ones(3, requires_grad=True)
    y = df.reduce(x, dst=0)
    if dist.get_rank() == 0:  # wrong: non-root ranks must run the backward too
        y.sum().backward()


def _skip_gather_backward_in_subgroup() -> None:
    g = dist.new_group([3, 1, 2])
    if dist.get_rank() == 0:
        return
    x = torch.ones(2, requires_grad=True)
    ys = df.gather(x, dst=3, group=g)
    if dist.get_rank() != 2:
        sum(t.sum() for t in ys).backward()


def test_simulator_names_a_skipped_backward() -> None:
    with pytest.raises(simulator.DeadlockError) as info:
        simulator.run(_skip_reduce_backward, 3)
    text = str(info.value)
    assert "rank 1 returned without running the backward of reduce" in text
    assert "rank 2 returned without running the backward of reduce" in text
    assert "y.sum().backward()" in text  # the fix

    with pytest.raises(simulator.DeadlockError) as info:
        simulator.run(_skip_gather_backward_in_subgroup, 4)
    text = str(info.value)
    assert "rank 2 returned without running the backward of gather" in text
    assert "rank 1" not in text.split("Hint:")[1]
