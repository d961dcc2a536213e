"""Point to point: send/recv, isend/irecv, batch_isend_irecv, tags, any-source receives, subgroups.

Any-source receives complete in whatever order the senders' messages arrive, which differs run to
run on gloo; those cases return what is order-independent (the set of (sender, payload) pairs).
"""
from __future__ import annotations

import torch

from .harness import case, doors


def _x(ctx, n=3, salt=0, dtype=torch.float64):
    return (torch.arange(n, dtype=torch.float64) * (ctx.rank + 2) + 10 * ctx.rank + salt).to(dtype).to(ctx.device)


def _buf(ctx, n=3, dtype=torch.float64):
    return torch.full((n,), -1.0, dtype=dtype, device=ctx.device)


@case(world_sizes=(2, 4))
def send_recv_pairs(ctx):
    """Even ranks send to the next odd rank; recv returns the sender's rank."""
    if ctx.rank % 2 == 0:
        ctx.dist.send(_x(ctx), dst=ctx.rank + 1)
        return None
    y = _buf(ctx)
    src = ctx.dist.recv(y, src=ctx.rank - 1)
    return [src, y]


@case(world_sizes=(2, 3))
def send_recv_int_and_0d(ctx):
    if ctx.rank == 0:
        for dst in range(1, ctx.world_size):
            ctx.dist.send(torch.tensor(7 * dst, device=ctx.device), dst=dst)
            ctx.dist.send(torch.arange(4, dtype=torch.int32, device=ctx.device) * dst, dst=dst)
        return None
    a = torch.tensor(0, device=ctx.device)
    b = torch.zeros(4, dtype=torch.int32, device=ctx.device)
    ctx.dist.recv(a, src=0)
    ctx.dist.recv(b, src=0)
    return [a, b]


@case(world_sizes=(2, 3, 4))
def isend_irecv_to_all(ctx):
    """Every rank posts an isend to every other rank and an irecv from each, then waits for all."""
    W, r = ctx.world_size, ctx.rank
    works, bufs = [], {}
    for peer in range(W):
        if peer != r:
            works.append(ctx.dist.isend(_x(ctx, salt=100 * peer), dst=peer))
            bufs[peer] = _buf(ctx)
            works.append(ctx.dist.irecv(bufs[peer], src=peer))
    for wk in works:
        wk.wait()
    return [bufs[p] for p in sorted(bufs)]


@case(world_sizes=(2,))
def isend_tags_received_out_of_order(ctx):
    """Tags pick the message: rank 1 receives tag 2 before tag 1."""
    if ctx.rank == 0:
        w1 = ctx.dist.isend(_x(ctx, salt=1), dst=1, tag=1)
        w2 = ctx.dist.isend(_x(ctx, salt=2), dst=1, tag=2)
        w1.wait()
        w2.wait()
        return None
    b2, b1 = _buf(ctx), _buf(ctx)
    ctx.dist.recv(b2, src=0, tag=2)
    ctx.dist.recv(b1, src=0, tag=1)
    return [b1, b2]


@case(world_sizes=(2, 3, 4))
def recv_any_source_returns_sender(ctx):
    if ctx.rank != 0:
        ctx.dist.send(_x(ctx), dst=0)
        return None
    got = []
    for _ in range(ctx.world_size - 1):
        y = _buf(ctx)
        src = ctx.dist.recv(y)  # any source
        got.append((src, y))
    got.sort(key=lambda p: p[0])
    return got


@case(world_sizes=(2, 3))
def irecv_any_source_work_source_rank(ctx):
    if ctx.rank != 0:
        ctx.dist.send(_x(ctx), dst=0)
        return None
    got = []
    for _ in range(ctx.world_size - 1):
        y = _buf(ctx)
        work = ctx.dist.irecv(y)
        work.wait()
        got.append((work.source_rank(), y))
    got.sort(key=lambda p: p[0])
    return got


def _ring_all_reduce(ctx, t):
    """The PyTorch tutorial's ring all-reduce: post an isend to the right, recv from the left, wait."""
    W, r = ctx.world_size, ctx.rank
    left, right = (r - 1) % W, (r + 1) % W
    send_buf, recv_buf, acc = t.clone(), t.clone(), t.clone()
    for i in range(W - 1):
        if i % 2 == 0:
            req = ctx.dist.isend(send_buf, right)
            ctx.dist.recv(recv_buf, left)
            acc += recv_buf
        else:
            req = ctx.dist.isend(recv_buf, right)
            ctx.dist.recv(send_buf, left)
            acc += send_buf
        req.wait()
    return acc


@case(world_sizes=(2, 3, 4))
def tutorial_ring_all_reduce(ctx):
    return _ring_all_reduce(ctx, _x(ctx, 4))


