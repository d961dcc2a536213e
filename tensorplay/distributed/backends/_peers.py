"""Which rank died: name the lost peer when gloo reports only "Connection closed by peer [addr]:port".

gloo's message names a socket address, which names no rank (it is not even one of the peer's sockets as the
peer sees them).  Every rank therefore publishes, in the default group's store, its host name and process
id at start-up; when a collective fails because a connection closed, the ranks on this host whose process
has ended (or is a zombie awaiting its parent) are the lost ones.  The records are read only when an error
needs them, with a short bound (the store may live on the rank that died).  Ranks on other hosts cannot be
checked this way: the error then says which ranks it could not check.
"""
from __future__ import annotations

import json
import os
import re
import socket
from datetime import timedelta
from typing import Any

__all__ = ["publish", "lost_ranks", "PEER_LOST"]

_KEY = "tensorplay/rank-process/{rank}"
#: gloo's and the OS's ways of saying that the other end of a pair went away
PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe")


def publish(store: Any, rank: int) -> None:
    """Record this rank's host and process id in ``store`` (once, at start-up)."""
    if store is None:
        return
    try:
        store.set(_KEY.format(rank=rank), json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    except Exception:  # noqa: BLE001  diagnosis only: never fail a working world over it
        pass


def _ended(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # an exited child its parent has not reaped yet still answers kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def lost_ranks(store: Any, world_size: int, me: int, bound_s: float = 2.0) -> list[int] | None:
    """The ranks of this host whose process has ended, or ``None`` when the records cannot be read."""
    if store is None:
        return None
    try:
        before = store.timeout
        store.set_timeout(timedelta(seconds=bound_s))
    except Exception:  # noqa: BLE001
        before = None
    try:
        host, dead = socket.gethostname(), []
        for r in range(world_size):
            if r == me:
                continue
            try:
                if not store.check([_KEY.format(rank=r)]):
                    continue
                rec = json.loads(store.get(_KEY.format(rank=r)))
            except Exception:  # noqa: BLE001  the store may have died with its rank
                return None
            if rec.get("host") == host and _ended(int(rec["pid"])):
                dead.append(r)
        return dead
    finally:
        if before is not None:  # the bound is for this lookup only: the group's later store calls keep theirs
            try:
                store.set_timeout(before)
            except Exception:  # noqa: BLE001
                pass
