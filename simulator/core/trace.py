"""The event trace of a simulated run, virtual time, and Chrome-trace export.

Every operation a rank issues becomes one :class:`Event`.  Besides wall-clock
times, each event carries *virtual* times from the run's cost model
(:class:`CostModel`, in :mod:`simulator.timing.cost`, calibrated or not): a rank's virtual clock advances by the CPU time it spends
between operations (measured with ``time.thread_time``) and by the modelled
cost of each operation, which ends at the last member's arrival plus its cost.

Example::

    >>> import simulator, tensorplay as tp, tensorplay.distributed as dist
    >>> def step():
    ...     x = tp.ones(1 << 20)
    ...     dist.all_reduce(x)
    >>> simulator.run(step, 4, cost=simulator.CostModel(latency_s=5e-6, bandwidth_Bps=25e9))
    [None, None, None, None]
    >>> tr = simulator.last_trace()
    >>> doc = tr.to_chrome("run.json")        # open in https://ui.perfetto.dev or chrome://tracing
    >>> [e.op for e in tr.events]             # one event per rank and operation
    ['all_reduce', 'all_reduce', 'all_reduce', 'all_reduce']
    >>> round(tr.summary()[0]["comm_s"] * 1e6, 1)   # the model's all_reduce time on rank 0, in microseconds
    281.7
    >>> print(tr.format_summary())            # per rank: communication, exposed communication, compute, step time
    virtual time, uncalibrated alpha-beta model (latency 5e-06 s, 2.5e+10 B/s); compute_scale=1
    rank    ops        bytes startup (s)    comm (s) exposed (s) compute (s)    end (s) steps   step (s)
       0      1      4194304 ...
"""
from __future__ import annotations

import json
import math
import statistics
from collections import deque
from typing import Any, Iterable, NamedTuple

from tensorplay.distributed.errors import DistValueError, format_message

from simulator.core.protocol import Pricing

__all__ = ["Event", "Trace", "EventLog", "DEFAULT_TRACE_LIMIT"]

#: events a run keeps by default (about 300 bytes each, so about 30 MB); older ones are counted, not kept
DEFAULT_TRACE_LIMIT = 100_000

_RPC_OPS = frozenset({"rpc_sync", "rpc_async", "remote"})  # recorded by tensorplay.distributed.rpc on sim
_ASYNC_TID = 100_000  # Chrome-trace thread of rank r's async operations: _ASYNC_TID + r


def _step_time(ends: list[float]) -> float | None:
    """Median time between consecutive step ends (the first step, with start-up in it, left out)."""
    if not ends:
        return None
    if len(ends) == 1:
        return ends[0]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return statistics.median(gaps)


