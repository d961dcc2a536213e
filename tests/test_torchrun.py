"""The example script runs unchanged under torchrun: two real gloo processes, env:// rendezvous."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tensorplay.distributed.pool import free_port

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "allreduce_demo.py"
TIMEOUT_S = 120


@pytest.mark.gloo
def test_torchrun_runs_the_demo_on_two_ranks() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(DEMO)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun did not finish within {TIMEOUT_S}s; output so far:\n{e.stdout}\n{e.stderr}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{output}"
    for rank in (0, 1):
        lines = re.findall(rf"^rank {rank}/2: (\S+) (ok|FAILED)(.*)$", proc.stdout, re.M)
        assert [(what, status) for what, status, _ in lines] == [
            ("all_reduce", "ok"), ("broadcast", "ok"), ("all_gather", "ok"), ("reduce_scatter", "ok")
        ], output
        assert f"rank {rank}/2: all_reduce ok sum=1.0" in proc.stdout, output
    assert "FAILED" not in proc.stdout, output
