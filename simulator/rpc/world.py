"""The RPC world of one simulated run: its agents, RRef counts and barriers.

**Bounded, cooperative waits.**  ``init_rpc`` and ``shutdown`` wait for the
other workers through the simulator's scheduler, so in ``coop`` mode the
waiting rank hands over to the others, and a wait nobody can end is
reported as a deadlock naming who is missing.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Protocol

from tensorplay.distributed.errors import DistValueError
from tensorplay.distributed.rpc import transport as rpc_transport
from tensorplay.distributed.rpc.errors import rpc_message

from simulator.core.protocol import Scheduler
from simulator.core.state import current_rank_state

if TYPE_CHECKING:  # for annotations only: the agent module builds on this one
    from simulator.rpc.agent import SimAgent

__all__ = ["Barrier", "RpcWorld", "world_of", "forget_when_all_out"]


# what this transport uses of the simulator's run and rank state (its whole surface)
class _Run(Protocol):
    seed: int
    cost: Any          # CostModel: .cost("send", nbytes, 2) for a message's transfer
    events: Any        # the trace: .append(Event)
    sched: Scheduler   # the scheduler contract (simulator.core.protocol): lock, block, wake, leave used here
    exit_hooks: list   # called with a rank's state when its thread ends (declared on simulator.core.state.Run)


class _Rank(Protocol):
    rank: int
    run: _Run
    state: int                  # FREE / DONE (sched)
    vt: float                   # the rank's (or actor's) virtual clock; moved through simulator.core.clock
    cpu_mark: float             # the CPU time its last compute was charged at
    torch_rng: Any              # coop mode: the rank's own torch RNG stream
    exc: BaseException | None   # what its function raised


def _on_rank_exit(run: _Run, hook: Callable[[Any], None]) -> None:
    """Have the simulator call ``hook(rank_state)`` when a rank thread of ``run`` ends."""
    run.exit_hooks.append(hook)


class Barrier:
    """A cooperative wait of several workers; ``done`` once every expected worker arrived or died."""

    __slots__ = ("what", "world", "arrived", "waiters", "done", "missing")

    def __init__(self, what: str, world: "RpcWorld") -> None:
        self.what = what
        self.world = world
        self.arrived: set[int] = set()
        self.waiters: list[Any] = []
        self.done = False
        self.missing: list[int] = []

    def describe(self) -> str:
        """The wait, as the simulator's deadlock report shows it."""
        missing = [r for r in range(self.world.size) if r not in self.arrived]
        serving = f", {self.world.handlers} request(s) still being served" if self.world.handlers else ""
        return (f"in rpc.{self.what} (RPC world of {self.world.size}: arrived {sorted(self.arrived)}, "
                f"missing {missing}{serving})")


class RpcWorld:
    """The RPC state of one simulated run: its agents, barriers and rank handles."""

    def __init__(self, run: Any, size: int) -> None:
        self.run = run
        self.size = size
        #: the run's own secret, for members whose environment names none (never leaves this process)
        self.secret = rpc_transport.generate_secret().encode()
        self.lock = threading.RLock()
        self.agents: dict[str, SimAgent] = {}
        self.by_rank: dict[int, SimAgent] = {}
        self.init_barrier = Barrier("init_rpc", self)
        self.shutdown_barrier = Barrier("shutdown", self)
        self.handlers = 0  # requests being served (handler threads running): a graceful shutdown waits for them
        self.next_context = itertools.count(1)

    # -- RRef counting ------------------------------------------------------------
    def retain(self, owner: str, rid: int) -> None:
        """One more reference to RRef ``rid`` of ``owner``."""
        with self.lock:
            a = self.agents.get(owner)
            if a is not None and rid in a.rrefs:
                a.rrefs[rid].count += 1

    def release(self, owner: str, rid: int) -> None:
        """One reference fewer; the owner drops the value with the last one."""
        with self.lock:
            a = self.agents.get(owner)
            slot = a.rrefs.get(rid) if a is not None else None
            if slot is not None:
                slot.count -= 1
                if slot.count <= 0:
                    del a.rrefs[rid]  # type: ignore[union-attr]

    # -- barriers (called with the scheduler's lock held) -----------------------
    def settle(self, b: Barrier) -> None:
        """Complete ``b`` (waking its waiters) if every worker it waits for arrived or left."""
        if b.done:
            return
        gone = {a.rank for a in self.by_rank.values() if not a.thread_alive()}
        if b is self.init_barrier:
            complete = len(b.arrived) == self.size
        else:  # a worker that left (thread ended, or shutdown(graceful=False)) is not waited for
            left = gone | {a.rank for a in self.by_rank.values() if a.closed}
            complete = (self.handlers == 0  # as TensorPipe's graceful shutdown, no request is left unanswered
                        and all(r in b.arrived or r in left or r not in self.by_rank for r in range(self.size)))
            b.missing = sorted(r for r in range(self.size) if r not in b.arrived)
        if complete:
            b.done = True
            for rs in b.waiters:
                self.run.sched.wake(rs)
            b.waiters.clear()

    def wait(self, b: Barrier, rank: int) -> None:
        """Arrive at ``b`` as ``rank`` and wait (cooperatively) until it completes."""
        rs = current_rank_state()
        sched = self.run.sched
        with sched.lock:
            b.arrived.add(rank)
            self.settle(b)
            if not b.done:
                b.waiters.append(rs)
        if not b.done:
            sched.block(rs, b)

    def rank_exited(self, rs: Any) -> None:
        """Simulator hook: a rank thread ended; barriers waiting for it may now complete."""
        with self.run.sched.lock:
            a = self.by_rank.get(rs.rank)
            if a is not None:
                a.exited = True
            self.settle(self.shutdown_barrier)


_worlds: "weakref.WeakKeyDictionary[Any, RpcWorld]" = weakref.WeakKeyDictionary()
_worlds_lock = threading.Lock()


def world_of(rs: Any, size: int) -> RpcWorld:
    """The RPC world of rank state ``rs``'s run (made on first use), which must have ``size`` workers."""
    run = rs.run
    with _worlds_lock:
        w = _worlds.get(run)
        if w is None:
            w = _worlds[run] = RpcWorld(run, size)
            _on_rank_exit(run, w.rank_exited)
        elif w.size != size:
            raise DistValueError(rpc_message(
                "init_rpc", "world_size differs from the one other workers passed",
                values={"world_size": size, "others": w.size}, fix="pass the same world_size on every worker"))
        return w


def forget_when_all_out(world: RpcWorld) -> None:
    """Once every worker is out, a later init_rpc in this run starts a fresh RPC world."""
    with _worlds_lock:
        if all(not a.alive() for a in world.by_rank.values()) and _worlds.get(world.run) is world:
            del _worlds[world.run]
