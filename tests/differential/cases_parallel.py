"""Parallel training on torch.distributed: DDP, FSDP2, DTensor, TP/SP, 2-D meshes, pipelining, DCP.

Each case is a small training or checkpointing program written against torch's own APIs only
(``front_doors=("torch",)``), run on simulated ranks and on gloo processes, and compared rank by
rank: parameters, gradients, losses, loaded checkpoints.  Models are built from a fixed seed on
every rank, and every rank's data is distinct, so a missing or wrong exchange shows up as a
difference.  Floating-point results use ``compare="close"`` where the two backends may sum in a
different order.
"""
from __future__ import annotations

import torch
from torch import nn

from .harness import case

TORCH = ("torch",)


def _mlp(ctx, seed=0, dims=(6, 8, 4), dtype=torch.float32):
    """A small MLP, the same on every rank (the seed is fixed), on the case's device."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).to(device=ctx.device, dtype=dtype)


def _batch(ctx, step, n=4, d_in=6, d_out=4, same=False, dtype=torch.float32):
    """This rank's batch for one step: distinct per rank (unless ``same``) and per step."""
    g = torch.Generator().manual_seed(1000 * step + (0 if same else 17 * (ctx.rank + 1)))
    x = torch.randn(n, d_in, generator=g, dtype=dtype)
    y = torch.randn(n, d_out, generator=g, dtype=dtype)
    return x.to(ctx.device), y.to(ctx.device)


def _params(module):
    return [p.detach().clone() for p in module.parameters()]


