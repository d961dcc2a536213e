"""Real rank processes listen on loopback only: the rendezvous store rank 0 serves, and gloo's transport."""
from __future__ import annotations

import os
import socket

import pytest

pytestmark = [pytest.mark.gloo, pytest.mark.xdist_group("gloo-W2"),
              pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp (Linux)")]


def listening() -> dict:
    """Listening TCP sockets of this process, and the rendezvous port."""
    import tensorplay.distributed as dist

    x = dist.get_rank() * 1.0  # the process group is up
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in open(table).read().splitlines()[1:]:
            parts = line.split()
            if parts[3] != "0A" or parts[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = parts[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:
                addr = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            else:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            found.append((addr, int(hexport, 16)))
    return {"sockets": found, "port": int(os.environ["MASTER_PORT"]), "rank": x}


def test_process_group_listens_on_loopback_only(rank_pool) -> None:
    outs = rank_pool(2).run(listening)
    for out in outs:
        bad = [s for s in out["sockets"] if s[0] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
        assert not bad, f"rank {int(out['rank'])} listens beyond loopback: {bad}"
    assert ("127.0.0.1", outs[0]["port"]) in outs[0]["sockets"], outs[0]
