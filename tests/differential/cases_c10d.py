"""c10d collectives and their variants: every reduce op, roots, list and flat forms, async, coalesced, subgroups.

Inputs are distinct per rank and position and integer-valued, so any summation order gives the same
bits; subgroups use members whose global ranks differ from their group ranks ([2, 0], [1, 2, 3]; torch sorts
the ranks given to new_group, so [2, 0] has group ranks 0 -> global 0 and 1 -> global 2).
"""
from __future__ import annotations

import torch

from .harness import case

def _x(ctx, n=4, salt=0, dtype=torch.float64):
    """Distinct per rank and position, integer-valued (any summation order is exact)."""
    return (torch.arange(n, dtype=torch.float64) * (ctx.rank + 2) + 10 * ctx.rank + salt).to(dtype).to(ctx.device)


def _ties(ctx, n=6, dtype=torch.int64):
    """Small integers with ties and zeros across ranks, for MIN/MAX/PRODUCT."""
    return ((torch.arange(n) * (ctx.rank + 1)) % 3 - (ctx.rank % 2)).to(dtype).to(ctx.device)


def _sub(ctx, ranks):
    """A subgroup created on every rank (torch requires it); None on non-members."""
    g = ctx.dist.new_group(ranks)
    return g if ctx.rank in ranks else None


# ---------------------------------------------------------------------------------------------------------------------
# all_reduce
# ---------------------------------------------------------------------------------------------------------------------
@case()
def all_reduce_sum(ctx):
    x = _x(ctx)
    ctx.dist.all_reduce(x)
    return x


@case()
def all_reduce_float_ops(ctx):
    R = ctx.dist.ReduceOp
    out = {}
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
        x = _x(ctx, salt=1) if name != "PRODUCT" else _ties(ctx, dtype=torch.float64)
        ctx.dist.all_reduce(x, op=getattr(R, name))
        out[name] = x
    return out


@case()
def all_reduce_int_ops(ctx):
    R = ctx.dist.ReduceOp
    out = {}
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        x = _ties(ctx, dtype=torch.int64) + (3 if name.startswith("B") else 0)
        ctx.dist.all_reduce(x, op=getattr(R, name))
        out[name] = x
    return out


@case(world_sizes=(1, 3))
def all_reduce_dtypes(ctx):
    out = []
    for dt in (torch.float32, torch.int32, torch.uint8, torch.int8, torch.float16, torch.bfloat16):
        x = (_ties(ctx, dtype=torch.int64) + 2).to(dt)
        ctx.dist.all_reduce(x)
        out.append(x)
    return out


@case(world_sizes=(2, 3))
def all_reduce_shapes(ctx):
    """0-d, empty, 2-D and a non-contiguous view (written through to its base)."""
    scalar = torch.tensor(float(ctx.rank + 1), dtype=torch.float64, device=ctx.device)
    empty = torch.zeros(0, 3, dtype=torch.float64, device=ctx.device)
    mat = _x(ctx, 12).reshape(3, 4)
    base = _x(ctx, 12, salt=5).reshape(3, 4)
    view = base.t()  # non-contiguous
    for t in (scalar, empty, mat, view):
        ctx.dist.all_reduce(t)
    return [scalar, empty, mat, base]


@case(front_doors=("torch",), world_sizes=(2,), raises=True)
def all_reduce_premul_sum_refused_by_gloo(ctx):
    # gloo refuses PREMUL_SUM on every rank before communicating
    x = _x(ctx)
    ctx.dist.all_reduce(x, op=ctx.dist._make_nccl_premul_sum(2.0))
    return x


@case(world_sizes=(2,), raises=True)
def all_reduce_bitwise_op_on_float_raises(ctx):
    x = _x(ctx)
    ctx.dist.all_reduce(x, op=ctx.dist.ReduceOp.BAND)
    return x


@case(world_sizes=(1, 2, 4))
def all_reduce_async(ctx):
    x, y = _x(ctx), _x(ctx, salt=3)
    w1 = ctx.dist.all_reduce(x, async_op=True)
    w2 = ctx.dist.all_reduce(y, op=ctx.dist.ReduceOp.MAX, async_op=True)
    w2.wait()
    w1.wait()
    return [x, y, w1.is_completed(), w2.is_completed()]