def _grads(module):
    return [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


def _full(ts):
    """Full tensors of DTensor parameters/gradients (plain tensors pass through)."""
    out = []
    for t in ts:
        if t is None:
            out.append(None)
        elif hasattr(t, "full_tensor"):
            out.append(t.full_tensor().detach().clone())
        else:
            out.append(t.detach().clone())
    return out


# ---------------------------------------------------------------------------------------------------------------------
# DDP
# ---------------------------------------------------------------------------------------------------------------------
def _ddp_train(ctx, steps=2, **ddp_kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp(ctx), **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for s in range(steps):
        x, y = _batch(ctx, s)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return {"params": _params(model), "grads": _grads(model), "losses": losses}


@case(world_sizes=(1, 2, 3), front_doors=TORCH, compare="close")
def ddp_plain(ctx):
    return _ddp_train(ctx)


@case(world_sizes=(2,), front_doors=TORCH, compare="close", slow=True)
def ddp_static_graph(ctx):
    return _ddp_train(ctx, steps=3, static_graph=True)


class _TwoHeads(nn.Module):
    """A model whose second head is used on some steps only (DDP must be told: find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x, use_b):
        h = torch.tanh(self.body(x))
        return self.b(h) if use_b else self.a(h)


@case(world_sizes=(2,), front_doors=TORCH, compare="close")
def ddp_find_unused_parameters(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(_TwoHeads().to(ctx.device), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for s in range(3):
        x, y = _batch(ctx, s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x, use_b=(s == 1)), y).backward()
        opt.step()
        out.append(_grads(model))
    return {"params": _params(model), "grads": out}


@case(world_sizes=(2, 3), front_doors=TORCH, compare="close")
def ddp_no_sync_accumulation(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp(ctx))
    x0, y0 = _batch(ctx, 0)
    x1, y1 = _batch(ctx, 1)
    with model.no_sync():  # local accumulation only: gradients differ per rank here
        nn.functional.mse_loss(model(x0), y0).backward()
    local = _grads(model)
    nn.functional.mse_loss(model(x1), y1).backward()  # this backward all-reduces the accumulated gradients
    return {"local": local, "synced": _grads(model)}


@case(world_sizes=(2, 3), front_doors=TORCH, compare="close")
def ddp_join_uneven_inputs(ctx):
    # rank r trains on r + 2 batches; the ranks that run out early shadow the others' all-reduces under join().
    # divide_by_initial_world_size=False: each backward divides by the ranks still training, read from the work
    # of the forward pass's all-reduce, which DDP's reducer keeps in C++ and waits on in backward
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp(ctx))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    with model.join(divide_by_initial_world_size=False):
        for step in range(ctx.rank + 2):
            x, y = _batch(ctx, step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            grads.append(_grads(model))
            opt.step()
    return {"grads": grads, "params": _params(model)}


@case(world_sizes=(2,), front_doors=TORCH, compare="close")
def ddp_comm_hook_allreduce(ctx):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp(ctx))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    x, y = _batch(ctx, 0)
    nn.functional.mse_loss(model(x), y).backward()
    return _grads(model)


# W=2 only: a float16 sum of more than two values depends on the order of summation, which gloo's
# ring and the simulator's rank-order reduction do not share (one float16 ulp apart at W=4)
@case(world_sizes=(2,), front_doors=TORCH, compare="close", slow=True)
def ddp_comm_hook_fp16_compress(ctx):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp(ctx))
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    x, y = _batch(ctx, 0)
    nn.functional.mse_loss(model(x), y).backward()
    return _grads(model)


# ---------------------------------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------------------------------
def _fsdp_train(ctx, steps=2, reshard_after_forward=True, mp_policy=None, prefetch=False, dims=(6, 8, 8, 4)):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = _mlp(ctx, dims=dims)
    kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for m in linears:
        fully_shard(m, **kw)
    fully_shard(model, **kw)
    if prefetch:
        for a, b in zip(linears[:-1], linears[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for s in range(steps):
        x, y = _batch(ctx, s)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return {"local_shards": [p.to_local().detach().clone() for p in model.parameters()],
            "full": _full(model.parameters()), "losses": losses}


@case(world_sizes=(1, 2, 3), front_doors=TORCH, compare="close")
def fsdp2_reshard_after_forward(ctx):
    return _fsdp_train(ctx, reshard_after_forward=True)


@case(world_sizes=(2,), front_doors=TORCH, compare="close", slow=True)
def fsdp2_no_reshard_after_forward(ctx):
    return _fsdp_train(ctx, reshard_after_forward=False)


@case(world_sizes=(2,), front_doors=TORCH, compare="close", slow=True)
def fsdp2_mixed_precision(ctx):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return _fsdp_train(ctx, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


@case(world_sizes=(2, 4), front_doors=TORCH, compare="close", slow=True)
def fsdp2_explicit_prefetch(ctx):
    return _fsdp_train(ctx, prefetch=True)


# ---------------------------------------------------------------------------------------------------------------------
# DTensor
# ---------------------------------------------------------------------------------------------------------------------
@case(world_sizes=(1, 2, 3, 4), front_doors=TORCH, compare="close")
def dtensor_ops_and_redistribute(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    full = torch.arange(48.0, device=ctx.device).reshape(8, 6)
    a = distribute_tensor(full, mesh, [Shard(0)])
    b = distribute_tensor(full.t().contiguous() + 1, mesh, [Shard(1)])
    out = {"a_local": a.to_local().clone(), "matmul": (a @ b).full_tensor(), "sum": (a * 2).sum().full_tensor()}
    r = a.redistribute(mesh, [Replicate()])
    out["replicate_local"] = r.to_local().clone()
    s1 = r.redistribute(mesh, [Shard(1)])
    out["shard1_local"] = s1.to_local().clone()
    # a Partial built from per-rank local values: redistribute reduces it (Replicate) or reduce-scatters (Shard)
    local = torch.full((4, 3), float(ctx.rank + 1), device=ctx.device) + torch.arange(3.0, device=ctx.device)
    p = torch.distributed.tensor.DTensor.from_local(local, mesh, [Partial()])
    out["partial_to_replicate"] = p.redistribute(mesh, [Replicate()]).to_local().clone()
    out["partial_to_shard"] = p.redistribute(mesh, [Shard(0)]).to_local().clone()
    out["placements"] = repr(s1.placements)
    return out


@case(world_sizes=(4,), front_doors=TORCH, compare="close")
def dtensor_2d_mesh(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(32.0, device=ctx.device).reshape(4, 8)
    t = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    r = t.redistribute(mesh, [Replicate(), Shard(1)])
    return {"local": t.to_local().clone(), "row_gathered": r.to_local().clone(),
            "dp_rank": mesh["dp"].get_local_rank(), "tp_rank": mesh["tp"].get_local_rank(),
            "sum": (t * t).sum().full_tensor()}


# ---------------------------------------------------------------------------------------------------------------------
# tensor and sequence parallelism
# ---------------------------------------------------------------------------------------------------------------------
class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(10, 16)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(16, 6)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


def _tp_train(ctx, plan_kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    torch.manual_seed(0)
    model = _Toy().to(ctx.device)
    if plan_kind == "tp":
        plan = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    else:  # sequence parallel: inputs and outputs sharded on the sequence (batch) dim
        plan = {"in_proj": ColwiseParallel(input_layouts=Shard(0)), "out_proj": RowwiseParallel(output_layouts=Shard(0))}
    model = parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=True)
    outs = []
    for s in range(3):
        g = torch.Generator().manual_seed(s if plan_kind == "tp" else 100 * ctx.rank + s)
        x = torch.rand(8, 10, generator=g).to(ctx.device)
        y = model(x)
        outs.append(y.detach().clone() if not hasattr(y, "full_tensor") else y.full_tensor().detach().clone())
        y.sum().backward()
        opt.step()
        opt.zero_grad()
    return {"outputs": outs, "params": _full(model.parameters())}


@case(world_sizes=(1, 2, 4), front_doors=TORCH, compare="close")
def tp_colwise_rowwise(ctx):
    return _tp_train(ctx, "tp")


@case(world_sizes=(2, 4), front_doors=TORCH, compare="close", slow=True)
def sp_sequence_sharded(ctx):
    return _tp_train(ctx, "sp")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


@case(world_sizes=(2,), front_doors=TORCH, compare="close", slow=True)
def sp_sequence_parallel_layernorm(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    torch.manual_seed(0)
    block = _Block().to(ctx.device)
    block = parallelize_module(block, mesh, {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=torch.distributed.tensor.Replicate()),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
    })
    g = torch.Generator().manual_seed(7 + ctx.rank)
    x = torch.randn(2, 4, 8, generator=g).to(ctx.device)  # this rank's shard of the sequence (dim 1)
    y = block(x)
    y.to_local().sum().backward() if hasattr(y, "to_local") else y.sum().backward()
    return {"out": y.full_tensor() if hasattr(y, "full_tensor") else y.detach(),
            "grads": _full([p.grad for p in block.parameters()])}


@case(world_sizes=(4,), front_doors=TORCH, compare="close", slow=True)
def fsdp_x_tp_2d(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = _Toy().to(ctx.device)
    model = parallelize_module(model, mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = mesh["dp"].get_local_rank()
    losses = []
    for s in range(2):
        g = torch.Generator().manual_seed(10 * s + dp)  # data parallel over dp, the same within a tp group
        x = torch.rand(4, 10, generator=g).to(ctx.device)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "params": _full(model.parameters())}


# ---------------------------------------------------------------------------------------------------------------------
# pipelining
# ---------------------------------------------------------------------------------------------------------------------
def _pipeline(ctx, schedule_name, n_micro=4):
    from torch.distributed import pipelining

    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).to(ctx.device)
    per = len(full) // ctx.world_size + (1 if len(full) % ctx.world_size else 0)
    part = nn.Sequential(*list(full)[ctx.rank * per:(ctx.rank + 1) * per])
    stage = pipelining.PipelineStage(part, ctx.rank, ctx.world_size, ctx.device)
    schedule_cls = getattr(pipelining, schedule_name)
    schedule = schedule_cls(stage, n_microbatches=n_micro, loss_fn=nn.functional.mse_loss)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 6, generator=g).to(ctx.device)
    y = torch.randn(8, 4, generator=g).to(ctx.device)
    losses: list[torch.Tensor] = []
    if ctx.rank == 0:
        schedule.step(x)
    elif ctx.rank == ctx.world_size - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    return {"grads": _grads(part), "losses": [t.detach() for t in losses]}


@case(world_sizes=(2,), front_doors=TORCH, compare="close")
def pipeline_gpipe(ctx):
    return _pipeline(ctx, "ScheduleGPipe")


@case(world_sizes=(2, 3), front_doors=TORCH, compare="close", slow=True)
def pipeline_1f1b(ctx):
    return _pipeline(ctx, "Schedule1F1B")


# ---------------------------------------------------------------------------------------------------------------------
# distributed checkpointing
# ---------------------------------------------------------------------------------------------------------------------
@case(world_sizes=(2, 3), front_doors=TORCH, compare="close")
def dcp_save_load_fsdp2(ctx):
    import torch.distributed.checkpoint as dcp

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = _mlp(ctx, seed=0, dims=(6, 8, 8, 4))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(ctx, 3)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    saved = _full(model.parameters())
    dcp.save({"model": model.state_dict()}, checkpoint_id=ctx.tmpdir)
    fresh = _mlp(ctx, seed=123, dims=(6, 8, 8, 4))
    fully_shard(fresh, mesh=mesh)
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=ctx.tmpdir)
    fresh.load_state_dict(sd["model"])
    return {"saved": saved, "loaded": _full(fresh.parameters()),
            "local": [p.to_local().detach().clone() for p in fresh.parameters()]}


@case(world_sizes=(2,), front_doors=TORCH, compare="close", slow=True)
def dcp_get_set_state_dict_fsdp2_with_optimizer(ctx):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))

    def build(seed):
        m = _mlp(ctx, seed=seed, dims=(6, 8, 4))
        fully_shard(m, mesh=mesh)
        return m, torch.optim.Adam(m.parameters(), lr=0.01)

    model, opt = build(0)
    for s in range(2):
        x, y = _batch(ctx, s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ctx.tmpdir)
    model2, opt2 = build(99)
    nn.functional.mse_loss(model2(x), y).backward()
    opt2.step()  # creates optimizer state to be overwritten
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=ctx.tmpdir)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    # one more identical step on both: the restored optimizer state must make them agree
    for m, o in ((model, opt), (model2, opt2)):
        x, y = _batch(ctx, 5)
        o.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        o.step()
    return {"original": _full(model.parameters()), "restored": _full(model2.parameters())}
