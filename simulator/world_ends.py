"""What a simulated world says about how its run ended, besides its result (part of :mod:`simulator.world`).

A rank that exited non-zero (its status as the OS reports it: the low 8 bits), a thread the operating system refused (the run's own error, with the fix), point-to-point operations that never
met their peer in a run that ended well, and rank threads still executing after a bound ran out (warnings).
"""
from __future__ import annotations

import threading
import warnings
from typing import Any

from tensorplay.distributed.errors import format_message

from simulator.adapters.threads import RankOsExit
from simulator.core.errors import RankExitError, SimError, os_status
from simulator.core.report import _where
from simulator.core.sched import DONE
from simulator.core.state import Incident, Run

__all__ = ["refused_thread", "warn_unmatched_p2p", "warn_still_running"]


def refused_thread(run: Any, started: list[threading.Thread], e: RuntimeError) -> None:
    """The OS refused the thread of rank ``len(started)``: release the ranks started so far, raise why."""
    n, world_size = len(started), len(run.ranks)
    inc = Incident(SimError, format_message(
        "simulator.run", f"the operating system refused to start the thread of rank {n} ({e}): thread ranks need "
        "one thread each", values={"world_size": world_size, "threads_started": n},
        fix="run fewer ranks, or raise the OS's limits on threads (ulimit -u, /proc/sys/kernel/threads-max) and "
            "their memory (a smaller stack_size= takes less per rank)"))
    with run.sched.lock:
        run.abort(inc)
    for t in started:  # (each ends at once: the abort is its first step)
        t.join(5.0)
    raise inc.make(-1) from e


def warn_unmatched_p2p(run: Run) -> None:
    """After a run that ended well: name the sends nobody received (a buffered send, p2p="eager", completes at once)
    and the receives nothing matched (an irecv never waited for), which a real backend would leave pending; and the
    asynchronous collectives some members issued, never waited for, that the others never joined."""
    open_colls = [w for w in run.unwaited if not w._slot.done]
    if open_colls:
        what = "; ".join(f"rank {w._call.rs.rank}'s {w._slot.name} #{w._slot.seq} on group {list(w._slot.group.ranks)} "
                         f"at {w._call.site}" for w in open_colls[:8])
        warnings.warn(format_message(
            "simulator.run", f"{len(open_colls)} asynchronous collective(s) were never waited for and never joined "
            f"by every member before the run ended: {what}",
            fix="issue the collective on every member of the group (and wait for it), or drop it; on gloo and NCCL "
                "it is left pending, and a member can hang at its exit or in destroy_process_group"),
            RuntimeWarning, stacklevel=4)  # (the caller of simulator.run)
    # (a negative tag is the simulator's own, as a failed monitored_barrier leaves pending: not the program's doing)
    left = [r for q in (*run.sends.values(), *run.recvs.values()) for r in q if not (r.tag or 0) < 0]
    if not left:
        return
    what = "; ".join(f"rank {r.rs.rank}'s {r.kind} " + (f"to rank {r.dst}" if r.kind == "send" else
                     f"from {'any rank' if r.src is None else f'rank {r.src}'}") + f" (tag {r.tag}) at {r.site}"
                     for r in left[:8])
    warnings.warn(format_message(
        "simulator.run", f"{len(left)} point-to-point operation(s) never met their peer before the run ended: {what}",
        values={"p2p": run.p2p},
        fix="post the matching recv (or send) on the peer, with the same group and tag, or drop the operation; "
            "on gloo and NCCL an unmatched send or receive is left pending and can hang the process's exit"),
        RuntimeWarning, stacklevel=4)  # (the caller of simulator.run)


def warn_still_running(run: Run) -> None:
    """After a bound ran out: name the rank threads that are still executing (a computation that does not end)."""
    alive = [rs for rs in run.actors if rs.thread is not None and rs.thread.is_alive() and rs.state != DONE]
    if alive:
        where = "; ".join(f"{rs.label} at {_where(rs)}" for rs in alive[:8])
        warnings.warn(format_message(
            "simulator.run", f"{len(alive)} rank thread(s) still running after the run timed out (threads cannot be "
            f"stopped from outside; they are daemons and end when their computation does): {where}",
            fix="make the stuck computation end (it is shown above), or run the program in a separate process"),
            RuntimeWarning, stacklevel=3)


def exit_status(code: Any) -> Any:
    """An exit code as the process's parent would see it (an int keeps its low 8 bits)."""
    return os_status(code) if isinstance(code, int) else code


def exit_error(rs: Any, e: SystemExit) -> RankExitError:
    """The failure of rank ``rs``, which exited with a non-zero status (sys.exit or os._exit)."""
    code = exit_status(e.code)
    how = "os._exit" if isinstance(e, RankOsExit) else "sys.exit / SystemExit"
    if code != e.code:  # (sys.exit(-3): the parent sees 253)
        how += f" with {e.code!r}, which the OS reports as {code}"
    meaning, fix = rs.run.world.exit_codes.get(code if isinstance(code, int) else None, (  # (sys.exit([...]) too)
        "a process that exits non-zero is a failed rank, as under torchrun",
        "return normally (or sys.exit(0)) from every rank, or handle the condition that made it exit"))
    err = RankExitError(format_message("simulator.run", f"rank {rs.rank} exited with code {code!r} ({how}); {meaning}",
                                       rank=rs.rank, values={"exit_code": code, "last_call": rs.last_site}, fix=fix))
    err.exit_code = code
    err.rank = rs.rank
    err.__cause__ = e
    return err
