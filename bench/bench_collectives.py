"""Time every blocking collective through tensorplay.distributed and through raw torch.distributed, on gloo.

Both run in the same rank processes (a :class:`~tensorplay.distributed.pool.RankPool`
on 127.0.0.1), interleaved round by round so machine noise hits both alike.
For each (collective, size) every rank records, per round, the mean time of
``inner`` back-to-back calls (after a barrier).  A round's figure is its
slowest rank's; the table shows the best round (``min``: least disturbed by
other work on the machine, as ``timeit`` does) and the median round, and the
ratios tensorplay / torch of both.

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


def _time_block(fn: Callable[[], Any], inner: int) -> float:
    import torch.distributed as tdist

    tdist.barrier()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def bench_rank(jobs: list[tuple[str, int]], rounds: int,
               budget_s: float) -> dict[tuple[str, int], tuple[list[float], list[float]]]:
    """On every rank: for each (collective, n), seconds per call of (ours, torch), one entry per round."""
    import torch

    torch.set_num_threads(1)
    out = {}
    for name, n in jobs:
        ours, theirs = _ragged_pair(n) if name == "ragged all_to_all" else _pair(name, n)
        for fn in (ours, theirs, ours, theirs):  # warm up: first calls allocate and connect
            fn()
        # enough calls per round that one round takes ~budget_s / rounds, agreed by every rank
        probe = _time_block(ours, 1) + _time_block(theirs, 1)
        inner = torch.tensor([max(1, min(200, int(budget_s / rounds / max(probe, 1e-6))))])
        torch.distributed.all_reduce(inner, op=torch.distributed.ReduceOp.MIN)
        k = int(inner.item())
        a, b = [], []
        for r in range(rounds):
            if r % 2 == 0:
                a.append(_time_block(ours, k))
                b.append(_time_block(theirs, k))
            else:
                b.append(_time_block(theirs, k))
                a.append(_time_block(ours, k))
        out[name, n] = (a, b)
    return out


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------
def _fmt_time(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.3f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds, short budget (a smoke run)")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 1000000])
    ap.add_argument("--rounds", type=int, default=None, help="rounds per (collective, size); default 9, quick 3")
    ap.add_argument("--only", nargs="+", default=None, help="collectives to time (default: all, plus ragged)")
    args = ap.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 9)
    budget = 0.3 if args.quick else 1.5  # seconds per (collective, size, implementation)

    # run the rank function from an importable module (by reference), not from __main__
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_collectives as me

    from tensorplay.distributed.pool import RankPool

    names = args.only or [*COLLECTIVES, "ragged all_to_all"]
    import torch

    print(f"# torch {torch.__version__}, gloo on 127.0.0.1, float32, {rounds} rounds; per round the slowest "
          f"rank counts; best = fastest round, med = median round")
    print(f"{'W':>2} {'collective':<22} {'n':>7} {'tensorplay best':>15} {'torch best':>12} {'ratio':>6} "
          f"{'tp med':>11} {'torch med':>11} {'ratio':>6}")
    for w in args.world_sizes:
        jobs = []
        for name in names:
            sizes = [0] if name == "barrier" else args.sizes
            jobs += [(name, n) for n in sizes]
        with RankPool(w, call_timeout=3600, pg_timeout=600) as pool:
            per_rank = pool.run(me.bench_rank, jobs, rounds, budget)
        for name, n in jobs:
            ours = [max(r[name, n][0][k] for r in per_rank) for k in range(rounds)]
            theirs = [max(r[name, n][1][k] for r in per_rank) for k in range(rounds)]
            best = (min(ours), min(theirs))
            med = (statistics.median(ours), statistics.median(theirs))
            note = "   (torch column: W scatters)" if name == "ragged all_to_all" else ""
            print(f"{w:>2} {name:<22} {n if n else '-':>7} {_fmt_time(best[0]):>15} {_fmt_time(best[1]):>12} "
                  f"{best[0] / best[1]:6.2f} {_fmt_time(med[0]):>11} {_fmt_time(med[1]):>11} "
                  f"{med[0] / med[1]:6.2f}{note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