# ---------------------------------------------------------------------------------------------------------------------
# broadcast / reduce
# ---------------------------------------------------------------------------------------------------------------------
@case()
def broadcast_every_src(ctx):
    out = []
    for src in range(ctx.world_size):
        x = _x(ctx, salt=src)
        ctx.dist.broadcast(x, src=src)
        out.append(x)
    return out


@case(world_sizes=(2, 3))
def broadcast_int_and_async(ctx):
    x = _ties(ctx) + 100 * ctx.rank
    work = ctx.dist.broadcast(x, src=ctx.world_size - 1, async_op=True)
    work.wait()
    return x


@case()
def reduce_every_dst(ctx):
    out = []
    for dst in range(ctx.world_size):
        for op in ("SUM", "MAX"):
            x = _x(ctx, salt=dst)
            ctx.dist.reduce(x, dst=dst, op=getattr(ctx.dist.ReduceOp, op))
            if ctx.rank == dst:  # torch leaves the other ranks' tensors unspecified
                out.append(x)
    return out


@case(world_sizes=(3,))
def reduce_async(ctx):
    x = _ties(ctx, dtype=torch.int64)
    ctx.dist.reduce(x, dst=1, op=ctx.dist.ReduceOp.PRODUCT, async_op=True).wait()
    return x if ctx.rank == 1 else None


@case(world_sizes=(2,), raises=True)
def broadcast_src_out_of_range_raises(ctx):
    x = _x(ctx)
    ctx.dist.broadcast(x, src=ctx.world_size + 3)
    return x


# ---------------------------------------------------------------------------------------------------------------------
# all_gather / gather / scatter
# ---------------------------------------------------------------------------------------------------------------------
@case()
def all_gather_list(ctx):
    x = _x(ctx, 3)
    out = [torch.full((3,), -1.0, dtype=torch.float64, device=ctx.device) for _ in range(ctx.world_size)]
    ctx.dist.all_gather(out, x)
    return out


@case(world_sizes=(2, 3))
def all_gather_list_async_int(ctx):
    x = _ties(ctx, 2, dtype=torch.int32)
    out = [torch.zeros(2, dtype=torch.int32, device=ctx.device) for _ in range(ctx.world_size)]
    ctx.dist.all_gather(out, x, async_op=True).wait()
    return out


@case()
def all_gather_into_tensor_concat(ctx):
    x = _x(ctx, 6).reshape(2, 3)
    cat = torch.zeros(2 * ctx.world_size, 3, dtype=torch.float64, device=ctx.device)
    ctx.dist.all_gather_into_tensor(cat, x)
    cat2 = torch.zeros(2 * ctx.world_size, 3, dtype=torch.float64, device=ctx.device)
    ctx.dist.all_gather_into_tensor(cat2, x + 1, async_op=True).wait()
    return [cat, cat2]


@case(world_sizes=(2, 3), raises=True,
      door_drift="tensorplay accepts the stacked output form on every backend (torch's gloo does not)")
def all_gather_into_tensor_stacked_output(ctx):
    stack = torch.zeros(ctx.world_size, 2, 3, dtype=torch.float64, device=ctx.device)
    ctx.dist.all_gather_into_tensor(stack, _x(ctx, 6).reshape(2, 3))
    return stack


@case(front_doors=("torch",), world_sizes=(1, 2, 4))
def all_gather_base_deprecated(ctx):
    x = _x(ctx, 3)
    out = torch.zeros(3 * ctx.world_size, dtype=torch.float64, device=ctx.device)
    ctx.dist._all_gather_base(out, x)
    return out


@case(world_sizes=(2,), raises=True)
def all_gather_into_tensor_wrong_size_raises(ctx):
    out = torch.zeros(3 * ctx.world_size + 1, dtype=torch.float64, device=ctx.device)
    ctx.dist.all_gather_into_tensor(out, _x(ctx, 3))
    return out


@case()
def gather_every_dst(ctx):
    out = []
    for dst in range(ctx.world_size):
        x = _x(ctx, 2, salt=dst)
        lst = [torch.zeros(2, dtype=torch.float64, device=ctx.device) for _ in range(ctx.world_size)] \
            if ctx.rank == dst else None
        ctx.dist.gather(x, lst, dst=dst)
        out.append(lst)
    return out


@case()
def scatter_every_src(ctx):
    out = []
    for src in range(ctx.world_size):
        lst = [_x(ctx, 3, salt=100 * i + src) for i in range(ctx.world_size)] if ctx.rank == src else None
        y = torch.full((3,), -1.0, dtype=torch.float64, device=ctx.device)
        ctx.dist.scatter(y, lst, src=src)
        out.append(y)
    return out


