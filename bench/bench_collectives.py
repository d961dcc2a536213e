"""Time every blocking collective through tensorplay.distributed and through raw torch.distributed, on gloo.

Both run in the same rank processes (a :class:`~tensorplay.testing.RankPool`
on 127.0.0.1), interleaved call by call so that other work on the machine
disturbs both alike.  Each call's time is its slowest rank's; the table shows
the median over calls (and the 10th percentile, the least disturbed calls) and
the ratios tensorplay / torch.

``n`` is the number of float32 elements in each rank's tensor: the input of
broadcast / all_reduce / reduce / all_gather* / gather / all_to_all_single,
the output of scatter / reduce_scatter*; list all_to_all sends ``n`` elements
in total, split into ``W`` blocks.

A second table compares a *ragged* list all_to_all (a different block size for
every sender/receiver pair) through tensorplay.distributed, which runs it as
one exchange, with the torch-style emulation by ``W`` scatters of padded blocks.

Usage::

    python bench/bench_collectives.py            # W = 2, 4; n = 1e3, 1e6
    python bench/bench_collectives.py --quick    # fewer rounds, for a smoke run
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

COLLECTIVES = (
    "barrier", "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
)


# ---------------------------------------------------------------------------
# on every rank
# ---------------------------------------------------------------------------
def _pair(name: str, n: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(tensorplay call, raw torch call) for one collective, on freshly allocated float32 buffers."""
    import torch
    import torch.distributed as tdist

    import tensorplay.distributed as dist

    rank, w = dist.get_rank(), dist.get_world_size()
    z = lambda k: torch.zeros(k, dtype=torch.float32)  # noqa: E731  zeros: repeated SUMs stay finite
    x = z(n)
    if name == "barrier":
        return dist.barrier, tdist.barrier
    if name == "broadcast":
        return lambda: dist.broadcast(x, src=0), lambda: tdist.broadcast(x, src=0)
    if name == "all_reduce":
        return lambda: dist.all_reduce(x), lambda: tdist.all_reduce(x)
    if name == "reduce":
        return lambda: dist.reduce(x, dst=0), lambda: tdist.reduce(x, dst=0)
    if name == "all_gather":
        outs = [z(n) for _ in range(w)]
        return lambda: dist.all_gather(outs, x), lambda: tdist.all_gather(outs, x)
    if name == "all_gather_into_tensor":
        out = z(w * n)
        return lambda: dist.all_gather_into_tensor(out, x), lambda: tdist.all_gather_into_tensor(out, x)
    if name == "gather":
        gl = [z(n) for _ in range(w)] if rank == 0 else None
        return lambda: dist.gather(x, gl, dst=0), lambda: tdist.gather(x, gl, dst=0)
    if name == "scatter":
        sl = [z(n) for _ in range(w)] if rank == 0 else None
        return lambda: dist.scatter(x, sl, src=0), lambda: tdist.scatter(x, sl, src=0)
    if name == "reduce_scatter":
        ins = [z(n) for _ in range(w)]
        return lambda: dist.reduce_scatter(x, ins), lambda: tdist.reduce_scatter(x, ins)
    if name == "reduce_scatter_tensor":
        inp = z(w * n)
        return lambda: dist.reduce_scatter_tensor(x, inp), lambda: tdist.reduce_scatter_tensor(x, inp)
    if name == "all_to_all":
        ins, outs = [z(n // w) for _ in range(w)], [z(n // w) for _ in range(w)]
        return lambda: dist.all_to_all(outs, ins), lambda: tdist.all_to_all(outs, ins)
    if name == "all_to_all_single":
        out = z(n)
        return lambda: dist.all_to_all_single(out, x), lambda: tdist.all_to_all_single(out, x)
    raise ValueError(name)


def _ragged_numel(n: int, w: int, s: int, d: int) -> int:
    """Elements sender ``s`` sends receiver ``d``: between 0.5 and 1.5 times n / w, different per pair."""
    return max(1, int(n / w * (0.5 + ((s + 2 * d) % w) / max(w - 1, 1))))


def _ragged_pair(n: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(tensorplay ragged all_to_all, emulation by W scatters of blocks padded to the largest)."""
    import torch
    import torch.distributed as tdist

    import tensorplay.distributed as dist

    rank, w = dist.get_rank(), dist.get_world_size()
    ins = [torch.zeros(_ragged_numel(n, w, rank, d)) for d in range(w)]
    outs = [torch.zeros(_ragged_numel(n, w, s, rank)) for s in range(w)]
    widest = max(_ragged_numel(n, w, s, d) for s in range(w) for d in range(w))
    padded = [torch.zeros(widest) for _ in range(w)]
    slot = torch.zeros(widest)

    def emulated() -> None:
        for src in range(w):
            if src == rank:
                for p, t in zip(padded, ins):
                    p[: t.numel()].copy_(t)
            tdist.scatter(slot, padded if src == rank else None, src=src)
            outs[src].copy_(slot[: outs[src].numel()])

    return lambda: dist.all_to_all(outs, ins), emulated


def bench_rank(jobs: list[tuple[str, int]], budget_s: float,
               max_calls: int) -> dict[tuple[str, int], tuple[list[float], list[float]]]:
    """On every rank: for each (collective, n), the seconds of every timed call of (ours, torch).

    Calls alternate one by one (ours, torch, torch, ours, ...), so a burst of
    other work on the machine hits both sides alike.
    """
    import warnings

    import torch
    import torch.distributed as tdist

    # torch 2.13 deprecates the old names the raw-torch column calls on purpose (what most code uses)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    clock = time.perf_counter
    out = {}
    for name, n in jobs:
        ours, theirs = _ragged_pair(n) if name == "ragged all_to_all" else _pair(name, n)
        for fn in (ours, theirs, ours, theirs):  # warm up: first calls allocate and connect
            fn()
        tdist.barrier()
        t0 = clock()
        ours()
        theirs()
        probe = clock() - t0
        # every rank must make the same number of calls: agree on the smallest estimate
        calls = torch.tensor([max(10, min(max_calls, int(budget_s / max(probe, 1e-6))))])
        tdist.all_reduce(calls, op=tdist.ReduceOp.MIN)
        a, b = [], []
        tdist.barrier()
        for i in range(int(calls.item())):
            first, second = (ours, theirs) if i % 2 == 0 else (theirs, ours)
            t0 = clock()
            first()
            t1 = clock()
            second()
            t2 = clock()
            (a if i % 2 == 0 else b).append(t1 - t0)
            (b if i % 2 == 0 else a).append(t2 - t1)
        out[name, n] = (a, b)
    return out


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------
def _fmt_time(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.3f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short budget per case (a smoke run)")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 1000000])
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of calls per (collective, size); default 2.0, quick 0.3")
    ap.add_argument("--only", nargs="+", default=None, help="collectives to time (default: all, plus ragged)")
    args = ap.parse_args(argv)
    budget = args.budget or (0.3 if args.quick else 2.0)
    max_calls = 200 if args.quick else 2000

    # run the rank function from an importable module (by reference), not from __main__
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_collectives as me
    import torch

    from tensorplay.testing import RankPool

    names = args.only or [*COLLECTIVES, "ragged all_to_all"]
    print(f"# torch {torch.__version__}, gloo on 127.0.0.1, float32; per call the slowest rank counts; "
          f"med = median call, p10 = 10th percentile")
    print(f"{'W':>2} {'collective':<22} {'n':>7} {'calls':>5} {'tp med':>10} {'torch med':>10} {'ratio':>6} "
          f"{'tp p10':>10} {'torch p10':>10} {'ratio':>6}")
    for w in args.world_sizes:
        jobs = []
        for name in names:
            sizes = [0] if name == "barrier" else args.sizes
            jobs += [(name, n) for n in sizes]
        with RankPool(w, call_timeout=3600, pg_timeout=600) as pool:
            per_rank = pool.run(me.bench_rank, jobs, budget, max_calls)
        for name, n in jobs:
            calls = len(per_rank[0][name, n][0])
            ours = sorted(max(r[name, n][0][k] for r in per_rank) for k in range(calls))
            theirs = sorted(max(r[name, n][1][k] for r in per_rank) for k in range(calls))
            med = (statistics.median(ours), statistics.median(theirs))
            p10 = (ours[calls // 10], theirs[calls // 10])
            note = "   (torch column: W scatters)" if name == "ragged all_to_all" else ""
            print(f"{w:>2} {name:<22} {n if n else '-':>7} {calls:>5} {_fmt_time(med[0]):>10} {_fmt_time(med[1]):>10} "
                  f"{med[0] / med[1]:6.2f} {_fmt_time(p10[0]):>10} {_fmt_time(p10[1]):>10} "
                  f"{p10[0] / p10[1]:6.2f}{note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
