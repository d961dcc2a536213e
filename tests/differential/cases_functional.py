"""torch.distributed._functional_collectives: results as new tensors, async tensors (AsyncCollectiveTensor,
wait_tensor), with the group given as a list of ranks, a ProcessGroup and a DeviceMesh."""
from __future__ import annotations

import torch

from .harness import case


def _x(ctx, n=4, salt=0):
    return (torch.arange(n, dtype=torch.float64) * (ctx.rank + 2) + 10 * ctx.rank + salt).to(ctx.device)


def _groups(ctx):
    """The world group three ways: list of ranks, ProcessGroup, 1-D DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    return {"list": list(range(ctx.world_size)), "pg": ctx.dist.group.WORLD, "mesh": mesh}


@case(front_doors=("torch",))
def funcol_all_reduce_group_forms(ctx):
    import torch.distributed._functional_collectives as fc

    out = {}
    for kind, g in _groups(ctx).items():
        x = _x(ctx)
        y = fc.all_reduce(x, "sum", g)
        out[kind] = [fc.wait_tensor(y), x]  # the input is left as it was
    out["max"] = fc.all_reduce(_x(ctx, salt=1), "max", list(range(ctx.world_size)))
    out["avg"] = fc.all_reduce(_x(ctx, salt=2), "avg", ctx.dist.group.WORLD)
    return out


@case(front_doors=("torch",))
def funcol_all_gather_tensor_dims(ctx):
    import torch.distributed._functional_collectives as fc

    g = list(range(ctx.world_size))
    x = _x(ctx, 6).reshape(2, 3)
    return [fc.all_gather_tensor(x, 0, g).wait(), fc.all_gather_tensor(x, 1, ctx.dist.group.WORLD)]


@case(front_doors=("torch",))
def funcol_reduce_scatter_tensor_dims(ctx):
    import torch.distributed._functional_collectives as fc

    W = ctx.world_size
    g = _groups(ctx)["mesh"]
    x0 = _x(ctx, 2 * W * 3).reshape(2 * W, 3)
    x1 = _x(ctx, 2 * W * 3, salt=1).reshape(3, 2 * W)
    return [fc.reduce_scatter_tensor(x0, "sum", 0, g), fc.reduce_scatter_tensor(x1, "sum", 1, list(range(W)))]


@case(front_doors=("torch",))
def funcol_all_to_all_single_uneven(ctx):
    import torch.distributed._functional_collectives as fc

    W, r = ctx.world_size, ctx.rank
    ins = [(r + 2 * d) % 3 for d in range(W)]
    outs = [(s + 2 * r) % 3 for s in range(W)]
    x = _x(ctx, sum(ins))
    even = fc.all_to_all_single(_x(ctx, W, salt=5), None, None, ctx.dist.group.WORLD)
    return [fc.all_to_all_single(x, outs, ins, list(range(W))), even]


@case(front_doors=("torch",))
def funcol_broadcast(ctx):
    import torch.distributed._functional_collectives as fc

    return [fc.broadcast(_x(ctx), src, list(range(ctx.world_size))) for src in range(ctx.world_size)]


@case(front_doors=("torch",), world_sizes=(2, 3))
def funcol_async_tensor_used_in_compute(ctx):
    """Arithmetic on an AsyncCollectiveTensor waits for it; wait_tensor returns the plain result."""
    import torch.distributed._functional_collectives as fc

    g = list(range(ctx.world_size))
    a = fc.all_reduce(_x(ctx), "sum", g)
    b = fc.all_gather_tensor(_x(ctx, 2, salt=1), 0, g)
    is_async = isinstance(a, fc.AsyncCollectiveTensor)
    c = a * 2 + 1
    return [is_async, c, fc.wait_tensor(b), type(fc.wait_tensor(b)) is torch.Tensor]


@case(front_doors=("torch",), world_sizes=(2, 3))
def funcol_coalesced(ctx):
    import torch.distributed._functional_collectives as fc

    g = list(range(ctx.world_size))
    ar = fc.all_reduce_coalesced([_x(ctx, 2), _x(ctx, 3, salt=1)], "sum", g)
    ag = fc.all_gather_into_tensor_coalesced([_x(ctx, 2), _x(ctx, 1, salt=2)], g)
    return [[fc.wait_tensor(t) for t in ar], [fc.wait_tensor(t) for t in ag]]


@case(front_doors=("torch",), world_sizes=(4,))
def funcol_on_subgroups_and_2d_mesh(ctx):
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    out = {"dp": fc.all_reduce(_x(ctx), "sum", (mesh, 0)), "tp": fc.all_reduce(_x(ctx, salt=1), "sum", mesh["tp"])}
    sub = ctx.dist.new_group([1, 3])
    if ctx.rank in (1, 3):
        out["pg_1_3"] = fc.all_gather_tensor(_x(ctx, 2), 0, sub)
    return out


@case(front_doors=("torch",), world_sizes=(2, 3))
def funcol_all_gather_tensor_autograd(ctx):
    """The autograd variant: d/dx of sum(all_gather(x) * w_r) over ranks is the reduce-scatter of the w_r."""
    import torch.distributed._functional_collectives as fc

    W = ctx.world_size
    x = _x(ctx, 2).requires_grad_(True)
    y = fc.all_gather_tensor_autograd(x, 0, list(range(W)))
    w = torch.arange(2 * W, dtype=torch.float64, device=ctx.device) * (ctx.rank + 1)
    (fc.wait_tensor(y) * w).sum().backward()
    return [fc.wait_tensor(y).detach(), x.grad]
