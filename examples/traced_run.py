"""A traced run: a few data-parallel steps whose collectives appear on a Perfetto timeline.

On simulated ranks the simulator records every collective (rank, group,
sequence number, bytes, call site, wall time and alpha-beta virtual time) and
writes the timeline itself::

    python -m simulator --nproc-per-node 4 --trace traced_run.json examples/traced_run.py

On real ranks each process records its own timeline with torch.profiler::

    torchrun --nproc-per-node 2 examples/traced_run.py --trace-dir traces/

Either JSON file opens in the Perfetto UI or chrome://tracing.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import tensorplay as tp
import tensorplay.distributed as dist


def steps(n: int, size: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = tp.Generator().manual_seed(rank)
    w = tp.zeros(size)
    for _ in range(n):
        grad = tp.randn(size, generator=gen)
        dist.all_reduce(grad, op=dist.ReduceOp.AVG)            # gradient averaging
        w -= 0.1 * grad
        shards = [tp.empty(size // world) for _ in range(world)]
        dist.all_gather(shards, w[rank * (size // world):(rank + 1) * (size // world)].contiguous())
        dist.barrier()
    return float(w.sum())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--trace-dir", default=None, help="real ranks: write rank<r>.json with torch.profiler here")
    args = ap.parse_args()
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    simulated = dist.get_backend() == "sim"
    profile = args.trace_dir is not None and not simulated
    ctx = tp.profiler.profile(activities=[tp.profiler.ProfilerActivity.CPU]) if profile else contextlib.nullcontext()
    with ctx as prof:
        total = steps(args.steps, args.size)
    # every rank applied the same averaged gradients, so every rank holds the same weights
    check = tp.tensor([total])
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    same = check.item() == total
    where = "the simulator's --trace file" if simulated else "(no trace requested)"
    if profile:
        os.makedirs(args.trace_dir, exist_ok=True)
        where = os.path.join(args.trace_dir, f"rank{rank}.json")
        prof.export_chrome_trace(where)
    sys.stdout.write(f"traced_run rank {rank}/{world}: {'ok' if same else 'MISMATCH'} timeline in {where}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