@case(world_sizes=(3,))
def gather_scatter_async(ctx):
    lst = [torch.zeros(2, dtype=torch.float64, device=ctx.device) for _ in range(3)] if ctx.rank == 2 else None
    ctx.dist.gather(_x(ctx, 2), lst, dst=2, async_op=True).wait()
    y = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    src_list = [_x(ctx, 2, salt=i) for i in range(3)] if ctx.rank == 0 else None
    ctx.dist.scatter(y, src_list, src=0, async_op=True).wait()
    return [lst, y]


# ---------------------------------------------------------------------------------------------------------------------
# reduce_scatter
# ---------------------------------------------------------------------------------------------------------------------
@case()
def reduce_scatter_list(ctx):
    out = {}
    for op in ("SUM", "MAX"):
        y = torch.zeros(3, dtype=torch.float64, device=ctx.device)
        ctx.dist.reduce_scatter(y, [_x(ctx, 3, salt=7 * i) for i in range(ctx.world_size)],
                                op=getattr(ctx.dist.ReduceOp, op))
        out[op] = y
    return out


@case()
def reduce_scatter_tensor_ops(ctx):
    out = {}
    for op in ("SUM", "AVG", "MIN"):
        y = torch.zeros(2, 3, dtype=torch.float64, device=ctx.device)
        ctx.dist.reduce_scatter_tensor(y, _x(ctx, 6 * ctx.world_size).reshape(2 * ctx.world_size, 3),
                                       op=getattr(ctx.dist.ReduceOp, op))
        out[op] = y
    flat = torch.zeros(4, dtype=torch.float64, device=ctx.device)
    ctx.dist.reduce_scatter_tensor(flat, _x(ctx, 4 * ctx.world_size), async_op=True).wait()
    out["flat_async"] = flat
    return out


def _all_raised_runtime_error(per_rank):
    bad = {r: v for r, v in enumerate(per_rank) if not isinstance(v, RuntimeError)}
    assert not bad, f"every rank must refuse the stacked input with a RuntimeError as gloo does; got {bad}"


@case(front_doors=("torch",), world_sizes=(2,), raises=True,
      gloo="ProcessGroupGloo aborts the rank process (CHECK failure 'outputShape[0] * worldSize == inputShape[0]') "
           "on a stacked (W, n) input with an (n,) output",
      expect_sim=_all_raised_runtime_error)
def reduce_scatter_tensor_stacked_input(ctx):
    out = torch.zeros(4, dtype=torch.float64, device=ctx.device)
    ctx.dist.reduce_scatter_tensor(out, _x(ctx, 4 * ctx.world_size).reshape(ctx.world_size, 4))
    return out


@case(front_doors=("torch",), world_sizes=(1, 2, 4))
def reduce_scatter_base_deprecated(ctx):
    y = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    ctx.dist._reduce_scatter_base(y, _x(ctx, 2 * ctx.world_size))
    return y


# ---------------------------------------------------------------------------------------------------------------------
# all_to_all
# ---------------------------------------------------------------------------------------------------------------------
@case()
def all_to_all_single_even(ctx):
    y = torch.zeros(2 * ctx.world_size, dtype=torch.float64, device=ctx.device)
    ctx.dist.all_to_all_single(y, _x(ctx, 2 * ctx.world_size))
    return y


@case()
def all_to_all_single_uneven_and_zero_splits(ctx):
    W, r = ctx.world_size, ctx.rank

    def n(src, dst):  # rows src sends to dst; some are zero
        return (src + 2 * dst) % 3

    ins = [n(r, d) for d in range(W)]
    outs = [n(s, r) for s in range(W)]
    x = _x(ctx, 2 * sum(ins)).reshape(sum(ins), 2)
    y = torch.full((sum(outs), 2), -1.0, dtype=torch.float64, device=ctx.device)
    ctx.dist.all_to_all_single(y, x, output_split_sizes=outs, input_split_sizes=ins)
    return y


@case(world_sizes=(2, 3))
def all_to_all_single_async(ctx):
    y = torch.zeros(ctx.world_size, 2, dtype=torch.int64, device=ctx.device)
    x = (torch.arange(2 * ctx.world_size) + 100 * ctx.rank).reshape(ctx.world_size, 2).to(ctx.device)
    ctx.dist.all_to_all_single(y, x, async_op=True).wait()
    return y