def _non_finite(obj: Any, where: str) -> tuple[str, float] | None:
    """The JSON path and value of the first NaN or infinity in ``obj``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        hit = _non_finite(v, f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}")
        if hit is not None:
            return hit
    return None


def _non_finite_error(doc: dict[str, Any], path: str) -> Exception:
    field, value = _non_finite(doc, "") or ("?", math.nan)
    values: dict[str, Any] = {"path": path, "field": field.lstrip("."), "value": value}
    if field.startswith(".traceEvents["):
        ev = doc["traceEvents"][int(field[len(".traceEvents["):].split("]", 1)[0])]
        tid = ev.get("tid", 0)
        values["event"] = f"{ev.get('name')} on rank {tid % _ASYNC_TID}"
    return DistValueError(format_message(
        "simulator.Trace.to_chrome", "the trace holds a time that is not a finite number, which JSON cannot hold",
        values=values, fix="find what made that operation's time infinite or NaN: the cost model's parameters "
                           "(a profile, CostModel(...)) or a Delay fault's seconds"))


class Event(NamedTuple):
    """One operation as one rank saw it.

    ``seq`` is the group's sequence number for collectives (1-based) and the
    rank's own p2p counter for send/recv.  ``peer`` is the global peer of a
    send/recv (the actual source for an any-source recv), ``root`` the global
    root of rooted collectives, else ``None``.  RPCs (``rpc_sync``,
    ``rpc_async``, ``remote``) are events of the calling rank with ``group =
    (caller, callee)``, ``peer`` the callee, ``seq`` the caller's RPC counter and
    ``nbytes`` the request plus the answer.  ``async_op`` is True for an operation issued with
    ``async_op=True`` that overlapped the rank's work: the rank's clock moved more than
    :data:`simulator.core.clock.OVERLAP_S` between its issue and its wait (torch's synchronous calls are
    asynchronous ones waited for at once, and stay False).
    """

    rank: int
    op: str
    group: tuple[int, ...]
    seq: int
    nbytes: int
    site: str
    peer: int | None
    wall_start: float
    wall_end: float
    vstart: float
    vend: float
    backward: str | None
    async_op: bool = False

    def signature(self) -> tuple:
        """The schedule-determined fields (no times): equal across same-seed runs in coop mode."""
        return (self.rank, self.op, self.group, self.seq, self.nbytes, self.site, self.peer, self.backward)


class EventLog:
    """Where a run records its events: the last ``limit`` kept (a ring buffer, like NCCL's flight recorder), and
    per-rank totals of every event (what the summary needs), so a long run's memory stays bounded.

    ``limit=None`` keeps every event; ``limit=0`` keeps none (the totals are still kept).
    """

    __slots__ = ("kept", "limit", "dropped", "ops", "nbytes", "comm_s", "exposed_s", "compute_s", "steps",
                 "startup_s", "started")

    def __init__(self, world_size: int, limit: int | None = DEFAULT_TRACE_LIMIT) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"simulator.run: trace_limit={limit!r} must be None (keep all), 0 (keep none) or a "
                             f"positive number of events. Fix: pass e.g. trace_limit=100_000")
        self.kept: deque[Event] = deque(maxlen=limit)
        self.limit = limit
        self.dropped = 0
        self.ops = [0] * world_size
        self.nbytes = [0] * world_size
        self.comm_s = [0.0] * world_size
        #: per rank: how far operations moved the clock (the communication the rank's compute did not hide)
        self.exposed_s = [0.0] * world_size
        #: per rank: the CPU time charged to the clock between operations (times compute_scale)
        self.compute_s = [0.0] * world_size
        #: per rank: the clock at the end of each torch.optim step (see simulator.adapters.clock_hooks)
        self.steps: list[list[float]] = [[] for _ in range(world_size)]
        #: per rank: CPU time before its first operation or optimizer step (start-up; not on the clock)
        self.startup_s = [0.0] * world_size
        #: per rank: whether its clock started (at its first operation or optimizer step)
        self.started = [False] * world_size

    def append(self, e: Event) -> None:
        r = e.rank
        self.ops[r] += 1
        self.nbytes[r] += e.nbytes
        self.comm_s[r] += e.vend - e.vstart
        kept = self.kept
        if self.limit is not None and len(kept) == self.limit:
            self.dropped += 1
            if self.limit == 0:
                return
        kept.append(e)

    def __len__(self) -> int:
        return len(self.kept)

    def __iter__(self):
        return iter(self.kept)


class Trace:
    """The events of one run (the last ``trace_limit`` of them), in the order the ranks finished them (a total
    order in coop mode), and per-rank totals over every event."""

    def __init__(self, events: Iterable[Event], world_size: int, *, seed: int, mode: str,
                 cost: Pricing, wall_origin: float, end_vtime: list[float]) -> None:
        self.events: list[Event] = list(events)
        #: events recorded but no longer kept (the run's trace_limit)
        self.dropped = events.dropped if isinstance(events, EventLog) else 0
        self._totals = (events.ops, events.nbytes, events.comm_s) if isinstance(events, EventLog) else None
        self._clock = (events.exposed_s, events.compute_s, events.steps, events.startup_s) \
            if isinstance(events, EventLog) else None
        self.world_size = world_size
        self.seed = seed
        self.mode = mode
        self.cost = cost
        self.wall_origin = wall_origin
        #: each rank's virtual clock when it returned
        self.end_vtime = list(end_vtime)
        #: False when a rank waited on the wall clock outside the schedule (a coop rank's ``time.sleep``): the seed
        #: then replays the schedule only up to that wait; ``nondeterminism`` says where the first one was
        self.deterministic = True
        self.nondeterminism: str | None = None

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self):
        return iter(self.events)

    def by_rank(self, rank: int) -> list[Event]:
        return [e for e in self.events if e.rank == rank]

    def signature(self) -> tuple:
        """Hashable summary of the schedule: equal for two runs with the same seed in coop mode."""
        totals = (tuple(self._totals[0]), tuple(self._totals[1])) if self._totals else ()
        return (self.dropped, totals, *(e.signature() for e in self.events))

    # -- summaries ------------------------------------------------------
    def summary(self) -> list[dict[str, Any]]:
        """Per rank: operations, bytes and the predicted times (virtual seconds).

        * ``comm_s``: the sum of ``vend - vstart`` over the rank's operations: from the issue to the end, so
          the wait for the slowest member plus the modelled transfer (async operations included in full);
        * ``exposed_s``: how far operations moved the rank's clock: the communication its compute did not
          hide (a synchronous operation's whole ``vend - vstart``; an async one's end past its ``wait()``);
        * ``compute_s``: CPU time charged between operations (times ``compute_scale``; imports excluded);
        * ``startup_s``: CPU time before the rank's first operation or optimizer step (times
          ``compute_scale``): start-up, not on the clock, which starts at that first operation;
        * ``end_s``: the clock when the rank returned (the predicted run time from the world's start);
        * ``steps`` / ``step_s``: torch.optim steps the rank took, and the median time between consecutive
          step ends (the first step, which includes start-up, is left out when there are two or more
          steps); ``None`` without optimizer steps.
        """
        n = self.world_size
        if self._totals is not None:  # every event counted, kept or not
            ops, nbytes, comm = self._totals
            rows = [{"rank": r, "ops": ops[r], "bytes": nbytes[r], "comm_s": comm[r]} for r in range(n)]
        else:
            rows = [{"rank": r, "ops": 0, "bytes": 0, "comm_s": 0.0} for r in range(n)]
            for e in self.events:
                row = rows[e.rank]
                row["ops"] += 1
                row["bytes"] += e.nbytes
                row["comm_s"] += e.vend - e.vstart
        if self._clock is not None:
            exposed, compute, steps, startup = self._clock
        else:  # a bare list of events: no clock accounting, every operation counted as exposed
            exposed = [sum(e.vend - e.vstart for e in self.events if e.rank == r) for r in range(n)]
            compute, steps, startup = [0.0] * n, [[] for _ in range(n)], [0.0] * n
        for r, row in enumerate(rows):
            row["exposed_s"] = exposed[r]
            row["compute_s"] = compute[r]
            row["startup_s"] = startup[r]
            row["end_s"] = self.end_vtime[r]
            row["steps"] = len(steps[r])
            row["step_s"] = _step_time(steps[r])
        return rows

    def format_summary(self) -> str:
        """The summary as a table, with a line saying which cost model predicted it."""
        head = (f"{'rank':>4} {'ops':>6} {'bytes':>12} {'startup (s)':>11} {'comm (s)':>11} {'exposed (s)':>11} "
                f"{'compute (s)':>11} {'end (s)':>10} {'steps':>5} {'step (s)':>10}")
        lines = [f"virtual time, {self.cost.describe()}; compute_scale={self.cost.compute_scale:g}", head]
        for row in self.summary():
            step = "-" if row["step_s"] is None else f"{row['step_s']:.4g}"
            lines.append(f"{row['rank']:>4} {row['ops']:>6} {row['bytes']:>12} {row['startup_s']:>11.4g} "
                         f"{row['comm_s']:>11.4g} "
                         f"{row['exposed_s']:>11.4g} {row['compute_s']:>11.4g} {row['end_s']:>10.4g} "
                         f"{row['steps']:>5} {step:>10}")
        if not self.deterministic:  # (a failed run's report says so too; a run that ended well says it here)
            lines.append(f"schedule: not a pure function of the seed, replayed only up to the first wait on the wall "
                         f"clock ({self.nondeterminism})")
        return "\n".join(lines)

    # -- Chrome trace / Perfetto ---------------------------------------
    def chrome_events(self, clock: str = "virtual") -> list[dict[str, Any]]:
        """Chrome-trace "complete" events, one row (tid) per rank, times in microseconds."""
        if clock not in ("virtual", "wall"):
            raise ValueError(f"clock must be 'virtual' or 'wall', got {clock!r}")
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": f"simulator ({clock} time)"}}
        ]
        for r in range(self.world_size):
            out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        async_ranks = sorted({e.rank for e in self.events if e.async_op})
        for r in async_ranks:  # async operations on their own track, so their overlap with compute shows
            out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": _ASYNC_TID + r,
                        "args": {"name": f"rank {r} async ops"}})
        for e in self.events:
            if clock == "virtual":
                ts, dur = e.vstart * 1e6, (e.vend - e.vstart) * 1e6
            else:
                ts, dur = (e.wall_start - self.wall_origin) * 1e6, (e.wall_end - e.wall_start) * 1e6
            args: dict[str, Any] = {"group": list(e.group), "seq": e.seq, "bytes": e.nbytes, "site": e.site}
            if e.peer is not None:
                args["peer"] = e.peer
            if e.backward is not None:
                args["backward_of"] = e.backward
            out.append({"name": e.op, "cat": "rpc" if e.op in _RPC_OPS else "comm", "ph": "X", "pid": 0,
                        "tid": _ASYNC_TID + e.rank if e.async_op else e.rank,
                        "ts": round(ts, 3), "dur": round(max(dur, 0.0), 3), "args": args})
        return out

    def to_chrome(self, path: str | None = None, clock: str = "virtual") -> dict[str, Any]:
        """Return the Chrome-trace JSON object, and write it to ``path`` if given.

        The file is strict JSON: a non-finite time (which JSON cannot hold; Python would write ``Infinity``, which
        Perfetto and other strict readers refuse) raises :class:`~tensorplay.distributed.errors.DistValueError`
        naming the event, and nothing is written.
        """
        doc = {"traceEvents": self.chrome_events(clock), "displayTimeUnit": "ms",
               "otherData": {"world_size": self.world_size, "seed": self.seed, "mode": self.mode,
                             "latency_s": self.cost.latency_s, "bandwidth_Bps": self.cost.bandwidth_Bps,
                             "cost_model": self.cost.describe()}}
        if path is not None:
            try:
                text = json.dumps(doc, allow_nan=False)  # text first: a refused trace leaves no half-written file
            except ValueError:
                raise _non_finite_error(doc, path) from None
            with open(path, "w") as fh:
                fh.write(text)
        return doc

    def __repr__(self) -> str:
        return f"Trace({len(self.events)} events, world_size={self.world_size}, seed={self.seed}, mode={self.mode!r})"
