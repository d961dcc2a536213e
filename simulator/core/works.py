"""The waits of the engine: a rank's wait on its operation (bounded by the operation's timeout), the work
objects ``async_op=True`` returns, and what a completed operation records (the trace event, the rank's clock).
"""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch

from tensorplay.distributed.backends import Work
from tensorplay.distributed.errors import DistBackendError, DistTypeError, format_message

from simulator.core.clock import OVERLAP_S, charge_compute, reach
from simulator.core.collectives import outputs
from simulator.core.errors import SimError
from simulator.core.state import Incident, P2PRecord, RankCall, RankState, Slot, _local
from simulator.core.trace import Event

__all__ = ["OperationTimeoutError", "GroupTimeout", "CollWork", "P2PWork", "timeout_arg", "caller", "done_with", "notify",
           "observe_coll", "observe_p2p", "wait_too", "wake_others"]

_thread_time = time.thread_time
_perf = time.perf_counter


# ---------------------------------------------------------------------------
# which actor calls: a rank, or a thread the rank started (see simulator/adapters/threads.py)
# ---------------------------------------------------------------------------
class OperationTimeoutError(SimError, DistBackendError, torch.distributed.DistBackendError):
    """An operation waited past its own timeout (its process group's, or ``Work.wait(timeout)``), as gloo's
    ``Timed out waiting ...``; also a ``torch.distributed.DistBackendError``, which torch programs catch."""


class GroupTimeout(timedelta):
    """A bound that is the operation's process group's (the torch adapter passes it when the program gave
    ``Work.wait`` none): its timeout error names the group's setting, not ``Work.wait``'s."""


def timeout_arg(timeout: Any) -> Optional[timedelta]:
    """``Work.wait``'s ``timeout``: a timedelta or seconds, as torch's binding takes (checked before any wait, so
    that a wrong one fails whether the operation is done or not)."""
    if timeout is None or type(timeout) is timedelta:
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        return timedelta(seconds=float(timeout))
    if isinstance(timeout, timedelta):
        return timeout
    raise DistTypeError(format_message(
        "Work.wait", "timeout must be a datetime.timedelta or seconds", values={"timeout": timeout},
        fix="pass e.g. work.wait(timeout=datetime.timedelta(seconds=60)), or no timeout"))


def _block(rs: RankState, w: Any, timeout: Optional[timedelta], name: str) -> None:
    """Wait for ``w``; with a ``timeout`` (the torch adapter passes its group's), fail the wait once it ran out."""
    if timeout is None:
        return rs.run.sched.block(rs, w)
    seconds = timeout.total_seconds()

    def timed_out() -> Incident:
        if isinstance(timeout, GroupTimeout):
            call, whose, fix = f"torch.distributed.{name}", "its process group's timeout", (
                "make every rank of the group call the operation, or pass a longer timeout= to "
                "init_process_group / new_group")
        else:
            call, whose, fix = "Work.wait", "the timeout given for this operation: Work.wait's, or the call's timeout=", (
                f"make every rank of the group call {name}, or pass a longer timeout")
        return Incident(OperationTimeoutError, format_message(
            call, f"Timed out waiting {seconds * 1000:.0f}ms for the other ranks of the group to join {name} "
            f"({whose})", rank=rs.rank, values={"group": list(w.group.ranks), "timeout": timedelta(seconds=seconds)},
            fix=fix))

    if seconds <= 0:  # (a process rank whose turn came after its operation's timeout ran out)
        raise timed_out().make(rs.rank)
    rs.run.sched.block_until(rs, w, seconds, timed_out)


def caller(rs: RankState) -> RankState:
    """The calling thread's actor when it is one of ``rs``'s rank (a rank's threads share its backend and works)."""
    me = _local.__dict__.get("rs")
    return me if me is not None and me is not rs and me.run is rs.run and me.rank == rs.rank else rs


def wait_too(rs: RankState, issuer: RankState, w: Any) -> None:
    """``rs``, another actor of ``issuer``'s rank (a thread waiting on a work the rank's main thread issued), is
    about to wait for ``w``: its completion must wake ``rs`` too (it wakes the issuer only)."""
    if rs is not issuer:
        with rs.run.sched.lock:
            if not w.done:  # (completed meanwhile: the wait sees it done and does not block)
                if w.others is None:
                    w.others = []
                w.others.append(rs)


def wake_others(w: Any, error: Incident | None, source: int | None = None) -> None:
    """``w`` completed: wake the actors :func:`wait_too` registered (under the scheduler's lock)."""
    others, w.others = w.others, None
    for o in others:
        notify(o, w, error, source)
        o.run.sched.wake(o)


def notify(rs: RankState, w: Any, error: Incident | None, source: int | None = None) -> None:
    """``w``, which ``rs`` is blocked on, has completed: tell ``rs.on_complete`` before ``rs`` resumes."""
    hook = rs.on_complete
    if hook is not None and rs.waiting is w:
        hook(error, source)


