"""Real rank processes listen on loopback only: the rendezvous store rank 0 serves, and gloo's transport."""
from __future__ import annotations

import os

import pytest

from _net import LOOPBACK, listening

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

    from tensorplay.distributed.pool import _ephemeral_range, free_port

    lo, hi = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    # outside the range the kernel auto-assigns from, so no bind(0) or outgoing connection can take it
    assert all(not lo <= p <= hi for p in ports), (lo, hi, sorted(ports))
    assert len(ports) > 1, ports  # drawn at random, so parallel test workers rarely pick the same one
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
