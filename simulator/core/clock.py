"""The clock rules of virtual time, applied by the engine to every rank (docs/simulator.md "Virtual time").

Clock rules (applied by the backend, see docs/simulator.md "Virtual time"):

* a rank's clock starts at 0 at its first operation (or optimizer step); the
  CPU time before is its start-up, counted apart (in one process only the
  first rank to reach a code path pays torch's one-time costs);
* then it advances by the rank's own CPU time times ``compute_scale``; the CPU
  time a rank spends importing modules is never charged (every real process
  pays its own imports once, but only one simulated rank pays them here);
* an operation starts at the latest of its members' issue times and of the
  free times of the links it uses, and ends ``cost`` later.  Each rank has an
  outgoing and an incoming link (full duplex): a collective occupies both on
  every member, a send the sender's outgoing and the receiver's incoming one.
  So concurrent operations of one rank *serialise* on its links in the order
  they are matched (one group's collectives: issue order);
* ``wait()`` of an ``async_op=True`` operation advances the clock to
  ``max(now, end)``: the compute done since the issue overlaps the transfer.

The cost of an operation comes from the run's cost model (``run.cost``: :class:`simulator.timing.cost.CostModel`,
given by the world); the rules here only move clocks and links, so the core needs nothing of the timing wing.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

__all__ = ["links_start", "links_reserve", "charge_compute", "reach", "OVERLAP_S"]


# ---------------------------------------------------------------------------
# links: when an operation may start on its members' links
# ---------------------------------------------------------------------------
def _links(run: Any) -> list[float]:
    """Per rank ``[out_free, in_free]`` flattened: index ``2r`` is rank r's outgoing link, ``2r+1`` incoming."""
    return run.links


def links_start(run: Any, ranks: Sequence[int], issue: float, *, send: int | None = None,
                recv: int | None = None) -> float:
    """The virtual time an operation may start: ``issue`` or later, once its links are free.

    A collective (``ranks`` given, ``send``/``recv`` None) uses both links of each member; a transfer uses
    ``send``'s outgoing and ``recv``'s incoming link.  Call with the scheduler lock held.
    """
    links = _links(run)
    t = issue
    if send is not None:
        return max(t, links[2 * send], links[2 * recv + 1])  # type: ignore[operator]
    for r in ranks:
        t = max(t, links[2 * r], links[2 * r + 1])
    return t


def links_reserve(run: Any, ranks: Sequence[int], end: float, *, send: int | None = None,
                  recv: int | None = None) -> None:
    """Mark the operation's links busy until ``end`` (after :func:`links_start`; scheduler lock held)."""
    links = _links(run)
    if send is not None:
        links[2 * send] = max(links[2 * send], end)
        links[2 * recv + 1] = max(links[2 * recv + 1], end)  # type: ignore[operator]
        return
    for r in ranks:
        links[2 * r] = max(links[2 * r], end)
        links[2 * r + 1] = max(links[2 * r + 1], end)


# ---------------------------------------------------------------------------
# a rank's own clock: compute charged, waits reached
# ---------------------------------------------------------------------------
#: the Chrome trace shows an ``async_op=True`` operation on the rank's async track when the rank's clock moved
#: more than this between its issue and its wait (torch's synchronous calls are async ones waited at once)
OVERLAP_S = 5e-5


def charge_compute(rs: Any, *, starts: bool = True) -> None:
    """Advance ``rs``'s clock by its CPU time since its mark (times ``compute_scale``), counted as compute.

    A rank's CPU time before its first operation (or optimizer step) is its start-up: counted apart and not
    on the clock, which starts there, at 0, on every rank (as after torchrun's rendezvous).  In one process
    the first rank to reach a code path pays torch's one-time warm-ups (lazy caches, first kernels) for all;
    charging them would make the other ranks "wait" for it in their first operation.  ``starts=False``: the
    rank's end, which starts no clock (a rank that never communicates keeps its compute).
    """
    now = time.thread_time()
    dt = (now - rs.cpu_mark) * rs.run.cost.compute_scale
    rs.cpu_mark = now
    ev = rs.run.events
    if rs.parent is None and not ev.started[rs.rank] and rs.vt == 0.0:
        if starts:
            ev.started[rs.rank] = True
            ev.startup_s[rs.rank] += max(dt, 0.0)
            return
    if dt > 0:
        rs.vt += dt
        ev.compute_s[rs.rank] += dt


def reach(rs: Any, vend: float) -> float:
    """An operation that ends at ``vend`` was waited for: the clock moves to ``max(now, vend)``; the move is
    the rank's exposed communication.  Returns the clock before the move."""
    before = rs.vt
    if vend > before:
        rs.vt = vend
        rs.run.events.exposed_s[rs.rank] += vend - before
    return before
