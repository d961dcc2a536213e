"""A tiny multi-rank program: a few collectives with distinct per-rank values, one checkable line each.

Run it with torchrun (real gloo processes on this machine)::

    torchrun --nproc-per-node 2 examples/allreduce_demo.py

or, unchanged, on simulated ranks::

    python -m simulator --nproc-per-node 2 examples/allreduce_demo.py

Each rank prints lines such as ``rank 0/2: all_reduce ok sum=1.0`` and the
program exits 0; a wrong result prints ``... FAILED ...`` and exits 1.
"""
from __future__ import annotations

import sys

import tensorplay as tp
import tensorplay.distributed as dist


def main() -> int:
    dist.init_process_group()  # env:// under torchrun; already done under the simulator
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []

    def report(what: str, ok: bool, detail: str) -> None:
        # one write per line: ranks share stdout, and print() writes the newline separately
        sys.stdout.write(f"rank {rank}/{world}: {what} {'ok' if ok else 'FAILED'} {detail}\n")
        sys.stdout.flush()
        if not ok:
            failures.append(what)

    # all_reduce: every rank contributes its own rank; everyone gets 0 + 1 + ... + (world - 1)
    x = tp.tensor([float(rank)])
    dist.all_reduce(x)
    report("all_reduce", x.item() == world * (world - 1) / 2, f"sum={x.item()}")

    # broadcast from the last rank: everyone ends up with its value
    src = world - 1
    y = tp.full((3,), 10.0 * rank)
    dist.broadcast(y, src=src)
    report("broadcast", bool((y == 10.0 * src).all()), f"src={src} value={y[0].item()}")

    # all_gather: rank r contributes [r, r*r]; everyone sees every rank's pair in rank order
    parts = [tp.empty(2) for _ in range(world)]
    dist.all_gather(parts, tp.tensor([float(rank), float(rank * rank)]))
    flat = [v for p in parts for v in p.tolist()]
    expected = [v for r in range(world) for v in (float(r), float(r * r))]
    report("all_gather", flat == expected, f"gathered={flat}")

    # reduce_scatter: rank r sends r + 100*i to rank i, which receives the sum over senders
    out = tp.empty(1)
    dist.reduce_scatter(out, [tp.tensor([rank + 100.0 * i]) for i in range(world)])
    want = world * 100.0 * rank + world * (world - 1) / 2
    report("reduce_scatter", out.item() == want, f"value={out.item()}")

    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
