"""PyTorch's own test harness on simulated ranks vs on real gloo processes: the same test files, side by side.

Run: ``python bench/bench_harness.py`` (takes a few minutes: the gloo side starts a process per rank per test).
Each case file of ``tests/torch_harness_cases/`` (our own small suites on ``MultiProcessTestCase``,
``DTensorTestBase`` and torch's ``distributed_test.py``) runs under pytest twice in a fresh folder: with
``-p simulator.torch_harness --sim-harness thread`` and without it (real processes).  Prints each side's wall
time, its verdict counts, and the ratio.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "torch_harness_cases"
SIM = ["-p", "simulator.torch_harness", "--sim-harness", "thread"]
#: distributed_test.py's class holds hundreds of tests; these are the ones tests/test_torch_harness.py compares
DISTRIBUTED_TESTS = ("test_barrier", "test_get_rank", "test_all_reduce_sum")


def _env(case: str, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "TENSORPLAY_SIM_HARNESS")}
    env.update(PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    if case == "case_distributed_test.py":  # what torch's test_distributed_spawn.py sets up
        (tmp / "temp" / "barrier").mkdir(parents=True, exist_ok=True)
        env.update(BACKEND="gloo", WORLD_SIZE="3", TEMP_DIR=str(tmp / "temp"), INIT_METHOD=f"file://{tmp}/temp/init")
    return env


def _run(case: str, sim: bool) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        shutil.copy(CASES / case, tmp / case)
        nodes = [f"{case}::TestDistBackendWithSpawn::{t}" for t in DISTRIBUTED_TESTS] \
            if case == "case_distributed_test.py" else [case]
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(SIM if sim else []), *nodes]
        t = time.perf_counter()
        p = subprocess.run(cmd, cwd=tmp, env=_env(case, tmp), capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped).*?) in [\d.]+s", p.stdout, re.M)
    return wall, summary[-1] if summary else p.stdout[-200:]


def main() -> None:
    print(f"{'case file':28} {'gloo processes':>34} {'simulated threads':>34} {'ratio':>6}")
    for case in sorted(p.name for p in CASES.glob("case_*.py")):
        g_wall, g_sum = _run(case, sim=False)
        s_wall, s_sum = _run(case, sim=True)
        print(f"{case:28} {g_wall:7.1f} s ({g_sum:>22}) {s_wall:7.1f} s ({s_sum:>22}) {g_wall / s_wall:5.1f}x")


if __name__ == "__main__":
    main()
