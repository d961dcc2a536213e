"""The differential runner: PyTorch distributed test files on real gloo processes and on simulated ranks, verdicts
compared test by test.

Run it on the test files a project already has (PyTorch's own ``test/distributed`` of a checkout at the installed
torch's version, or a library's suites written on ``MultiProcessTestCase``)::

    python -m simulator.harness_diff test/distributed/test_c10d_object_collectives.py test/distributed/tensor
    python -m simulator.harness_diff --isolations process --distributed-test -k "all_reduce or barrier"

Each file runs under pytest three times, in its own folder (so its own ``conftest.py`` applies): as it is (real
gloo processes), with ``--sim-harness thread`` and with ``--sim-harness process``; the verdicts come from pytest's
junit report.  ``--distributed-test`` adds torch's own ``distributed_test.py`` (shipped with torch, under
``torch/testing/_internal/distributed``), set up as PyTorch's ``test_distributed_spawn.py`` sets it up
(``BACKEND=gloo WORLD_SIZE=3``, a file rendezvous).  The report lists, per file, each side's counts and wall time,
the speed-up, and every test whose verdict differs from gloo's with the first line of its failure; the exit status
is 1 when a test that passes on gloo does not pass on a simulated side, so the runner can gate a CI job.
Loopback only: ``GLOO_SOCKET_IFNAME=lo``, ``MASTER_ADDR=127.0.0.1``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple, Sequence

__all__ = ["Side", "run_file", "main"]

ISOLATIONS = ("thread", "process")
_DISTRIBUTED_TEST = '''"""torch's distributed_test.py, as test_distributed_spawn.py runs it (written by simulator.harness_diff)."""
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
'''


class Side(NamedTuple):
    """One run of one file: its name (``gloo``, ``thread``, ``process``), the verdicts, the failures, the wall time."""

    name: str
    verdicts: dict[str, str]  # test id -> passed / failed / skipped
    failures: dict[str, str]  # test id -> the first line of its failure
    wall_s: float
    note: str  # what went wrong with the run itself ("" when pytest wrote its report)


def _verdicts(junit: Path) -> tuple[dict[str, str], dict[str, str]]:
    verdicts: dict[str, str] = {}
    failures: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '?')}"
        bad = [c for c in case if c.tag in ("failure", "error")]
        verdicts[test] = "failed" if bad else "skipped" if any(c.tag == "skipped" for c in case) else "passed"
        if bad:
            text = (bad[0].get("message") or bad[0].text or "").strip().splitlines()
            failures[test] = text[-1][:160] if text else "?"
    return verdicts, failures


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "TENSORPLAY_SIM_HARNESS")}
    env.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", **extra)
    return env


def run_file(path: Path, side: str, pytest_args: Sequence[str] = (), env: dict[str, str] | None = None,
             timeout: float = 3600.0) -> Side:
    """Run the test file ``path`` under pytest on ``side`` (``gloo`` or an isolation), bounded by ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="harness-diff-") as d:
        junit = Path(d) / "junit.xml"
        switch = [] if side == "gloo" else ["-p", "simulator.torch_harness", "--sim-harness", side]
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *switch, f"--junitxml={junit}",
               path.name, *pytest_args]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=path.parent, env=_env(env or {}), capture_output=True, text=True,
                                  timeout=timeout)
            note = ""
        except subprocess.TimeoutExpired:
            proc, note = None, f"did not finish in {timeout:g} s"
        wall = time.perf_counter() - start
        if not junit.exists():
            tail = "" if proc is None else (proc.stdout + proc.stderr)[-300:]
            return Side(side, {}, {}, wall, note or f"pytest wrote no report: {tail}")
        verdicts, failures = _verdicts(junit)
        return Side(side, verdicts, failures, wall, note)


def _count(side: Side) -> str:
    v = list(side.verdicts.values())
    return f"{v.count('passed')} passed, {v.count('failed')} failed, {v.count('skipped')} skipped"


def report(path: str, sides: list[Side]) -> list[str]:
    """Print one file's comparison; return the tests that pass on gloo and not on a simulated side."""
    gloo = sides[0]
    print(f"\n== {path}")
    for s in sides:
        ratio = f"  {gloo.wall_s / s.wall_s:5.1f}x faster than gloo" if s is not gloo and s.wall_s > 0 else ""
        print(f"   {s.name:8} {_count(s):40} {s.wall_s:8.1f} s{ratio}{'  (' + s.note + ')' if s.note else ''}")
    lost = []
    for s in sides[1:]:
        for test, verdict in sorted(s.verdicts.items()):
            want = gloo.verdicts.get(test)
            if want is not None and verdict != want:
                why = s.failures.get(test, "")
                print(f"   {s.name:8} {test}: {verdict} (gloo: {want}) {why}")
                if want == "passed":
                    lost.append(f"{s.name}: {test}")
    return lost


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulator.harness_diff", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", help="test files, or folders of test_*.py files")
    p.add_argument("--isolations", default=",".join(ISOLATIONS),
                   help="simulated sides to run, comma-separated (default: thread,process)")
    p.add_argument("--distributed-test", action="store_true",
                   help="also run torch's own distributed_test.py (BACKEND=gloo WORLD_SIZE=3, file rendezvous)")
    p.add_argument("-k", dest="keyword", default=None, help="pytest's -k, for every file")
    p.add_argument("--timeout", type=float, default=3600.0, help="bound on each pytest run, in seconds")
    ns = p.parse_args(argv)
    isolations = [s for s in ns.isolations.split(",") if s]
    bad = [s for s in isolations if s not in ISOLATIONS]
    if bad:
        p.error(f"--isolations takes {', '.join(ISOLATIONS)}: got {', '.join(bad)}")
    files: list[tuple[Path, dict[str, str]]] = []
    for given in ns.paths:
        path = Path(given).resolve()
        if path.is_dir():
            files += [(f, {}) for f in sorted(path.rglob("test_*.py"))]
        elif path.is_file():
            files.append((path, {}))
        else:
            p.error(f"no such test file or folder: {given}")
    scratch = None
    if ns.distributed_test:
        scratch = Path(tempfile.mkdtemp(prefix="harness-diff-dt-"))
        (scratch / "barrier").mkdir()
        case = scratch / "test_distributed_spawn_sim.py"
        case.write_text(_DISTRIBUTED_TEST)
        files.append((case, {"BACKEND": "gloo", "WORLD_SIZE": "3", "TEMP_DIR": str(scratch),
                             "INIT_METHOD": f"file://{scratch}/init"}))
    if not files:
        p.error("name test files or folders, or --distributed-test")
    args = ["-k", ns.keyword] if ns.keyword else []
    lost: list[str] = []
    try:
        for path, env in files:
            sides = [run_file(path, side, args, env, ns.timeout) for side in ("gloo", *isolations)]
            lost += report(str(path), sides)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{len(lost)} test(s) pass on gloo and not on simulated ranks" + (":" if lost else ""))
    for item in lost:
        print(f"   {item}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
