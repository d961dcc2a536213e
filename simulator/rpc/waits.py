"""Waiting for an answer on a simulated rank: futures, pending ``@async_execution`` calls, RNG lending.

The caller's wait is a scheduler wait (:func:`coop_wait`, installed as
tensorplay's ``Future.wait`` hook when this module loads), so a handler may
wait for later requests (an ``@async_execution`` future completed by them)
and a wait nobody can end is reported as a deadlock naming the handler thread.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import torch

from tensorplay.distributed.rpc import futures as _futures
from tensorplay.distributed.rpc.transport import RemoteFailure, async_outcome, future_outcome, is_async
from tensorplay.distributed.rpc.futures import Future

from simulator.core.errors import RankFailedError
from simulator.core.sched import FREE
from simulator.core.state import Incident, current_rank_state

__all__ = ["Answer", "Pending", "FutureWait", "rng_lender", "coop_wait", "resolve_async"]


class Answer(Future):
    """The future of a call's answer.  Its handler always completes it (with the answer or the failure that
    ended the handler), so a wait on it outlives another rank's failure: on TensorPipe a call to a live worker
    is answered whoever else crashed meanwhile."""

    __slots__ = ()


class Pending:
    """An ``@async_execution`` call whose future has not completed yet.

    ``outcome`` completes (on whichever thread completes the function's
    future) with the result or a :class:`RemoteFailure`, as seen by the callee.
    """

    __slots__ = ("outcome",)

    def __init__(self, fut: Any = None, callee: str = "", what: str = "async_execution") -> None:
        self.outcome: Future[Any] = Future(what=what)
        out = self.outcome
        if fut is not None:  # else a placeholder (an RRef's value before its handler ran), completed by hand
            fut.add_done_callback(lambda f: out.set_result(future_outcome(f, callee)))


class FutureWait:
    """What a simulated rank blocked in ``Future.wait`` waits for (read by the deadlock report)."""

    __slots__ = ("done", "what")

    def __init__(self, what: str) -> None:
        self.done = False
        self.what = what

    def describe(self) -> str:
        """The wait, as the deadlock report shows it."""
        if self.what == "async_execution":
            return (f"in {self.what}.wait() (serving a request: the future the @async_execution function "
                    f"returned is not completed and nothing left running can complete it)")
        return (f"in {self.what}.wait() (the future is not completed and nothing left running can complete it; "
                f"an RPC's answer comes from its handler, which runs on a thread of the callee rank: see the "
                f"callee's threads below)")


rng_lender = threading.local()  # .rs: the rank whose torch RNG stream this thread draws from while it serves a call


class _PastDeadline(Exception):
    """A wait on a call that ran past its own timeout (raised in the waiting rank, see :func:`coop_wait`)."""


def _past_deadline() -> Incident:
    return Incident(_PastDeadline, "the call ran past its timeout")


class _WaitOver(Exception):
    """The waiter's own bound (``fut.wait(timeout=...)``) passed; the call itself goes on."""


def _wait_over() -> Incident:
    return Incident(_WaitOver, "the wait ran past its own timeout")


def coop_wait(fut: Future[Any], timeout: float | None) -> bool:
    """A simulated rank waiting for a future hands over to the others until it completes, or until the
    waiter's own ``timeout`` (seconds) passes: then the future is left pending, and the caller raises.

    Returns ``False`` (not waited) when the calling thread is not a simulated rank.
    """
    rs = current_rank_state()
    if rs is None:
        return False
    sched = rs.run.sched
    w = FutureWait(getattr(fut, "_what", "torch.futures.Future"))  # (torch's own futures too: see torch_rpc)

    def wake(_: Any) -> None:
        with sched.lock:
            w.done = True
            sched.wake(rs)

    fut.add_done_callback(wake)
    was_free = rs.state == FREE  # a thread the rank started joins the schedule for the wait, then leaves it
    lender = getattr(rng_lender, "rs", None)  # a handler drawing from its callee's stream: others draw meanwhile
    if lender is not None:
        lender.torch_rng = torch.get_rng_state()
    bound = getattr(fut, "_bound", None)  # the call's own timeout (an RPC's: see SimAgent._send)
    mine = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            try:
                call = None if bound is None or bound[1].done() else bound[0]
                # the nearer of the two deadlines decides which way the wait ends
                if call is not None and (mine is None or call <= mine):
                    left, over = call - time.monotonic(), _past_deadline
                elif mine is not None:
                    left, over = mine - time.monotonic(), _wait_over
                else:
                    left, over = None, _past_deadline
                if left is None:
                    sched.block(rs, w)
                elif left <= 0:
                    raise _WaitOver() if over is _wait_over else _PastDeadline()
                else:
                    sched.block_until(rs, w, left, over)
                break
            except _WaitOver:  # the future stays pending: the caller reports its own bound
                break
            except _PastDeadline:  # the call fails with its timeout here, on the waiting rank: its chain follows
                fut.expire()
                if w.done:
                    break
                bound = None  # (this future hangs on the call through callbacks of the program's: wait for them)
            except RankFailedError:
                if not isinstance(fut, Answer):
                    raise
                if w.done:  # the answer came with the news
                    break
    finally:
        if lender is not None:
            torch.set_rng_state(lender.torch_rng)
        if was_free:
            sched.leave(rs)
    return True


# tensorplay's futures ask this hook first: on a simulated rank their waits go through the scheduler
_futures.coop_wait = coop_wait


def resolve_async(value: Any, fn: Any, callee: str) -> Any:
    """The callee's answer to a call: an async function's completed future is unwrapped, a pending one
    becomes :class:`Pending`, anything else is the value itself."""
    if type(value) is RemoteFailure or not is_async(fn):
        return value
    value = async_outcome(value, fn, callee)
    if type(value) is RemoteFailure:
        return value
    if value.done():
        return future_outcome(value, callee)
    return Pending(value, callee)
