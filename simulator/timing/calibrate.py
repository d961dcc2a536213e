"""``python -m simulator calibrate``: measure collectives on real processes and fit a cost profile.

For each world size, a :class:`tensorplay.testing.RankPool` of real processes
(gloo on loopback, or nccl when CUDA is present) runs every collective class
at a sweep of sizes with ``torch.distributed``.  One measurement is a
barrier-aligned loop of ``iters`` calls on every rank (``iters`` picked so a
loop lasts a few milliseconds, the same on every rank); its time per call is
the *slowest* rank's (what the program waits for), and the class's time at
that size is the median over ``repeats`` loops, after ``warmup`` calls.  The
loops of a class go round its sizes ``repeats`` times (not all loops of one
size in a row), so a burst of load on a shared host costs each size one sample.

The fit (:func:`fit_class`) is a non-negative least-squares fit of
``overhead + alpha * L(n) + beta * F(n) * S`` on the relative error (every
point weighs the same in %), for every algorithm the class may use
(:data:`simulator.timing.cost.CLASSES`), with one regime or two (a small/large message
split at one of the measured sizes, kept only when it pays for its three
extra parameters); the best by that criterion wins and every candidate's error
is recorded.  With a single world size, latency steps and per-call overhead
cannot be told apart and the overhead is fixed at 0.  The command then prints
each class's error against the measured points (:func:`fit_report`), a
``WARNING:`` line for a class off by more than :data:`FIT_WARN_REL_ERROR`
somewhere, and how to use the profile.

Example::

    python -m simulator calibrate --backend gloo --world-sizes 2,4 --out profile.json
    python -m simulator --nproc-per-node 4 --cost profile.json --summary train.py
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import platform
import socket
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as tdist

from tensorplay.distributed.errors import DistValueError, format_message

from simulator.timing.cost import ALGORITHMS, CLASSES, ClassCost, CostModel, Regime

__all__ = ["measure", "fit_class", "fit_profile", "fit_report", "calibrate", "machine_info", "main",
           "DEFAULT_SIZES", "QUICK_SIZES", "FIT_WARN_REL_ERROR", "class_nbytes"]

#: bytes swept by default (1 kB .. 10 MB) and in quick mode
DEFAULT_SIZES = (1_000, 4_000, 16_000, 65_536, 262_144, 1_000_000, 4_000_000, 10_000_000)
QUICK_SIZES = (1_000, 100_000)
#: a class whose fit is off by more than this (relative) at some measured point is flagged by a warning line: its
#: predictions are no better than that at those sizes (a noisy machine, or a backend the model does not describe)
FIT_WARN_REL_ERROR = 0.20


# ---------------------------------------------------------------------------
# measuring (runs inside the pool's rank processes)
# ---------------------------------------------------------------------------
def class_nbytes(cls: str, nbytes: int, world_size: int) -> tuple[int, int]:
    """``(elements per rank chunk, bytes as the cost model counts them)`` for float32 tensors of class ``cls``
    near ``nbytes``: the full gathered/scattered size for all_gather, reduce_scatter, gather, scatter and
    all_to_all, one rank's buffer otherwise (what the simulator's backend passes to :meth:`CostModel.cost`)."""
    if cls == "barrier":
        return 0, 0
    if cls in ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all"):
        chunk = max(1, round(nbytes / 4 / world_size))
        return chunk, chunk * 4 * world_size
    n = max(1, round(nbytes / 4))
    return n, n * 4


def _rank_measure(cls: str, sizes: Sequence[int], repeats: int, warmup: int, target_s: float,
                  device: str) -> dict[int, list[float]]:
    """On every rank of the pool: time ``cls`` at each size; per size, the per-call seconds of each loop."""
    rank, w = tdist.get_rank(), tdist.get_world_size()
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def make(nbytes: int) -> Callable[[], None]:
        chunk, _ = class_nbytes(cls, nbytes, w)
        z = lambda k: torch.full((k,), float(rank + 1), device=dev)  # noqa: E731
        if cls == "all_reduce":
            t = z(chunk)
            return lambda: tdist.all_reduce(t)
        if cls == "broadcast":
            t = z(chunk)
            return lambda: tdist.broadcast(t, src=0)
        if cls == "reduce":
            t = z(chunk)
            return lambda: tdist.reduce(t, dst=0)
        if cls == "all_gather":
            inp, out = z(chunk), z(chunk * w)
            return lambda: tdist.all_gather_into_tensor(out, inp)
        if cls == "reduce_scatter":
            inp, out = z(chunk * w), z(chunk)
            return lambda: tdist.reduce_scatter_tensor(out, inp)
        if cls == "all_to_all":
            inp, out = z(chunk * w), z(chunk * w)
            return lambda: tdist.all_to_all_single(out, inp)
        if cls == "gather":
            inp = z(chunk)
            outs = [z(chunk) for _ in range(w)] if rank == 0 else None
            return lambda: tdist.gather(inp, outs, dst=0)
        if cls == "scatter":
            out = z(chunk)
            ins = [z(chunk) for _ in range(w)] if rank == 0 else None
            return lambda: tdist.scatter(out, ins, src=0)
        if cls == "barrier":
            return lambda: tdist.barrier()
        if cls == "p2p":  # ping-pong between ranks 0 and 1: two one-way messages per call
            t = z(chunk)
            if rank == 0:
                return lambda: (tdist.send(t, 1), tdist.recv(t, 1))
            if rank == 1:
                return lambda: (tdist.recv(t, 0), tdist.send(t, 0))
            return lambda: None
        raise ValueError(f"unknown class {cls!r}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renames *_into_tensor/_tensor
        return _time_sizes(make, cls, sizes, repeats, warmup, target_s, sync)


def _time_sizes(make: Callable[[int], Callable[[], None]], cls: str, sizes: Sequence[int], repeats: int,
                warmup: int, target_s: float, sync: Callable[[], None]) -> dict[int, list[float]]:
    ops, iters = {}, {}
    for nbytes in sizes:  # warm-up, and the loop length of each size (agreed: the slowest rank's estimate)
        op = ops[nbytes] = make(nbytes)
        for _ in range(warmup):
            op()
        sync()
        tdist.barrier()
        t0 = time.perf_counter()
        op()
        sync()
        est = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        tdist.all_reduce(est, op=tdist.ReduceOp.MAX)  # every rank runs the same number of iterations
        iters[nbytes] = int(max(1, min(500, target_s / max(est.item(), 1e-7))))
    per_call = 2 if cls == "p2p" else 1
    out: dict[int, list[float]] = {n: [] for n in sizes}
    # repeats interleaved across sizes: a burst of load on a shared host spreads over every size's samples
    # (one sample each) instead of ruining all samples of one size, so the median discards it
    for _ in range(repeats):
        for nbytes in sizes:
            op, n = ops[nbytes], iters[nbytes]
            tdist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                op()
            sync()
            out[nbytes].append((time.perf_counter() - t0) / (n * per_call))
    tdist.barrier()
    return out


def measure(pool: Any, classes: Iterable[str], sizes: Sequence[int], *, repeats: int = 5, warmup: int = 2,
            target_s: float = 0.02, device: str = "cpu", timeout: float = 600.0) -> list[dict[str, Any]]:
    """Time each class at each size on ``pool`` (a started :class:`tensorplay.testing.RankPool`).

    Returns one row per (class, size): ``class``, ``world_size``, ``bytes`` (as the cost model counts them),
    ``median_s`` (median over repeats of the slowest rank's per-call time) and ``samples_s``.
    """
    w = pool.world_size
    rows = []
    for cls in classes:
        csizes = (0,) if cls == "barrier" else tuple(sizes)
        per_rank = pool.run(_rank_measure, cls, csizes, repeats, warmup, target_s, device, timeout=timeout)
        for nbytes in csizes:
            loops = [max(rk[nbytes][i] for rk in per_rank) for i in range(repeats)]  # slowest rank per loop
            rows.append({"class": cls, "world_size": w, "bytes": class_nbytes(cls, nbytes, w)[1],
                         "median_s": statistics.median(loops), "samples_s": loops})
    return rows


# ---------------------------------------------------------------------------
# fitting
# ---------------------------------------------------------------------------
def _nnls(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares with x >= 0 for a handful of columns: the best feasible solution over column subsets."""
    k = a.shape[1]
    best_x, best_r = np.zeros(k), float(np.sum(b * b))
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        sub = a[:, cols]
        if not np.any(sub):
            continue
        x, *_ = np.linalg.lstsq(sub, b, rcond=None)
        if np.any(x < 0):
            continue
        r = float(np.sum((sub @ x - b) ** 2))
        if r < best_r - 1e-18:
            best_x = np.zeros(k)
            best_x[cols] = x
            best_r = r
    return best_x, best_r


def _fit_regime(points: Sequence[tuple[float, int, float]], algorithm: str, upto: float,
                free_overhead: bool) -> tuple[Regime, float]:
    lat, bw = ALGORITHMS[algorithm]
    rows, rhs = [], []
    for s, n, t in points:
        wgt = 1.0 / t  # relative error: every point counts the same in %
        rows.append([wgt if free_overhead else 0.0, lat(n) * wgt, bw(n) * s * wgt])
        rhs.append(1.0)
    x, r = _nnls(np.array(rows), np.array(rhs))
    return Regime(upto, float(x[0]), float(x[1]), float(x[2])), r


def _best_regimes(pts: Sequence[tuple[float, int, float]], algorithms: Sequence[str],
                  free_overhead: bool) -> tuple[str, tuple[Regime, ...], dict[str, float]]:
    """The algorithm and regimes (one, or two split at a measured size) that fit ``pts`` best by AIC."""
    sizes = sorted({s for s, _, _ in pts})
    npts = len(pts)
    best: tuple[float, str, tuple[Regime, ...]] | None = None
    candidates: dict[str, float] = {}
    for algo in algorithms:
        splits: list[float | None] = [None]
        # a split leaves at least two sizes on each side
        splits += [sizes[i] for i in range(2, len(sizes) - 1)] if npts >= 8 else []
        for split in splits:
            if split is None:
                reg, r = _fit_regime(pts, algo, math.inf, free_overhead)
                regimes, k = (reg,), 3
                candidates[algo] = math.sqrt(r / npts)
            else:
                r1, e1 = _fit_regime([p for p in pts if p[0] < split], algo, split, free_overhead)
                r2, e2 = _fit_regime([p for p in pts if p[0] >= split], algo, math.inf, free_overhead)
                regimes, r, k = (r1, r2), e1 + e2, 6
            score = npts * math.log(max(r, 1e-12) / npts) + 2 * k  # AIC: a split must pay for itself
            if best is None or score < best[0]:
                best = (score, algo, regimes)
    _, algo, regimes = best  # type: ignore[misc]  (algorithms is never empty)
    return algo, regimes, candidates


def _sq_rel(cost: ClassCost, pts: Sequence[tuple[float, int, float]]) -> float:
    return sum(((cost.time(s, n) - t) / t) ** 2 for s, n, t in pts)


def fit_class(points: Sequence[tuple[float, int, float]], algorithms: Sequence[str] | None = None,
              *, cls: str = "all_reduce") -> tuple[ClassCost, dict[str, Any]]:
    """Fit one class to ``(bytes, world_size, seconds)`` points; returns the cost and a report of the fit
    (chosen algorithm and split, rms and max relative error, each candidate algorithm's rms error).

    Across world sizes the algorithm and the shared parameters are fitted together (what other world sizes
    use); each measured world size with at least two sizes also gets its own regimes (``by_world``).
    """
    pts = [(float(s), int(n), float(t)) for s, n, t in points if t > 0]
    if not pts:
        raise ValueError(f"fit_class({cls!r}): no positive measurements")
    worlds = sorted({n for _, n, _ in pts})
    algos = list(algorithms or CLASSES.get(cls, ("ring",)))
    algo, regimes, candidates = _best_regimes(pts, algos, len(worlds) > 1)
    by_world: dict[int, tuple[Regime, ...]] = {}
    if len(worlds) > 1:
        for w in worlds:
            wpts = [p for p in pts if p[1] == w]
            if len({p[0] for p in wpts}) >= 2:
                own = _best_regimes(wpts, [algo], False)[1]
                if _sq_rel(ClassCost(algo, own), wpts) < _sq_rel(ClassCost(algo, regimes), wpts):
                    by_world[w] = own  # kept only where it predicts this world size's points better
    cost = ClassCost(algo, regimes, by_world)
    errs = [(cost.time(s, n) - t) / t for s, n, t in pts]
    worst = max(range(len(pts)), key=lambda i: abs(errs[i]))
    shared = ClassCost(algo, regimes)
    shared_errs = [(shared.time(s, n) - t) / t for s, n, t in pts]
    report = {"algorithm": algo, "regimes": len(regimes), "world_sizes": worlds,
              "rms_rel_error": math.sqrt(sum(e * e for e in errs) / len(errs)),
              "max_rel_error": max(abs(e) for e in errs),
              "median_rel_error": statistics.median(abs(e) for e in errs),
              "worst": {"bytes": pts[worst][0], "world_size": pts[worst][1], "rel_error": errs[worst]},
              "shared_fit_rms_rel_error": math.sqrt(sum(e * e for e in shared_errs) / len(shared_errs)),
              "candidates_rms_rel_error": candidates, "overhead_fitted": len(worlds) > 1}
    return cost, report


def fit_profile(rows: Sequence[Mapping[str, Any]]) -> tuple[dict[str, ClassCost], dict[str, Any], list[dict]]:
    """Fit every class present in ``rows`` (from :func:`measure`); returns the classes, the fit reports and
    the rows with ``predicted_s`` and ``error_pct`` added (the residuals)."""
    by_cls: dict[str, list[tuple[float, int, float]]] = {}
    for row in rows:
        by_cls.setdefault(row["class"], []).append((row["bytes"], row["world_size"], row["median_s"]))
    classes, reports = {}, {}
    for cls, pts in by_cls.items():
        classes[cls], reports[cls] = fit_class(pts, cls=cls)
    out = []
    for row in rows:
        pred = classes[row["class"]].time(row["bytes"], row["world_size"])
        out.append({**row, "predicted_s": pred, "error_pct": 100.0 * (pred - row["median_s"]) / row["median_s"]})
    return classes, reports, out


def fit_report(reports: Mapping[str, Mapping[str, Any]], path: str | None = None, *,
               threshold: float = FIT_WARN_REL_ERROR) -> list[str]:
    """The lines ``calibrate`` prints after fitting: per class the algorithm and the model's relative error
    against the measured points (median, max, rms), a ``WARNING`` line for each class whose max error exceeds
    ``threshold``, and, given the profile's ``path``, how to use it."""
    def pct(rep: Mapping[str, Any], key: str) -> str:  # a profile written before a key existed lacks it
        return f"{100 * rep[key]:.1f}%" if isinstance(rep.get(key), (int, float)) else "?"

    lines, bad = [], []
    for cls, rep in reports.items():
        lines.append(f"  {cls:<15} {rep.get('algorithm', '?'):<17} regimes={rep.get('regimes', '?')}  error vs "
                     f"measured: median {pct(rep, 'median_rel_error')}, max {pct(rep, 'max_rel_error')}, "
                     f"rms {pct(rep, 'rms_rel_error')}")
        if rep.get("max_rel_error", 0) > threshold:
            bad.append((cls, rep))
    for cls, rep in bad:
        w = rep.get("worst")
        where = (f"by {100 * w['rel_error']:+.1f}% at {w['bytes']:.0f} bytes, W={w['world_size']}" if w
                 else f"by up to {pct(rep, 'max_rel_error')}")
        lines.append(f"WARNING: {cls}: the fit is off {where} (more than {100 * threshold:.0f}%): predictions of "
                     f"{cls} are unreliable there. Measure again on an idle machine with more --repeats (the "
                     f"spread is in the profile's samples_s), and at the world sizes you will run (--world-sizes)")
    if path is not None:
        lines += ["use it:",
                  f"  python -m simulator --nproc-per-node N --cost {path} --summary script.py",
                  f"  simulator.run(fn, N, cost={path!r})"]
    return lines


# ---------------------------------------------------------------------------
# the whole calibration
# ---------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """What the profile says about the machine it was measured on (the host name only as a hash)."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu_model": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(),
            "hostname_sha256": hashlib.sha256(socket.gethostname().encode()).hexdigest()[:16]}


