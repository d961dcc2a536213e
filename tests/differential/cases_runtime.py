"""What a rank process does beyond collectives: its threads, autograd-flagged buffers, RNG, exits.

These are the places where thread ranks in one process could differ from real processes: every case
here runs the same program on gloo processes and on simulated ranks.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from .harness import case


def _x(ctx, n=4):
    return (torch.arange(n, dtype=torch.float64) * (ctx.rank + 2) + 10 * ctx.rank).to(ctx.device)


# -- threads a rank starts (issue 12, item 4) ---------------------------------------------------------------------------
@case(world_sizes=(1, 2, 3, 4))
def collective_from_a_comm_thread(ctx):
    """A communication thread overlapping compute: the thread's all_reduce is the rank's."""
    x = _x(ctx)
    box = {}

    def comm():
        y = x.clone()
        ctx.dist.all_reduce(y)
        box["y"] = y

    t = threading.Thread(target=comm, name="comm")
    t.start()
    z = (x * 3).sum()
    t.join()
    return box["y"], z


@case(world_sizes=(2, 3))
def async_collectives_from_a_worker_pool(ctx):
    """A ThreadPoolExecutor worker issues the rank's collectives while the rank waits on its futures."""
    xs = [_x(ctx) + i for i in range(3)]
    with ThreadPoolExecutor(max_workers=1) as ex:  # one worker keeps the issue order the same on every rank
        futs = [ex.submit(ctx.dist.all_reduce, x) for x in xs]
        for f in futs:
            f.result()
    return xs


@case(world_sizes=(2, 4))
def ring_with_sends_in_a_thread(ctx):
    """Each rank's blocking send runs in its own thread while the rank receives."""
    r, w = ctx.rank, ctx.world_size
    out = torch.empty(3, dtype=torch.float64, device=ctx.device)
    t = threading.Thread(target=ctx.dist.send, args=(_x(ctx, 3), (r + 1) % w))
    t.start()
    ctx.dist.recv(out, (r - 1) % w)
    t.join()
    return out


# -- autograd-flagged buffers (item 5): c10d writes memory; some of gloo's copies are autograd-checked ------------------------
# (the refusals are torch.distributed's on gloo; tensorplay.distributed writes every result as memory on every backend)
def _leaf(ctx, n):
    return torch.zeros(n, dtype=torch.float64, device=ctx.device, requires_grad=True)


@case()
def raw_written_collectives_on_leaves_that_require_grad(ctx):
    """gloo writes these results as memory: a leaf that requires grad is fine (and still requires grad)."""
    w = ctx.world_size
    x = _x(ctx).requires_grad_()
    ctx.dist.all_reduce(x)
    b = _x(ctx, 2).requires_grad_()
    ctx.dist.broadcast(b, src=0)
    r = _x(ctx, 3).requires_grad_()
    ctx.dist.reduce(r, dst=w - 1)
    s = _leaf(ctx, 2)
    ctx.dist.scatter(s, [_x(ctx, 2) + i for i in range(w)] if ctx.rank == 0 else None, src=0)
    a = _leaf(ctx, 2 * w)
    ctx.dist.all_to_all_single(a, _x(ctx, 2 * w))
    outs = [x, b, s, a] + ([r] if ctx.rank == w - 1 else [])
    return [t.detach() for t in outs], [t.requires_grad for t in outs]


@case(world_sizes=(2, 3))
def recv_into_a_leaf_that_requires_grad(ctx):
    buf = _leaf(ctx, 3)
    if ctx.rank == 0:
        ctx.dist.send(_x(ctx, 3), 1)
    elif ctx.rank == 1:
        ctx.dist.recv(buf, 0)
    return buf.detach(), buf.requires_grad


@case(world_sizes=(1, 2, 3), raises=True, front_doors=("torch",))
def all_gather_into_outputs_that_require_grad(ctx):
    ctx.dist.all_gather([_leaf(ctx, 2) for _ in range(ctx.world_size)], _x(ctx, 2))


@case(world_sizes=(2, 3), raises=True, front_doors=("torch",))
def gather_into_a_root_list_that_requires_grad(ctx):
    """Only the root writes into its list: only the root fails."""
    ctx.dist.gather(_x(ctx, 2), [_leaf(ctx, 2) for _ in range(ctx.world_size)] if ctx.rank == 1 else None, dst=1)
    return "finished"


@case(world_sizes=(1, 2, 3), raises=True, front_doors=("torch",))
def all_to_all_into_outputs_that_require_grad(ctx):
    w = ctx.world_size
    ctx.dist.all_to_all([_leaf(ctx, 2) for _ in range(w)], [_x(ctx, 2) + i for i in range(w)])


@case(world_sizes=(1, 2, 3), raises=True, front_doors=("torch",))
def reduce_scatter_tensor_into_an_output_that_requires_grad(ctx):
    ctx.dist.reduce_scatter_tensor(_leaf(ctx, 2), _x(ctx, 2 * ctx.world_size))


@case(world_sizes=(1, 2, 3), raises=True, front_doors=("torch",))
def all_gather_into_tensor_into_an_output_that_requires_grad(ctx):
    ctx.dist.all_gather_into_tensor(_leaf(ctx, 2 * ctx.world_size), _x(ctx, 2))


@case(world_sizes=(2, 3), raises=True, front_doors=("torch",))
def all_reduce_coalesced_on_leaves_that_require_grad(ctx):
    ctx.dist.all_reduce_coalesced([_leaf(ctx, 2), _leaf(ctx, 3)])


@case(world_sizes=(1, 2, 3))
def autograd_checked_collectives_under_no_grad(ctx):
    """The same calls succeed under torch.no_grad() on gloo: grad mode is the caller's."""
    w = ctx.world_size
    with torch.no_grad():
        ag = [_leaf(ctx, 2) for _ in range(w)]
        ctx.dist.all_gather(ag, _x(ctx, 2))
        a2a = [_leaf(ctx, 2) for _ in range(w)]
        ctx.dist.all_to_all(a2a, [_x(ctx, 2) + i for i in range(w)])
        rs = _leaf(ctx, 2)
        ctx.dist.reduce_scatter_tensor(rs, _x(ctx, 2 * w))
        agt = _leaf(ctx, 2 * w)
        ctx.dist.all_gather_into_tensor(agt, _x(ctx, 2))
    return [t.detach() for t in ag], [t.detach() for t in a2a], rs.detach(), agt.detach()


# -- randomness (item 11) ---------------------------------------------------------------------------------------------
# (an unseeded program's draws differ per rank: the pool's processes are reused, so that is checked against
# fresh processes in tests/test_sim_determinism.py instead)
@case(world_sizes=(2, 3), front_doors=("torch",))
def seeded_ranks_draw_the_same_numbers(ctx):
    torch.manual_seed(1234)
    mine = torch.rand(4, dtype=torch.float64)
    model = torch.nn.Linear(3, 2)
    return mine, [p.detach() for p in model.parameters()], torch.initial_seed()