@case()
def all_to_all_list_even(ctx):
    ins = [_x(ctx, 2, salt=10 * d) for d in range(ctx.world_size)]
    outs = [torch.zeros(2, dtype=torch.float64, device=ctx.device) for _ in range(ctx.world_size)]
    ctx.dist.all_to_all(outs, ins)
    return outs


@case(world_sizes=(2, 3), raises=True,
      door_drift="tensorplay's c10d backend emulates ragged list all_to_all with all_to_all_single (docs/design.md)")
def all_to_all_list_uneven(ctx):
    W, r = ctx.world_size, ctx.rank
    ins = [_x(ctx, (r + d) % 3, salt=10 * d) for d in range(W)]
    outs = [torch.zeros((s + r) % 3, dtype=torch.float64, device=ctx.device) for s in range(W)]
    ctx.dist.all_to_all(outs, ins)
    return outs


# ---------------------------------------------------------------------------------------------------------------------
# coalesced
# ---------------------------------------------------------------------------------------------------------------------
@case(front_doors=("torch",), world_sizes=(1, 2, 3))
def all_reduce_coalesced_list(ctx):
    ts = [_x(ctx, 3), _x(ctx, 5, salt=2), _x(ctx, 1, salt=4)]
    ctx.dist.all_reduce_coalesced(ts)
    return ts


@case(front_doors=("torch",), world_sizes=(1, 2, 3))
def coalescing_manager_all_reduce(ctx):
    ts = [_x(ctx, 3), _x(ctx, 2, salt=9)]
    with ctx.dist._coalescing_manager():
        for t in ts:
            ctx.dist.all_reduce(t)
    return ts


@case(front_doors=("torch",), world_sizes=(2, 3))
def coalescing_manager_async_all_gather_into_tensor(ctx):
    xs = [_x(ctx, 2), _x(ctx, 3, salt=5)]
    outs = [torch.zeros(x.numel() * ctx.world_size, dtype=torch.float64, device=ctx.device) for x in xs]
    with ctx.dist._coalescing_manager(async_ops=True) as cm:
        for o, x in zip(outs, xs):
            ctx.dist.all_gather_into_tensor(o, x)
    cm.wait()
    return outs


@case(front_doors=("torch",), world_sizes=(2, 3))
def coalescing_manager_reduce_scatter_tensor(ctx):
    W = ctx.world_size
    xs = [_x(ctx, 2 * W), _x(ctx, 3 * W, salt=5)]
    outs = [torch.zeros(n, dtype=torch.float64, device=ctx.device) for n in (2, 3)]
    with ctx.dist._coalescing_manager():
        for o, x in zip(outs, xs):
            ctx.dist.reduce_scatter_tensor(o, x)
    return outs


@case(front_doors=("torch",), world_sizes=(2, 3))
def all_gather_coalesced_list(ctx):
    xs = [_x(ctx, 2), _x(ctx, 3, salt=1)]
    outs = [[torch.zeros_like(x) for x in xs] for _ in range(ctx.world_size)]
    ctx.dist.all_gather_coalesced(outs, xs)
    return outs


# ---------------------------------------------------------------------------------------------------------------------
# subgroups: src/dst are global ranks, group_src/group_dst group ranks
# ---------------------------------------------------------------------------------------------------------------------
@case(world_sizes=(3, 4))
def subgroup_2_0_collectives(ctx):
    g = _sub(ctx, [2, 0])
    if g is None:
        return "not a member"
    d = ctx.dist
    out = {"rank": d.get_rank(g), "size": d.get_world_size(g)}
    x = _x(ctx)
    d.all_reduce(x, group=g)
    out["all_reduce"] = x
    b = _x(ctx, salt=1)
    d.broadcast(b, src=2, group=g)  # torch sorts new_group's ranks: global rank 2 is group rank 1
    out["broadcast_src2"] = b
    b2 = _x(ctx, salt=2)
    d.broadcast(b2, group=g, group_src=0)  # group rank 0 is global rank 0
    out["broadcast_group_src1"] = b2
    r = _x(ctx, salt=3)
    d.reduce(r, dst=0, group=g, op=d.ReduceOp.MAX)
    out["reduce_dst0"] = r if ctx.rank == 0 else None
    ag = [torch.zeros(4, dtype=torch.float64, device=ctx.device) for _ in range(2)]
    d.all_gather(ag, _x(ctx, salt=4), group=g)
    out["all_gather"] = ag
    return out


