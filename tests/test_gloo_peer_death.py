"""A gloo rank that dies mid-run is named in the other ranks' errors (gloo itself gives only a socket address)."""
from __future__ import annotations

import json
import sys

import pytest

from _support.net import run_ranks

pytestmark = [pytest.mark.gloo,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")]

_PROGRAM = """
import json, os, sys, time
from datetime import timedelta
import torch
import tensorplay.distributed as dist
port, rank = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                        timeout=timedelta(seconds=60))
dist.barrier()
if rank == 2:
    os._exit(3)                      # dies without a word, as a killed process would
time.sleep(1.0)
try:
    dist.all_reduce(torch.ones(4))
    print(json.dumps({"rank": rank, "error": None}), flush=True)
except Exception as e:
    print(json.dumps({"rank": rank, "type": type(e).__name__, "error": str(e)}), flush=True)
time.sleep(3.0)                      # rank 0 serves the store the others read while naming the lost rank
os._exit(0)
"""


def test_the_survivors_error_names_the_rank_that_died(tmp_path) -> None:
    script = tmp_path / "peer_death.py"
    script.write_text(_PROGRAM)
    ranks = run_ranks(str(script), 3)
    outs = [(out, err) for _, out, err in ranks]
    assert ranks[2][0] == 3, outs[2][1][-2000:]
    for r in (0, 1):
        lines = [ln for ln in outs[r][0].splitlines() if ln.startswith("{")]
        assert lines, f"rank {r} printed no outcome; stderr:\n{outs[r][1][-3000:]}"
        rep = json.loads(lines[-1])
        assert rep["error"] is not None, f"rank {r}'s all_reduce succeeded without rank 2"
        assert rep["type"] == "DistBackendError", rep
        assert "rank 2 ended during the call" in rep["error"], rep["error"]
        assert "lost_ranks=[2]" in rep["error"] and "Fix: look at rank 2's own output" in rep["error"], rep["error"]
        # the old advice (a collective-order bug) does not fit a dead peer
        assert "made the same call" not in rep["error"]
