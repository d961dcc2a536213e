"""Two checkouts of this repository side by side: the simulator's small all_reduce at W=4 in each.

For changes on the simulator's hot path (a scheduling point, a work object): run the same
workload on the old tree and the new one, alternating, in one run, and print both medians and
the ratio (so machine load affects both alike)::

    git worktree add /tmp/old <commit>
    python bench/bench_checkouts.py /tmp/old .            # old vs this tree
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import gc, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch, simulator, tensorplay.distributed as dist
n = int(sys.argv[2])
def body():
    x = torch.ones(1000)
    for _ in range(n):
        dist.all_reduce(x)
simulator.run(body, 4)
ts = []
for _ in range(5):
    gc.collect(); t = time.perf_counter(); simulator.run(body, 4); ts.append(time.perf_counter() - t)
assert simulator.__file__.startswith(sys.argv[1]), simulator.__file__
print(statistics.median(ts) / n * 1e6)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--calls", type=int, default=1000, help="all_reduces per run (default 1000)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ns = ap.parse_args()
    res: dict[str, list[float]] = {ns.old: [], ns.new: []}
    for _ in range(ns.rounds):
        for tree in (ns.old, ns.new):
            # an absolute path: the child runs from / and checks that it imported this tree
            out = subprocess.run([sys.executable, "-c", _CHILD, os.path.abspath(tree), str(ns.calls)],
                                 capture_output=True, text=True, timeout=600, cwd="/")
            if out.returncode:
                raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
            res[tree].append(float(out.stdout.strip().splitlines()[-1]))
    old, new = statistics.median(res[ns.old]), statistics.median(res[ns.new])
    print(f"W=4 all_reduce of 1e3 float32, coop, us per collective (median of {ns.rounds} alternating rounds)")
    print(f"  old {ns.old}: {old:8.1f}")
    print(f"  new {ns.new}: {new:8.1f}")
    print(f"  new / old   : {new / old:8.2f}")


if __name__ == "__main__":
    main()
