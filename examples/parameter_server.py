"""A parameter server: layers live on server workers as RemoteModules; a trainer drives them.

Rank 0 trains.  The other ranks are servers: each holds one layer of the
model (``RemoteModule``), so the parameters never leave their owner.  The
trainer runs the forward through the remote layers, backpropagates with
distributed autograd, and ``DistributedOptimizer`` asks every owner to step its
own parameters.  A local copy of the model trained the same way must match the
remote parameters after every step.

    python -m simulator --nproc-per-node 3 examples/parameter_server.py
    torchrun --nproc-per-node 3 examples/parameter_server.py
"""
from __future__ import annotations

import argparse
import os
import sys

import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.distributed.autograd as dist_autograd
import tensorplay.distributed.rpc as rpc
from tensorplay.distributed.nn import RemoteModule
from tensorplay.distributed.optim import DistributedOptimizer


class Layer(tp.nn.Module):
    """A layer whose weights come from a seed, so the trainer can build an identical local copy."""

    def __init__(self, d_in: int, d_out: int, seed: int, last: bool) -> None:
        super().__init__()
        self.lin = tp.nn.Linear(d_in, d_out).double()
        gen = tp.Generator().manual_seed(seed)
        with tp.no_grad():
            for p in self.lin.parameters():
                p.copy_(tp.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
        self.last = last

    def forward(self, x: tp.Tensor) -> tp.Tensor:
        y = self.lin(x)
        return y if self.last else tp.tanh(y)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        sys.stderr.write("parameter_server needs at least 2 ranks (a trainer and a server)\n")
        return 2
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    ok = True
    if rank == 0:
        servers = list(range(1, world))
        dims = [4] + [6] * (len(servers) - 1) + [1]
        specs = [(dims[i], dims[i + 1], 100 + i, i == len(servers) - 1) for i in range(len(servers))]
        remote = [RemoteModule(f"worker{s}/cpu", Layer, args=spec) for s, spec in zip(servers, specs)]
        local = tp.nn.Sequential(*(Layer(*spec) for spec in specs))
        params = [p for layer in remote for p in layer.remote_parameters()]
        opt = DistributedOptimizer(tp.optim.SGD, params, lr=0.05)
        ref_opt = tp.optim.SGD(local.parameters(), lr=0.05)
        data = tp.Generator().manual_seed(7)
        for _ in range(args.steps):
            x = tp.randn(8, 4, generator=data, dtype=tp.float64)
            target = x.sum(1, keepdim=True).cos()
            with dist_autograd.context() as ctx:
                h = x
                for layer in remote:
                    h = layer(h)
                loss = tp.nn.functional.mse_loss(h, target)
                dist_autograd.backward(ctx, [loss])
                opt.step(ctx)
            ref_opt.zero_grad()
            tp.nn.functional.mse_loss(local(x), target).backward()
            ref_opt.step()
            fetched = [p.to_here() for p in params]
            ok = ok and all(tp.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(fetched, local.parameters()))
        sys.stdout.write(f"parameter_server trainer: {'ok' if ok else 'MISMATCH'} remote parameters match the "
                         f"local model after {args.steps} steps (loss {loss.item():.6f})\n")
    rpc.shutdown()
    if rank != 0:
        sys.stdout.write(f"parameter_server server worker{rank}: ok\n")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
