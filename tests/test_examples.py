"""Every example runs both ways, at small size: on simulated ranks (python -m simulator) and on real gloo
processes (torchrun), and reports success on every rank."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _support.net import run_bounded, torchrun

TIMEOUT_S = 180

EXAMPLES = {
    # name: (extra args, line rank r of w must print)
    "data_parallel": ([], "data_parallel rank {r}/{w}: ok"),
    "tensor_parallel_mlp": ([], "tensor_parallel_mlp rank {r}/{w}: ok"),
    "traced_run": (["--steps", "2", "--size", "64"], "traced_run rank {r}/{w}: ok"),
    "parameter_server": (["--steps", "2"], "parameter_server {role}: ok"),
}


def _expected(line: str, r: int, w: int) -> str:
    return line.format(r=r, w=w, role="trainer" if r == 0 else f"server worker{r}")


def _check(proc: subprocess.CompletedProcess, line: str, world: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out}"
    for r in range(world):
        assert _expected(line, r, world) in proc.stdout, out


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_on_simulated_ranks(name: str, tmp_path: Path) -> None:
    extra, line = EXAMPLES[name]
    trace = tmp_path / "trace.json"
    proc = run_bounded([sys.executable, "-m", "simulator", "--nproc-per-node", "4", "--trace", str(trace),
                        f"examples/{name}.py", *extra], TIMEOUT_S)
    _check(proc, line, 4)
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    ops = {e["name"] for e in events if e.get("ph") == "X"}
    assert ops, "the simulator's timeline has no op events"
    if name == "parameter_server":  # RPC traffic is on the timeline too
        assert ops & {"rpc_sync", "rpc_async", "remote"}, ops


@pytest.mark.gloo
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_under_torchrun(name: str, tmp_path: Path) -> None:
    extra, line = EXAMPLES[name]
    if name == "traced_run":
        extra = [*extra, "--trace-dir", str(tmp_path)]
    proc = torchrun(f"examples/{name}.py", *extra, timeout=TIMEOUT_S)
    _check(proc, line, 2)
    if name == "traced_run":
        for r in range(2):
            names = {e.get("name", "") for e in json.loads((tmp_path / f"rank{r}.json").read_text())["traceEvents"]}
            assert any("all_reduce" in n for n in names), sorted(names)[:20]
