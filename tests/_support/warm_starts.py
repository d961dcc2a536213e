"""Test helper: run ``python -m MODULE ARGS`` in a fresh interpreter that counts the warm interpreters it starts
(no tests here).

:func:`run_counting` returns the process, how many warm interpreters it started, for how many distinct hash seeds,
and how many before a given module was imported (``torch`` for the command line, the test file for pytest): a world
that found the interpreters started ahead for it starts none of its own, so all of them were started ahead.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_COUNTING = r"""
import atexit, runpy, sys
from simulator.isolation import warm
started = []
spawn = warm.WarmPool._spawn
ahead_of = sys.argv[2]  # a module: how many were started before it was imported
warm.WarmPool._spawn = lambda self, env: started.append((env["PYTHONHASHSEED"], ahead_of not in sys.modules)) or \
    spawn(self, env)
if __name__ == "__main__":  # (rank processes import this file as their __main__ too)
    atexit.register(lambda: print(f"WARM-STARTS {len(started)} {len(set(started))} "
                                  f"{sum(ahead for _, ahead in started)}", file=sys.stderr))
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def run_counting(cwd: Path, module: str, args: list[str], ahead_of: str, env: dict[str, str] | None = None,
                 timeout: float = 300.0) -> tuple[subprocess.CompletedProcess, tuple[int, int, int] | None]:
    """Run ``python -m module *args`` in ``cwd``: (the process, (warm interpreters started, distinct hash seeds,
    how many of them were started before the module ``ahead_of`` was imported))."""
    (cwd / "_count_warm.py").write_text(_COUNTING)
    full = dict(os.environ if env is None else env)
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), full.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "_count_warm.py", module, ahead_of, *args], cwd=cwd, env=full, capture_output=True,
                       text=True, timeout=timeout)
    m = re.search(r"WARM-STARTS (\d+) (\d+) (\d+)", p.stderr)
    return p, (int(m[1]), int(m[2]), int(m[3])) if m else None
