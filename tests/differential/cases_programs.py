"""Programs in the shape of PyTorch's distributed tutorials and examples, as differential cases.

Each case is a small whole training or communication program as a new user writes it from the
tutorials (FSDP1 with an auto-wrap policy and state-dict round trips, DDP with a rank-0 checkpoint
and a barrier, a DistributedSampler/DataLoader loop, a ring all-reduce built from isend/recv),
written against torch's own APIs only and compared rank by rank between simulated ranks and gloo
processes.  Models are built from a fixed seed; every rank's data is distinct.
"""
from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn import functional as F

from .harness import case

TORCH = ("torch",)


class _Block(nn.Module):
    """A residual MLP block: the unit an FSDP1 auto-wrap policy wraps."""

    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        return x + self.b(F.gelu(self.a(x)))


class _Net(nn.Module):
    def __init__(self, d_in=8, d=12, n_blocks=2, n_out=3):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList([_Block(d) for _ in range(n_blocks)])
        self.out = nn.Linear(d, n_out)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _data(rank, step, n=5, d_in=8, n_out=3):
    g = torch.Generator().manual_seed(1000 * step + 31 * (rank + 1))
    return torch.randn(n, d_in, generator=g), torch.randint(0, n_out, (n,), generator=g)


def _fsdp1(ctx, strategy_name="FULL_SHARD", **kwargs):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    return FSDP(_Net().to(ctx.device), auto_wrap_policy=ModuleWrapPolicy({_Block}),
                sharding_strategy=getattr(ShardingStrategy, strategy_name), device_id=ctx.device, **kwargs)


def _fsdp1_train(ctx, model, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for s in range(steps):
        x, y = _data(ctx.rank, s)
        loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        loss.backward()
        norms.append(model.clip_grad_norm_(1.0).detach())
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return opt, losses, norms


def _full_params(model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


@case(world_sizes=(1, 2, 3), front_doors=TORCH, compare="close")
def fsdp1_full_shard_train(ctx):
    """FSDP1 tutorial shape: auto-wrapped blocks, AdamW, clip_grad_norm_, full parameters gathered at the end."""
    from torch.distributed.fsdp import BackwardPrefetch

    model = _fsdp1(ctx, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    _, losses, norms = _fsdp1_train(ctx, model)
    return {"losses": losses, "norms": norms, "params": _full_params(model)}


@case(world_sizes=(2,), front_doors=TORCH, compare="close")
def fsdp1_optim_state_dict(ctx):
    """Full model and optimizer state dicts: FSDP1's optim_state_dict keeps per-process profiling state
    around its collectives (rank threads must not share it)."""
    from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig,
                                        FullyShardedDataParallel as FSDP, StateDictType)

    model = _fsdp1(ctx)
    opt, _, _ = _fsdp1_train(ctx, model)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                              FullOptimStateDictConfig()):
        msd = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt)
    exp_avg = {k: v["exp_avg"] for k, v in sorted(osd["state"].items())}
    return {"model": dict(sorted(msd.items())), "exp_avg": exp_avg}


@case(world_sizes=(2,), front_doors=TORCH, compare="close", slow=True)
def fsdp1_other_strategies(ctx):
    """SHARD_GRAD_OP with forward prefetch, NO_SHARD, and bf16 mixed precision with use_orig_params."""
    from torch.distributed.fsdp import MixedPrecision

    out = {}
    for name, kw in (("SHARD_GRAD_OP", {"forward_prefetch": True}), ("NO_SHARD", {}),
                     ("FULL_SHARD", {"use_orig_params": True,
                                     "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16,
                                                                       reduce_dtype=torch.float32)})):
        model = _fsdp1(ctx, name, **kw)
        _, losses, norms = _fsdp1_train(ctx, model)
        out[f"{name}-{sorted(kw)}"] = {"losses": losses, "norms": norms, "params": _full_params(model)}
    return out


