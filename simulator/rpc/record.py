"""One RPC as an event on the simulator's trace, in virtual time from the run's cost model."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from simulator.core.callsite import call_site
from simulator.core.clock import charge_compute, reach
from simulator.core.state import current_rank_state
from simulator.core.trace import Event
from simulator.rpc.codec import Message

if TYPE_CHECKING:  # for annotations only: the agent module builds on this one
    from simulator.rpc.agent import SimAgent

__all__ = ["RpcRecord"]


class RpcRecord:
    """One RPC as an event on the simulator's trace, with virtual time from the run's cost model.

    The call has its own clock ``v``: it starts at the caller's clock after the
    compute since the caller's last operation (as a collective does), takes the
    request's serialisation and transfer and any injected delay (the caller's
    clock follows it that far: sending is the caller's work), then the
    callee's clock when its handler ends (the handler thread starts at the
    request's arrival and takes its own compute), then the answer's transfer.
    ``rpc_sync`` moves the caller's clock to the answer's arrival; an
    ``rpc_async`` caller goes on.  The event (``group = (caller, callee)``,
    ``peer`` the callee, ``seq`` the caller's RPC counter at the call) is
    recorded when the answer arrives.  The caller is the calling thread's actor
    when it belongs to the agent's rank (the rank, a thread of it, a handler
    thread of it), else the agent's rank, whose compute accounting is left alone.
    """

    __slots__ = ("agent", "call", "peer", "rs", "own", "seq", "wall_start", "vstart", "v", "nbytes", "site")

    def __init__(self, agent: SimAgent, call: str, peer: SimAgent) -> None:
        self.agent, self.call, self.peer = agent, call, peer
        me = current_rank_state()
        self.own = me is not None and me.run is agent.rs.run and me.rank == agent.rank
        self.rs = rs = me if self.own else agent.rs
        if self.own:
            charge_compute(rs)
        self.site = call_site(4)  # the program's line that made the call (the agent's and the api's frames skipped)
        agent.rpc_seq += 1
        self.seq = agent.rpc_seq
        self.wall_start = time.perf_counter()
        self.vstart = self.v = rs.vt
        self.nbytes = 0

    def transfer(self, msg: Any) -> None:
        """A message (request or answer) crossed: its bytes and modelled transfer time."""
        if type(msg) is Message or hasattr(msg, "nbytes"):  # (a rank process's message: see isolation.rpc_routes)
            n = msg.nbytes
            self.nbytes += n
            self.v += self.rs.run.cost.cost("send", n, 2)

    def sent(self) -> None:
        """The request left: the caller's clock takes its serialisation, transfer and delay."""
        rs = self.rs
        if self.own:  # serialising is the caller's compute; the call's clock takes it too
            before = rs.vt
            charge_compute(rs)
            self.v += rs.vt - before
        reach(rs, self.v)  # the transfer (and any injected delay) the caller waited for

    def arrived(self) -> None:
        """The caller waited for the answer: its clock moves to the answer's arrival."""
        reach(self.rs, self.v)
        if self.own:
            self.rs.cpu_mark = time.thread_time()  # the wait is not the caller's compute

    def close(self) -> None:
        """The call ended: record its event on the run's trace."""
        rs = self.rs
        rs.run.events.append(Event(rs.rank, self.call, (self.agent.rank, self.peer.rank), self.seq,
                                   self.nbytes, self.site, self.peer.rank, self.wall_start, time.perf_counter(),
                                   self.vstart, self.v, None))
