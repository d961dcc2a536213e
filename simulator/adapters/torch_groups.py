"""torch process groups over a subset of the simulated ranks (part of :mod:`simulator.adapters.torch_native`).

A launched world of N processes may hold a default process group of its own
for some of them: pytorch/examples' ``ddp_rpc`` starts 4 processes, all join
RPC, and 2 of them call ``init_process_group(rank=r, world_size=2,
init_method="tcp://...")`` and train with DDP.  On simulated ranks such a
claim is a *rendezvous*: the simulated ranks that claim ranks ``0..k-1`` of
the same rendezvous (the same ``init_method`` / ``MASTER_ADDR:MASTER_PORT``
/ store) become its members, in the order of the ranks they claimed.  Waiting
for the other members is a wait the scheduler sees (:meth:`sched.block`), so
a member that never comes is the simulator's deadlock report, never a hang.
A rank process claims its rank through the coordinator (its backend's
``rendezvous``), so its members meet in the same scheduler.
"""
from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

from tensorplay.distributed.errors import DistRuntimeError, DistValueError, format_message

from tensorplay.distributed import state as dist_state

from simulator.core._actor import current_rank_state

__all__ = ["rendezvous_key", "check_url", "join", "reset", "store_key"]

_open: dict[tuple[int, Any], "_Rendezvous"] = {}  # (world, key) -> the rendezvous still gathering its members


def rendezvous_key(url: str | None) -> Any:
    """What identifies a rendezvous: the address (tcp://, env:// from MASTER_ADDR/PORT) or the file."""
    if not url:
        return None
    u = urlparse(url)
    if u.scheme == "env":
        return ("addr", os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""))
    if u.scheme == "tcp":
        return ("addr", u.hostname or "", str(u.port or ""))
    if u.scheme == "file":
        return ("file", u.path)
    return ("url", url)


def check_url(scheme: str, parsed: Any, query: dict[str, str]) -> None:
    """torch's own checks of a file:// or tcp:// rendezvous URL, with its errors: such a URL carries the rank and
    the world size (init_process_group and init_rpc add them when given), a simulated rank's included."""
    if scheme not in ("file", "tcp"):
        return  # (env:// takes them from the environment torchrun sets, and the simulator stands in for torchrun)
    missing = ("path" if scheme == "file" and not parsed.path else
               "port number" if scheme == "tcp" and parsed.port is None else
               "rank parameter" if "rank" not in query else
               "world size parameter" if "world_size" not in query else None)
    if missing is not None:
        raise ValueError(f"{scheme}:// rendezvous: {missing} missing")  # (torch's text and type)


def _label(key: Any) -> str:
    if isinstance(key, tuple) and key and key[0] == "addr":
        return f"{key[1]}:{key[2]}"
    if isinstance(key, tuple) and key and key[0] == "file":
        return f"file://{key[1]}"
    return str(key)


class _Rendezvous:
    """One subset rendezvous: the wait object members block on (``done``, ``describe`` as the reports expect)."""

    def __init__(self, key: Any, world_size: int) -> None:
        self.key = key
        self.world_size = world_size
        self.claims: dict[int, int] = {}  # claimed rank -> simulated rank
        self.waiters: list[Any] = []
        self.done = False
        self.error: str | None = None
        self.name = "init_process_group"

    def describe(self) -> str:
        missing = [r for r in range(self.world_size) if r not in self.claims]
        return (f"in init_process_group's rendezvous at {_label(self.key)} (world_size={self.world_size}; "
                f"claimed ranks {sorted(self.claims)} by simulated ranks "
                f"{[self.claims[r] for r in sorted(self.claims)]}; no rank has claimed {missing})")


def join(world_key: Any, key: Any, rank: int, world_size: int, sim_rank: int, sim_world_size: int) -> tuple[int, ...]:
    """Claim ``rank`` of the ``world_size``-rank group at ``key``; return the members' simulated ranks in rank order.

    Blocks (visibly to the scheduler) until every rank of the group is claimed.
    """
    where = f"rendezvous at {_label(key)}"
    if not 0 <= rank < world_size:
        raise DistRuntimeError(format_message(  # (gloo's own check of it is a RuntimeError)
            "torch.distributed.init_process_group", f"rank {rank} is outside the {where}'s world_size",
            values={"rank": rank, "world_size": world_size, "simulated_rank": sim_rank},
            fix="claim a rank in 0..world_size-1"))
    rs = current_rank_state()
    if rs is None:
        # a rank process: its members meet in the coordinator's scheduler, which the rank's backend asks
        st = dist_state.current()
        ask = getattr(st.backend, "rendezvous", None) if st is not None else None
        if ask is None:  # pragma: no cover  (every simulated rank is a rank thread or a rank process)
            raise DistValueError(format_message(
                "torch.distributed.init_process_group", "a process group over part of the simulated world needs "
                "a simulated rank", values={"world_size": world_size, "simulated_world_size": sim_world_size},
                fix="call it on a rank of simulator.run or python -m simulator"))
        return tuple(ask(key, rank, world_size))
    sched = rs.run.sched
    with sched.lock:
        r = _open.get((id(world_key), key))
        if r is None:
            r = _open[(id(world_key), key)] = _Rendezvous(key, world_size)
        problem = None
        if world_size != r.world_size:
            problem = (f"simulated rank {sim_rank} asks for world_size={world_size} at the {where}, where another "
                       f"rank asked for world_size={r.world_size}", {"world_size": world_size,
                                                                      "other_world_size": r.world_size})
        elif rank in r.claims:
            problem = (f"simulated ranks {r.claims[rank]} and {sim_rank} both claim rank {rank} of the {where}",
                       {"rank": rank, "world_size": world_size, "claimed_by": r.claims[rank],
                        "simulated_rank": sim_rank})
        if problem is not None:
            # every claimant fails with the same message: none of them is left waiting for a group that cannot form
            r.error = format_message(
                "torch.distributed.init_process_group", problem[0], values=problem[1],
                fix="give each process of one rendezvous its own rank in 0..world_size-1, and the same world_size "
                    "(two separate groups need separate init_method addresses / MASTER_PORTs)")
            r.done = True
            del _open[(id(world_key), key)]
            for w in r.waiters:
                sched.wake(w)
            raise DistValueError(r.error)
        r.claims[rank] = sim_rank
        if len(r.claims) == world_size:
            r.done = True
            del _open[(id(world_key), key)]
            for w in r.waiters:
                sched.wake(w)
        else:
            r.waiters.append(rs)
    if not r.done:
        sched.block(rs, r)
    if r.error is not None:
        raise DistValueError(r.error)
    return tuple(r.claims[i] for i in range(world_size))


def reset() -> None:
    """Drop every unfinished rendezvous (the adapter is uninstalled: no world runs)."""
    _open.clear()


def store_key(store: Any) -> Any:
    """Which rendezvous a store stands for: a file store by its file, a TCP store by its address (each rank, or
    rank process, opens its own), else the store itself."""
    inner = getattr(store, "underlying_store", store)
    path = getattr(inner, "path", None)
    if isinstance(path, str):
        return ("file", path)
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    if isinstance(host, str) and isinstance(port, int):
        return ("addr", host, str(port))
    return ("store", id(inner))
