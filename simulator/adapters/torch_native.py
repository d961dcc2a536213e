"""Run unmodified torch.distributed code (DDP, FSDP2, DTensor, functional collectives) on simulated ranks.

Inside a simulated world, ``torch.distributed.init_process_group("sim")`` (or
any backend name torch knows, with ``env://``) creates a torch ``ProcessGroup`` whose
collectives call tensorplay.distributed on the simulator; a name torch refuses
(``"glo"``) is refused as torch refuses it.  torch keeps its
process-group bookkeeping in process-global state; simulated ranks are threads
of one process, so while a simulated world runs, this module gives every rank
thread its own copy of that state.

This is the one module that touches torch internals, all of them private and
liable to change between releases:

* ``torch.distributed.distributed_c10d._world`` (per-thread c10d state),
* ``torch._C._distributed_c10d._set_thread_isolation_mode`` (per-thread
  registry of group names, used by functional collectives),
* ``torch.distributed.rendezvous._rendezvous_handlers`` (an in-memory store
  instead of a TCP rendezvous),
* the Python ``ProcessGroup`` override names (``allreduce``,
  ``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``...).

It is therefore pinned: :data:`SUPPORTED_TORCH` lists the versions it is tested
with, and :func:`check_torch_version` refuses others with a clear message.

Example (4 simulated ranks, plain torch code)::

    import torch, torch.distributed as tdist, simulator

    def body():
        tdist.init_process_group("sim")
        x = torch.ones(2) * tdist.get_rank()
        tdist.all_reduce(x)
        return x

    simulator.run(body, 4)   # [tensor([6., 6.])] * 4
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, ContextManager, Iterator
from urllib.parse import urlparse

import torch
import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _set_thread_isolation_mode

import tensorplay.distributed as tpd
from tensorplay.distributed.api import _backend_name_refusal
from tensorplay.distributed.backends.base import completed_future
from tensorplay.distributed import _state
from tensorplay.distributed.errors import DistBackendError, DistError, DistRuntimeError, DistValueError, format_message
from tensorplay.distributed.group import ProcessGroup as TpGroup

from simulator.adapters import torch_groups, torch_profiling
from simulator.adapters._patch import Installation

# the package attribute of that name is the rendezvous() function; the module holds the handler table
tdist_rendezvous = importlib.import_module("torch.distributed.rendezvous")

__all__ = ["SUPPORTED_TORCH", "check_torch_version", "enabled", "SimProcessGroup", "SimWork"]

#: torch releases the adapter is tested with (major.minor)
SUPPORTED_TORCH = ("2.13", "2.14")


def check_torch_version(version: str | None = None) -> None:
    """Raise a clear error when the installed torch is not one the adapter supports."""
    v = version or torch.__version__
    if ".".join(v.split("+")[0].split(".")[:2]) not in SUPPORTED_TORCH:
        raise DistRuntimeError(format_message(
            "torch_native", "this torch release is not supported by the torch.distributed adapter",
            values={"torch": v, "supported": list(SUPPORTED_TORCH)},
            fix="install a supported torch (e.g. pip install torch==2.13.0), or use tensorplay.distributed "
                "directly, which needs no adapter"))


check_torch_version()


# ---------------------------------------------------------------------------
# the torch Work and ProcessGroup that forward to tensorplay.distributed
# ---------------------------------------------------------------------------
#: the tag of monitored_barrier's messages (a program's own tags are small; gloo keeps these apart likewise)
_MONITORED_TAG = -(2 ** 31) + 7
def _op(opts: Any) -> Any:
    op = opts.reduceOp
    return getattr(op, "op", op)  # torch's ReduceOp wraps a RedOpType; ours understands the latter


class SimWork(tdist.Work):
    """torch's ``Work`` for an operation issued on the simulator with ``async_op=True``.

    ``wait()`` waits on the simulator's own work objects, so the scheduler sees
    the wait (deadlock detection, coop hand-offs); nothing ever blocks in C++ on
    something the simulator cannot see.  torch's C++ side (DDP's reducer,
    functional collectives' ``wait_tensor``) reaches ``wait`` and
    ``get_future`` through pybind's trampoline, so they run this code too.

    ``result()``/``get_future().value()`` follow gloo: the op's output tensors.
    """

    def __init__(self, works: list[Any], result: list[Any], *, source: Any = None, refuse: str | None = None) -> None:
        super().__init__()
        self._refuse = refuse  # an error gloo gives this rank once the exchange is done (see _autograd_refusal)
        self._works = [w for w in works if w is not None]
        self._result = result
        self._source = source  # () -> sender's group rank, for receives
        self._done = False
        self._exc: BaseException | None = None
        self._fut: torch.futures.Future | None = None
        self._event: Any = None  # the profiler's event of this operation, closed when it is waited for
        self._timeout: timedelta | None = None  # its group's bound on the operation

    def wait(self, timeout: Any = None) -> bool:
        """Block (visibly to the simulator) until the operation finished, at most ``timeout`` (default: its group's
        timeout; torch's ``timedelta(0)`` means the same); raise its error if it failed."""
        if not self._done:
            bound = timeout if isinstance(timeout, timedelta) and timeout else self._timeout
            try:
                for w in self._works:
                    w.wait(bound)
                if self._refuse is not None:
                    raise DistBackendError(self._refuse)
            except BaseException as e:  # noqa: BLE001  kept for exception(), then re-raised as is
                self._exc = e
                raise
            finally:
                self._done = True
                if self._event is not None:
                    event, self._event = self._event, None
                    torch_profiling.completed(event)
        elif self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        if not self._done:
            if not self.is_completed():
                return False
            try:
                self.wait()
            except BaseException:  # noqa: BLE001  the failure is what is_success reports
                return False
        return self._exc is None

    def exception(self) -> Any:
        return self._exc

    def result(self) -> list[Any]:
        self.wait()
        return self._result

    def source_rank(self) -> int:
        if self._source is None:
            raise DistRuntimeError(format_message(
                "Work.source_rank", "sourceRank() may only be called on work objects that correspond to a recv "
                "or recv-from-any call", values={"work": "send" if not self._result else type(self).__name__},
                fix="call source_rank() on the work that irecv returned"))
        self.wait()
        return int(self._source())

    _source_rank = source_rank

    def get_future(self) -> torch.futures.Future:
        """A future holding the op's outputs.

        It is returned completed: torch waits on futures in C++ (DDP's reducer),
        where the simulator could not see the wait, so the operation is waited
        for here, visibly, first.
        """
        if self._fut is None:
            self._fut = completed_future(self.wait, lambda: self._result)
        return self._fut

    def synchronize(self) -> None:
        self.wait()


_LEAF_INPLACE = "a leaf Variable that requires grad is being used in an in-place operation"


def _autograd_refusal(name: str, rank: int, outputs: Any) -> str | None:
    """The error gloo gives this rank after the exchange, where it writes results with autograd-checked torch ops.

    gloo (torch 2.13) writes the results of all_reduce, broadcast, reduce,
    scatter, all_to_all_single and recv as raw memory, but copies those of
    all_gather, gather (on the root), all_to_all, reduce_scatter_tensor,
    all_reduce_coalesced and all_gather_into_tensor into the outputs with torch
    ops, in the caller's grad mode: a leaf output that requires grad makes that
    rank fail, while the other ranks finish.  Measured per collective on 2 gloo
    processes; none fails under ``torch.no_grad()``.  (An all_gather_into_tensor
    *input* that requires grad fails on some gloo ranks and not others, varying
    between runs: not imitated.)  tensorplay's own API writes every result as
    memory on every backend, so this is the torch front door's only.
    """
    if not torch.is_grad_enabled():
        return None
    bad = [i for i, t in enumerate(outputs or ()) if t.requires_grad and t.is_leaf]
    if not bad:
        return None
    what = {"outputs_requiring_grad": bad}
    return format_message(
        f"torch.distributed.{name}", f"{_LEAF_INPLACE} (gloo writes this collective's results with torch ops that "
        f"autograd checks, so this rank fails once the exchange is done, as it does on gloo)", rank=rank, values=what,
        fix="pass tensors that do not require grad (torch.empty(...), or .detach()), or call it under "
            "torch.no_grad(); for a collective that autograd differentiates, use "
            "tensorplay.distributed.nn.functional")


class _SimBackendView:
    """What ``ProcessGroup._get_backend(device)`` returns for a simulated group.

    torch's Python code asks a group's backend a few capability questions
    (splitting, coalescing, time estimates); the simulator supports none of
    them, which sends torch down the same generic paths gloo takes.
    """

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    supports_shrinking = False

    def __init__(self, pg: "SimProcessGroup", device: torch.device) -> None:
        self._pg = pg
        self.device = device

    def name(self) -> str:
        return self._pg.getBackendName()

    def rank(self) -> int:
        return self._pg.rank()

    def size(self) -> int:
        return self._pg.size()

    def supports_tensor_alloc(self, device: Any) -> bool:
        """A method on torch's ``Backend`` (FSDP2's ``set_allocate_memory_from_process_group_for_comm`` asks)."""
        return False

    def _set_sequence_number_for_group(self) -> None:
        pass

    def eager_connect_single_device(self, device: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"<simulated {self.name()} backend of {self._pg!r} for {self.device}>"


def _device_types_for(named: str) -> list[torch.device]:
    """The devices torch would register for backend ``named`` (gloo: cuda and cpu), plus the rank's own."""
    from simulator.core.state import rank_device

    types: list[str] = []
    try:
        types = list(c10d.BackendConfig(tdist.Backend(named)).get_device_backend_map())
    except Exception:  # noqa: BLE001  an unknown name: fall back to the rank's device below
        types = []
    own = rank_device().type
    standin = sys.modules.get("simulator.standin")
    # on CUDA stand-ins an "nccl" group is NCCL's: CUDA only (see _nccl_devices), so checkpointing's device query
    # (_get_pg_default_device) answers cuda, as on GPUs
    if own not in types and not (named == "nccl" and standin is not None and standin.is_active()):
        types.append(own)
    # c10d lists accelerators before cpu (gloo's group reports [cuda, cpu])
    return [torch.device(t) for t in sorted(set(types), key=lambda t: (t == "cpu", t))]


class SimProcessGroup(tdist.ProcessGroup):
    """A torch ProcessGroup whose operations run on the simulator through tensorplay.distributed.

    Every operation is issued asynchronously and returns a :class:`SimWork`;
    torch itself calls ``wait()`` for the blocking forms, as it does on gloo.
    To Python callers the group reports the backend the program named
    (``"gloo"``, ``"nccl"`` or ``"sim"``: ``get_backend``,
    ``_get_backend_name``) and that backend's devices (``_device_types``), so
    code that asks (object collectives, checkpointing) takes the path it would
    take on a real run; torch's C++ side sees backend ``"sim"``.
    """

    def __init__(self, group: TpGroup, named: str = "sim", timeout: timedelta | None = None) -> None:
        super().__init__(group.rank(), group.size())
        self._g = group
        self._named = str(named)
        self._types = _device_types_for(self._named)
        #: the bound on each of its operations (init_process_group / new_group's timeout=), as gloo's
        self._timeout = timeout if timeout else None

    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        # what torch's C++ side reads (DDP's logger, ...): "gloo" there would send it looking for a
        # ProcessGroupGloo; Python callers get the named backend from get_backend()/_get_backend_name()
        return "sim"

    def _get_backend_name(self) -> str:
        return self._named

    @property
    def _device_types(self) -> list[torch.device]:
        return list(self._types)

    def _get_backend(self, device: Any) -> _SimBackendView:
        dev = torch.device(device) if not isinstance(device, torch.device) else device
        if torch.device(dev.type) not in self._types:
            raise RuntimeError(format_message(
                "ProcessGroup._get_backend", "no backend is registered for this device type on the group",
                values={"device": str(dev), "registered": [str(t) for t in self._types], "backend": self._named},
                fix="use a tensor on one of the registered devices"))
        return _SimBackendView(self, torch.device(dev.type))

    @property
    def group_name(self) -> str:
        # torch records the name it gave the group in the (per-rank) c10d state; destroy_process_group(group)
        # drops that record before it unregisters the group by this name, so the record also keeps it here
        name = c10d._world.pg_names.get(self)
        return name if name is not None else self.__dict__.get("_tp_name") or c10d._world.pg_names[self]

    pg_name = group_name

    def __repr__(self) -> str:
        return f"SimProcessGroup(ranks={list(self._g.ranks)}, rank={self._g.rank()}, backend={self._named!r})"

    def _start_coalescing(self, device: Any) -> None:
        # gloo has no coalescing either; torch's generic paths (batch_isend_irecv, ...) never ask for it here
        raise RuntimeError(format_message(
            "ProcessGroup._start_coalescing", f"backend {self._named} does not implement startCoalescing",
            values={"backend": self._named, "device": str(device)},
            fix="use _coalescing_manager() without device= (each op is issued on its own, as on gloo)"))

    def _end_coalescing(self, device: Any) -> None:
        self._start_coalescing(device)

    # -- collectives (torch passes group ranks in opts.rootRank) -------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        op = _op(opts) if opts is not None else tpd.ReduceOp.SUM
        if any(t.layout == torch.sparse_coo for t in tensors):
            return self._sparse_allreduce(tensors, op)
        return SimWork([tpd.all_reduce(t, op=op, group=self._g, async_op=True) for t in tensors], tensors)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: Any) -> SimWork:
        """gloo's sparse all_reduce: each rank's (indices, values) gathered, summed, coalesced, written back in
        place.  gloo reduces sparse tensors with SUM only; NCCL none."""
        if self._named == "nccl" or getattr(op, "name", None) != "SUM":
            raise DistBackendError(format_message(
                "torch.distributed.all_reduce", f"backend {self._named} does not reduce sparse tensors with this op",
                rank=self._g.rank(), values={"op": op, "backend": self._named, "group": list(self._g.ranks)},
                fix="use ReduceOp.SUM on a gloo group, or reduce the dense tensor (t.to_dense())"))
        g, w = self._g, self._g.size()
        for t in tensors:
            c = t.coalesce()
            idx, val = c.indices(), c.values()
            counts = [torch.zeros(1, dtype=torch.long) for _ in range(w)]
            tpd.all_gather(counts, torch.tensor([idx.shape[1]]), group=g)
            m = int(max(int(n) for n in counts))
            pad_idx = idx.new_zeros((idx.shape[0], m))
            pad_idx[:, :idx.shape[1]] = idx
            pad_val = val.new_zeros((m, *val.shape[1:]))
            pad_val[:val.shape[0]] = val
            all_idx = [torch.empty_like(pad_idx) for _ in range(w)]
            all_val = [torch.empty_like(pad_val) for _ in range(w)]
            tpd.all_gather(all_idx, pad_idx, group=g)
            tpd.all_gather(all_val, pad_val, group=g)
            n = [int(k) for k in counts]
            total = torch.sparse_coo_tensor(torch.cat([a[:, :k] for a, k in zip(all_idx, n)], dim=1),
                                            torch.cat([v[:k] for v, k in zip(all_val, n)]), t.shape).coalesce()
            t.copy_(total)
        return SimWork([], tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        # the implementation itself, not the wrapped call: one operation, one profiler event (as gloo records it)
        work = SimProcessGroup.allreduce.__wrapped__(self, tensors, opts)
        work._refuse = _autograd_refusal("all_reduce_coalesced", self._g.rank(), tensors)
        return work

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        return SimWork([tpd.broadcast(t, group=self._g, group_src=opts.rootRank, async_op=True) for t in tensors],
                       tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        return SimWork([tpd.reduce(t, op=_op(opts), group=self._g, group_dst=opts.rootRank, async_op=True)
                        for t in tensors], tensors)

    def barrier(self, opts: Any = None) -> SimWork:
        return SimWork([tpd.barrier(group=self._g, async_op=True)], [])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier, as ProcessGroupGloo runs it: every other rank sends to the group's rank 0 and
        waits for its answer; rank 0 receives from each within ``timeout`` (default: the group's) and names the
        first rank (or, with ``wait_all_ranks``, every rank) that did not arrive; the others, left without an
        answer, say they reached the barrier and name rank 0.  Its messages are gloo's."""
        bound = timeout if isinstance(timeout, timedelta) else (
            timedelta(seconds=float(timeout)) if timeout is not None else self._timeout or timedelta(minutes=30))
        ms = int(bound.total_seconds() * 1000)
        g, me = self._g, self._g.rank()
        token = torch.zeros(1)
        if me != 0:
            try:
                tpd.isend(token, group=g, group_dst=0, tag=_MONITORED_TAG)
                tpd.irecv(token, group=g, group_src=0, tag=_MONITORED_TAG).wait(bound)
            except DistError as e:
                raise DistBackendError(
                    f"Rank {me} successfully reached monitoredBarrier, but received errors while waiting for "
                    f"send/recv from rank 0. Please check rank 0 logs for faulty rank.") from e
            return
        start = time.monotonic()
        failed: list[int] = []
        for peer in range(1, g.size()):
            # gloo: waiting for every rank gives each its whole timeout; else the ranks share one
            left = bound.total_seconds() - (0.0 if wait_all_ranks else time.monotonic() - start)
            if left <= 0:
                raise DistBackendError(f"Rank 0 timed out in monitoredBarrier after {ms} ms.")
            try:
                tpd.irecv(torch.zeros(1), group=g, group_src=peer, tag=_MONITORED_TAG).wait(timedelta(seconds=left))
            except DistError as e:
                if not wait_all_ranks:
                    raise DistBackendError(f"[Rank 0]: Rank {peer} failed to pass monitoredBarrier in {ms} ms") from e
                failed.append(peer)
        if failed:
            raise DistBackendError(f"[Rank 0]: Ranks {', '.join(map(str, failed))} failed to pass monitoredBarrier "
                                   f"in {ms} ms")
        for peer in range(1, g.size()):
            tpd.isend(token, group=g, group_dst=peer, tag=_MONITORED_TAG)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> SimWork:
        works = [tpd.all_gather(outs, t, group=self._g, async_op=True)
                 for outs, t in zip(output_tensors, input_tensors)]
        flat = [t for outs in output_tensors for t in outs]
        return SimWork(works, flat, refuse=_autograd_refusal("all_gather", self._g.rank(), flat))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> SimWork:
        # output_lists[r][i] receives rank r's input_list[i]: one all_gather per input tensor, as gloo does
        works = [tpd.all_gather([outs[i] for outs in output_lists], t, group=self._g, async_op=True)
                 for i, t in enumerate(input_list)]
        flat = [t for outs in output_lists for t in outs]
        return SimWork(works, flat, refuse=_autograd_refusal("all_gather_coalesced", self._g.rank(), flat))

    def _gloo_layout(self, name: str, flat: torch.Tensor, part: torch.Tensor, what: str) -> None:
        """gloo takes only the concatenated layout (``flat`` = ``W`` parts along dim 0); NCCL also the stacked one."""
        if self._named == "nccl":
            return
        w = self._g.size()
        rows = part.shape[0] if part.dim() else 1
        want = (w * rows, *part.shape[1:])
        if tuple(flat.shape) != want:
            raise DistBackendError(format_message(
                f"torch.distributed.{name}", f"invalid tensor size: {self._named} takes the {what} as the "
                f"concatenation of the {w} ranks' parts along dim 0 (ProcessGroupGloo refuses any other layout)",
                rank=self._g.rank(), values={f"{what}.shape": tuple(flat.shape), "expected": want},
                fix=f"allocate the {what} with shape {want} (e.g. torch.cat of the parts), or use the list form"))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        self._gloo_layout("all_gather_into_tensor", output, input, "output")
        return SimWork([tpd.all_gather_into_tensor(output, input, group=self._g, async_op=True)], [output],
                       refuse=_autograd_refusal("all_gather_into_tensor", self._g.rank(), [output]))

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> SimWork:
        return SimWork([tpd.all_gather_into_tensor(o, i, group=self._g, async_op=True)
                        for o, i in zip(outputs, inputs)], outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> SimWork:
        is_root = self._g.rank() == opts.rootRank
        w = tpd.gather(input_tensors[0], output_tensors[0] if is_root else None, group=self._g,
                       group_dst=opts.rootRank, async_op=True)
        outs = output_tensors[0] if is_root and output_tensors else []
        return SimWork([w], outs, refuse=_autograd_refusal("gather", self._g.rank(), outs))

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> SimWork:
        is_root = self._g.rank() == opts.rootRank
        w = tpd.scatter(output_tensors[0], input_tensors[0] if is_root else None, group=self._g,
                        group_src=opts.rootRank, async_op=True)
        return SimWork([w], output_tensors)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> SimWork:
        return SimWork([tpd.reduce_scatter(o, ins, op=_op(opts), group=self._g, async_op=True)
                        for o, ins in zip(output_tensors, input_tensors)], output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        self._gloo_layout("reduce_scatter_tensor", input, output, "input")
        return SimWork([tpd.reduce_scatter_tensor(output, input, op=_op(opts), group=self._g, async_op=True)],
                       [output], refuse=_autograd_refusal("reduce_scatter_tensor", self._g.rank(), [output]))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> SimWork:
        return SimWork([tpd.reduce_scatter_tensor(o, i, op=_op(opts), group=self._g, async_op=True)
                        for o, i in zip(outputs, inputs)], outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> SimWork:
        w = tpd.all_to_all_single(output, input, list(output_split_sizes) or None,
                                  list(input_split_sizes) or None, group=self._g, async_op=True)
        return SimWork([w], [output])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> SimWork:
        shapes = {tuple(t.shape) for t in [*output_tensors, *input_tensors]}
        if len(shapes) > 1 and self._named != "nccl":  # NCCL exchanges per-pair shapes; gloo only equal blocks
            raise DistBackendError(format_message(
                "torch.distributed.all_to_all", f"invalid tensor size: {self._named} exchanges equal blocks only "
                f"(ProcessGroupGloo::alltoall refuses per-pair shapes)", rank=self._g.rank(),
                values={"input_shapes": [tuple(t.shape) for t in input_tensors],
                        "output_shapes": [tuple(t.shape) for t in output_tensors]},
                fix="pad the blocks to one shape, or use all_to_all_single with split sizes"))
        return SimWork([tpd.all_to_all(output_tensors, input_tensors, group=self._g, async_op=True)],
                       output_tensors, refuse=_autograd_refusal("all_to_all", self._g.rank(), output_tensors))

    # -- point to point ----------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> SimWork:
        return SimWork([tpd.isend(t, group=self._g, group_dst=dst, tag=tag) for t in tensors], tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> SimWork:
        works = [tpd.irecv(t, group=self._g, group_src=src, tag=tag) for t in tensors]
        return SimWork(works, tensors, source=lambda: src)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> SimWork:
        w = tpd.irecv(tensors[0], group=self._g, tag=tag)
        # tensorplay reports the sender as a global rank; torch's _source_rank() is a group rank
        return SimWork([w], tensors, source=lambda: self._g.group_rank(w.source_rank()))


# ---------------------------------------------------------------------------
# groups: the world, and member-only subgroups
# ---------------------------------------------------------------------------
def _tp_group_for(global_ranks: list[int]) -> TpGroup:
    st = _state.current()
    if st is None or st.backend.name != "sim":
        raise DistRuntimeError(format_message(
            "init_process_group", "the 'sim' torch backend runs only on simulated ranks",
            values={"backend": "sim"},
            fix="run the code under simulator.run(fn, world_size) or `python -m simulator`"))
    members = getattr(_tls, "members", None)
    if not global_ranks and members is None:  # init_process_group's default group (torch passes no ranks for it)
        return st.world
    # any other group is a communicator of its own, even over every rank (torch's new_group() is): its
    # collectives never match the world's. torch calls the creator on member ranks only, so the group is
    # made without the non-members. Inside a default group over some simulated ranks, torch's ranks are that
    # group's: their simulated ranks are kept in torch's order (a group rank is its index)
    if members is not None:
        ranks = tuple(members)
    else:
        inner = getattr(c10d._world, "sim_members", None)
        ranks = tuple(sorted(global_ranks)) if inner is None else tuple(inner[r] for r in sorted(global_ranks))
    handle = st.backend.member_group_handle(ranks)
    pg = TpGroup(ranks, st.backend, handle, group_id=len(st.groups) + 1)
    st.groups.append(pg)
    return pg


_tls = threading.local()  # the backend name the program gave, while torch builds the group


def _create(dist_backend_opts: Any, backend_options: Any) -> SimProcessGroup:
    return SimProcessGroup(_tp_group_for(list(dist_backend_opts.global_ranks_in_group)),
                           getattr(_tls, "named", None) or "sim", getattr(dist_backend_opts, "timeout", None))


# ---------------------------------------------------------------------------
# per-thread c10d state while a simulated world runs
# ---------------------------------------------------------------------------
def _backend_errors(method: Any) -> Any:
    """Validation errors raised inside a group's call reach the caller as gloo's do: as RuntimeError.

    torch validates its own arguments in Python before calling the group; what
    tensorplay then refuses (an unknown op, a root outside the group, a shape)
    gloo refuses in C++, which torch raises as ``RuntimeError``
    (``DistBackendError``).  The message and the original error are kept.
    """
    name = method.__name__

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._named == "nccl":
            _nccl_devices(args)
        event = torch_profiling.issued(self._named, name, args)  # (None unless a profiler is on)
        try:
            work = method(self, *args, **kwargs)
        except DistError as e:
            torch_profiling.completed(event)
            if isinstance(e, RuntimeError):
                raise
            raise DistBackendError(str(e)) from e
        except BaseException:
            torch_profiling.completed(event)
            raise
        if event is not None:
            work._event = event
        work._timeout = self._timeout
        return work

    return call


def _nccl_devices(args: tuple) -> None:
    """NCCL's rule on CUDA stand-ins (``devices="cuda"``): a group the program made with "nccl" takes CUDA tensors
    only, and refuses a CPU tensor with torch's own error (a program that says "nccl" on plain CPU ranks keeps
    running on the simulated world, as before)."""
    standin = sys.modules.get("simulator.standin")
    if standin is None or not standin.is_active():
        return
    stack = list(args)
    while stack:
        a = stack.pop()
        if isinstance(a, (list, tuple)):
            stack.extend(a)
        elif isinstance(a, torch.Tensor):
            dev = standin.device_of(a)
            if dev.type != "cuda":
                raise RuntimeError(f"No backend type associated with device type {dev.type}")


_GROUP_CALLS = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "barrier", "allgather",
                "allgather_coalesced", "all_gather_single", "allgather_into_tensor_coalesced", "gather", "scatter",
                "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor_coalesced", "all_to_all_single",
                "alltoall", "send", "recv", "recv_anysource")
#: torch's other names for some calls (bound to the same functions when the class was made)
_ALIASES = {"_allgather_base": "all_gather_single", "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
            "_reduce_scatter_base": "reduce_scatter_single",
            "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced", "alltoall_base": "all_to_all_single"}
for _name in _GROUP_CALLS:
    setattr(SimProcessGroup, _name, _backend_errors(getattr(SimProcessGroup, _name)))
for _alias, _name in _ALIASES.items():
    setattr(SimProcessGroup, _alias, getattr(SimProcessGroup, _name))


class _NameTable(dict):
    """torch's group -> name table; a simulated group also keeps its name, for torch's lookups after removal."""

    def __setitem__(self, pg: Any, name: Any) -> None:
        if isinstance(pg, SimProcessGroup):
            pg.__dict__["_tp_name"] = name
        super().__setitem__(pg, name)


class _RankWorld(c10d._World):
    """One simulated rank's c10d bookkeeping.

    torch's ``_World`` keeps most of its tables in module globals, which the
    rank threads would share; here every table belongs to the instance.
    """

    def __init__(self) -> None:
        super().__init__()
        self._tables: dict[str, Any] = {
            "pg_map": {}, "pg_names": _NameTable(), "pg_group_ranks": {}, "pg_backend_config": {}, "tags_to_pg": {},
            "pg_to_tag": {},
        }
        self._count = 0
        self.sim_members: tuple[int, ...] | None = None  # the default group's simulated ranks, when not the world

    pg_map = property(lambda self: self._tables["pg_map"])
    pg_names = property(lambda self: self._tables["pg_names"])
    pg_group_ranks = property(lambda self: self._tables["pg_group_ranks"])
    pg_backend_config = property(lambda self: self._tables["pg_backend_config"])
    tags_to_pg = property(lambda self: self._tables["tags_to_pg"])
    pg_to_tag = property(lambda self: self._tables["pg_to_tag"])

    @property
    def group_count(self) -> int:
        return self._count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._count = value


class _PerRankWorld:
    """Stands in for c10d's ``_world``: each simulated rank thread sees its own; other threads the original."""

    def __init__(self, original: Any) -> None:
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_local", threading.local())

    def _target(self) -> Any:
        w = getattr(self._local, "world", None)
        return self._original if w is None else w

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target(), name, value)


class _PerThreadTable:
    """Stands in for a process-global mutable table of torch's (a set or dict in a class attribute).

    A real process has one such table per rank; rank threads would share one,
    and torch code that keeps "in progress" bookkeeping there (FSDP1's
    ``SimpleProfiler.profiling`` around collectives of ``optim_state_dict``)
    then sees another rank's entries.  Each thread gets its own table, made by
    ``factory``; threads outside a simulated world use the original.
    """

    def __init__(self, original: Any, factory: Any) -> None:
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_factory", factory)
        object.__setattr__(self, "_local", threading.local())

    def _target(self) -> Any:
        if _state.current() is None:
            return self._original
        t = getattr(self._local, "table", None)
        if t is None:
            t = self._factory()
            self._local.table = t
        return t

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __contains__(self, key: Any) -> bool:
        return key in self._target()

    def __getitem__(self, key: Any) -> Any:
        return self._target()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._target()[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._target()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._target())

    def __len__(self) -> int:
        return len(self._target())

    def __bool__(self) -> bool:
        return bool(self._target())

    def __repr__(self) -> str:
        return repr(self._target())


def _isolate_fsdp1_profiler(module: Any) -> Any:
    """FSDP1's ``SimpleProfiler`` keeps "being profiled" in class-level tables: per thread while a world runs."""
    from collections import defaultdict

    owner = module.SimpleProfiler
    saved = {attr: owner.__dict__[attr] for attr in ("profiling", "results")}
    owner.profiling = _PerThreadTable(saved["profiling"], set)
    owner.results = _PerThreadTable(saved["results"], lambda: defaultdict(float))

    def undo() -> None:
        for attr, original in saved.items():
            setattr(owner, attr, original)

    return undo


def _isolate_dtensor_op_handlers(module: Any) -> Any:
    """DTensor's custom op handlers (one process-wide table) per rank thread.

    ``loss_parallel()`` adds its handlers to ``DTensor._op_dispatcher._custom_op_handlers``
    on entry and pops them on exit: rank threads sharing one table pop each other's
    entries (``KeyError`` on the second exit) and run their loss outside the context
    while another rank has left it.  A property on the dispatcher class hands each
    rank thread its own copy of the table (torch's C++ dispatch reads the attribute
    on every call); other threads read the dispatcher's own table.
    """
    cls = module.OpDispatcher
    name = "_custom_op_handlers"
    local = threading.local()

    def tables() -> dict[int, dict[Any, Any]]:
        t = getattr(local, "tables", None)
        if t is None:
            t = local.tables = {}
        return t

    def get(self: Any) -> dict[Any, Any]:
        own = self.__dict__[name]
        if _state.current() is None:
            return own
        t = tables()
        if id(self) not in t:
            t[id(self)] = dict(own)
        return t[id(self)]

    def set_(self: Any, value: dict[Any, Any]) -> None:
        if _state.current() is None or name not in self.__dict__:
            self.__dict__[name] = value
        else:
            tables()[id(self)] = value

    had = name in cls.__dict__
    previous = cls.__dict__.get(name)
    setattr(cls, name, property(get, set_))

    def undo() -> None:
        if had:
            setattr(cls, name, previous)
        else:
            delattr(cls, name)

    return undo


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` right after module ``name`` is first executed (a post-import hook)."""

    def __init__(self, name: str, then: Any) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        loader, then = spec.loader, self.then

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                then(module)

        spec.loader = _Loader()
        return spec


def _when_imported(name: str, apply: Any) -> Any:
    """``apply(module)`` to module ``name`` now if imported, else right after its import; returns the undo.

    The modules patched this way (FSDP1, DTensor) take a second or more to
    import: a program that never imports them must not pay for it.
    """
    undos: list[Any] = []
    module = sys.modules.get(name)
    if module is not None:
        undos.append(apply(module))
        hook = None
    else:
        hook = _AfterImport(name, lambda m: undos.append(apply(m)))
        sys.meta_path.insert(0, hook)

    def undo() -> None:
        if hook is not None and hook in sys.meta_path:
            sys.meta_path.remove(hook)
        while undos:
            undos.pop()()

    return undo


def _ddp_logging_names_the_backend(module: Any) -> Any:
    """DDP's logging data reports the backend the program named (``"gloo"``), as on a real run: its C++ logger
    reads the group's ``getBackendName()``, which is ``"sim"`` for torch's C++ side (see SimProcessGroup)."""
    cls = module.DistributedDataParallel
    original = cls.__dict__["_get_ddp_logging_data"]

    @functools.wraps(original)
    def _get_ddp_logging_data(self: Any) -> Any:
        data = original(self)
        pg = getattr(self, "process_group", None)
        if isinstance(pg, SimProcessGroup) and data.get("backend_name") == "sim":
            data["backend_name"] = named = pg._get_backend_name()
            if named == "gloo":  # what DDP's logger adds for a gloo group (its environment, its thread count)
                env = os.environ
                data.update(gloo_socket_ifname=env.get("GLOO_SOCKET_IFNAME", "N/A"),
                            gloo_device_transport=env.get("GLOO_DEVICE_TRANSPORT", "N/A"), gloo_num_threads=2)
        return data

    cls._get_ddp_logging_data = _get_ddp_logging_data

    def undo() -> None:
        cls._get_ddp_logging_data = original

    return undo


#: torch's process-wide tables that code changes around collectives, and what it reports of the backend:
#: (module, isolate(module) -> undo)
_ISOLATED = (("torch.distributed.fsdp._debug_utils", _isolate_fsdp1_profiler),
             ("torch.distributed.tensor._dispatch", _isolate_dtensor_op_handlers),
             ("torch.nn.parallel.distributed", _ddp_logging_names_the_backend))


_lock = threading.Lock()
_saved: dict[str, Any] = {}
_stores: dict[Any, Any] = {}  # world -> rendezvous store; (world, host, port) -> TCPStore stand-in
_SCHEMES = ("env", "tcp", "file")


def _sim_state() -> Any:
    """The calling simulated rank's tensorplay state, or ``None`` outside a simulated world."""
    from simulator.core.backend import SimBackend

    st = _state.current()
    return st if st is not None and isinstance(st.backend, SimBackend) else None


def _mismatch(call: str, what: str, given: int, st: Any) -> DistValueError:
    actual = st.rank if what == "rank" else st.world_size
    return DistValueError(format_message(
        call, f"the program asks for {what}={given}, but this simulated rank has {what}={actual}",
        values={what: given, f"simulated_{what}": actual, "simulated_rank": st.rank,
                "simulated_world_size": st.world_size},
        fix=f"start as many simulated ranks as the program expects (python -m simulator --nproc-per-node "
            f"{given if what == 'world_size' else 'N'} script.py; for a script that starts its own ranks, "
            f"nprocs=N or N Process objects), or let the program read its rank and world size from the "
            "environment (RANK, WORLD_SIZE) as torchrun sets them"))


def _rendezvous_handler(scheme: str) -> Any:
    def handler(url: str, timeout: Any = None, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        st = _sim_state()
        if st is None:
            original = _saved["rdzv"][scheme]
            yield from original(url, **kwargs) if timeout is None else original(url, timeout=timeout, **kwargs)
            return
        # explicit rank/world_size (init_process_group(rank=..., world_size=...) or the URL) must be this rank's,
        # or claim a rank of a smaller group over some of the simulated ranks (torch_groups)
        query = tdist_rendezvous._query_to_dict(urlparse(url).query)
        size = int(query.get("world_size", -1))
        rank = int(query.get("rank", -1))
        key = id(st.backend.world_key())
        if size != -1 and size < st.world_size and rank != -1:
            where = torch_groups.rendezvous_key(url)
            _tls.rendezvous = where  # the helper joins the group's members there
            with _lock:  # one store per rendezvous: two subset groups never see each other's keys
                store = _stores.setdefault((key, "rendezvous", where), tdist.HashStore())
            yield store, rank, size
        else:
            for what, given in (("rank", rank), ("world_size", size)):
                if given != -1 and given != (st.rank if what == "rank" else st.world_size):
                    raise _mismatch("init_process_group", what, given, st)
            # one in-memory store per simulated world, shared by its rank threads; never a socket or a file
            with _lock:
                store = _stores.setdefault(key, tdist.HashStore())
            yield store, st.rank, st.world_size
        raise DistRuntimeError(format_message(
            "init_process_group", "a simulated rank cannot re-rendezvous", values={"init_method": url},
            fix="destroy the process group and call init_process_group again"))

    handler.__name__ = f"_sim_{scheme}_rendezvous_handler"
    return handler


class _StoreClassMeta(type):
    """``isinstance(x, torch.distributed.TCPStore)`` stays true for real TCP stores while the stand-in is installed."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _saved.get("TCPStore", tdist.TCPStore)) or obj in _sim_tcp_stores()

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _saved.get("TCPStore", tdist.TCPStore))


def _sim_tcp_stores() -> list[Any]:
    return [v for k, v in list(_stores.items()) if isinstance(k, tuple) and k[1] != "rendezvous"]


class _TCPStore(metaclass=_StoreClassMeta):
    """Stands in for ``torch.distributed.TCPStore`` while a simulated world runs.

    On a simulated rank, ``TCPStore(host, port, world_size, is_master, ...)``
    returns the world's in-memory store for that address: rank threads cannot
    serve each other over sockets (the master would wait in C++ for workers the
    simulator never gets to run).  Elsewhere it is the real ``TCPStore``.
    """

    def __new__(cls, host_name: str = "", port: int = 0, *args: Any, **kwargs: Any) -> Any:
        st = _sim_state()
        if st is None:
            return _saved["TCPStore"](host_name, port, *args, **kwargs)
        key = (id(st.backend.world_key()), str(host_name), int(port))
        with _lock:
            return _stores.setdefault(key, tdist.HashStore())  # type: ignore[arg-type]


def _new_process_group_helper(group_size: int, group_rank: int, global_ranks_in_group: list[int], backend: Any,
                              store: Any, group_name: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's one place that builds a group's backend; on a simulated rank every backend is the simulator.

    ``init_process_group``, ``new_group``, ``init_device_mesh`` and friends look
    this module global up at call time, so no import style escapes it.
    """
    original = _saved["helper"]
    st = _sim_state()
    if st is None or str(backend).lower() == "fake":
        # ("fake": torch's process-local group for tracing, every process its own world over a FakeStore, nothing
        # communicated: torch's own, on a simulated rank too)
        return original(group_size, group_rank, global_ranks_in_group, backend, store, group_name, *args, **kwargs)
    default = len(global_ranks_in_group) == 0
    members = None
    if default:
        where, _tls.rendezvous = getattr(_tls, "rendezvous", None), None
        if group_size != -1 and group_size < st.world_size and group_rank != -1:
            # a group over some of the simulated ranks: its members are whoever claims its ranks at this rendezvous
            if where is None:  # init_process_group(store=...): the store is the rendezvous
                where = ("store", id(getattr(store, "underlying_store", store)))
            members = torch_groups.join(st.backend.world_key(), where, group_rank, group_size, st.rank,
                                        st.world_size)
        else:
            if group_size not in (-1, st.world_size):
                raise _mismatch("init_process_group", "world_size", group_size, st)
            if group_rank not in (-1, st.rank):
                raise _mismatch("init_process_group", "rank", group_rank, st)
            group_size, group_rank = st.world_size, st.rank
        # torch wraps sys.excepthook with a "[rank<r>]" prefixer; rank threads would nest them
        _tls.excepthook = sys.excepthook
    torch_rank = _torch_rank(st.rank)
    if default or torch_rank in global_ranks_in_group:  # (torch sends a non-member away before it reads the name)
        # every name becomes the simulator below: first refuse, as torch's helper would, a name torch does not know
        refusal = _backend_name_refusal(f"torch.distributed.{'init_process_group' if default else 'new_group'}",
                                        backend)
        if refusal is not None:
            raise refusal
    named = tdist.Backend(str(backend)) if backend is not None else tdist.Backend("undefined")
    if len(args) >= 1:  # backend_options: options of the real backend mean nothing to the simulator
        args = (None,) + tuple(args[1:])
    kwargs.pop("backend_options", None)
    _tls.named = str(named)
    _tls.members = members
    try:
        pg, prefix_store = original(group_size, group_rank, global_ranks_in_group, "sim", store, group_name,
                                    *args, **kwargs)
    finally:
        _tls.named = _tls.members = None
    if default:
        c10d._world.sim_members = members  # torch's ranks -> simulated ranks, for the groups made inside it
    if isinstance(pg, SimProcessGroup):
        # what a real run records: the backend the program named, and its configuration
        world = c10d._world
        world.pg_map[pg] = (named, world.pg_map[pg][1])
        try:
            world.pg_backend_config[pg] = str(c10d.BackendConfig(named))
        except Exception:  # noqa: BLE001  a name torch cannot configure: keep torch's record
            pass
    return pg, prefix_store


def _torch_rank(sim_rank: int) -> int:
    """This simulated rank's rank in torch's default group (they differ inside a group over some ranks)."""
    inner = getattr(c10d._world, "sim_members", None)
    return sim_rank if inner is None or sim_rank not in inner else inner.index(sim_rank)


def _is_barrier_after_init() -> int:
    """Runs right after init_process_group installed its excepthook: a simulated rank puts the old one back."""
    hook = getattr(_tls, "excepthook", None)
    if hook is not None and _sim_state() is not None:
        _tls.excepthook = None
        if getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook":
            sys.excepthook = hook
    return _saved["barrier_after_init"]()


def _install() -> None:
    _saved["world"] = c10d._world
    _saved["rdzv"] = {s: tdist_rendezvous._rendezvous_handlers[s] for s in _SCHEMES
                      if s in tdist_rendezvous._rendezvous_handlers}
    _saved["helper"] = c10d._new_process_group_helper
    _saved["barrier_after_init"] = c10d._is_barrier_after_init
    _saved["excepthook"] = sys.excepthook
    _saved["TCPStore"] = tdist.TCPStore
    c10d._world = _PerRankWorld(_saved["world"])
    # the process-wide name table too (process isolation uses torch's own _World): see SimProcessGroup.group_name
    _saved["pg_names"] = c10d._pg_names
    c10d._pg_names = _NameTable(c10d._pg_names)
    for s in _saved["rdzv"]:
        tdist_rendezvous._rendezvous_handlers[s] = _rendezvous_handler(s)
    c10d._new_process_group_helper = _new_process_group_helper
    c10d._is_barrier_after_init = _is_barrier_after_init
    tdist.TCPStore = _TCPStore  # type: ignore[misc]
    # a CPU build of torch has no NCCL default timeout (None), and init_process_group("nccl") warns for it: NCCL's own
    # default (10 minutes) while the simulator binds "nccl" to its world
    _saved["nccl_timeout"] = getattr(c10d, "default_pg_nccl_timeout", None)
    if _saved["nccl_timeout"] is None:
        c10d.default_pg_nccl_timeout = timedelta(minutes=10)
    _saved["isolated"] = [_when_imported(name, isolate) for name, isolate in _ISOLATED]
    _set_thread_isolation_mode(True)


def _uninstall() -> None:
    # tolerates a partial installation (what was saved is put back)
    for attr, key in (("_world", "world"), ("_new_process_group_helper", "helper"),
                      ("_is_barrier_after_init", "barrier_after_init")):
        if key in _saved:
            setattr(c10d, attr, _saved.pop(key))
    if "pg_names" in _saved:
        names = c10d._pg_names
        c10d._pg_names = _saved.pop("pg_names")
        c10d._pg_names.update(names)  # (groups named while installed, outside simulated ranks, stay named)
    if "rdzv" in _saved:
        tdist_rendezvous._rendezvous_handlers.update(_saved.pop("rdzv"))
    if "excepthook" in _saved:
        sys.excepthook = _saved.pop("excepthook")
    if "TCPStore" in _saved:
        tdist.TCPStore = _saved.pop("TCPStore")  # type: ignore[misc]
    if "nccl_timeout" in _saved:
        c10d.default_pg_nccl_timeout = _saved.pop("nccl_timeout")
    for undo in reversed(_saved.pop("isolated", [])):
        undo()
    _set_thread_isolation_mode(False)
    _stores.clear()
    torch_groups.reset()


_INSTALLATION = Installation(_install, _uninstall)


def enabled() -> ContextManager[None]:
    """While active, torch.distributed in simulated rank threads is per-rank and runs on the simulator."""
    return _INSTALLATION.enabled()


@contextlib.contextmanager
def rank_thread() -> Iterator[None]:
    """Give the calling (simulated rank) thread fresh c10d state; tear it down afterwards."""
    world = c10d._world
    if not isinstance(world, _PerRankWorld):
        yield
        return
    world._local.world = _RankWorld()
    try:
        yield
    finally:
        try:
            if world._local.world.default_pg is not None:
                tdist.destroy_process_group()
        except Exception:  # noqa: BLE001  best effort: the thread's state is dropped below anyway
            pass
        world._local.world = None


tdist.Backend.register_backend("sim", _create, extended_api=True, devices=["cpu", "cuda"])
