"""What tensorplay's pytest plugins cost a project that does not use them.

Run: ``python bench/bench_plugins.py`` (optionally ``--repeat N``).  Makes a throw-away project (a pytest.ini with
``filterwarnings = error``, one trivial test) and prints, best of N, the wall and CPU time of its pytest run with the
plugins loaded (they are pytest11 entry points of the installed package) and with them disabled
(``-p no:...``), the difference, and the import time of the plugin modules alone (pytest already imported).
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLUGINS = ("tensorplay-simulator", "conformance", "simulator.torch_harness")


def _best(cmd: list[str], cwd: str, n: int) -> tuple[float, float, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TENSORPLAY_"))}
    wall, cpu, out = [], [], ""
    for _ in range(n):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        wall.append(time.perf_counter() - t)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}{p.stderr}")
        out = p.stdout
    return min(wall), min(cpu), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    n = ap.parse_args().repeat
    with tempfile.TemporaryDirectory() as d:
        Path(d, "pytest.ini").write_text("[pytest]\nfilterwarnings = error\n")
        Path(d, "test_unrelated.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
        _, _, imp = _best([sys.executable, "-c", "import pytest, time; t = time.perf_counter(); "
                           "import simulator.pytest_plugin, conformance.plugin, simulator.torch_harness; "
                           "print(time.perf_counter() - t)"], d, n)
        run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", d]
        off = [a for p in PLUGINS for a in ("-p", f"no:{p}")]
        w1, c1, out = _best(run, d, n)
        w0, c0, _ = _best(run + off, d, n)
    print(f"import of the three plugin modules (pytest imported): {float(imp) * 1e3:.1f} ms")
    print(f"unrelated project, best of {n}: with the plugins {w1:.2f} s wall / {c1:.2f} s CPU; "
          f"without {w0:.2f} s wall / {c0:.2f} s CPU")
    print(f"added by the plugins: {w1 - w0:+.3f} s wall, {c1 - c0:+.3f} s CPU; warnings in its summary: "
          f"{'yes' if 'warning' in out.lower() else 'none'}")


if __name__ == "__main__":
    main()
