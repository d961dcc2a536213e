"""Benchmarks of the simulator, with the reference figures measured side by side in the same run.

Three parts (``python bench/bench_sim.py``; ``--quick`` for a smaller run):

1. **small all_reduce, W=4**: 1000 all_reduces of 1e3 float32 on the simulator
   (coop and threads) vs 4 gloo processes on loopback (raw torch.distributed,
   spawned with ``multiprocess``, ``tcp://127.0.0.1:<free port>``).  Wall time
   per collective (slowest rank), ratio to gloo, and the simulator's CPU time
   per collective (whole process, all ranks together) and per rank-call.
2. **scale**: W = 64, 256, 1024, 4096 ranks, each in a fresh child process:
   world start-up (run() called -> the first rank out of a first barrier),
   all_reduces of 1e3 float32 (first rank out of the barrier before it -> last
   rank leaving; the first one and the median of five), peak resident memory
   and the growth per rank.
   Beside it, the floor of the design: W bare Python threads passing a lock
   round a ring (a coop hand-off's OS wake-up and GIL hand-off, and nothing
   else) plus the simulator's per-call cost at W=1, times W.
3. **large all_reduce**: 16 MiB per rank at W=8 vs the memory-copy bound: the
   bytes the reference must move (read W inputs, write W outputs = copying
   W x 16 MiB) divided by the bandwidth of copying W separate 16 MiB buffers,
   measured in the same run.

Targets (issue 23): sim >= 50x faster than gloo and <= 50 us of CPU per
4-rank collective; one all_reduce at 1024 ranks <= 0.1 s, at 4096 <= 0.5 s,
start-up <= 2 s; large all_reduce within 2x of the copy bound.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import simulator  # noqa: E402
import tensorplay.distributed as dist  # noqa: E402
from tensorplay.testing import free_port  # noqa: E402


# ---------------------------------------------------------------------------
# 1. small all_reduce at W=4
# ---------------------------------------------------------------------------
def _sim_small(mode: str, calls: int) -> dict:
    def fn():
        x = torch.ones(1000)
        for _ in range(20):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(x)
        return t0, time.perf_counter()

    gc.collect()  # start both sides without the import-time garbage (a full collection costs ~45 ms here)
    c0 = time.process_time()
    res = simulator.run(fn, 4, mode=mode, timeout=600)
    cpu = time.process_time() - c0
    wall = max(b for _, b in res) - min(a for a, _ in res)
    return {"wall_per_call_s": wall / calls, "cpu_per_call_s": cpu / (calls + 21)}


def _gloo_worker(rank: int, world: int, port: int, calls: int, q) -> None:
    import time as _t

    import torch as _torch
    import torch.distributed as _d

    _d.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = _torch.ones(1000)
    for _ in range(20):
        _d.all_reduce(x)
    gc.collect()
    _d.barrier()
    t0 = _t.perf_counter()
    for _ in range(calls):
        _d.all_reduce(x)
    t1 = _t.perf_counter()
    q.put((rank, t1 - t0))
    _d.destroy_process_group()


def _gloo_small(calls: int, world: int = 4) -> dict:
    import multiprocess as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, port, calls, q)) for r in range(world)]
    for p in procs:
        p.start()
    times = [q.get(timeout=600)[1] for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return {"wall_per_call_s": max(times) / calls}


# ---------------------------------------------------------------------------
# 2. scale (one child process per world size, for a clean peak-memory figure)
# ---------------------------------------------------------------------------
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


_SCALE_REPS = 5  # all_reduces per world: the first (cold) one and the median are reported


def _scale_child(w: int, mode: str) -> dict:
    base = _rss_kib("VmRSS")

    def fn():
        x = torch.ones(1000)
        out = []
        for _ in range(_SCALE_REPS):
            dist.barrier()
            ta = time.perf_counter()
            dist.all_reduce(x)
            out.append((ta, time.perf_counter()))
        return out

    t0 = time.perf_counter()
    res = simulator.run(fn, w, mode=mode, timeout=600)
    total = time.perf_counter() - t0
    first_ready = min(r[0][0] for r in res)
    # each all_reduce: the first rank out of the barrier before it -> the last rank out of the all_reduce
    each = [max(r[i][1] for r in res) - min(r[i][0] for r in res) for i in range(_SCALE_REPS)]
    peak = _rss_kib("VmHWM")
    return {"world_size": w, "mode": mode, "startup_s": first_ready - t0,
            "all_reduce_s": each[0], "all_reduce_median_s": statistics.median(each), "run_total_s": total,
            "peak_rss_mib": peak / 1024, "base_rss_mib": base / 1024, "kib_per_rank": (peak - base) / w}


def _scale(sizes: list[int], modes: list[str]) -> list[dict]:
    out = []
    for w in sizes:
        for mode in modes:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--scale-child", str(w), mode],
                               capture_output=True, text=True, timeout=900)
            if p.returncode != 0:
                out.append({"world_size": w, "mode": mode, "error": p.stderr.strip().splitlines()[-1:]})
            else:
                out.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return out


def _floor_child(w: int, rounds: int = 4) -> dict:
    """What this design cannot go below: ``w`` bare Python threads passing one lock-baton round a ring (each
    pass is one OS wake-up and one GIL hand-off, as a coop hand-off is), and the simulator's own per-call cost
    with nobody to wait for (one rank)."""
    import threading

    threading.stack_size(256 << 10)  # as the simulator's rank threads above 64 ranks
    locks = [threading.Lock() for _ in range(w)]
    for lk in locks:
        lk.acquire()

    def ring(i: int) -> None:
        for _ in range(rounds):
            locks[i].acquire()
            locks[(i + 1) % w].release()

    ts = [threading.Thread(target=ring, args=(i,)) for i in range(w)]
    for t in ts:
        t.start()
    time.sleep(0.2 + w / 4096)  # every thread asleep on its lock
    t0 = time.perf_counter()
    locks[0].release()
    for t in ts:
        t.join()
    per_pass = (time.perf_counter() - t0) / (w * rounds)

    def one_rank(n: int) -> float:
        x = torch.ones(1000)
        for _ in range(200):
            dist.all_reduce(x)
        t = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        return (time.perf_counter() - t) / n

    call = simulator.run(one_rank, 1, args=(5000,))[0]
    return {"world_size": w, "handoff_s": per_pass, "call_s": call, "floor_s": w * (per_pass + call)}


# ---------------------------------------------------------------------------
# 3. large all_reduce vs the memory-copy bound
# ---------------------------------------------------------------------------
def _large(w: int = 8, mib: int = 16, reps: int = 5) -> dict:
    """Median sim all_reduce time vs the median copy bound, sampled alternately (this machine is noisy)."""
    n = mib * 2**20 // 4
    srcs = [torch.full((n,), float(i)) for i in range(w)]
    dsts = [torch.empty(n) for _ in range(w)]

    def copy_bound() -> float:
        t = time.perf_counter()
        for d, s in zip(dsts, srcs):
            d.copy_(s)
        return time.perf_counter() - t

    copy_bound()

    def fn():
        x = torch.full((n,), float(dist.get_rank()))
        ts = []
        for _ in range(2):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            ts.append((t0, time.perf_counter()))
        return ts

    bounds: list[float] = []
    sims: dict[str, list[float]] = {"threads": [], "coop": []}
    for _ in range(reps):
        for mode in ("threads", "coop"):
            bounds.append(copy_bound())  # moving W x S bytes once: the least the reduction must do
            res = simulator.run(fn, w, mode=mode, timeout=600)
            sims[mode].append(max(r[1][1] for r in res) - min(r[1][0] for r in res))  # the warm second call
    bound = statistics.median(bounds)
    out = {"world_size": w, "mib_per_rank": mib, "copy_bound_s": bound,
           "copy_GBps": w * mib * 2**20 / bound / 1e9}
    for mode, ts in sims.items():
        out[f"{mode}_s"] = statistics.median(ts)
        out[f"{mode}_ratio"] = statistics.median(ts) / bound
    return out


# ---------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls and world sizes (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--skip-gloo", action="store_true")
    ap.add_argument("--scale-child", nargs=2, metavar=("W", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--floor-child", type=int, metavar="W", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.scale_child:
        print(json.dumps(_scale_child(int(ns.scale_child[0]), ns.scale_child[1])))
        return
    if ns.floor_child:
        print(json.dumps(_floor_child(ns.floor_child)))
        return

    calls = 200 if ns.quick else 1000
    sizes = [64, 256] if ns.quick else [64, 256, 1024, 4096]
    print(f"# simulator benchmarks  (torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"intra-op threads {torch.get_num_threads()})\n")

    figures: dict = {}
    print(f"## 1. all_reduce of 1e3 float32, W=4, {calls} calls")
    small = {"sim coop": _sim_small("coop", calls), "sim threads": _sim_small("threads", calls)}
    if not ns.skip_gloo:
        small["gloo (4 procs)"] = _gloo_small(calls)
    gloo = small.get("gloo (4 procs)", {}).get("wall_per_call_s")
    print(f"{'backend':<16} {'wall/call':>11} {'vs gloo':>9} {'CPU/collective':>15} {'CPU/rank-call':>14}")
    for name, f in small.items():
        ratio = f"{gloo / f['wall_per_call_s']:.1f}x" if gloo else "-"
        cpu = f.get("cpu_per_call_s")
        cpu_txt = f"{cpu * 1e6:.0f} us" if cpu is not None else "-"
        per_rank = f"{cpu / 4 * 1e6:.0f} us" if cpu is not None else "-"
        print(f"{name:<16} {f['wall_per_call_s'] * 1e6:>8.0f} us {ratio:>9} {cpu_txt:>15} {per_rank:>14}")
    figures["small"] = small

    print("\n## 2. scale: start-up, one all_reduce of 1e3 float32, peak memory")
    rows = _scale(sizes, ["threads", "coop"])
    print(f"{'W':>6} {'mode':<8} {'start-up':>10} {'all_reduce':>11} {f'(median of {_SCALE_REPS})':>16} "
          f"{'peak RSS':>10} {'(base)':>8} {'per rank':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['world_size']:>6} {r['mode']:<8} failed: {r['error']}")
            continue
        print(f"{r['world_size']:>6} {r['mode']:<8} {r['startup_s']:>8.3f} s {r['all_reduce_s']:>9.4f} s "
              f"{r['all_reduce_median_s']:>14.4f} s {r['peak_rss_mib']:>6.0f} MiB {r['base_rss_mib']:>5.0f} MiB "
              f"{r['kib_per_rank']:>5.0f} KiB")
    figures["scale"] = rows

    print("\nfloor of this design (W bare threads passing a lock round a ring: one OS wake-up and GIL hand-off "
          "each; plus the per-call cost at W=1):")
    floors = []
    for w in sizes:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--floor-child", str(w)],
                           capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            print(f"{w:>6} failed: {p.stderr.strip().splitlines()[-1:]}")
            continue
        f = json.loads(p.stdout.strip().splitlines()[-1])
        floors.append(f)
        coop = next((r for r in rows if r.get("world_size") == w and r.get("mode") == "coop" and "error" not in r), None)
        vs = f"   coop median = {coop['all_reduce_median_s'] / f['floor_s']:.2f}x the floor" if coop else ""
        print(f"{w:>6} hand-off {f['handoff_s'] * 1e6:>5.1f} us + call {f['call_s'] * 1e6:>5.1f} us per rank "
              f"= {f['floor_s']:.4f} s per collective{vs}")
    figures["floor"] = floors

    print("\n## 3. all_reduce of 16 MiB per rank, W=8, vs the memory-copy bound")
    large = _large(reps=3 if ns.quick else 5)
    print(f"copy bound (move 8 x 16 MiB once, median): {large['copy_bound_s'] * 1e3:.1f} ms "
          f"({large['copy_GBps']:.1f} GB/s)")
    for mode in ("threads", "coop"):
        print(f"sim {mode:<8} {large[f'{mode}_s'] * 1e3:>7.1f} ms  = {large[f'{mode}_ratio']:.2f}x the bound")
    figures["large"] = large

    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()
