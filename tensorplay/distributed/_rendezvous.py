"""A TCP rendezvous store that listens only where it is told to (loopback by default).

torch's ``TCPStore`` server listens on every interface.  Here rank 0 binds the
socket to the given host itself and hands it to the store, so a world started
on 127.0.0.1 is reachable from this machine only.  Every wait is bounded.
"""
from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from .errors import DistRuntimeError, format_message

__all__ = ["bound_tcp_store"]


def bound_tcp_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta, *,
                    caller: str) -> Any:
    """Rank 0 serves a store on ``host:port`` (bound to ``host`` only); other ranks connect to it."""
    if rank == 0:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise DistRuntimeError(format_message(
                caller, "rank 0 cannot bind the rendezvous address",
                values={"host": host, "port": port, "error": str(e)},
                fix="pick a free port (tensorplay.testing.free_port()) and an address of this machine")) from e
        sock.listen(128)
        return tdist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                              master_listen_fd=sock.detach(), use_libuv=True)
    try:
        return tdist.TCPStore(host, port, world_size, False, timeout)
    except Exception as e:  # noqa: BLE001  torch raises several types for "nobody listens"
        raise DistRuntimeError(format_message(
            caller, "cannot reach rank 0's rendezvous store",
            values={"host": host, "port": port, "rank": rank, "error": str(e)[:200]},
            fix="start rank 0 too, with the same address, within the timeout")) from e