@contextlib.contextmanager
def own_checks() -> Iterator[None]:
    """The simulator's own questions about completion (a rank process's proxy reporting which works finished, with
    every answer) are no polls of the program's: no scheduling choice, whose number would follow real timing."""
    outer = _local.__dict__.get("own_checks", False)
    _local.own_checks = True
    try:
        yield
    finally:
        _local.own_checks = outer


def _polled(rs: RankState) -> None:
    """The calling actor of ``rs``'s rank asked about an operation that has not completed: let the others run (see
    :meth:`simulator.core.sched._SchedulerBase.poll`)."""
    if _local.__dict__.get("own_checks"):
        return
    me = caller(rs)
    try:
        me.run.sched.poll(me)
    finally:
        done_with(me)


def done_with(rs: RankState) -> None:
    """After an operation of a rank's thread: the thread goes back to running outside the schedule."""
    if rs.parent is not None:
        rs.run.sched.leave(rs)


# ---------------------------------------------------------------------------
# work objects
# ---------------------------------------------------------------------------
def _forget(rs: RankState, work: Work) -> None:
    """A waited async operation leaves its rank's unflushed list (which otherwise keeps every async operation's
    tensors alive until the rank ends: DTensor's functional collectives, one per layer and step)."""
    try:
        rs.unflushed.remove(work)
    except ValueError:
        pass


class CollWork(Work):
    __slots__ = ("_rs", "_slot", "_call")

    def __init__(self, rs: RankState, slot: Slot, call: RankCall) -> None:
        self._rs = rs
        self._slot = slot
        self._call = call

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        timeout = timeout_arg(timeout)
        rs, slot = caller(self._rs), self._slot
        try:
            if self._call.async_op and not self._call.observed:
                charge_compute(rs)  # what the rank computed since the issue ran while the operation did
            if not slot.done:
                wait_too(rs, self._rs, slot)
                _block(rs, slot, timeout, slot.name)
            observe_coll(rs, slot, self._call)
            _forget(self._rs, self)
        finally:
            done_with(rs)
        if slot.error is not None:
            raise slot.error.make(rs.rank)
        return True

    def is_completed(self) -> bool:
        if not self._slot.done:
            _polled(self._rs)
        return self._slot.done

    def is_success(self) -> bool:
        return self._slot.done and self._slot.error is None

    def result(self) -> list[torch.Tensor]:
        return outputs(self._slot.name, self._call.data)


class P2PWork(Work):
    __slots__ = ("_rec",)

    def __init__(self, rec: P2PRecord) -> None:
        self._rec = rec

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        timeout = timeout_arg(timeout)
        rec = self._rec
        rs = caller(rec.rs)
        try:
            if rec.async_op and not rec.observed:
                charge_compute(rs)  # what the rank computed since the issue ran while the operation did
            if not rec.done:
                wait_too(rs, rec.rs, rec)
                _block(rs, rec, timeout, rec.kind)
            observe_p2p(rs, rec)
            _forget(rec.rs, self)
        finally:
            done_with(rs)
        if rec.error is not None:
            raise rec.error.make(rs.rank)
        return True

    def is_completed(self) -> bool:
        if not self._rec.done:
            _polled(self._rec.rs)
        return self._rec.done

    def is_success(self) -> bool:
        return self._rec.done and self._rec.error is None

    def result(self) -> list[torch.Tensor]:
        return [self._rec.tensor] if self._rec.kind == "recv" else []

    def source_rank(self) -> int:
        rec = self._rec
        if rec.kind != "recv":
            return super().source_rank()
        self.wait()
        return rec.source  # type: ignore[return-value]


def observe_coll(rs: RankState, slot: Slot, call: RankCall) -> None:
    """Record the event once and advance the rank's virtual clock to the collective's end."""
    if call.observed:
        return
    call.observed = True
    waited_at = reach(rs, slot.vend)
    g = slot.group
    root = call.key.root
    rs.run.events.append(Event(rs.rank, slot.name, g.ranks, slot.seq, call.nbytes, call.site,
                               None if root is None else g.ranks[root], call.wall_start, _perf(),
                               call.vstart, slot.vend, call.backward,
                               call.async_op and waited_at - call.vstart > OVERLAP_S))
    rs.cpu_mark = _thread_time()


def observe_p2p(rs: RankState, rec: P2PRecord) -> None:
    if rec.observed:
        return
    rec.observed = True
    waited_at = reach(rs, rec.vend)
    if rec.kind == "send":
        peer = rec.dst
    else:
        peer = rec.group.ranks[rec.source] if rec.source is not None else rec.src
    rs.run.events.append(Event(rs.rank, rec.kind, rec.group.ranks, rec.seq, rec.tensor.numel() * rec.tensor.element_size(),
                               rec.site, peer, rec.wall_start, _perf(), rec.vstart, rec.vend, rec.backward,
                               rec.async_op and waited_at - rec.vstart > OVERLAP_S))
    rs.cpu_mark = _thread_time()
