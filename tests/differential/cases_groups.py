"""Process groups: new_group, new_subgroups, new_subgroups_by_enumeration, split_group, rank queries and
2-D DeviceMesh with per-dimension collectives."""
from __future__ import annotations

import torch

from .harness import case, doors


def _x(ctx, n=3, salt=0):
    return (torch.arange(n, dtype=torch.float64) * (ctx.rank + 2) + 10 * ctx.rank + salt).to(ctx.device)


@case(world_sizes=(3, 4))
def new_group_rank_queries(ctx):
    d = ctx.dist
    g = d.new_group([2, 0])
    out = {"world": (d.get_rank(), d.get_world_size()), "ranks": d.get_process_group_ranks(g)}
    out["global_of_group_1"] = d.get_global_rank(g, 1)
    out["group_of_global_2"] = d.get_group_rank(g, 2)
    out["in_group"] = (d.get_rank(g), d.get_world_size(g))  # torch: (-1, -1) on rank 1, outside the group
    return out


@case(world_sizes=(1, 2, 3))
def new_group_all_ranks_and_backend(ctx):
    d = ctx.dist
    g = d.new_group()  # every rank
    x = _x(ctx)
    d.all_reduce(x, group=g)
    return [d.get_process_group_ranks(g), d.is_initialized(), x]


@case(world_sizes=(1, 2), front_doors=("torch",))  # tensorplay.distributed.get_backend() names the simulator "sim"
def get_backend_names_gloo(ctx):
    """A script that initialised "gloo" reads "gloo" back, also on simulated ranks."""
    g = ctx.dist.new_group()
    return [ctx.dist.get_backend(), ctx.dist.get_backend(g), ctx.dist.is_gloo_available()]


@case(world_sizes=(2,), raises=True)
def new_group_with_rank_outside_world_raises(ctx):
    ctx.dist.new_group([0, ctx.world_size + 2])
    return None


@case(world_sizes=(2,), front_doors=("torch",))
def new_group_of_no_ranks_is_a_type_error_and_later_groups_work(ctx):
    """torch refuses ``new_group([])`` with a TypeError on every rank; the next group still forms."""
    d = ctx.dist
    try:
        d.new_group([])
        refused = None
    except TypeError:
        refused = "TypeError"
    g = d.new_group()
    x = _x(ctx)
    d.all_reduce(x, group=g)
    return [refused, x]


@case(world_sizes=(3,), raises=True)
def get_group_rank_of_non_member_raises(ctx):
    g = ctx.dist.new_group([2, 0])
    return ctx.dist.get_group_rank(g, 1)


@case(world_sizes=(2, 4), front_doors=doors("new_subgroups"))
def new_subgroups_by_size(ctx):
    d = ctx.dist
    cur, subgroups = d.new_subgroups(group_size=2)
    x = _x(ctx)
    d.all_reduce(x, group=cur)
    return [len(subgroups), [d.get_process_group_ranks(s) for s in subgroups], d.get_rank(cur), x]


@case(world_sizes=(4,), front_doors=doors("new_subgroups_by_enumeration"))
def new_subgroups_by_enumeration_interleaved(ctx):
    d = ctx.dist
    cur, subgroups = d.new_subgroups_by_enumeration([[0, 2], [3, 1]])
    x = _x(ctx)
    d.all_reduce(x, group=cur)
    b = _x(ctx, salt=1)
    d.broadcast(b, src=d.get_process_group_ranks(cur)[0], group=cur)
    return [[d.get_process_group_ranks(s) for s in subgroups], d.get_rank(cur), x, b]


@case(world_sizes=(2, 4), front_doors=doors("split_group"), raises=True)
def split_group_without_bound_device_raises(ctx):
    """torch 2.13 splits only a default group bound to a device (init_process_group(device_id=...));
    neither the pool's nor the simulated default group is, so every rank refuses before communicating."""
    half = ctx.world_size // 2 or 1
    g = ctx.dist.split_group(split_ranks=[list(range(half)), list(range(half, ctx.world_size))])
    return g is not None


@case(world_sizes=(1, 2, 3, 4), front_doors=("torch",))
def device_mesh_1d(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp",))
    g = mesh.get_group("dp")
    x = _x(ctx)
    ctx.dist.all_reduce(x, group=g)
    return [mesh.get_local_rank("dp"), mesh.size(), ctx.dist.get_process_group_ranks(g), x]


@case(world_sizes=(4,), front_doors=("torch",))
def device_mesh_2d_per_dim_collectives(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    out = {"coord": mesh.get_coordinate(), "mesh": mesh.mesh.tolist()}
    for dim in ("dp", "tp"):
        g = mesh.get_group(dim)
        x = _x(ctx, salt=len(dim))
        ctx.dist.all_reduce(x, group=g)
        gathered = [torch.zeros(3, dtype=torch.float64, device=ctx.device) for _ in range(2)]
        ctx.dist.all_gather(gathered, _x(ctx, salt=7), group=mesh[dim].get_group())
        out[dim] = {"ranks": ctx.dist.get_process_group_ranks(g), "local_rank": mesh.get_local_rank(dim),
                    "all_reduce": x, "all_gather": gathered}
    g0 = mesh.get_group(0)
    b = _x(ctx, salt=3)
    ctx.dist.broadcast(b, group=g0, group_src=1)
    out["broadcast_dim0_group_src1"] = b
    return out


@case(world_sizes=(4,), front_doors=("torch",))
def device_mesh_2d_flatten_and_slice(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    flat = mesh["dp", "tp"]._flatten("dp_tp")
    x = _x(ctx)
    ctx.dist.all_reduce(x, group=flat.get_group())
    sub = mesh["tp"]
    return [flat.size(), ctx.dist.get_process_group_ranks(flat.get_group()), sub.mesh.tolist(), x]
