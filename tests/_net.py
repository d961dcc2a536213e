"""Test helper: the TCP sockets this process listens on (Linux /proc), to check loopback-only binding."""
from __future__ import annotations

import os
import socket

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def listening() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] != "0A" or parts[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = parts[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:
                addr = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            else:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            out.append((addr, int(hexport, 16)))
    return out
