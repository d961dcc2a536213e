"""The bounds of a run: ``stall_timeout`` on progress (the default) and the optional whole-run ``timeout``.

Deadlocks need no timeout: the scheduler finds them by counting (see :mod:`simulator.core.sched`).  What is left
is an actor that never comes back into the simulator (an endless loop, a long sleep, a wait on something
outside it) while others wait for it.  torch bounds each *operation* by its process-group timeout (30 min by
default), not the program; so does the simulator: the run fails with :class:`SimTimeoutError` when some
actor waits inside an operation and nothing progressed for ``stall_timeout`` seconds.  Progress is an
operation completing or any actor entering or leaving a call into the simulator, so a long program that
keeps calling in is never stopped, and neither is a rank that computes while nobody waits for it.

Accounting costs a clock read and a float store per call: an actor stamps ``rs.stamp`` when it enters an
operation (``sched.point``), when a wait of it ends, and in coop mode when its turn comes back.  (``time.sleep``
and waits the scheduler cannot see are no progress.)  The main thread (``world._serve``) takes the latest
stamp lazily, only once ``stall_timeout`` seems to have passed, so its periodic check is O(1).
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from tensorplay.distributed.errors import DistTypeError, DistValueError, format_message

from simulator.core._actor import BLOCKED, RUNNABLE

if TYPE_CHECKING:  # pragma: no cover
    from simulator.core.state import RankState, Run

__all__ = ["DEFAULT_STALL_TIMEOUT", "BoundNames", "PYTHON", "CLI", "clock", "check_seconds"]

#: torch's default process-group timeout (``torch.distributed.constants.default_pg_timeout``, 30 minutes): how
#: long a torch rank waits in one operation before it fails
DEFAULT_STALL_TIMEOUT = 1800.0
#: the clock of both bounds (monotonic seconds); a test replaces it to compress time (read once per run)
clock = time.monotonic
#: a rank's own backstop acts this long after a bound, if the main thread has not acted yet
GRACE_S = 5.0
_SLICE_MAX_S = 60.0  # the longest a waiting actor sleeps before it checks the bounds itself


class BoundNames(NamedTuple):
    """How the caller spells the two bounds, so a message names the knob they can turn."""

    timeout: str = "timeout"
    stall: str = "stall_timeout"
    sep: str = "="

    def spell(self, which: str, value: float) -> str:
        """``timeout=60`` (Python) or ``--timeout 60`` (the command line)."""
        return f"{getattr(self, which)}{self.sep}{value:g}"

    def knob(self, which: str) -> str:
        """``timeout=`` (Python) or ``--timeout`` (the command line)."""
        return getattr(self, which) + ("=" if self.sep == "=" else "")


PYTHON = BoundNames()
CLI = BoundNames("--timeout", "--stall-timeout", " ")


def check_seconds(value: Any, name: str, *, call: str = "simulator.run", example: str = "600") -> float:
    """``value`` as a bound in seconds: ``None`` and ``inf`` mean no bound (``inf``); else a positive number."""
    if value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DistTypeError(format_message(
            call, f"{name} must be a number of seconds or None", values={name: value},
            fix=f"pass e.g. {name}={example}, or {name}=None for no bound"))
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0:
        raise DistValueError(format_message(
            call, f"{name} must be a positive number of seconds (or None / inf for no bound)", values={name: value},
            fix=f"pass e.g. {name}={example}, or {name}=None for no bound"))
    return seconds


# -- the actors' side -------------------------------------------------------------------------------------------
def wait_slice(run: "Run", rs: "RankState | None") -> float:
    """How long ``rs`` may sleep in a wait before it checks the bounds itself; raises once one ran out.

    The main thread fails a stalled or late run first; this is the backstop should it not (every wait of the
    simulator is bounded, with or without a whole-run ``timeout``).  ``rs=None``: the first slice of any wait.
    """
    now = run.clock()
    left = run.deadline - now + GRACE_S
    if left <= 0 and rs is not None:
        run.local_timeout(rs, "timeout")
    if run.stall < math.inf and run.job_since is None:
        # the main thread's check keeps ``progress_seen`` within a poll of the latest stamp (see check_stall)
        quiet = now - max(run.progress_seen, rs.stamp if rs is not None else now)
        if quiet > run.stall + GRACE_S and rs is not None:
            run.local_timeout(rs, "stall")
        left = min(left, run.stall + GRACE_S - quiet + 0.05)
    return max(0.01, min(left, run.stall / 4, _SLICE_MAX_S))


# -- the main thread's side ---------------------------------------------------------------------------------------
def poll_interval(run: "Run") -> float:
    """How often the main thread checks the bounds: a small fraction of the stall bound, at most a second."""
    return max(0.01, min(run.stall / 8, 1.0))


def expire(run: "Run", now: float) -> float:
    """Main thread: fail the waits whose operation ran past its own timeout (``sched.block_until``); returns how
    long until the next such deadline (inf: none)."""
    nearest = math.inf
    for actor, (deadline, timed_out) in run.deadlines.copy().items():
        if now >= deadline:
            run.deadlines.pop(actor, None)
            run.sched.time_out(actor, timed_out())
        else:
            nearest = min(nearest, deadline - now)
    return nearest


def is_waiting(run: "Run", a: "RankState") -> bool:
    """``a`` waits inside an operation: blocked in one (not in ``Thread.join``, which torch does not bound), or,
    in coop mode, at a scheduling point for its turn while another actor computes."""
    if a.state == BLOCKED:
        return getattr(a.waiting, "actor", None) is None  # a join of the rank's own thread: no operation
    return a.state == RUNNABLE and run.sched.baton and getattr(run.sched, "current", None) is not a


def check_stall(run: "Run", now: float) -> list["RankState"] | None:
    """The actors that wait while nothing progressed for ``stall_timeout`` seconds, or None (main thread)."""
    if now - run.progress_seen < run.stall:
        return None
    actors = run.actors
    latest = max(a.stamp for a in actors)
    if latest > run.progress_seen:
        run.progress_seen = latest
        if now - latest < run.stall:
            return None
    waiting = [a for a in actors if is_waiting(run, a)]
    return waiting or None


#: seconds a coop rank may hold the turn, blocked in the OS, while a thread of its own waits for it, before the
#: run says so (it goes on: the rank may be waiting for something else that will come)
HELD_TURN_WARN_S = 10.0


def watch_turn(run: "Run", now: float) -> "tuple[RankState, RankState, float] | None":
    """Main thread, coop mode on thread ranks: ``(holder, thread, seconds)`` once (then None) when the turn's holder
    has been blocked in the OS (its CPU time does not advance) for ``HELD_TURN_WARN_S`` at the same place while a
    thread of its own rank waits for the turn. That is usually a wait for that thread outside the simulator (a lock
    it holds across an operation), which coop mode cannot run; the stall bound would say so only after 30 minutes
    (the caller warns: see :func:`simulator.core.report.held_turn_warning`)."""
    sched = run.sched
    held = getattr(sched, "current", None)
    asking = getattr(sched, "requests", None)
    # (an actor with on_complete stands for a rank process: its thread here relays, so its CPU clock says nothing)
    if (held is None or not asking or held.state != RUNNABLE or held.on_complete is not None
            or held.thread is None or held.thread.ident is None):
        return None
    root = held.parent or held
    thread = next((a for a in asking if (a.parent or a) is root and a is not held), None)
    if thread is None:
        return None
    try:
        cpu = time.clock_gettime(time.pthread_getcpuclockid(held.thread.ident))
    except (AttributeError, OSError):  # (no per-thread CPU clock here, or the thread just ended)
        return None
    seen = sched.turn_seen
    if seen is None or seen[0] is not held or seen[1] != held.stamp:
        sched.turn_seen = (held, held.stamp, now, cpu, False)
        return None
    _, _, since, cpu0, warned = seen
    if warned or now - since < HELD_TURN_WARN_S or cpu - cpu0 > 0.05 * (now - since):
        return None
    sched.turn_seen = seen[:4] + (True,)
    return held, thread, now - since