@case(world_sizes=(4,))
def subgroup_1_2_3_roots(ctx):
    g = _sub(ctx, [1, 2, 3])
    if g is None:
        return "not a member"
    d = ctx.dist
    out = {}
    lst = [torch.zeros(2, dtype=torch.float64, device=ctx.device) for _ in range(3)] if ctx.rank == 3 else None
    d.gather(_x(ctx, 2), lst, dst=3, group=g)
    out["gather_dst3"] = lst
    lst2 = [torch.zeros(2, dtype=torch.float64, device=ctx.device) for _ in range(3)] if ctx.rank == 2 else None
    d.gather(_x(ctx, 2, salt=1), lst2, group=g, group_dst=1)
    out["gather_group_dst1"] = lst2
    y = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    d.scatter(y, [_x(ctx, 2, salt=10 * i) for i in range(3)] if ctx.rank == 1 else None, src=1, group=g)
    out["scatter_src1"] = y
    y2 = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    d.scatter(y2, [_x(ctx, 2, salt=20 * i) for i in range(3)] if ctx.rank == 3 else None, group=g, group_src=2)
    out["scatter_group_src2"] = y2
    r = _x(ctx, 2, salt=5)
    d.reduce(r, group=g, group_dst=2)
    out["reduce_group_dst2"] = r if ctx.rank == 3 else None
    return out


@case(world_sizes=(4,))
def subgroup_1_2_3_flat_collectives(ctx):
    g = _sub(ctx, [1, 2, 3])
    if g is None:
        return "not a member"
    d = ctx.dist
    cat = torch.zeros(6, dtype=torch.float64, device=ctx.device)
    d.all_gather_into_tensor(cat, _x(ctx, 2), group=g)
    rs = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    d.reduce_scatter_tensor(rs, _x(ctx, 6), group=g)
    a2a = torch.zeros(6, dtype=torch.float64, device=ctx.device)
    d.all_to_all_single(a2a, _x(ctx, 6, salt=3), group=g)
    rsl = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    d.reduce_scatter(rsl, [_x(ctx, 2, salt=i) for i in range(3)], group=g)
    w = d.all_reduce(rsl, group=g, async_op=True)
    w.wait()
    return [cat, rs, a2a, rsl]


@case(world_sizes=(4,))
def two_disjoint_subgroups_interleaved(ctx):
    d = ctx.dist
    g01 = d.new_group([0, 1])
    g23 = d.new_group([2, 3])
    mine = g01 if ctx.rank < 2 else g23
    x = _x(ctx)
    d.all_reduce(x, group=mine)
    y = _x(ctx, salt=1)
    d.broadcast(y, src=1 if ctx.rank < 2 else 3, group=mine)
    z = _x(ctx, salt=2)
    d.all_reduce(z)  # the world group between subgroup calls
    return [x, y, z]


@case(world_sizes=(3,), raises=True)
def subgroup_src_not_in_group_raises(ctx):
    g = ctx.dist.new_group([2, 0])
    if ctx.rank not in (2, 0):
        return "not a member"
    x = _x(ctx)
    ctx.dist.broadcast(x, src=1, group=g)  # global rank 1 is not a member: refused before sending
    return x


@case(world_sizes=(3,), raises=True)
def subgroup_src_and_group_src_both_raises(ctx):
    g = ctx.dist.new_group([2, 0])
    if ctx.rank not in (2, 0):
        return "not a member"
    x = _x(ctx)
    ctx.dist.broadcast(x, src=2, group=g, group_src=0)
    return x


@case(world_sizes=(3,), front_doors=("torch",))  # tensorplay refuses a non-member's call by design
def non_member_calls_are_no_ops(ctx):
    """torch: a rank outside the group returns at once (with a warning) from a collective on it."""
    g = ctx.dist.new_group([2, 0])
    x = _x(ctx)
    ctx.dist.all_reduce(x, group=g)  # rank 1 is not a member: its x stays as it was
    return x


