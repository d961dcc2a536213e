"""The contracts of the simulator's pluggable parts, as :class:`typing.Protocol` classes.

:class:`Scheduler` is what the backend, the world and the thread adapter call; both
:class:`~simulator.core.sched.CoopScheduler` (one actor at a time, seeded) and
:class:`~simulator.core.sched.ThreadScheduler` (free-running) implement it, and a test checks that
they do (``isinstance`` against this runtime-checkable protocol, and the signatures).

:class:`Pricing` is what the core reads of a cost model (``run.cost``): the timing wing's
:class:`~simulator.timing.cost.CostModel` implements it, and the world hands it in, so the core never
imports the timing wing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from simulator.core.state import RankState

__all__ = ["Scheduler", "Waitable", "Pricing"]


class Waitable(Protocol):
    """Something an actor can block on: a collective's slot, a posted send/recv, an RPC reply."""

    done: bool


@runtime_checkable
class Scheduler(Protocol):
    """How the actors of one run (ranks, and the threads they start) take turns and wait.

    Every call is made by the actor it names, on its own thread, except :meth:`wake` and
    :meth:`wake_all_blocked` (by whoever completed what the actor waits for, holding :attr:`lock`)
    and :meth:`prepare`/:meth:`kick` (by the thread that runs the world).
    """

    #: guards the shared matching state (slots, mailboxes, actor states)
    lock: ContextManager[Any]
    #: True when only one actor runs at a time, holding a baton (coop): an actor that waits where the
    #: scheduler cannot see it must step out of the schedule, or the others never run
    baton: bool
    #: True when a hand-off moves the process into the next actor's working directory (each rank keeps its own
    #: ``os.chdir``; see simulator.core._handoff.CwdSwap)
    swaps_cwd: bool

    def prepare(self, ranks: list["RankState"]) -> None:
        """Before any rank runs: the ranks of the run, in rank order."""

    def kick(self) -> None:
        """Let the first actor run."""

    def enter_rank(self, rs: "RankState") -> None:
        """``rs``'s thread starts: wait for its first turn."""

    def point(self, rs: "RankState", switch: bool = True) -> None:
        """A scheduling point at the start of every operation (coop: another actor may run first; with
        ``switch=False``, a blocking collective, whose wait follows at once, the actor runs on)."""

    def block(self, rs: "RankState", w: Waitable) -> None:
        """Wait until ``w.done``, or until an incident for ``rs`` (raised as ``rs``'s own exception).

        When every live actor is blocked, nothing can complete: the run declares a deadlock at once
        (by counting, not by a timeout).
        """

    def block_until(self, rs: "RankState", w: Waitable, seconds: float, timed_out: Callable[[], Any]) -> None:
        """:meth:`block`, bounded: after ``seconds`` of wall time ``rs`` fails with ``timed_out()``'s incident."""

    def time_out(self, rs: "RankState", inc: Any) -> None:
        """``rs``'s own operation timed out (the main thread saw its deadline pass): fail its wait with ``inc``."""

    def wake(self, rs: "RankState") -> None:
        """``rs`` may be able to go on (called under :attr:`lock`)."""

    def wake_all_blocked(self, ranks: list["RankState"]) -> None:
        """Release every actor of ``ranks`` (an incident reached them; called under :attr:`lock`)."""

    def exit(self, rs: "RankState") -> None:
        """``rs``'s function returned or raised (or a thread a rank started ended)."""

    def add_thread(self, rs: "RankState") -> None:
        """A rank started a thread: ``rs`` is a new actor with that rank's identity."""

    def leave(self, rs: "RankState") -> None:
        """``rs`` steps out of the schedule around a wait the scheduler cannot see (joining its own threads)."""

    def rejoin(self, rs: "RankState") -> None:
        """``rs`` comes back into the schedule after :meth:`leave`."""


@runtime_checkable
class Pricing(Protocol):
    """How long an operation takes, in virtual seconds (the cost model of a run)."""

    #: the factor on a rank's CPU time when it is charged as compute
    compute_scale: float
    latency_s: float
    bandwidth_Bps: float

    def cost(self, op: str, nbytes: int, group_size: int) -> float:
        """Virtual seconds of operation ``op`` (a backend collective's name, or ``"send"``) on ``nbytes``."""

    def describe(self) -> str:
        """One line naming the model (the trace's header)."""
