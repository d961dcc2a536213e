"""Real rank processes listen on loopback only: the rendezvous store rank 0 serves, and gloo's transport."""
from __future__ import annotations

import os

import pytest

from _support.net import LOOPBACK, listening, run_ranks

pytestmark = [pytest.mark.gloo, pytest.mark.xdist_group("gloo-W2"),
              pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp (Linux)")]


def sockets_and_port() -> dict:
    import tensorplay.distributed as dist

    return {"sockets": listening(), "port": int(os.environ["MASTER_PORT"]), "rank": dist.get_rank()}


def test_process_group_listens_on_loopback_only(rank_pool) -> None:
    outs = rank_pool(2).run(sockets_and_port)
    for out in outs:
        bad = [s for s in out["sockets"] if s[0] not in LOOPBACK]
        assert not bad, f"rank {out['rank']} listens beyond loopback: {bad}"
    assert ("127.0.0.1", outs[0]["port"]) in outs[0]["sockets"], outs[0]


def test_free_port_is_bindable_and_outside_the_kernels_ephemeral_range() -> None:
    import socket

    from tensorplay.testing._ports import _ephemeral_range, free_port

    lo, hi = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    # outside the range the kernel auto-assigns from, so no bind(0) or outgoing connection can take it
    assert all(not lo <= p <= hi for p in ports), (lo, hi, sorted(ports))
    assert len(ports) > 1, ports  # drawn at random, so parallel test workers rarely pick the same one
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


_LOCAL_WORLD = """
import json, os, sys
sys.path.insert(0, sys.argv[3])
from _support.net import listening
import tensorplay.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=int(sys.argv[2]), world_size=2)
socks = listening()
dist.barrier()
print(json.dumps({"sockets": socks, "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}))
dist.barrier()
dist.destroy_process_group()
"""


def test_a_loopback_world_without_gloo_socket_ifname_listens_on_loopback_only(tmp_path) -> None:
    """A user's own script (no GLOO_SOCKET_IFNAME): gloo must not listen on the hostname's address."""
    import json

    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "local_world.py"
    script.write_text(_LOCAL_WORLD)
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    for r, (code, out, err) in enumerate(run_ranks(str(script), 2, here, env=env)):
        assert code == 0, err[-2000:]
        rep = json.loads(out.strip().splitlines()[-1])
        bad = [s for s in rep["sockets"] if s[0] not in LOOPBACK]
        assert not bad, f"rank {r} listens beyond loopback: {bad}"
        assert rep["ifname"] is not None and rep["ifname"].startswith("lo")
