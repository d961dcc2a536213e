"""``SimBackend``: tensorplay.distributed's backend interface on simulated ranks.

How a collective runs:

1. the calling rank reaches a scheduling point (coop mode may switch ranks);
2. it takes the next sequence number of the group and files a *call* (what it
   asked for, its tensors and its call site) into the group's slot for that
   number;
3. the last member to arrive checks that every call agrees (collective, op,
   root, dtype, shape, split sizes), computes every member's output with
   :mod:`simulator.core.kernels`, stamps the virtual end time and wakes the others;
4. a disagreement becomes one :class:`CollectiveMismatchError` for every member.

Point-to-point calls are matched by (group, source, destination, tag) in the
order they were posted.  What a blocking ``send`` waits for is the run's
``p2p`` setting: ``"rendezvous"`` (the default) completes a send when its
receive is posted, as gloo and NCCL do (measured on gloo with torch 2.13: even
a one-element blocking send returns only once the peer posted its recv), so
two ranks that both send first deadlock, and the simulator says so;
``"eager"`` copies the message at once and completes the send (MPI's buffered
sends), for programs written against that model.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch

from tensorplay.distributed.backends import Backend, Work, register_backend
from tensorplay.distributed.errors import DistBackendError, DistRuntimeError, DistValueError, format_message
from tensorplay.distributed.group import ProcessGroup
from tensorplay.distributed.reduce_op import ReduceOp
from tensorplay.distributed.rpc._agent import register_transport
from tensorplay.distributed.spec import BACKEND_COLLECTIVES as _WIRE
from tensorplay.distributed.spec import CallKey

from simulator.core import kernels
from simulator.core.callsite import call_site
from simulator.core.clock import OVERLAP_S, charge_compute, links_reserve, links_start, reach
from simulator.core.errors import CollectiveMismatchError, InjectedFault, SimError
from simulator.core.faults import Crash, Delay
from simulator.core.report import mismatch_message
from simulator.core.trace import Event
from simulator.core.state import Incident, P2PRecord, RankCall, RankState, SimGroup, Slot, _local

__all__ = ["SimBackend"]

_OFFLOAD_BYTES = 1 << 20  # kernels on buffers this big run on the main thread (see Run.execute)
_thread_time = time.thread_time
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_perf = time.perf_counter


# ---------------------------------------------------------------------------
# which actor calls: a rank, or a thread the rank started (see simulator/adapters/threads.py)
# ---------------------------------------------------------------------------
class OperationTimeoutError(SimError, DistBackendError, torch.distributed.DistBackendError):
    """An operation waited past its own timeout (its process group's, or ``Work.wait(timeout)``), as gloo's
    ``Timed out waiting ...``; also a ``torch.distributed.DistBackendError``, which torch programs catch."""


def _block(rs: RankState, w: Any, timeout: Optional[timedelta], name: str) -> None:
    """Wait for ``w``; with a ``timeout`` (the torch adapter passes its group's), fail the wait once it ran out."""
    if timeout is None:
        return rs.run.sched.block(rs, w)
    seconds = timeout.total_seconds()

    def timed_out() -> Incident:
        return Incident(OperationTimeoutError, format_message(
            f"torch.distributed.{name}", f"Timed out waiting {seconds * 1000:.0f}ms for the other ranks of the "
            f"group to join {name} (the operation's timeout: its process group's, or Work.wait's)", rank=rs.rank,
            values={"timeout": timeout}, fix="make every rank of the group call the operation, or pass a longer "
                                             "timeout= to init_process_group / new_group"))

    if seconds <= 0:  # (a process rank whose turn came after its operation's timeout ran out)
        raise timed_out().make(rs.rank)
    rs.run.sched.block_until(rs, w, seconds, timed_out)


def _caller(rs: RankState) -> RankState:
    """The calling thread's actor when it is one of ``rs``'s rank (a rank's threads share its backend and works)."""
    me = _local.__dict__.get("rs")
    return me if me is not None and me is not rs and me.run is rs.run and me.rank == rs.rank else rs


def _notify(rs: RankState, w: Any, error: Incident | None, source: int | None = None) -> None:
    """``w``, which ``rs`` is blocked on, has completed: tell ``rs.on_complete`` before ``rs`` resumes."""
    hook = rs.on_complete
    if hook is not None and rs.waiting is w:
        hook(error, source)


def _done_with(rs: RankState) -> None:
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


class _CollWork(Work):
    __slots__ = ("_rs", "_slot", "_call")

    def __init__(self, rs: RankState, slot: Slot, call: RankCall) -> None:
        self._rs = rs
        self._slot = slot
        self._call = call

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        rs, slot = _caller(self._rs), self._slot
        try:
            if self._call.async_op and not self._call.observed:
                charge_compute(rs)  # what the rank computed since the issue ran while the operation did
            if not slot.done:
                _block(rs, slot, timeout, slot.name)
            _observe_coll(rs, slot, self._call)
            _forget(self._rs, self)
        finally:
            _done_with(rs)
        if slot.error is not None:
            raise slot.error.make(rs.rank)
        return True

    def is_completed(self) -> bool:
        return self._slot.done

    def is_success(self) -> bool:
        return self._slot.done and self._slot.error is None

    def result(self) -> list[torch.Tensor]:
        return _outputs(self._slot.name, self._call.data)


class _P2PWork(Work):
    __slots__ = ("_rec",)

    def __init__(self, rec: P2PRecord) -> None:
        self._rec = rec

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        rec = self._rec
        rs = _caller(rec.rs)
        try:
            if rec.async_op and not rec.observed:
                charge_compute(rs)  # what the rank computed since the issue ran while the operation did
            if not rec.done:
                _block(rs, rec, timeout, rec.kind)
            _observe_p2p(rs, rec)
            _forget(rec.rs, self)
        finally:
            _done_with(rs)
        if rec.error is not None:
            raise rec.error.make(rs.rank)
        return True

    def is_completed(self) -> bool:
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


def _outputs(name: str, data: Any) -> list[torch.Tensor]:
    """The tensors a collective wrote on this rank (what ``Work.result()`` gives), from its call data."""
    if data is None:
        return []
    if isinstance(data, torch.Tensor):  # all_reduce, broadcast, reduce
        return [data]
    if name in ("all_gather", "all_to_all"):
        return list(data[0])
    if name == "gather":
        return list(data[1] or ())
    return [data[0]]  # one output tensor: *_into_tensor, scatter, reduce_scatter*, all_to_all_single


def _observe_coll(rs: RankState, slot: Slot, call: RankCall) -> None:
    """Record the event once and advance the rank's virtual clock to the collective's end."""
    if call.observed:
        return
    call.observed = True
    waited_at = reach(rs, slot.vend)
    g = slot.group
    root = call.key[2]
    rs.run.events.append(Event(rs.rank, slot.name, g.ranks, slot.seq, call.nbytes, call.site,
                               None if root is None else g.ranks[root], call.wall_start, _perf(),
                               call.vstart, slot.vend, call.backward,
                               call.async_op and waited_at - call.vstart > OVERLAP_S))
    rs.cpu_mark = _thread_time()


def _observe_p2p(rs: RankState, rec: P2PRecord) -> None:
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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storages(ts: Sequence[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in ts if t.numel()}


def _stage(srcs: list[torch.Tensor], outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Clone the sources when an output shares memory with one (then writes cannot clobber inputs)."""
    if _storages(srcs) & _storages(outs):
        return [s.clone() for s in srcs]
    return srcs


_below_autograd = torch._C._AutoDispatchBelowADInplaceOrView


def _no_grad(kernel: Callable[[list["RankCall"]], Any], calls: list["RankCall"]) -> Any:
    """Run a kernel as c10d does: on the tensors' memory, invisible to autograd.

    gloo and NCCL write results into the buffers without looking at
    ``requires_grad``, so an in-place collective on a leaf that requires grad
    succeeds there; without this, torch would refuse the in-place write.  The
    writes also run below autograd's in-place/view bookkeeping, as c10d's C++
    kernels do: a collective on a view that a backward hook returned (module
    hooks under ``CommDebugMode``) is no "in-place modification of a view".
    """
    prev = _grad_enabled()
    _set_grad_enabled(False)  # torch.no_grad() costs about 4x more, once per collective
    try:
        with _below_autograd():
            return kernel(calls)
    finally:
        _set_grad_enabled(prev)


# ---------------------------------------------------------------------------
# agreement checks (run by the last arriver, before any work)
# ---------------------------------------------------------------------------
_FIELDS = ("collective", "op", "root", "dtype", "shape")


def _disagreement(calls: list[RankCall]) -> str | None:
    k0 = calls[0].key
    for c in calls:
        if c.key != k0:
            for i, field in enumerate(_FIELDS):
                vals: dict[Any, list[int]] = {}
                for cc in calls:
                    vals.setdefault(cc.key[i], []).append(cc.rs.rank)
                if len(vals) > 1:
                    parts = []
                    for v, ranks in list(vals.items())[:8]:
                        shown = v.name if isinstance(v, ReduceOp) else (str(v).replace("torch.", "") if v is not None else "-")
                        if field == "shape" and v is not None:
                            shown = str(tuple(v))
                        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[:8]}"
                        parts.append(f"{who}: {shown}")
                    return f"{field} differs ({'; '.join(parts)})"
    return None


def _check_all_to_all(calls: list[RankCall]) -> str | None:
    w = len(calls)
    for i in range(w):
        outs_i = calls[i].data[0]
        for j in range(w):
            sent = calls[j].data[1][i].shape
            want = outs_i[j].shape
            if sent != want:
                return (f"rank {calls[j].rs.rank} sends a block of shape {tuple(sent)} to rank {calls[i].rs.rank}, "
                        f"which expects shape {tuple(want)} (input_tensor_list[{i}] on the sender must match "
                        f"output_tensor_list[{j}] on the receiver)")
    return None


def _check_all_to_all_single(calls: list[RankCall]) -> str | None:
    w = len(calls)
    for i in range(w):
        out_splits = calls[i].data[2]
        for j in range(w):
            sent = calls[j].data[3][i]
            if sent != out_splits[j]:
                return (f"rank {calls[j].rs.rank} sends {sent} rows to rank {calls[i].rs.rank}, which expects "
                        f"{out_splits[j]} (input_split_sizes[{i}] on rank {calls[j].rs.rank} must equal "
                        f"output_split_sizes[{j}] on rank {calls[i].rs.rank})")
    return None


# ---------------------------------------------------------------------------
# kernels per collective: f(calls) writes every member's outputs
# ---------------------------------------------------------------------------
def _k_barrier(calls: list[RankCall]) -> None:
    return None


def _k_broadcast(calls: list[RankCall], root: int) -> None:
    src = calls[root].data
    for i, c in enumerate(calls):
        if i != root:
            c.data.copy_(src)


def _k_all_reduce(calls: list[RankCall], op: ReduceOp) -> None:
    ts = [c.data for c in calls]
    kernels.reduce_into(ts, ts, op)


def _k_reduce(calls: list[RankCall], op: ReduceOp, root: int) -> None:
    kernels.reduce_into([calls[root].data], [c.data for c in calls], op)


def _k_all_gather(calls: list[RankCall]) -> None:
    outs = [o for c in calls for o in c.data[0]]
    srcs = _stage([c.data[1] for c in calls], outs)
    for c in calls:
        for o, s in zip(c.data[0], srcs):
            o.copy_(s)


def _k_all_gather_into_tensor(calls: list[RankCall]) -> None:
    srcs = _stage([c.data[1] for c in calls], [c.data[0] for c in calls])
    for c in calls:
        kernels.copy_rows(c.data[0], srcs)


def _k_gather(calls: list[RankCall], root: int) -> None:
    gl = calls[root].data[1]
    srcs = _stage([c.data[0] for c in calls], gl)
    for o, s in zip(gl, srcs):
        o.copy_(s)


def _k_scatter(calls: list[RankCall], root: int) -> None:
    sl = calls[root].data[1]
    srcs = _stage(list(sl), [c.data[0] for c in calls])
    for c, s in zip(calls, srcs):
        c.data[0].copy_(s)


def _k_reduce_scatter(calls: list[RankCall], op: ReduceOp) -> None:
    w = len(calls)
    results = [kernels.reduce_tensors([c.data[1][i] for c in calls], op) for i in range(w)]
    for c, r in zip(calls, results):
        c.data[0].copy_(r)


def _k_reduce_scatter_tensor(calls: list[RankCall], op: ReduceOp) -> None:
    w = len(calls)
    rows = [kernels.rows_view(c.data[1], w) for c in calls]
    results = [kernels.reduce_tensors([r[i] for r in rows], op) for i in range(w)]
    for c, r in zip(calls, results):
        out = c.data[0]
        out.copy_(r.view(out.shape) if r.numel() == out.numel() else r)


def _k_all_to_all(calls: list[RankCall]) -> None:
    outs = [o for c in calls for o in c.data[0]]
    ins = [t for c in calls for t in c.data[1]]
    if _storages(ins) & _storages(outs):
        staged = [[t.clone() for t in c.data[1]] for c in calls]
    else:
        staged = [c.data[1] for c in calls]
    for i, c in enumerate(calls):
        for j, o in enumerate(c.data[0]):
            o.copy_(staged[j][i])


def _k_all_to_all_single(calls: list[RankCall]) -> None:
    w = len(calls)
    ins = _stage([c.data[1] for c in calls], [c.data[0] for c in calls])
    in_off = []
    for c in calls:
        offs, acc = [], 0
        for s in c.data[3]:
            offs.append(acc)
            acc += s
        in_off.append(offs)
    for i, c in enumerate(calls):
        out, out_splits = c.data[0], c.data[2]
        off = 0
        for j in range(w):
            n = out_splits[j]
            if n:
                out.narrow(0, off, n).copy_(ins[j].narrow(0, in_off[j][i], n))
            off += n


# ---------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------
# every collective of the backend interface has its kernel here (send/recv are matched, not computed)
_missing = [n for n, b in _WIRE.items() if b.cost_class != "p2p" and f"_k_{n}" not in globals()]
if _missing:  # pragma: no cover  (a new entry in spec.BACKEND_COLLECTIVES without a simulator kernel)
    raise ImportError(f"simulator/core/backend.py has no kernel for the backend collective(s) {_missing}: add _k_<name>")


class SimBackend(Backend):
    """One simulated rank's backend (built by the simulator, never by ``init_process_group``)."""

    name = "sim"

    def __init__(self, rs: RankState, world_group: SimGroup) -> None:
        super().__init__(rs.rank, rs.run.n)
        self._rs = rs
        self._world_group = world_group
        self._seq: dict[int, int] = {}
        #: how many member-only groups of each rank set this rank asked for (see _member_group)
        self._member_group_counts: dict[tuple[int, ...], int] = {}

    # -- life cycle -------------------------------------------------------
    @classmethod
    def create(cls, *, rank: int, world_size: int, init_method: str | None, store: Any,
               timeout: timedelta) -> "SimBackend":
        raise DistRuntimeError(format_message(
            "init_process_group", "the 'sim' backend only runs inside a simulated world",
            values={"backend": "sim"},
            fix="run the code with simulator.run(fn, world_size) or `python -m simulator --nproc-per-node N "
                "script.py`; inside those, init_process_group() returns at once"))

    def world_handle(self) -> SimGroup:
        return self._world_group

    def check_reinit(self, rank: int | None, world_size: int | None) -> None:
        # the simulator initialised this rank already; calling again is allowed, but a rank or world size
        # the program names must be this rank's (a real run with other values would hang in the rendezvous)
        for what, given, actual in (("rank", rank, self.rank), ("world_size", world_size, self.world_size)):
            if given not in (-1, None) and given != actual:
                raise DistValueError(format_message(
                    "init_process_group", f"the program asks for {what}={given}, but this simulated rank has "
                    f"{what}={actual}", rank=self.rank, values={what: given, f"simulated_{what}": actual},
                    fix="start as many simulated ranks as the program expects (python -m simulator "
                        "--nproc-per-node N script.py; for a script that starts its own ranks, nprocs=N or N "
                        "Process objects), or let it read RANK and WORLD_SIZE from the environment"))

    def device_for(self, kind: str) -> torch.device:
        return self._rs.device if kind == self._rs.device.type else torch.device(kind)

    def new_group_handle(self, ranks: tuple[int, ...], timeout: timedelta) -> SimGroup | None:
        rs = self._rs
        run = rs.run

        def make(calls: list[RankCall]) -> SimGroup:
            g = SimGroup(run.next_gid, tuple(ranks))
            run.next_gid += 1
            return g

        slot = self._collective(self._world_group, "new_group", CallKey("new_group", None, None, None, tuple(ranks)),
                                None, 0, False, make, detail=f"ranks={list(ranks)}", return_slot=True)
        g = slot.result
        return g if rs.rank in g.index else None

    def world_key(self) -> object:
        """An object that identifies this simulated world (the same for all of its ranks)."""
        return self._rs.run

    def member_group_handle(self, ranks: tuple[int, ...]) -> SimGroup:
        """A group created by its members only (torch's new_group skips non-members).

        Members ask for the groups of one rank set in the same order, so the
        k-th request for ``ranks`` from any member names the same group.
        """
        run = self._rs.run
        counts = self._member_group_counts
        k = counts.get(ranks, 0)
        counts[ranks] = k + 1
        with run.sched.lock:
            table = run.member_groups
            g = table.get((ranks, k))
            if g is None:
                g = table[(ranks, k)] = SimGroup(run.next_gid, tuple(ranks))
                run.next_gid += 1
        return g

    def shutdown(self) -> None:
        return None

    def supports_device(self, device: torch.device) -> bool:
        return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())

    # -- the common path ----------------------------------------------------
    def _enter(self, rs: RankState, name: str, site: str) -> None:
        """Scheduling point, compute accounting and fault injection at the start of an operation."""
        rs.run.sched.point(rs)
        charge_compute(rs)
        rs.ops += 1
        rs.last_site = site
        if rs.faults is not None:
            for f in rs.faults:
                if isinstance(f, Crash):
                    if f.at == rs.ops:
                        raise InjectedFault(format_message(
                            name, f"injected crash of rank {rs.rank} at its operation #{rs.ops}", rank=rs.rank,
                            values={"fault": f, "site": site},
                            fix="this failure was requested with faults=[simulator.Crash(...)]"))
                elif isinstance(f, Delay) and (f.at is None or f.at == rs.ops):
                    if f.virtual:
                        rs.vt += f.seconds
                    if f.real:
                        time.sleep(f.seconds)

    def _collective(self, g: SimGroup, name: str, key: CallKey, data: Any, nbytes: int, async_op: bool,
                    kernel: Callable[[list[RankCall]], None], detail: str | None = None,
                    check: Callable[[list[RankCall]], str | None] | None = None, return_slot: bool = False) -> Any:
        rs = _caller(self._rs)
        site = call_site(3)
        try:
            self._enter(rs, name, site)
        except BaseException:
            _done_with(rs)
            raise
        seq = self._seq.get(g.gid, 0) + 1
        self._seq[g.gid] = seq
        call = RankCall(rs, key, data, site, nbytes, async_op, detail)
        run = rs.run
        sched = run.sched
        with sched.lock:
            slot = g.slots.get(seq)
            if slot is None:
                slot = g.slots[seq] = Slot(g, seq, name)
            slot.calls[g.index[rs.rank]] = call
            slot.arrived += 1
            if slot.arrived == g.size:
                del g.slots[seq]
                self._complete(slot, kernel, check)
            else:
                slot.waiters.append(rs)
        if async_op:
            rs.cpu_mark = _thread_time()  # a kernel this rank ran for the group is not its compute
        work = _CollWork(rs, slot, call)
        if return_slot:
            work.wait()
            return slot
        if async_op:
            rs.unflushed.append(work)
            _done_with(rs)
            return work
        work.wait()
        return None

    def _complete(self, slot: Slot, kernel: Callable[[list[RankCall]], None],
                  check: Callable[[list[RankCall]], str | None] | None) -> None:
        calls: list[RankCall] = slot.calls  # type: ignore[assignment]
        run = self._rs.run
        reason = _disagreement(calls)
        if reason is None and check is not None:
            reason = check(calls)
        if reason is not None:
            slot.error = Incident(CollectiveMismatchError,
                                  mismatch_message(slot.name, slot.group, slot.seq, calls, reason))
        else:
            try:
                if max(c.nbytes for c in calls) >= _OFFLOAD_BYTES:
                    slot.result = run.execute(lambda: _no_grad(kernel, calls))
                else:
                    slot.result = _no_grad(kernel, calls)
            except Exception as e:  # noqa: BLE001  (a kernel failure fails the collective on every member)
                slot.error = Incident(DistBackendError, format_message(
                    slot.name, f"the simulator failed to compute the result: {type(e).__name__}: {e}",
                    group=slot.group.ranks, fix="check that every rank passes tensors on compatible devices"),
                    cause=e)
        # starts when the last member issued it and its members' links are free (see simulator.timing.cost)
        start = links_start(run, slot.group.ranks, max(c.vstart for c in calls))
        slot.vend = start + run.cost.cost(slot.name, max(c.nbytes for c in calls), slot.group.size)
        links_reserve(run, slot.group.ranks, slot.vend)
        slot.done = True
        for c in calls:
            _notify(c.rs, slot, slot.error)
        wake = run.sched.wake
        for w in slot.waiters:
            wake(w)

    def _flush_unobserved(self, rs: RankState | None = None) -> None:
        """At the end of a rank (or of a thread it started): trace the async operations nobody waited for."""
        rs = rs or self._rs
        charge_compute(rs, starts=False)  # the compute after the rank's last operation is part of its run
        for w in rs.unflushed:
            if isinstance(w, _CollWork) and w._slot.done:
                _observe_coll(rs, w._slot, w._call)
            elif isinstance(w, _P2PWork) and w._rec.done:
                _observe_p2p(rs, w._rec)
        rs.unflushed.clear()

    # -- collectives --------------------------------------------------------
    def barrier(self, group: ProcessGroup, async_op: bool) -> Work | None:
        return self._collective(group.handle, "barrier", _WIRE["barrier"].key(), None, 0, async_op,
                                _k_barrier)

    def broadcast(self, tensor: torch.Tensor, root: int, group: ProcessGroup, async_op: bool) -> Work | None:
        return self._collective(group.handle, "broadcast",
                                _WIRE["broadcast"].key(root=root, dtype=tensor.dtype, shape=tensor.shape),
                                tensor, _nbytes(tensor), async_op, lambda calls: _k_broadcast(calls, root))

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, group: ProcessGroup, async_op: bool) -> Work | None:
        return self._collective(group.handle, "all_reduce",
                                _WIRE["all_reduce"].key(op=op, dtype=tensor.dtype, shape=tensor.shape),
                                tensor, _nbytes(tensor), async_op, lambda calls: _k_all_reduce(calls, op))

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp, group: ProcessGroup,
               async_op: bool) -> Work | None:
        return self._collective(group.handle, "reduce",
                                _WIRE["reduce"].key(op=op, root=root, dtype=tensor.dtype, shape=tensor.shape),
                                tensor, _nbytes(tensor), async_op, lambda calls: _k_reduce(calls, op, root))

    def all_gather(self, output_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup,
                   async_op: bool) -> Work | None:
        return self._collective(group.handle, "all_gather",
                                _WIRE["all_gather"].key(dtype=tensor.dtype, shape=tensor.shape),
                                (output_list, tensor), _nbytes(tensor) * len(output_list), async_op, _k_all_gather)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: ProcessGroup,
                               async_op: bool) -> Work | None:
        return self._collective(group.handle, "all_gather_into_tensor",
                                _WIRE["all_gather_into_tensor"].key(dtype=input.dtype, shape=input.shape),
                                (output, input), _nbytes(output), async_op, _k_all_gather_into_tensor)

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, root: int, group: ProcessGroup,
               async_op: bool) -> Work | None:
        return self._collective(group.handle, "gather",
                                _WIRE["gather"].key(root=root, dtype=tensor.dtype, shape=tensor.shape),
                                (tensor, gather_list), _nbytes(tensor) * group.size(), async_op,
                                lambda calls: _k_gather(calls, root))

    def scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, root: int, group: ProcessGroup,
                async_op: bool) -> Work | None:
        return self._collective(group.handle, "scatter",
                                _WIRE["scatter"].key(root=root, dtype=tensor.dtype, shape=tensor.shape),
                                (tensor, scatter_list), _nbytes(tensor) * group.size(), async_op,
                                lambda calls: _k_scatter(calls, root))

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp,
                       group: ProcessGroup, async_op: bool) -> Work | None:
        return self._collective(group.handle, "reduce_scatter",
                                _WIRE["reduce_scatter"].key(op=op, dtype=output.dtype, shape=output.shape),
                                (output, input_list), _nbytes(output) * len(input_list), async_op,
                                lambda calls: _k_reduce_scatter(calls, op))

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, group: ProcessGroup,
                              async_op: bool) -> Work | None:
        return self._collective(group.handle, "reduce_scatter_tensor",
                                _WIRE["reduce_scatter_tensor"].key(op=op, dtype=output.dtype, shape=output.shape),
                                (output, input), _nbytes(input), async_op,
                                lambda calls: _k_reduce_scatter_tensor(calls, op))

    def all_to_all(self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], group: ProcessGroup,
                   async_op: bool) -> Work | None:
        detail = "in=" + ",".join(str(tuple(t.shape)) for t in input_list[:8]) + \
                 " out=" + ",".join(str(tuple(t.shape)) for t in output_list[:8])
        return self._collective(group.handle, "all_to_all", _WIRE["all_to_all"].key(dtype=input_list[0].dtype),
                                (output_list, input_list), sum(_nbytes(t) for t in input_list), async_op,
                                _k_all_to_all, detail=detail, check=_check_all_to_all)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], group: ProcessGroup, async_op: bool) -> Work | None:
        detail = (f"in_splits={list(input_split_sizes)} out_splits={list(output_split_sizes)} "
                  f"rows={tuple(input.shape[1:])}")
        return self._collective(group.handle, "all_to_all_single",
                                _WIRE["all_to_all_single"].key(dtype=input.dtype, shape=tuple(input.shape[1:])),
                                (output, input, list(output_split_sizes), list(input_split_sizes)), _nbytes(input),
                                async_op, _k_all_to_all_single, detail=detail, check=_check_all_to_all_single)

    # -- point to point -----------------------------------------------------
    def send(self, tensor: torch.Tensor, peer: int, group: ProcessGroup, tag: int, async_op: bool) -> Work | None:
        rs = _caller(self._rs)
        site = call_site(2)
        try:
            self._enter(rs, "send", site)
        except BaseException:
            _done_with(rs)
            raise
        g: SimGroup = group.handle
        dst = g.ranks[peer]
        run = rs.run
        if run.p2p == "eager":  # buffered (MPI bsend-like): the message is copied now and the send is complete
            with torch.no_grad():
                tensor = tensor.detach().clone()
        rec = P2PRecord("send", rs, rs.rank, dst, g, tag, tensor, site, async_op)
        if run.p2p == "eager":
            rec.vend = rec.vstart + run.cost.cost("send", _nbytes(tensor), 2)
            rec.done = True
        with run.sched.lock:
            q = run.recvs.get(dst)
            match = None
            if q:
                for i, r in enumerate(q):
                    if r.group is g and r.tag == tag and (r.src is None or r.src == rs.rank):
                        match = q.pop(i)
                        break
            if match is not None:
                self._match(rec, match)
            else:
                run.sends.setdefault(dst, []).append(rec)
        return self._p2p_finish(rec, async_op)

    def recv(self, tensor: torch.Tensor, peer: int | None, group: ProcessGroup, tag: int,
             async_op: bool) -> Work | int:
        rs = _caller(self._rs)
        site = call_site(2)
        try:
            self._enter(rs, "recv", site)
        except BaseException:
            _done_with(rs)
            raise
        g: SimGroup = group.handle
        src = None if peer is None else g.ranks[peer]
        rec = P2PRecord("recv", rs, src, rs.rank, g, tag, tensor, site, async_op)
        run = rs.run
        with run.sched.lock:
            q = run.sends.get(rs.rank)
            match = None
            if q:
                for i, s in enumerate(q):
                    if s.group is g and s.tag == tag and (src is None or s.src == src):
                        match = q.pop(i)
                        break
            if match is not None:
                self._match(match, rec)
            else:
                run.recvs.setdefault(rs.rank, []).append(rec)
        work = self._p2p_finish(rec, async_op)
        if async_op:
            return work  # type: ignore[return-value]
        return rec.source  # type: ignore[return-value]

    def _p2p_finish(self, rec: P2PRecord, async_op: bool) -> Any:
        work = _P2PWork(rec)
        if async_op:
            rec.rs.cpu_mark = _thread_time()  # a copy this rank made for the pair is not its compute
            rec.rs.unflushed.append(work)
            _done_with(rec.rs)
            return work
        work.wait()
        return None

    def _match(self, s: P2PRecord, r: P2PRecord) -> None:
        """Complete a send/recv pair (caller holds the scheduler lock)."""
        run = self._rs.run
        st, rt = s.tensor, r.tensor
        if st.dtype != rt.dtype or st.numel() != rt.numel():
            s.detail = f"to rank {s.dst}, tag {s.tag}"
            r.detail = f"from rank {'any' if r.src is None else r.src}, tag {r.tag}"
            reason = (f"rank {s.rs.rank} sends dtype={str(st.dtype).replace('torch.', '')} shape={tuple(st.shape)} "
                      f"but rank {r.rs.rank} receives into dtype={str(rt.dtype).replace('torch.', '')} "
                      f"shape={tuple(rt.shape)}")
            inc = Incident(CollectiveMismatchError, mismatch_message("send/recv", s.group, None, [s, r], reason))
            s.error = r.error = inc
        else:
            try:
                with torch.no_grad():  # c10d writes the buffer as memory: autograd never sees it
                    rt.copy_(st if st.shape == rt.shape else st.reshape(rt.shape))
            except Exception as e:  # noqa: BLE001
                s.error = r.error = Incident(DistBackendError, format_message(
                    "recv", f"the simulator failed to copy the message: {type(e).__name__}: {e}",
                    group=s.group.ranks, fix="check the devices of the send and recv tensors"), cause=e)
        r.source = s.group.index[s.rs.rank]
        snd, rcv = s.rs.rank, r.rs.rank  # the sender's outgoing link, the receiver's incoming one
        start = links_start(run, (), max(s.vstart, r.vstart), send=snd, recv=rcv)
        end = start + run.cost.cost("send", _nbytes(st), 2)
        links_reserve(run, (), end, send=snd, recv=rcv)
        if not s.done:  # an eager send completed when it was posted
            s.vend = end
            s.done = True
        r.vend = end
        r.done = True
        _notify(s.rs, s, s.error)
        _notify(r.rs, r, r.error, r.source)
        run.sched.wake(s.rs)
        run.sched.wake(r.rs)


register_backend("sim", SimBackend)
# ... and the RPC transports, here because every simulated world and every rank process imports this module;
# the transport modules themselves are imported only when a world uses RPC
register_transport("sim", "simulator.rpc")  # RPC inside a simulated world
register_transport("sim-process", "simulator.isolation.rpc_process")  # RPC in a process-isolated rank
