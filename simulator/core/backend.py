"""``SimBackend``: tensorplay.distributed's backend interface on simulated ranks.

How a collective runs:

1. the calling rank reaches a scheduling point (coop mode may switch ranks);
2. it takes the next sequence number of the group and files a *call* (what it
   asked for, its tensors and its call site) into the group's slot for that
   number;
3. the last member to arrive checks that every call agrees (collective, op,
   root, dtype, shape, split sizes), computes every member's output with
   its kernel (:mod:`simulator.core.collectives`: each collective's
   rules in one place), stamps the virtual end time and wakes the others;
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
from typing import Any, Callable

import torch

from tensorplay.distributed.backends import Backend, Work, register_backend
from tensorplay.distributed.errors import DistBackendError, DistRuntimeError, format_message
from tensorplay.distributed.group import ProcessGroup
from tensorplay.distributed.reduce_op import ReduceOp
from tensorplay.distributed.rpc.transport import register_transport
from tensorplay.distributed.spec import CallKey

from simulator.core.callsite import call_site
from simulator.core.clock import charge_compute, links_reserve, links_start
from simulator.core.collectives import RULES, Args as _ARGS, disagreement, nbytes
from simulator.core.errors import CollectiveMismatchError, InjectedFault
from simulator.core.faults import Crash, Delay
from simulator.core.report import mismatch_message
from simulator.core.state import Incident, P2PRecord, RankCall, RankState, SimGroup, Slot
from simulator.core.works import CollWork, OperationTimeoutError, P2PWork, caller, done_with, notify, observe_coll, observe_p2p, wake_others

__all__ = ["SimBackend", "OperationTimeoutError"]

_OFFLOAD_BYTES = 1 << 20  # kernels on buffers this big run on the main thread (see Run.execute)
_thread_time = time.thread_time
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


_below_autograd = torch._C._AutoDispatchBelowADInplaceOrView


def _kernel_fix(e: Exception) -> str:
    """The fix for a collective whose result could not be written, as its error says why."""
    if "refers to a single memory location" in str(e):  # an output whose elements share memory (expand, stride 0)
        return ("pass output tensors whose elements have memory of their own: t.contiguous() or t.clone() of an "
                "expanded view (a collective writes every element)")
    return "check that every rank passes tensors on compatible devices"


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


class SimBackend(Backend):
    """One simulated rank's backend (built by the simulator, never by ``init_process_group``)."""

    name = "sim"
    rejoinable = True  # the simulated world is the rank's for its whole life, destroyed group or not

    def __init__(self, rs: RankState, world_group: SimGroup) -> None:
        super().__init__(rs.rank, rs.run.n)
        self._rs = rs
        self._world_group = world_group
        self._seq: dict[int, int] = {}
        #: how many member-only groups of each rank set this rank asked for (see _member_group)
        self._member_group_counts: dict[tuple[int, ...], int] = {}
        self._joined: str | bool = False  # the backend the program's init_process_group named (see check_reinit)
        self._made_torch_group = False  # ... and torch's default group was made for it (see joined)

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
        # the simulator initialised this rank already; the program's first init_process_group joins it (its
        # second, without a destroy_process_group between, is refused as on gloo); a rank or world size the
        # program names must be this rank's (a real run with other values would hang in the rendezvous)
        if self._joined:
            raise DistRuntimeError(format_message(
                "init_process_group", "the default process group is already initialised", rank=self.rank,
                values={"backend": self._joined}, fix="call destroy_process_group() before initialising again"))
        for what, given, actual in (("rank", rank, self.rank), ("world_size", world_size, self.world_size)):
            if given not in (-1, None) and given != actual:  # (gloo: a RuntimeError, at once or at the store's timeout)
                raise DistRuntimeError(format_message(
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

    def member_group_handle(self, ranks: tuple[int, ...], name: str | None = None) -> SimGroup:
        """A group created by its members only (torch's new_group skips non-members).

        Members ask for the groups of one rank set in the same order, so the
        k-th request for ``ranks`` from any member names the same group.  A group
        torch makes has a name (``name``: from a per-process count of new_group
        calls, which every rank makes in the same order, or a hash of the ranks),
        and members meet under it as gloo's members meet under it in the store: a
        rank that skipped a new_group call names the next group differently, and
        its collectives on it wait for members that are in another group, a
        deadlock report where gloo hangs.
        """
        run = self._rs.run
        counts = self._member_group_counts
        key: tuple = ranks if name is None else (ranks, "torch", name)
        k = counts.get(key, 0)
        counts[key] = k + 1
        with run.sched.lock:
            table = run.member_groups
            g = table.get((key, k))
            if g is None:
                g = table[(key, k)] = SimGroup(run.next_gid, tuple(ranks))
                g.torch_name = name
                run.next_gid += 1
        return g

    def joined(self, backend: str | None, timeout: timedelta | None) -> None:
        self._joined = backend or "gloo"
        self.awaiting_init = False
        # as on gloo and nccl, where tensorplay's init_process_group makes torch's default group too: a program
        # that goes on with torch.distributed (DDP, torch's collectives) finds it, bound to this world
        if torch.distributed.is_available() and not torch.distributed.is_initialized():
            name = None if backend in (None, "sim") else backend
            if timeout is None:
                torch.distributed.init_process_group(name)
            else:
                torch.distributed.init_process_group(name, timeout=timeout)
            self._made_torch_group = True

    def shutdown(self) -> None:
        self._joined = False
        if self._made_torch_group:
            self._made_torch_group = False
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()

    def supports_device(self, device: torch.device) -> bool:
        return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())

    # -- the common path ----------------------------------------------------
    def _enter(self, rs: RankState, name: str, site: str, switch: bool = True) -> None:
        """Scheduling point, compute accounting and fault injection at the start of an operation (``switch``:
        see :meth:`simulator.core.sched.CoopScheduler.point`)."""
        rs.run.sched.point(rs, switch)
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
        rs = caller(self._rs)
        site = call_site(3)
        try:
            self._enter(rs, name, site, switch=async_op)  # a blocking one waits right after: the choice is made there
        except BaseException:
            done_with(rs)
            raise
        seq = self._seq.get(g.gid, 0) + 1
        self._seq[g.gid] = seq
        call = RankCall(rs, key, data, site, nbytes, async_op, detail)
        if g.rule is not None:
            call.tag = g.rule.tag(data)
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
        work = CollWork(rs, slot, call)
        if return_slot:
            work.wait()
            return slot
        if async_op:
            rs.unflushed.append(work)
            done_with(rs)
            return work
        work.wait()
        return None

    def _complete(self, slot: Slot, kernel: Callable[[list[RankCall]], None],
                  check: Callable[[list[RankCall]], str | None] | None) -> None:
        calls: list[RankCall] = slot.calls  # type: ignore[assignment]
        run = self._rs.run
        reason = disagreement(calls)
        if reason is None and check is not None:
            reason = check(calls)
        refused = slot.group.rule.check(slot.name, calls) if reason is None and slot.group.rule is not None else None
        if reason is not None:
            slot.error = Incident(CollectiveMismatchError,
                                  mismatch_message(slot.name, slot.group, slot.seq, calls, reason))
        elif refused is not None:
            slot.error = refused
        nbytes = max([c.nbytes for c in calls])
        if reason is None and refused is None:
            try:
                if nbytes >= _OFFLOAD_BYTES:
                    slot.result = run.execute(lambda: _no_grad(kernel, calls))
                else:
                    slot.result = _no_grad(kernel, calls)
            except Exception as e:  # noqa: BLE001  (a kernel failure fails the collective on every member)
                slot.error = Incident(DistBackendError, format_message(
                    slot.name, f"the simulator failed to compute the result: {type(e).__name__}: {e}",
                    group=slot.group.ranks, fix=_kernel_fix(e)), cause=e)
        # starts when the last member issued it and its members' links are free (see simulator.timing.cost)
        start = links_start(run, slot.group.ranks, max([c.vstart for c in calls]))
        slot.vend = start + run.cost.cost(slot.name, nbytes, slot.group.size)
        links_reserve(run, slot.group.ranks, slot.vend)
        slot.done = True
        # the results are written: the slot lets go of the members' calls (each work keeps its own), so a rank's
        # tensors are freed when that rank drops them, not when the last member has waited (memory_allocated)
        slot.calls = [None] * len(calls)
        for c in calls:
            notify(c.rs, slot, slot.error)
        wake = run.sched.wake
        for w in slot.waiters:
            wake(w)
        if slot.others is not None:
            wake_others(slot, slot.error)

    def _run(self, name: str, data: Any, group: ProcessGroup, async_op: bool) -> Work | None:
        """One backend collective: described, filed and computed by its rule."""
        g: SimGroup = group.handle
        rule = RULES[name]
        key, size, detail = rule.describe(data, g.size)
        return self._collective(g, name, key, data, size, async_op, rule.kernel, detail=detail, check=rule.check)

    def _flush_unobserved(self, rs: RankState | None = None) -> None:
        """At the end of a rank (or of a thread it started): trace the async operations nobody waited for."""
        rs = rs or self._rs
        charge_compute(rs, starts=False)  # the compute after the rank's last operation is part of its run
        for w in rs.unflushed:
            if isinstance(w, CollWork):
                if w._slot.done:
                    observe_coll(rs, w._slot, w._call)
                else:  # the others may still issue it; what is still open when the run ends is named then
                    rs.run.unwaited.append(w)
            elif isinstance(w, P2PWork) and w._rec.done:
                observe_p2p(rs, w._rec)
        rs.unflushed.clear()

    # -- collectives: each one call of its rule (simulator/core/collectives.py) --------------
    def barrier(self, group: ProcessGroup, async_op: bool) -> Work | None:
        return self._run("barrier", _ARGS["barrier"](), group, async_op)

    def broadcast(self, tensor: torch.Tensor, root: int, group: ProcessGroup, async_op: bool) -> Work | None:
        return self._run("broadcast", _ARGS["broadcast"](tensor, root), group, async_op)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, group: ProcessGroup, async_op: bool) -> Work | None:
        return self._run("all_reduce", _ARGS["all_reduce"](tensor, op), group, async_op)

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp, group: ProcessGroup, async_op: bool) -> Work | None:
        return self._run("reduce", _ARGS["reduce"](tensor, root, op), group, async_op)

    def all_gather(self, output_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup,
                   async_op: bool) -> Work | None:
        return self._run("all_gather", _ARGS["all_gather"](output_list, tensor), group, async_op)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: ProcessGroup,
                               async_op: bool) -> Work | None:
        return self._run("all_gather_into_tensor", _ARGS["all_gather_into_tensor"](output, input), group, async_op)

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, root: int, group: ProcessGroup,
               async_op: bool) -> Work | None:
        return self._run("gather", _ARGS["gather"](tensor, gather_list, root), group, async_op)

    def scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, root: int, group: ProcessGroup,
                async_op: bool) -> Work | None:
        return self._run("scatter", _ARGS["scatter"](tensor, scatter_list, root), group, async_op)

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp, group: ProcessGroup,
                       async_op: bool) -> Work | None:
        return self._run("reduce_scatter", _ARGS["reduce_scatter"](output, input_list, op), group, async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, group: ProcessGroup,
                              async_op: bool) -> Work | None:
        return self._run("reduce_scatter_tensor", _ARGS["reduce_scatter_tensor"](output, input, op), group, async_op)

    def all_to_all(self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], group: ProcessGroup,
                   async_op: bool) -> Work | None:
        return self._run("all_to_all", _ARGS["all_to_all"](output_list, input_list), group, async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], group: ProcessGroup, async_op: bool) -> Work | None:
        return self._run("all_to_all_single", _ARGS["all_to_all_single"](
            output, input, list(output_split_sizes), list(input_split_sizes)), group, async_op)

    # -- point to point -----------------------------------------------------
    def send(self, tensor: torch.Tensor, peer: int, group: ProcessGroup, tag: int, async_op: bool) -> Work | None:
        rs = caller(self._rs)
        site = call_site(2)
        try:
            self._enter(rs, "send", site)
        except BaseException:
            done_with(rs)
            raise
        g: SimGroup = group.handle
        dst = g.ranks[peer]
        run = rs.run
        if run.p2p == "eager":  # buffered (MPI bsend-like): the message is copied now and the send is complete
            with torch.no_grad():
                tensor = tensor.detach().clone()
        rec = P2PRecord("send", rs, rs.rank, dst, g, tag, tensor, site, async_op)
        if run.p2p == "eager":
            rec.vend = rec.vstart + run.cost.cost("send", nbytes(tensor), 2)
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
        rs = caller(self._rs)
        site = call_site(2)
        try:
            self._enter(rs, "recv", site)
        except BaseException:
            done_with(rs)
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
        work = P2PWork(rec)
        if async_op:
            rec.rs.cpu_mark = _thread_time()  # a copy this rank made for the pair is not its compute
            rec.rs.unflushed.append(work)
            done_with(rec.rs)
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
                with torch.no_grad():  # c10d writes the buffer as memory: autograd never sees it (nor counts it)
                    rt.data.copy_(st if st.shape == rt.shape else st.reshape(rt.shape))
            except Exception as e:  # noqa: BLE001
                s.error = r.error = Incident(DistBackendError, format_message(
                    "recv", f"the simulator failed to copy the message: {type(e).__name__}: {e}",
                    group=s.group.ranks, fix="check the devices of the send and recv tensors"), cause=e)
        r.source = s.group.index[s.rs.rank]
        snd, rcv = s.rs.rank, r.rs.rank  # the sender's outgoing link, the receiver's incoming one
        start = links_start(run, (), max(s.vstart, r.vstart), send=snd, recv=rcv)
        end = start + run.cost.cost("send", nbytes(st), 2)
        links_reserve(run, (), end, send=snd, recv=rcv)
        if not s.done:  # an eager send completed when it was posted
            s.vend = end
            s.done = True
        r.vend = end
        r.done = True
        notify(s.rs, s, s.error)
        notify(r.rs, r, r.error, r.source)
        run.sched.wake(s.rs)
        run.sched.wake(r.rs)
        for rec in (s, r):
            if rec.others is not None:
                wake_others(rec, rec.error, rec.source)


register_backend("sim", SimBackend)
# ... and the RPC transports, here because every simulated world and every rank process imports this module;
# the transport modules themselves are imported only when a world uses RPC
register_transport("sim", "simulator.rpc")  # RPC inside a simulated world
register_transport("sim-process", "simulator.isolation.rpc_process")  # RPC in a process-isolated rank