@case(world_sizes=(2, 3, 4), front_doors=TORCH)
def ring_all_reduce_isend_recv(ctx):
    """The point-to-point tutorial's ring: every rank posts isend to the right, then a blocking recv from the left."""
    dist = ctx.dist
    rank, size = dist.get_rank(), dist.get_world_size()
    send = torch.arange(4, dtype=torch.float64) * (rank + 1) + rank
    recv_buf = send.clone()
    acc = send.clone()
    left, right = (rank - 1) % size, (rank + 1) % size
    for i in range(size - 1):
        out_buf, in_buf = (send, recv_buf) if i % 2 == 0 else (recv_buf, send)
        req = dist.isend(out_buf, right)
        dist.recv(in_buf, left)
        acc += in_buf
        req.wait()
    return acc


@case(world_sizes=(2, 3), front_doors=TORCH, compare="close")
def ddp_checkpoint_barrier(ctx):
    """DDP tutorial shape: rank 0 saves, everyone waits at a barrier, every rank loads the file and trains."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(ctx.rank)  # distinct initial weights: the loaded checkpoint must make them equal
    model = DDP(_Net().to(ctx.device))
    path = os.path.join(ctx.tmpdir, f"ddp-ckpt-{ctx.world_size}.pt")
    if ctx.rank == 0:
        torch.save(model.state_dict(), path)
    ctx.dist.barrier()
    model.load_state_dict(torch.load(path, map_location=ctx.device, weights_only=True))
    ctx.dist.barrier()  # nobody removes or rewrites the file while a rank still reads it
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data(ctx.rank, 0)
    loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
    loss.backward()
    opt.step()
    return {"loss": loss.detach(), "params": [p.detach().clone() for p in model.parameters()]}


@case(world_sizes=(2, 3), front_doors=TORCH, compare="close")
def ddp_distributed_sampler_loop(ctx):
    """ddp-tutorial-series shape: a DistributedSampler over a synthetic dataset, set_epoch, a DataLoader loop."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    g = torch.Generator().manual_seed(42)
    data = TensorDataset(torch.rand(50, 8, generator=g), torch.rand(50, 1, generator=g))
    sampler = DistributedSampler(data)  # rank and world size from the default group
    loader = DataLoader(data, batch_size=8, sampler=sampler, shuffle=False)
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1).to(ctx.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen, losses = [], []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen.append(list(iter(sampler)))
        for x, y in loader:
            opt.zero_grad()
            loss = F.mse_loss(model(x.to(ctx.device)), y.to(ctx.device))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"indices": seen, "losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


@case(world_sizes=(2,), front_doors=TORCH, compare="close")
def fsdp2_buffers_from_the_process_group(ctx):
    """FSDP2 asked to take its staging buffers from the group's allocator: gloo has none, torch.empty is used."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Net().to(ctx.device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.set_allocate_memory_from_process_group_for_comm(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for s in range(2):
        x, y = _data(ctx.rank, s)
        loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "params": [p.full_tensor().detach().clone() for p in model.parameters()]}


@case(world_sizes=(2,), front_doors=TORCH, compare="close")
def tp_loss_parallel(ctx):
    """TP tutorial shape: a vocabulary-sharded output layer and the loss computed under loss_parallel().

    loss_parallel adds DTensor op handlers on entry and removes them on exit; every rank enters and
    leaves it on its own.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   loss_parallel, parallelize_module)

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(16, 8), "norm": nn.LayerNorm(8), "out": nn.Linear(8, 16, bias=False)})
    model.to(ctx.device)
    parallelize_module(model, mesh, {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "out": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        tok = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(step)).to(ctx.device)
        logits = model["out"](model["norm"](model["emb"](tok)))
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), tok.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().detach())
    return {"losses": losses, "params": [p.full_tensor().detach().clone() for p in model.parameters()]}


@case(world_sizes=(2, 3, 4), front_doors=TORCH, known_divergence=(
    "gloo's reduce leaves partial results in the non-dst ranks' tensors (a ring reduce-scatter: chunk c "
    "of ceil(n/W) elements is folded along ranks c-1, c-2, ..., c (mod W), each writing its running value, "
    "then sent to dst); the simulator leaves non-dst tensors as they were (torch documents them as "
    "unspecified)"))
def reduce_tutorial_prints_every_rank(ctx):
    """A program that prints its tensor on every rank after reduce, as a newcomer to the collectives does."""
    t = torch.arange(5, dtype=torch.float64) + 10 * ctx.rank
    ctx.dist.reduce(t, dst=1 % ctx.world_size)
    return t
