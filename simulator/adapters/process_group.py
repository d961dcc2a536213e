"""The torch ``ProcessGroup`` whose operations run on the simulator, and how torch creates one.

Part of the torch.distributed adapter (:mod:`simulator.adapters.torch_native`, which registers
:func:`_create` as torch's ``"sim"`` backend): every process group torch builds on a simulated rank is a
:class:`SimProcessGroup` over a tensorplay group of the simulated world.  It reports the backend the program
named (gloo, nccl) and imitates that backend's refusals.  The private torch names it overrides are listed in
:mod:`simulator.adapters.torch_private`.
"""
from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d

import tensorplay.distributed as tpd
from tensorplay.distributed import state as dist_state
from tensorplay.distributed.errors import DistBackendError, DistError, DistRuntimeError, format_message
from tensorplay.distributed.group import ProcessGroup as TpGroup

from simulator.adapters.gloo_composites import reduce_scatter_sized, sparse_allreduce
from simulator.adapters.nccl_composites import allgather_reshaped
from simulator.adapters.gloo_rules import GlooRules, combine, premul_factor, reduce_op, root_of, tensor_list
from simulator.adapters.pg_lanes import LanesMixin, device_types_for
from simulator.adapters.pg_split import SplitMixin
from simulator.adapters.process_group_work import NcclDeviceRule, SimWork, _autograd_refusal, _backend_errors
from simulator.adapters.torch_private import check_torch_version
from simulator.core.state import rank_device
from simulator.core.works import GroupTimeout

__all__ = ["SimProcessGroup"]

check_torch_version()  # (refuses an unsupported torch before its classes are subclassed below)

#: the backends torch names a group's type after (any other, a plugin's, is "custom")
_BUILTIN_TYPES = ("gloo", "nccl", "mpi", "ucc", "xccl")
#: what reduce_op gives for NCCL's premultiplied sum (its factor: gloo_rules.premul_factor), and the sum it becomes
_PREMUL, _SUM = tdist.ReduceOp.RedOpType.PREMUL_SUM, tdist.ReduceOp.RedOpType.SUM

#: the tag of monitored_barrier's messages (a program's own tags are small; gloo keeps these apart likewise)
_MONITORED_TAG = -(2 ** 31) + 7


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
        # (a real group's backend for the device names itself, "nccl" or "gloo"; torch's C++ side reads getBackendName)
        return self._pg._by_device.get(self.device.type) or self._pg.name()

    options = property(lambda self: self._pg.options)  # (the group's, as a group's one backend holds them)

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

    @staticmethod
    def create_device(hostname: str = "", interface: str = "", lazy_init: Any = None) -> Any:
        """gloo's device factory (torch's tests call it on a group's backend): torch's own, nothing connects."""
        return c10d.ProcessGroupGloo.create_device(hostname=hostname, interface=interface, lazy_init=lazy_init)

    def __repr__(self) -> str:
        return f"<simulated {self.name()} backend of {self._pg!r} for {self.device}>"


