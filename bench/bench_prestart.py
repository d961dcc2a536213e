"""Rank processes' warm interpreters started ahead, or when the first world asks for them: side by side.

Run: ``python bench/bench_prestart.py [REPEATS]`` (about a minute; run it alone: two cores shared with anything
else make the overlap it measures disappear).  Each repeat runs, in fresh interpreters, once with the warm
interpreters started ahead (the default) and once with :meth:`simulator.isolation.warm.WarmPool.prestart` switched
off, alternating:

* ``python -m simulator --isolation process --nproc-per-node 2`` on a one-collective script (the command line
  starts the ranks' interpreters before it imports torch);
* ``pytest -p simulator.torch_harness --sim-harness process`` on a file of 4 trivial ``MultiProcessTestCase`` tests
  of 4 ranks (the plugin starts them before pytest imports the file).

Prints each side's median wall time of the whole command and the ratio.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# runs `python -m MODULE ARGS`; BENCH_NO_PRESTART=1 switches starting ahead off (the world then starts its own)
_WRAPPER = r"""
import os, runpy, sys
from simulator.isolation import warm
if os.environ.get("BENCH_NO_PRESTART") == "1":
    warm.WarmPool.prestart = lambda self, envs: 0
if __name__ == "__main__":  # (rank processes may import this file as their __main__)
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
"""

_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4) * dist.get_rank()
dist.all_reduce(t)
dist.destroy_process_group()
"""

_TESTS = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import run_tests

class Case(MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _one(self):
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}", rank=self.rank, world_size=4)
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        self.assertEqual(t.item(), 6.0)

    test_a = test_b = test_c = test_d = _one

if __name__ == "__main__":
    run_tests()
"""


def _timed(work: Path, args: list[str], prestart: bool) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONHASHSEED="0", BENCH_NO_PRESTART="0" if prestart else "1")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "wrapper.py", *args], cwd=work, env=env, capture_output=True, text=True,
                       timeout=600)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{args} failed:\n{p.stdout}\n{p.stderr}")
    return wall


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "wrapper.py").write_text(_WRAPPER)
        (work / "prog.py").write_text(_SCRIPT)
        (work / "test_four.py").write_text(_TESTS)
        rows = {"python -m simulator --isolation process --nproc-per-node 2 prog.py":
                ["simulator", "--isolation", "process", "--nproc-per-node", "2", "prog.py"],
                "pytest --sim-harness process test_four.py (4 tests, 4 ranks)":
                ["pytest", "-q", "-p", "no:cacheprovider", "-p", "simulator.torch_harness", "--sim-harness",
                 "process", "test_four.py"]}
        print(f"load average at start: {os.getloadavg()[0]:.2f}; {repeats} repeats, medians of wall time")
        for name, args in rows.items():
            ahead, late = [], []
            for _ in range(repeats):
                ahead.append(_timed(work, args, True))
                late.append(_timed(work, args, False))
            a, b = statistics.median(ahead), statistics.median(late)
            print(f"{name}\n    started ahead {a:6.2f} s   started by the first world {b:6.2f} s   ratio {b / a:.2f}x")
        print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
