"""PyTorch's own test harness on simulated ranks vs on real gloo processes: the same test files, side by side.

Run: ``python bench/bench_harness.py [FILE ...]`` (takes a few minutes: the gloo side starts a process per rank per
test); FILE names a case file or one of the two synthetic files (:data:`SYNTHETIC`: 32 trivial tests on 4 ranks,
``MultiProcContinuousTest`` and ``MultiProcessTestCase``, where the per-test cost of each side shows).
Each case file of ``tests/torch_harness_cases/`` (our own small suites on ``MultiProcessTestCase``,
``DTensorTestBase`` and torch's ``distributed_test.py``) runs under pytest in a fresh folder on real processes,
with ``--sim-harness thread`` and with ``--sim-harness process`` (``simulator.harness_diff.run_file``).  Prints each
side's wall time (the whole pytest command), its verdict counts, and the ratios.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulator.harness_diff import run_file  # noqa: E402

CASES = ROOT / "tests" / "torch_harness_cases"
#: distributed_test.py's class holds hundreds of tests; these are the ones tests/test_torch_harness.py compares
DISTRIBUTED_TESTS = ("test_barrier", "test_get_rank", "test_all_reduce_sum", "test_barrier_timeout_global",
                     "test_monitored_barrier_gloo")


_TRIVIAL = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import {base}
from torch.testing._internal.common_utils import run_tests

class Trivial({base}):
{body}

for i in range(32):
    def _case(self, i=i):
{init}        x = torch.tensor(float(self.rank + i))
        dist.all_reduce(x)
        self.assertEqual(x.item(), 6 + 4 * i)
{end}    setattr(Trivial, f"test_{{i:02d}}", _case)

if __name__ == "__main__":
    run_tests()
"""
#: synthetic case files: a class of 32 trivial tests (an all_reduce each) on 4 ranks, on each harness base
SYNTHETIC = {
    "trivial_continuous.py": _TRIVIAL.format(
        base="MultiProcContinuousTest", init="", end="",
        body="    world_size = 4\n    @classmethod\n    def backend_str(cls): return 'gloo'\n"
             "    @classmethod\n    def device_type(cls): return 'cpu'"),
    "trivial_multiprocess.py": _TRIVIAL.format(
        base="MultiProcessTestCase", end="        dist.destroy_process_group()\n",
        init="        dist.init_process_group('gloo', rank=self.rank, world_size=4, init_method=f'file://{self.file_name}')\n",
        body="    world_size = 4\n    def setUp(self):\n        super().setUp()\n        self._spawn_processes()"),
}


def _run(case: str, side: str) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if case in SYNTHETIC:
            (tmp / case).write_text(SYNTHETIC[case])
        else:
            shutil.copy(CASES / case, tmp / case)
        env: dict[str, str] = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        args: list[str] = []
        if case == "case_distributed_test.py":  # what torch's test_distributed_spawn.py sets up
            (tmp / "temp" / "barrier").mkdir(parents=True)
            env.update(BACKEND="gloo", WORLD_SIZE="3", TEMP_DIR=str(tmp / "temp"), INIT_METHOD=f"file://{tmp}/temp/init")
            args = ["-k", " or ".join(DISTRIBUTED_TESTS)]
        out = run_file(tmp / case, side, args, env, timeout=900)
    v = list(out.verdicts.values())
    return out.wall_s, f"{v.count('passed')} passed, {v.count('failed')} failed, {v.count('skipped')} skipped"


def main(argv: list[str]) -> None:
    print(f"{'case file':28} {'gloo processes':>34} {'thread ranks':>34} {'rank processes':>34}")
    for case in argv or sorted(p.name for p in CASES.glob("case_*.py")):
        g_wall, g_sum = _run(case, "gloo")
        cells = [f"{g_wall:7.1f} s ({g_sum:>22})"]
        for side in ("thread", "process"):
            wall, summary = _run(case, side)
            cells.append(f"{wall:6.1f} s {g_wall / wall:5.1f}x ({summary:>18})")
        print(f"{case:28} " + " ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