def _every_rank_deadlocked(per_rank):
    from simulator import DeadlockError

    bad = {r: repr(v)[:200] for r, v in enumerate(per_rank) if not isinstance(v, DeadlockError)}
    assert not bad, f"every rank must get DeadlockError (gloo hangs in its sends); got {bad}"


@case(world_sizes=(2, 3), raises=True, expect_sim=_every_rank_deadlocked,
      gloo="gloo's blocking send waits for the peer's receive (torch 2.13 on loopback, 3-element tensor: 'Timed out "
           "waiting ... for send operation to complete' on every rank), so this program hangs there until the "
           "process-group timeout")
def blocking_send_before_recv_ring(ctx):
    """Every rank sends to its right, then receives from its left: a deadlock on gloo (and NCCL), which the
    simulator reports at once."""
    W, r = ctx.world_size, ctx.rank
    y = _buf(ctx)
    ctx.dist.send(_x(ctx), dst=(r + 1) % W)
    src = ctx.dist.recv(y, src=(r - 1) % W)
    return [src, y]


@case(world_sizes=(2, 3, 4), front_doors=doors("batch_isend_irecv", "P2POp"))
def batch_isend_irecv_ring(ctx):
    W, r = ctx.world_size, ctx.rank
    y = _buf(ctx)
    ops = [ctx.dist.P2POp(ctx.dist.isend, _x(ctx), (r + 1) % W),
           ctx.dist.P2POp(ctx.dist.irecv, y, (r - 1) % W)]
    for wk in ctx.dist.batch_isend_irecv(ops):
        wk.wait()
    return y


@case(world_sizes=(3,), front_doors=doors("batch_isend_irecv", "P2POp"))
def batch_isend_irecv_recvs_first_with_tags(ctx):
    """Receives listed before sends, two messages per pair told apart by tag."""
    W, r = ctx.world_size, ctx.rank
    a, b = _buf(ctx), _buf(ctx, 2)
    ops = [ctx.dist.P2POp(ctx.dist.irecv, a, (r - 1) % W, tag=5),
           ctx.dist.P2POp(ctx.dist.irecv, b, (r - 1) % W, tag=6),
           ctx.dist.P2POp(ctx.dist.isend, _x(ctx, 2, salt=1), (r + 1) % W, tag=6),
           ctx.dist.P2POp(ctx.dist.isend, _x(ctx, salt=2), (r + 1) % W, tag=5)]
    reqs = ctx.dist.batch_isend_irecv(ops)
    for wk in reqs:
        wk.wait()
    return [a, b]


@case(world_sizes=(4,))
def subgroup_p2p_global_and_group_peers(ctx):
    """In group [3, 1, 2] (torch sorts it to [1, 2, 3]): dst/src are global ranks, group_dst/group_src group ranks."""
    g = ctx.dist.new_group([3, 1, 2])
    if ctx.rank == 3:
        ctx.dist.send(_x(ctx), dst=1, group=g)
        ctx.dist.send(_x(ctx, salt=1), group=g, group_dst=1)  # group rank 1 is global rank 2
        return None
    if ctx.rank == 1:
        y = _buf(ctx)
        return [ctx.dist.recv(y, src=3, group=g), y]
    if ctx.rank == 2:
        y = _buf(ctx)
        return [ctx.dist.recv(y, group=g, group_src=2), y]  # group rank 2 is global rank 3
    return "not a member"


@case(world_sizes=(4,))
def subgroup_any_source_recv_returns_global_rank(ctx):
    g = ctx.dist.new_group([2, 0, 3])
    if ctx.rank == 2:
        got = []
        for _ in range(2):
            y = _buf(ctx)
            got.append((ctx.dist.recv(y, group=g), y))
        return sorted(got, key=lambda p: p[0])
    if ctx.rank in (0, 3):
        ctx.dist.send(_x(ctx), dst=2, group=g)
    return None


@case(world_sizes=(2,), raises=True)
def send_to_self_raises(ctx):
    ctx.dist.send(_x(ctx), dst=ctx.rank)
    return None


def _all_runtime_errors(per_rank):
    bad = {r: repr(v)[:200] for r, v in enumerate(per_rank) if not isinstance(v, RuntimeError)}
    assert not bad, f"the simulator refuses a peer outside the world at once (RuntimeError); got {bad}"


# torch's gloo does not check dst: the send waits on the store for a peer that does not exist and raises a
# RuntimeError (DistStoreError) after the process-group timeout; the simulator refuses at once with the same class
# (tensorplay's own front door refuses it with RankNotInGroupError, a ValueError, on every backend)
@case(world_sizes=(2,), raises=True, front_doors=("torch",), expect_sim=_all_runtime_errors,
      gloo="gloo waits for the process-group timeout before it raises (a deliberate deviation: the simulator "
           "refuses at once)")
def send_to_rank_outside_world_raises(ctx):
    ctx.dist.send(_x(ctx), dst=ctx.world_size + 1)
    return None
