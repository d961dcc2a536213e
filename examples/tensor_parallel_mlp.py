"""A Megatron-style tensor-parallel MLP from tensorplay's autograd collectives.

``y = gelu(x @ A) @ B`` with ``A`` split by columns (column-parallel) and ``B``
by rows (row-parallel) across the ranks:

* ``df.broadcast(x, src=0)`` brings the input into the tensor-parallel region;
  its backward sums every rank's input gradient on rank 0;
* each rank computes its slice of the hidden layer, ``gelu(x @ A_r)``;
* ``df.all_reduce(h_r @ B_r)`` adds the partial products; its backward sums
  the ranks' output gradients.

Gradients follow the world-level adjoint: the world loss is the sum of every
rank's loss, so each rank, holding a full copy of ``y``, contributes
``loss / world``.  The shards' gradients then equal the matching slices of a
single-process model's gradients exactly, which this script checks.

    python -m simulator --nproc-per-node 4 examples/tensor_parallel_mlp.py
    torchrun --nproc-per-node 2 examples/tensor_parallel_mlp.py
"""
from __future__ import annotations

import sys

import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.distributed.nn.functional as df


def main() -> int:
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    d, hidden, batch = 6, 4 * world, 5
    gen = tp.Generator().manual_seed(0)
    A = tp.randn(d, hidden, generator=gen, dtype=tp.float64)
    B = tp.randn(hidden, d, generator=gen, dtype=tp.float64)
    X = tp.randn(batch, d, generator=gen, dtype=tp.float64)
    T = tp.randn(batch, d, generator=gen, dtype=tp.float64)
    cols = slice(rank * hidden // world, (rank + 1) * hidden // world)

    # the tensor-parallel model: this rank's shards only
    A_r = A[:, cols].clone().requires_grad_()
    B_r = B[cols, :].clone().requires_grad_()
    x = X.clone().requires_grad_()
    x_in = df.broadcast(x, src=0)
    y = df.all_reduce(tp.nn.functional.gelu(x_in @ A_r) @ B_r)
    loss = tp.nn.functional.mse_loss(y, T) / world
    loss.backward()

    # the single-process model it must match
    A_ref, B_ref, X_ref = (t.clone().requires_grad_() for t in (A, B, X))
    tp.nn.functional.mse_loss(tp.nn.functional.gelu(X_ref @ A_ref) @ B_ref, T).backward()

    checks = {
        "output": tp.allclose(y, tp.nn.functional.gelu(X @ A) @ B),
        "grad A shard": tp.allclose(A_r.grad, A_ref.grad[:, cols]),
        "grad B shard": tp.allclose(B_r.grad, B_ref.grad[cols, :]),
        # broadcast's gradient collects on src and is exactly zero elsewhere
        "grad x": tp.allclose(x.grad, X_ref.grad) if rank == 0 else bool((x.grad == 0).all()),
    }
    bad = [k for k, ok in checks.items() if not ok]
    sys.stdout.write(f"tensor_parallel_mlp rank {rank}/{world}: {'ok' if not bad else 'MISMATCH ' + ', '.join(bad)}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