class SimProcessGroup(SplitMixin, LanesMixin, tdist.ProcessGroup):
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
        self._types = device_types_for(self._named)
        self._open_lanes(self._named)  # "cpu:gloo,cuda:nccl": a communicator per backend (see pg_lanes)
        standin = sys.modules.get("simulator.standin")
        # NCCL's device rule, where the group's calls meet (on rank processes they meet in the coordinator, which
        # sees their tensors without devices: not checked there)
        if "nccl" in self._named and standin is not None and standin.is_active() and hasattr(group.handle, "rule"):
            group.handle.rule = NcclDeviceRule(tuple(group.ranks))
        self._bound_operations_by(timeout if timeout else None)

    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        # what torch's C++ side reads (DDP's logger, ...): "gloo" there would send it looking for a
        # ProcessGroupGloo; Python callers get the named backend from get_backend()/_get_backend_name()
        return "sim"

    def _get_backend_name(self) -> str:
        return self._named

    def name(self) -> str:
        """What torch's ``pg.name()`` says on a real run: the default backend's type (gloo, nccl, …; ``"custom"``
        for a plugin), not the ``"sim"`` that torch's C++ side reads through getBackendName."""
        named = self._named
        if ":" in named:  # a "cpu:gloo,cuda:nccl" configuration: the rank's device's backend
            pairs = dict(p.split(":", 1) for p in named.replace(" ", "").split(",") if ":" in p)
            named = pairs.get(rank_device().type, pairs.get("cpu", next(iter(pairs.values()), named)))
        if named == "undefined":  # init_process_group() without a backend makes cpu:gloo (and cuda:nccl)
            named = "nccl" if rank_device().type == "cuda" else "gloo"
        return named if named in _BUILTIN_TYPES else "custom"

    @property
    def options(self) -> Any:
        """The backend's options (``_timeout``): those given to ``ProcessGroupGloo(...)``, else the group's."""
        opts = self.__dict__.get("_tp_options")
        if opts is None:
            opts = self._tp_options = c10d.ProcessGroupGloo._Options()
            opts._timeout = self._timeout or c10d.default_pg_timeout
        return opts

    def _bound_operations_by(self, timeout: timedelta | None) -> None:
        #: the bound on each of its operations (init_process_group / new_group's timeout=), as gloo's
        self._timeout = timeout
        #: the same, marked as the group's for the waits it bounds (their timeout error names the group's setting)
        self._bound = GroupTimeout(seconds=timeout.total_seconds()) if timeout is not None else None

    def _set_default_timeout(self, timeout: timedelta) -> None:
        """The bound on the group's later operations (ProcessGroupGloo's ``_set_default_timeout``)."""
        self._bound_operations_by(timeout)
        self.options._timeout = timeout

    set_timeout = _set_default_timeout

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

    # -- collectives (torch passes group ranks in opts.rootRank) -------------
    # torch's front door passes one tensor in a list and an options object; a program calling the group itself
    # may pass several tensors or use the pybind overloads (pg.allreduce(t), pg.broadcast(t, root=0)): both are
    # taken, with gloo's argument checks and several-tensor meaning (gloo_rules)
    def _get_sequence_number_for_group(self) -> int:
        """How many operations this rank has issued on the group (the same on every member, as on gloo)."""
        return self.__dict__.get("_tp_seq", 0)

    def _set_sequence_number_for_group(self) -> None:
        self._tp_seq = self.__dict__.get("_tp_seq", 0)

    def _rules(self, call: str) -> GlooRules:
        return GlooRules(call, self._g.rank(), self._g.ranks, "NCCL" if self._named == "nccl" else "Gloo")

    def allreduce(self, tensors: Any, opts: Any = None, op: Any = None) -> SimWork:
        tensors = tensor_list(tensors)
        rop = self._reduction("allreduce", reduce_op(opts, op), tensors)
        if rop == _PREMUL:  # NCCL's premultiplied sum: the inputs (overwritten by the result) scaled, summed
            for t in tensors:
                t.mul_(premul_factor(opts, op, self._speaks_nccl(t)))
            rop = _SUM
        op = rop
        if len(tensors) == 1 and tensors[0].layout == torch.strided:  # torch's front door: nothing left to check
            return SimWork([tpd.all_reduce(tensors[0], op=op, group=self._lane(tensors[0]), async_op=True)], tensors)
        rules = self._rules("allreduce")
        rules.non_empty(tensors)
        rules.layouts_match(tensors)
        if any(t.layout == torch.sparse_coo for t in tensors):
            return SimWork([], sparse_allreduce(self._lane(tensors[0]), self._named, tensors, op, rules))
        rules.type_and_sizes(tensors)
        # several inputs: gloo reduces this rank's inputs together, then across the ranks, into every input
        folded = combine(tensors, op)
        return SimWork([tpd.all_reduce(folded, op=op, group=self._lane(folded), async_op=True)], tensors,
                       after=lambda: [t.copy_(folded) for t in tensors])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        tensors = list(tensors)
        rules = self._rules("allreduce_coalesced")
        rules.non_empty(tensors)
        rules.layouts_match(tensors)  # (gloo checks the layouts first: a sparse int64 among dense floats is a layout error)
        for t in tensors:
            if t.dtype != tensors[0].dtype:
                raise rules.fail("tensors must all have the same type", "pass tensors of one dtype",
                                 dtype=str(t.dtype), expected=str(tensors[0].dtype))
        if tensors[0].layout != torch.strided:
            raise rules.fail("unsupported layout", "pass dense tensors (t.to_dense())", layout=str(tensors[0].layout))
        # gloo flattens the tensors into one buffer, reduces it once and copies the parts back (a tensor given twice
        # is reduced once)
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])

        def copy_back() -> None:
            offset = 0
            with torch.no_grad():
                for t in tensors:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

        return SimWork([tpd.all_reduce(flat, op=self._reduction("allreduce_coalesced", reduce_op(opts), tensors),
                                       group=self._lane(flat), async_op=True)], tensors,
                       after=copy_back, refuse=_autograd_refusal("all_reduce_coalesced", self._g.rank(), tensors))

    def broadcast(self, tensors: Any, opts: Any = None, root: int | None = None) -> SimWork:
        tensors = tensor_list(tensors)
        opts, root_rank = root_of(opts, root)  # (or the overload broadcast(tensor, root))
        root_tensor = opts.rootTensor if opts is not None else 0
        rules = self._rules("broadcast")
        rules.root_rank(root_rank)
        rules.root_tensor(root_tensor, len(tensors))
        rules.type_and_sizes(tensors)
        me = self._g.rank()
        # the root sends its tensors[rootTensor]; every tensor of every rank receives it
        buf = tensors[root_tensor] if me == root_rank else tensors[0]
        w = tpd.broadcast(buf, group=self._lane(buf), group_src=root_rank, async_op=True)
        rest = [t for t in tensors if t is not buf]
        return SimWork([w], tensors, after=(lambda: [t.copy_(buf) for t in rest]) if rest else None, weak_result=True)

    def reduce(self, tensors: Any, opts: Any = None, root: int | None = None, op: Any = None) -> SimWork:
        tensors = tensor_list(tensors)
        opts, root_rank = root_of(opts, root)  # (or the overload reduce(tensor, root, op))
        rules = self._rules("reduce")
        rules.root_rank(root_rank)
        rules.root_tensor(opts.rootTensor if opts is not None else 0, len(tensors))
        rules.single(tensors, "tensor list")
        rules.dense(tensors)
        rop = self._reduction("reduce", reduce_op(opts, op), tensors)
        if rop == _PREMUL:  # a scaled copy is summed: a rank that is not the root keeps its input
            t = tensors[0]
            scaled = t * premul_factor(opts, op, self._speaks_nccl(t))
            w = tpd.reduce(scaled, group=self._lane(t), group_dst=root_rank, async_op=True)
            return SimWork([w], tensors, after=(lambda: t.copy_(scaled)) if self._g.rank() == root_rank else None)
        return SimWork([tpd.reduce(tensors[0], op=rop, group=self._lane(tensors[0]),
                                   group_dst=root_rank, async_op=True)], tensors)

    def barrier(self, opts: Any = None) -> SimWork:
        return SimWork([tpd.barrier(group=self._lane(self._barrier_device(opts)), async_op=True)], [])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier, as ProcessGroupGloo runs it: every other rank sends to the group's rank 0 and
        waits for its answer; rank 0 receives from each within ``timeout`` (default: the group's) and names the
        first rank (or, with ``wait_all_ranks``, every rank) that did not arrive; the others, left without an
        answer, say they reached the barrier and name rank 0.  Its messages are gloo's."""
        bound = timeout if isinstance(timeout, timedelta) else (
            timedelta(seconds=float(timeout)) if timeout is not None else self._timeout or timedelta(minutes=30))
        ms = int(bound.total_seconds() * 1000)
        token = torch.zeros(1)
        g, me = self._lane(token), self._g.rank()
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

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> SimWork:
        if isinstance(input_tensors, torch.Tensor):  # the overload allgather(output_list, tensor)
            output_tensors, input_tensors = [list(output_tensors)], [input_tensors]
        outs, ins = [list(o) for o in output_tensors], list(input_tensors)
        rules = self._rules("allgather")
        rules.non_empty(ins, "input tensor list")
        if len(outs) != len(ins):
            raise rules.fail("requires input/output tensor lists to have the same length",
                             "pass one output list per input tensor", outputs=len(outs), inputs=len(ins))
        n, w = len(ins), self._g.size()
        for i, o in enumerate(outs):
            if len(o) != n * w:
                raise rules.fail(f"invalid output tensor list at index {i} (expected length {n * w}, got {len(o)})",
                                 f"give each output list {n * w} tensors (inputs per rank x group size)")
        rules.dense(ins)
        if n == 1 and self._speaks_nccl(ins[0]) and any(o.shape != ins[0].shape for o in outs[0]):
            return SimWork([], allgather_reshaped(self._lane(ins[0]), outs[0], ins[0]),
                           refuse=_autograd_refusal("all_gather", self._g.rank(), outs[0]))
        rules.type_and_sizes(ins)
        for o in outs:
            rules.type_and_sizes(o, like=ins[0])
        # outs[j][r * n + i] receives rank r's input i, for every j: one all_gather per input, into outs[0]
        works = [tpd.all_gather([outs[0][r * n + i] for r in range(w)], t, group=self._lane(t), async_op=True)
                 for i, t in enumerate(ins)]
        flat = [t for o in outs for t in o]
        def copy_rest() -> None:  # (the other outputs' copies of outs[0])
            for o in outs[1:]:
                for dst, src in zip(o, outs[0]):
                    dst.copy_(src)
        # gloo's future holds the output list (a list of lists when there are several)
        return SimWork(works, outs[0] if len(outs) == 1 else outs, after=copy_rest if len(outs) > 1 else None,
                       refuse=_autograd_refusal("all_gather", self._g.rank(), flat))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> SimWork:
        rules = self._rules("allgather_coalesced")
        if len(output_lists) != self._g.size():
            raise rules.fail("output lists should be equal to world size", "pass one output list per rank",
                             output_lists=len(output_lists), group_size=self._g.size())
        for outs in output_lists:
            if len(outs) != len(input_list):
                raise rules.fail(f"invalid output size: (expected length {len(input_list)}, got {len(outs)})",
                                 "give each output list one tensor per input tensor")
            for i, (o, t) in enumerate(zip(outs, input_list)):
                if o.shape != t.shape:
                    raise rules.fail(f"invalid size of output tensor at index {i}", "match each input's shape",
                                     shape=tuple(o.shape), expected=tuple(t.shape))
                if o.dtype != t.dtype:
                    raise rules.fail(f"invalid tensor type at index {i}", "match each input's dtype",
                                     dtype=str(o.dtype), expected=str(t.dtype))
        # output_lists[r][i] receives rank r's input_list[i]: one all_gather per input tensor, as gloo does
        works = [tpd.all_gather([outs[i] for outs in output_lists], t, group=self._lane(t), async_op=True)
                 for i, t in enumerate(input_list)]
        flat = [t for outs in output_lists for t in outs]
        return SimWork(works, flat, refuse=_autograd_refusal("all_gather_coalesced", self._g.rank(), flat))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        laid = self._layout("all_gather_into_tensor", output, input, "output")
        return SimWork([tpd.all_gather_into_tensor(laid, input, group=self._lane(input), async_op=True)], [output],
                       refuse=_autograd_refusal("all_gather_into_tensor", self._g.rank(), [output]))

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> SimWork:
        return SimWork([tpd.all_gather_into_tensor(o, i, group=self._lane(i), async_op=True)
                        for o, i in zip(outputs, inputs)], outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None, root: int | None = None) -> SimWork:
        if isinstance(input_tensors, torch.Tensor):  # the overload gather(output_list, tensor, root)
            output_tensors, input_tensors = ([list(output_tensors)] if output_tensors else []), [input_tensors]
        opts, root_rank = root_of(opts, root)
        ins, is_root = list(input_tensors), self._g.rank() == root_rank
        self._rules("gather").rooted(root_rank, is_root, ins, "input tensor list", output_tensors, "output")
        w = tpd.gather(ins[0], output_tensors[0] if is_root else None, group=self._lane(ins[0]), group_dst=root_rank,
                       async_op=True)
        outs = list(output_tensors[0]) if is_root else []
        return SimWork([w], outs, refuse=_autograd_refusal("gather", self._g.rank(), outs))

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None, root: int | None = None) -> SimWork:
        if isinstance(output_tensors, torch.Tensor):  # the overload scatter(tensor, input_list, root)
            output_tensors, input_tensors = [output_tensors], ([list(input_tensors)] if input_tensors else [])
        opts, root_rank = root_of(opts, root)
        outs, is_root = list(output_tensors), self._g.rank() == root_rank
        self._rules("scatter").rooted(root_rank, is_root, outs, "output tensor list", input_tensors, "input")
        w = tpd.scatter(outs[0], list(input_tensors[0]) if is_root else None, group=self._lane(outs[0]),
                        group_src=root_rank, async_op=True)
        return SimWork([w], outs)

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None, op: Any = None) -> SimWork:
        if isinstance(output_tensors, torch.Tensor):  # the overload reduce_scatter(tensor, input_list, op)
            output_tensors, input_tensors = [output_tensors], [list(input_tensors)]
        rop = self._reduction("reduce_scatter", reduce_op(opts, op), output_tensors)
        if rop == _PREMUL:  # NCCL's premultiplied sum: scaled copies of the inputs, summed
            factor = premul_factor(opts, op, self._speaks_nccl(output_tensors[0]))
            input_tensors = [[t * factor for t in ins] for ins in input_tensors]
            rop = _SUM
        op = rop
        input_tensors = self._nccl_shaped(output_tensors, input_tensors)
        if any(t.shape != o.shape for o, ins in zip(output_tensors, input_tensors) for t in ins):
            sized = [list(ins) for ins in input_tensors]
            return SimWork([], reduce_scatter_sized(self._lane(output_tensors[0]), list(output_tensors), sized, op,
                                                    self._rules("reduce_scatter")))
        return SimWork([tpd.reduce_scatter(o, list(ins), op=op, group=self._lane(o), async_op=True)
                        for o, ins in zip(output_tensors, input_tensors)], list(output_tensors))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:
        laid = self._layout("reduce_scatter_tensor", input, output, "input")
        rop = self._reduction("reduce_scatter_tensor", reduce_op(opts), [output])
        if rop == _PREMUL:  # NCCL's premultiplied sum (FSDP2's gradient divide factor): a scaled copy, summed
            laid, rop = laid * premul_factor(opts, None, self._speaks_nccl(output)), _SUM
        return SimWork([tpd.reduce_scatter_tensor(output, laid, op=rop, group=self._lane(output), async_op=True)],
                       [output], refuse=_autograd_refusal("reduce_scatter_tensor", self._g.rank(), [output]))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> SimWork:
        rop = self._reduction("reduce_scatter_tensor_coalesced", reduce_op(opts), outputs)
        if rop == _PREMUL:
            factor = premul_factor(opts, None, self._speaks_nccl(outputs[0]))
            inputs, rop = [i * factor for i in inputs], _SUM
        return SimWork([tpd.reduce_scatter_tensor(o, i, op=rop, group=self._lane(o), async_op=True)
                        for o, i in zip(outputs, inputs)], outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> SimWork:
        if not input.is_contiguous():  # (torch raises this ValueError for gloo and NCCL alike)
            raise ValueError(format_message(
                "torch.distributed.all_to_all_single", "Tensors must be contiguous", group=self._g.ranks,
                rank=self._g.rank(),
                values={"input.shape": tuple(input.shape), "input.stride": input.stride()},
                fix="pass input.contiguous()"))
        w = tpd.all_to_all_single(output, input, list(output_split_sizes) or None,
                                  list(input_split_sizes) or None, group=self._lane(input), async_op=True)
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
        g = self._lane(input_tensors[0])
        return SimWork([tpd.all_to_all(output_tensors, input_tensors, group=g, async_op=True)], output_tensors,
                       refuse=_autograd_refusal("all_to_all", self._g.rank(), output_tensors))

    # -- point to point ----------------------------------------------------------
    # NCCL leaves tags unused (a pair's messages match in posting order): on its lane every tag is 0; gloo's match
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> SimWork:
        self._check_tag("send", tag, tensors[0])
        tag = 0 if self._speaks_nccl(tensors[0]) else tag
        if dst == self._g.rank() and self._speaks_nccl(tensors[0]):  # (torch's isend/irecv to self, on NCCL)
            return self._to_self(tensors)
        return SimWork([tpd.isend(self._p2p_buffer(t), group=self._lane(t), group_dst=dst, tag=tag) for t in tensors],
                       tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> SimWork:
        self._check_tag("recv", tag, tensors[0])
        tag = 0 if self._speaks_nccl(tensors[0]) else tag
        if src == self._g.rank() and self._speaks_nccl(tensors[0]):
            return self._from_self(tensors)
        works = [tpd.irecv(self._p2p_buffer(t), group=self._lane(t), group_src=src, tag=tag) for t in tensors]
        return SimWork(works, tensors, source=lambda: src)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> SimWork:
        self._check_tag("recvAnysource", tag, tensors[0])
        if self._speaks_nccl(tensors[0]):  # (ProcessGroupNCCL does not implement it: the base Backend refuses)
            raise DistBackendError(format_message(
                "torch.distributed.recv", "Backend nccl does not support recvAnysource (NCCL has no receive from "
                "any source)", group=list(self._g.ranks), rank=self._g.rank(), values={"src": None},
                fix="name the sender: recv(tensor, src=<its rank>)"))
        w = tpd.irecv(tensors[0], group=self._lane(tensors[0]), tag=tag)
        # tensorplay reports the sender as a global rank; torch's _source_rank() is a group rank
        return SimWork([w], tensors, source=lambda: self._g.group_rank(w.source_rank()))


# every operation's errors reach the caller as gloo's (see process_group_work._backend_errors)
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


# ---------------------------------------------------------------------------
# groups: the world, and member-only subgroups
# ---------------------------------------------------------------------------
def _tp_group_for(global_ranks: list[int], name: str | None = None) -> TpGroup:
    st = dist_state.current()
    if st is None or st.backend.name != "sim":
        raise DistRuntimeError(format_message(
            "init_process_group", "the 'sim' torch backend runs only on simulated ranks",
            values={"backend": "sim"},
            fix="run the code under simulator.run(fn, world_size) or `python -m simulator`"))
    st.backend.awaiting_init = False  # torch's init_process_group: the script's world is its default group now
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
        # (in torch's order: new_group(ranks, sort_ranks=False) makes group rank i the i-th rank given)
        ranks = tuple(global_ranks) if inner is None else tuple(inner[r] for r in global_ranks)
    return _member_group(st, ranks, name)


def _member_group(st: Any, ranks: tuple[int, ...], name: str | None = None) -> TpGroup:
    """A new communicator of this simulated rank's world over the simulated ranks ``ranks`` (in that order; ``name``:
    torch's name of the group, under which its members meet)."""
    pg = TpGroup(ranks, st.backend, st.backend.member_group_handle(ranks, name), group_id=len(st.groups) + 1)
    st.groups.append(pg)
    return pg


def direct_group(ranks: tuple[int, ...], options: Any) -> SimProcessGroup:
    """The group a program builds itself with ``ProcessGroupGloo(store, rank, size, options)`` on a simulated
    rank (see torch_globals' stand-in): a communicator of its own over ``ranks``, reporting gloo and ``options``."""
    pg = SimProcessGroup(_member_group(dist_state.current(), ranks), "gloo", options._timeout)
    pg._tp_options = options
    pg._tp_direct = True
    return pg


SplitMixin.direct = staticmethod(direct_group)  # (pg_split's groups are built as the program's own are)
LanesMixin.member_group = staticmethod(_member_group)


#: while torch builds a group on this thread (set by torch_globals' group helper): the backend name the program
#: gave, the members of a default group over some simulated ranks, the rendezvous it came from
_tls = threading.local()


def _create(dist_backend_opts: Any, backend_options: Any) -> SimProcessGroup:
    return SimProcessGroup(_tp_group_for(list(dist_backend_opts.global_ranks_in_group),
                                         getattr(dist_backend_opts, "group_id", None) or None),
                           getattr(_tls, "named", None) or "sim", getattr(dist_backend_opts, "timeout", None))
