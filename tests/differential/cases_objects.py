"""Object collectives: picklable Python objects through all_gather_object, broadcast_object_list,
gather_object, scatter_object_list and send_object_list/recv_object_list, on the world and on subgroups."""
from __future__ import annotations

import torch

from .harness import case, doors


def _obj(rank, salt=0):
    """A per-rank object with nesting, a tensor inside and types pickle must keep apart."""
    return {"rank": rank, "salt": salt, "items": [rank * 1.5, (rank, "r" * (rank + 1))], "none": None,
            "t": torch.arange(3, dtype=torch.float64) + 10 * rank + salt}


@case(front_doors=doors("all_gather_object"))
def all_gather_object_dicts(ctx):
    out = [None] * ctx.world_size
    ctx.dist.all_gather_object(out, _obj(ctx.rank))
    return out


@case(front_doors=doors("broadcast_object_list"))
def broadcast_object_list_every_src(ctx):
    got = []
    for src in range(ctx.world_size):
        lst = [_obj(ctx.rank, src), "x" * (ctx.rank + src), ctx.rank] if ctx.rank == src else [None, None, None]
        ctx.dist.broadcast_object_list(lst, src=src)
        got.append(lst)
    return got


@case(front_doors=doors("gather_object"))
def gather_object_every_dst(ctx):
    got = []
    for dst in range(ctx.world_size):
        lst = [None] * ctx.world_size if ctx.rank == dst else None
        ctx.dist.gather_object(_obj(ctx.rank, dst), lst, dst=dst)
        got.append(lst)
    return got


@case(front_doors=doors("scatter_object_list"))
def scatter_object_list_every_src(ctx):
    got = []
    for src in range(ctx.world_size):
        out = [None]
        ins = [_obj(i, 100 + src) for i in range(ctx.world_size)] if ctx.rank == src else None
        ctx.dist.scatter_object_list(out, ins, src=src)
        got.append(out)
    return got


@case(world_sizes=(2, 3, 4), front_doors=doors("send_object_list", "recv_object_list"))
def send_recv_object_list_pairs(ctx):
    """Rank 0 sends a different object list to every other rank; each receiver gets the sender's rank back."""
    if ctx.rank == 0:
        for dst in range(1, ctx.world_size):
            ctx.dist.send_object_list([_obj(0, dst), dst, f"to {dst}"], dst=dst)
        return None
    lst = [None, None, None]
    src = ctx.dist.recv_object_list(lst, src=0)
    return [src, lst]


def _receiver_refuses_any_source(per_rank):
    assert isinstance(per_rank[0], ValueError), f"rank 0: torch refuses src=None, got {per_rank[0]!r}"


@case(world_sizes=(2,), front_doors=("torch",), raises=True, expect_sim=_receiver_refuses_any_source,
      gloo="torch 2.13's recv_object_list(src=None) receives the size from any source, then raises ValueError "
           "('Must specify global_rank or group_rank') before the payload, and the sender hangs in its second send")
def recv_object_list_any_source(ctx):
    if ctx.rank != 0:
        ctx.dist.send_object_list([ctx.rank, _obj(ctx.rank)], dst=0)
        return None
    lst = [None, None]
    return [ctx.dist.recv_object_list(lst), lst]


@case(world_sizes=(3, 4), front_doors=doors("all_gather_object", "broadcast_object_list", "gather_object",
                                            "scatter_object_list"))
def object_collectives_on_subgroup_2_0(ctx):
    d = ctx.dist
    g = d.new_group([2, 0])
    if ctx.rank not in (2, 0):
        return "not a member"
    out = {}
    ag = [None, None]
    d.all_gather_object(ag, _obj(ctx.rank), group=g)
    out["all_gather_object"] = ag
    bl = [_obj(ctx.rank, 7)] if ctx.rank == 0 else [None]
    d.broadcast_object_list(bl, src=0, group=g)  # src is a global rank
    out["broadcast_object_list"] = bl
    gl = [None, None] if ctx.rank == 2 else None
    d.gather_object(_obj(ctx.rank, 1), gl, dst=2, group=g)
    out["gather_object"] = gl
    so = [None]
    d.scatter_object_list(so, [_obj(9, i) for i in range(2)] if ctx.rank == 2 else None, src=2, group=g)
    out["scatter_object_list"] = so
    return out


@case(world_sizes=(3, 4), front_doors=doors("broadcast_object_list", "gather_object"))
def object_collectives_group_src_dst(ctx):
    d = ctx.dist
    g = d.new_group([2, 0])
    if ctx.rank not in (2, 0):
        return "not a member"
    bl = [ctx.rank, "from me"] if ctx.rank == 2 else [None, None]
    d.broadcast_object_list(bl, group=g, group_src=1)  # torch sorts the ranks: group rank 1 is global rank 2
    gl = [None, None] if ctx.rank == 2 else None
    d.gather_object(("obj", ctx.rank), gl, group=g, group_dst=1)
    return [bl, gl]
