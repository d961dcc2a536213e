"""Free loopback ports for test worlds (no third-party imports: usable without the ``testing`` extra)."""
from __future__ import annotations

import random
import socket

__all__ = ["free_port"]


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for auto-assigned ports (Linux); the IANA range elsewhere."""
    try:
        lo, hi = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, chosen outside the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` can be handed out again to any
    socket (a gloo pair, an outgoing connection) before our server binds it; a
    port below the ephemeral range is only ever taken by an explicit bind, so
    the window between this check and the real bind is safe in practice.
    """
    lo, _ = _ephemeral_range()
    rng = random.SystemRandom()  # independent of any seeded RNG the caller uses
    if lo > 11024:
        for _ in range(64):
            port = rng.randrange(10000, lo - 1000)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