def calibrate(*, backend: str = "gloo", world_sizes: Sequence[int] = (2, 4), sizes: Sequence[int] = DEFAULT_SIZES,
              repeats: int = 5, warmup: int = 2, classes: Sequence[str] | None = None, target_s: float = 0.02,
              pools: Mapping[int, Any] | None = None, log: Callable[[str], None] | None = None) -> CostModel:
    """Measure and fit; return the calibrated :class:`CostModel` (``meta`` holds the machine, backend, torch
    version, world sizes, raw medians and residuals).  ``pools`` maps a world size to an already started
    pool to use instead of starting one."""
    classes = list(classes or CLASSES)
    bad = sorted(set(classes) - set(CLASSES))
    if bad:
        raise DistValueError(format_message("simulator calibrate", "unknown collective classes",
                                            values={"classes": bad}, fix=f"choose from {sorted(CLASSES)}"))
    if backend not in ("gloo", "nccl"):
        raise DistValueError(format_message("simulator calibrate", "unsupported backend", values={"backend": backend},
                                            fix="pass --backend gloo (or nccl on a machine with GPUs)"))
    if backend == "nccl" and not torch.cuda.is_available():
        raise DistValueError(format_message("simulator calibrate", "backend nccl needs CUDA, and none is available",
                                            values={"backend": backend}, fix="pass --backend gloo"))
    if not world_sizes or any(isinstance(w, bool) or not isinstance(w, int) or w < 2 for w in world_sizes):
        raise DistValueError(format_message("simulator calibrate", "world sizes must be integers >= 2",
                                            values={"world_sizes": list(world_sizes)}, fix="pass --world-sizes 2,4"))
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 4 for s in sizes):
        raise DistValueError(format_message("simulator calibrate", "sizes must be integers >= 4 (bytes)",
                                            values={"sizes": list(sizes)}, fix="pass e.g. --sizes 1000,100000"))
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise DistValueError(format_message("simulator calibrate", "repeats must be an integer >= 1",
                                            values={"repeats": repeats}, fix="pass e.g. --repeats 5"))
    say = log or (lambda s: None)
    device = "cuda" if backend == "nccl" else "cpu"
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for w in world_sizes:
        pool = (pools or {}).get(w)
        own = pool is None
        if own:
            from tensorplay.testing import RankPool  # (lazy: the pools need the optional `multiprocess` extra)

            say(f"starting {w} {backend} processes on loopback")
            pool = RankPool(w, backend)
            pool.start()
        try:
            for cls in classes:
                say(f"W={w} {cls}")
                rows += measure(pool, [cls], sizes, repeats=repeats, warmup=warmup, target_s=target_s, device=device)
        finally:
            if own:
                pool.close()
    fitted, reports, residuals = fit_profile(rows)
    meta = {"backend": backend, "torch_version": torch.__version__, "world_sizes": list(world_sizes),
            "sizes": list(sizes), "repeats": repeats, "warmup": warmup, "machine": machine_info(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "calibration_s": round(time.perf_counter() - t_start, 1),
            "method": "median over repeats of the slowest rank's per-call time in a barrier-aligned loop; "
                      "non-negative least squares on relative error",
            "fit": reports, "measurements": residuals}
    return CostModel(classes=fitted, meta=meta)


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated numbers, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m simulator calibrate ...``; returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m simulator calibrate",
                                description="measure collectives on real processes and write a cost profile")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--world-sizes", default="2,4", type=lambda s: _ints(s, "--world-sizes"),
                   help="comma-separated world sizes (default 2,4)")
    p.add_argument("--sizes", default=None, type=lambda s: _ints(s, "--sizes"),
                   help="comma-separated message sizes in bytes (default 1e3..1e7, 8 sizes)")
    p.add_argument("--repeats", type=int, default=5, help="timed loops per size; the median is kept (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before timing each size (default 2)")
    p.add_argument("--classes", default=None, help=f"comma-separated subset of {','.join(CLASSES)}")
    p.add_argument("--quick", action="store_true",
                   help="a tiny sweep (2 sizes, 3 repeats, short loops): seconds, for tests and smoke checks")
    p.add_argument("--out", required=True, help="where to write the JSON profile")
    ns = p.parse_args(argv)
    sizes = ns.sizes or (list(QUICK_SIZES) if ns.quick else list(DEFAULT_SIZES))
    repeats = 3 if ns.quick and ns.repeats == 5 else ns.repeats
    classes = [c.strip() for c in ns.classes.split(",")] if ns.classes else None
    try:
        model = calibrate(backend=ns.backend, world_sizes=ns.world_sizes, sizes=sizes, repeats=repeats,
                          warmup=ns.warmup, classes=classes, target_s=0.003 if ns.quick else 0.02,
                          log=lambda s: print(f"calibrate: {s}", file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"python -m simulator calibrate: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001  (a rank process failed or timed out: say so, no profile written)
        print(f"python -m simulator calibrate: the measurement failed, no profile written: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    model.save(ns.out)
    print(f"wrote {ns.out}: {model.describe()}")
    print("\n".join(fit_report(model.meta["fit"], ns.out)))
    return 0

