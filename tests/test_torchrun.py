"""The example script runs unchanged under torchrun: two real gloo processes, env:// rendezvous."""
from __future__ import annotations

import re

import pytest

from _support.net import ROOT, torchrun

DEMO = ROOT / "examples" / "allreduce_demo.py"


@pytest.mark.gloo
def test_torchrun_runs_the_demo_on_two_ranks() -> None:
    proc = torchrun(str(DEMO), timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{output}"
    for rank in (0, 1):
        lines = re.findall(rf"^rank {rank}/2: (\S+) (ok|FAILED)(.*)$", proc.stdout, re.M)
        assert [(what, status) for what, status, _ in lines] == [
            ("all_reduce", "ok"), ("broadcast", "ok"), ("all_gather", "ok"), ("reduce_scatter", "ok")
        ], output
        assert f"rank {rank}/2: all_reduce ok sum=1.0" in proc.stdout, output
    assert "FAILED" not in proc.stdout, output
