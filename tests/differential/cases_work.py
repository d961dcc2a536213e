"""The Work API of async collectives (wait with a timeout, is_completed, get_future, exception), barrier and
monitored_barrier."""
from __future__ import annotations

from datetime import timedelta

import torch

from .harness import case, doors


def _x(ctx, n=3, salt=0):
    return (torch.arange(n, dtype=torch.float64) * (ctx.rank + 2) + 10 * ctx.rank + salt).to(ctx.device)


@case()
def work_wait_with_timeout_then_is_completed(ctx):
    x = _x(ctx)
    work = ctx.dist.all_reduce(x, async_op=True)
    ok = work.wait(timeout=timedelta(seconds=30))
    return [ok, work.is_completed(), x]


@case(world_sizes=(1, 2, 3))
def work_get_future_value(ctx):
    """The future of an all_reduce resolves to the list of its output tensors."""
    x = _x(ctx)
    fut = ctx.dist.all_reduce(x, async_op=True).get_future()
    waited = fut.wait()
    return [waited, fut.value(), fut.done(), x]


@case(world_sizes=(2, 3), front_doors=("torch",))
def work_future_then_callback(ctx):
    x = _x(ctx)
    fut = ctx.dist.all_reduce(x, async_op=True).get_future()
    doubled = fut.then(lambda f: [t * 2 for t in f.value()])
    return [doubled.wait(), x]


@case(world_sizes=(2, 3))
def work_exception_after_success(ctx):
    """A completed, successful work has no exception."""
    x = _x(ctx)
    work = ctx.dist.broadcast(x, src=0, async_op=True)
    work.wait()
    return [work.exception() is None, work.is_success() if hasattr(work, "is_success") else "no is_success", x]


@case(world_sizes=(2, 3))
def work_wait_twice_and_many_in_flight(ctx):
    xs = [_x(ctx, salt=i) for i in range(4)]
    works = [ctx.dist.all_reduce(x, async_op=True) for x in xs]
    for w in reversed(works):
        w.wait()
    again = [w.wait() for w in works]
    return [again, [w.is_completed() for w in works], xs]


@case(world_sizes=(2, 3), front_doors=("torch",))
def get_future_of_all_gather_and_broadcast(ctx):
    out = [torch.zeros(3, dtype=torch.float64, device=ctx.device) for _ in range(ctx.world_size)]
    f1 = ctx.dist.all_gather(out, _x(ctx), async_op=True).get_future()
    b = _x(ctx, salt=5)
    f2 = ctx.dist.broadcast(b, src=ctx.world_size - 1, async_op=True).get_future()
    return [f1.wait(), f2.wait(), out, b]


@case()
def barrier_then_collective(ctx):
    ctx.dist.barrier()
    w = ctx.dist.barrier(async_op=True)
    w.wait()
    x = _x(ctx)
    ctx.dist.all_reduce(x)
    return [w.is_completed(), x]


@case(front_doors=doors("monitored_barrier"))
def monitored_barrier_all_arrive(ctx):
    ctx.dist.monitored_barrier(timeout=timedelta(seconds=30))
    ctx.dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
    x = _x(ctx)
    ctx.dist.all_reduce(x)
    return x


@case(world_sizes=(3, 4), front_doors=doors("monitored_barrier"))
def monitored_barrier_on_subgroup(ctx):
    g = ctx.dist.new_group([2, 0])
    if ctx.rank in (2, 0):
        ctx.dist.monitored_barrier(group=g, timeout=timedelta(seconds=30))
        return "passed"
    return "not a member"