@case(world_sizes=(3, 4), slow=True)
def mixed_collectives_many_rounds(ctx):
    """Forty rounds of interleaved blocking and async collectives on the world and a subgroup, with sizes that
    change per round: the order in which each side matches calls must not matter."""
    d = ctx.dist
    g = d.new_group([0, ctx.world_size - 1])
    acc = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    for i in range(40):
        n = 1 + i % 5
        x = _x(ctx, n, salt=i)
        w = d.all_reduce(x, async_op=True)
        b = _x(ctx, 3, salt=2 * i)
        d.broadcast(b, src=i % ctx.world_size)
        if ctx.rank in (0, ctx.world_size - 1):
            s = _x(ctx, 3, salt=3 * i)
            d.all_reduce(s, group=g, op=d.ReduceOp.MAX)
            acc += s
        w.wait()
        acc += b + x.sum()
    return acc


@case(front_doors=("torch",), world_sizes=(2,))
def gloo_dtype_rules(ctx):
    """Which dtypes gloo's collectives take: int16 and the unsigned 16/32-bit types fail each call on every rank
    before it communicates ("Invalid scalar type"); send/recv move any dtype; complex fails only in gather."""
    d, r = ctx.dist, ctx.rank
    calls = {
        "all_reduce": lambda t: d.all_reduce(t),
        "broadcast": lambda t: d.broadcast(t, 0),
        "all_gather": lambda t: d.all_gather([torch.empty_like(t) for _ in range(2)], t),
        "all_gather_into_tensor": lambda t: d.all_gather_into_tensor(torch.empty(2, dtype=t.dtype), t),
        "all_to_all_single": lambda t: d.all_to_all_single(torch.empty(2, dtype=t.dtype), t.repeat(2)),
        "gather": lambda t: d.gather(t, [torch.zeros_like(t) for _ in range(2)] if r == 0 else None, 0),
        "scatter": lambda t: d.scatter(t, [torch.zeros_like(t) for _ in range(2)] if r == 0 else None, 0),
        "send_recv": lambda t: d.send(t, 1) if r == 0 else d.recv(t, 0),
    }
    out = {}
    for dt in (torch.int16, torch.uint16, torch.uint32, torch.complex64, torch.int32):
        for name, call in calls.items():
            t = torch.full((1,), 3 + r).to(dt)
            try:
                call(t)
                out[f"{dt}.{name}"] = t.tolist()  # (a uint16 tensor does not cross between processes)
            except RuntimeError as e:
                out[f"{dt}.{name}"] = ("RuntimeError", "Invalid scalar type" in str(e))
    return out


@case(front_doors=("torch",), world_sizes=(2, 3))
def output_version_counters(ctx):
    """How often each collective counts a write of its outputs in their autograd version counters (gloo writes
    some through counted copies: an output saved for backward then fails the backward, on both sides)."""
    d, r, w = ctx.dist, ctx.rank, ctx.world_size
    out = {}

    def run(name, outs, call):
        before = [o._version for o in outs]
        work = call()
        if work is not None:
            work.wait()
        out[name] = [o._version - b for o, b in zip(outs, before)]

    x = torch.ones(4)
    run("all_reduce", [x], lambda: d.all_reduce(x, async_op=True))
    run("broadcast", [x], lambda: d.broadcast(x, 0, async_op=True))
    o = torch.empty(2 * w)
    run("all_gather_into_tensor", [o], lambda: d.all_gather_into_tensor(o, torch.ones(2), async_op=True))
    os_ = [torch.empty(2) for _ in range(w)]
    run("all_gather", os_, lambda: d.all_gather(os_, torch.ones(2), async_op=True))
    o = torch.empty(2)
    run("reduce_scatter_tensor", [o], lambda: d.reduce_scatter_tensor(o, torch.ones(2 * w), async_op=True))
    o = torch.empty(2 * w)
    run("all_to_all_single", [o], lambda: d.all_to_all_single(o, torch.ones(2 * w), async_op=True))
    os_ = [torch.empty(2) for _ in range(w)]
    run("all_to_all", os_, lambda: d.all_to_all(os_, [torch.ones(2) for _ in range(w)], async_op=True))
    os_ = [torch.empty(2) for _ in range(w)] if r == 0 else []
    run("gather", os_, lambda: d.gather(torch.ones(2), os_ if r == 0 else None, 0, async_op=True))
    if w > 1:
        y = torch.zeros(2)
        run("send_recv", [y], lambda: d.isend(y, 1) if r == 0 else (d.irecv(y, 0) if r == 1 else None))
    return out
