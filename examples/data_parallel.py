"""Data-parallel training with tensorplay collectives, checked against one process on the full batch.

Every rank holds the same model and a different slice of each batch; after
backward, gradients are averaged with ``all_reduce(op=AVG)``.  Averaging the
gradients of equal slices is the gradient of the full-batch mean loss, so the
model must follow a single process trained on the whole batch, step for step.

    python -m simulator --nproc-per-node 4 examples/data_parallel.py
    torchrun --nproc-per-node 2 examples/data_parallel.py --steps 5
"""
from __future__ import annotations

import argparse
import sys

import tensorplay as tp
import tensorplay.distributed as dist


def make_model(gen: tp.Generator) -> tp.nn.Module:
    model = tp.nn.Sequential(tp.nn.Linear(8, 16), tp.nn.Tanh(), tp.nn.Linear(16, 1)).double()
    with tp.no_grad():  # explicit generator: identical weights on every rank, whatever the rank's RNG state
        for p in model.parameters():
            p.copy_(tp.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--per-rank", type=int, default=4, help="samples per rank per step")
    args = ap.parse_args()

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(tp.Generator().manual_seed(0))
    reference = make_model(tp.Generator().manual_seed(0))
    opt = tp.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = tp.optim.SGD(reference.parameters(), lr=0.1)
    data = tp.Generator().manual_seed(1)
    n = args.per_rank
    for _ in range(args.steps):
        x = tp.randn(world * n, 8, generator=data, dtype=tp.float64)
        y = x.sum(1, keepdim=True).sin()
        opt.zero_grad()
        loss = tp.nn.functional.mse_loss(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
        ref_opt.zero_grad()
        ref_loss = tp.nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
    same = all(tp.allclose(p, q, rtol=1e-10, atol=1e-12) for p, q in zip(model.parameters(), reference.parameters()))
    sys.stdout.write(f"data_parallel rank {rank}/{world}: {'ok' if same else 'MISMATCH'} "
                     f"full-batch loss {ref_loss.item():.6f} after {args.steps} steps\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
