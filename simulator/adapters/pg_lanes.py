"""A simulated group's backends by device: the device types it reports, and one communicator per backend of a
group of several backends (``"cpu:gloo,cuda:nccl"``).

torch's ``ProcessGroup`` of several backends sends each operation to the backend registered for its tensors'
device, and each backend is a communicator of its own: the operations on CPU tensors (gloo's) and those on CUDA
tensors (NCCL's) are matched each in their own order, never against each other. ``dcp.async_save``'s recipe
relies on it: the saver's thread gathers CPU tensors while the training loop all-reduces CUDA ones. A simulated
group matches the operations of one communicator in one sequence, so such a group holds a second one, made by
its members when the group is made, for its CPU tensors.

Each call's tensors then follow their backend's rules; those that differ between NCCL and gloo live here too:
NCCL's reduce ops and dtypes, its flat buffers, its point-to-point with oneself and over non-contiguous tensors.
"""
from __future__ import annotations

import sys
import threading
import warnings
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d

from tensorplay.distributed import state as dist_state
from tensorplay.distributed.errors import DistBackendError, format_message

from simulator.adapters.process_group_work import SimWork, _nccl_devices, coalescing

from simulator.core.state import rank_device

__all__ = ["LanesMixin", "backends_by_device", "device_types_for"]

_warned = threading.local()  # (a rank's once-only warnings: each rank thread, each rank process has its own)

#: the reductions NCCL does not have (gloo has them, on integers)
_BITWISE = frozenset({tdist.ReduceOp.RedOpType.BAND, tdist.ReduceOp.RedOpType.BOR, tdist.ReduceOp.RedOpType.BXOR})
_AVG, _PREMUL = tdist.ReduceOp.RedOpType.AVG, tdist.ReduceOp.RedOpType.PREMUL_SUM
#: what NCCL's premultiplied sum takes (its unpackPreMulSum)
_PREMUL_DTYPES = frozenset({torch.float16, torch.float32, torch.bfloat16, torch.float64})
#: float8 types NCCL moves as bytes (gathers, broadcasts) but does not reduce
_BYTES_FLOAT8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))


def device_types_for(named: str) -> list[torch.device]:
    """The devices torch would register for backend ``named`` (gloo: cuda and cpu), plus the rank's own."""
    types = list(backends_by_device(named))  # (an unknown name: none, the rank's device below)
    own = rank_device().type
    standin = sys.modules.get("simulator.standin")
    # on CUDA stand-ins an "nccl" group is NCCL's: CUDA only (see _nccl_devices), so checkpointing's device query
    # (_get_pg_default_device) answers cuda, as on GPUs
    if own not in types and not (named == "nccl" and standin is not None and standin.is_active()):
        types.append(own)
    # c10d lists accelerators before cpu (gloo's group reports [cuda, cpu])
    return [torch.device(t) for t in sorted(set(types), key=lambda t: (t == "cpu", t))]


def backends_by_device(named: str) -> dict[str, str]:
    """The backend torch registers for each device type of a group made with backend ``named``."""
    try:
        return {str(k): str(v) for k, v in c10d.BackendConfig(tdist.Backend(named)).get_device_backend_map().items()}
    except Exception:  # noqa: BLE001  a name torch does not know (a plugin, "sim"): one backend
        return {}


class LanesMixin:
    """What :class:`~simulator.adapters.process_group.SimProcessGroup` uses to pick the communicator of a call."""

    #: makes a communicator over some simulated ranks (``process_group._member_group``, set there)
    member_group: Any = None
    _g: Any
    _cpu_lane: Any = None
    _by_device: dict[str, str] = {}

    def _open_lanes(self, named: str) -> None:
        """Give the CPU tensors a communicator of their own when CPU and CUDA have different backends here (only
        where CUDA tensors can exist: on GPUs or stand-ins)."""
        by_device = self._by_device = backends_by_device(named)  # (read at every call: see _speaks_nccl)
        if "cpu" in by_device and by_device.get("cuda", by_device["cpu"]) != by_device["cpu"] \
                and torch.cuda.is_available():
            self._cpu_lane = type(self).member_group(dist_state.current(), tuple(self._g.ranks))

    def _speaks_nccl(self, t: torch.Tensor) -> bool:
        """Whether calls on ``t`` follow NCCL's rules: an "nccl" group, or the CUDA side of "cpu:gloo,cuda:nccl"."""
        named: str = self._named  # type: ignore[attr-defined]
        # (on every group call: a tensor's device, a Python property on stand-ins, is read for mixed groups only)
        return named == "nccl" or (":" in named and self._nccl_for(t.device.type))

    def _reduction(self, call: str, rop: Any, tensors: list[torch.Tensor]) -> Any:
        """``rop``, checked as ProcessGroupNCCL checks it as the call starts, for tensors that go to NCCL (gloo's
        own rules are tensorplay's): no bitwise reductions; no AVG of booleans; PREMUL_SUM of floating dtypes only;
        no reductions of the float8 types NCCL moves as bytes."""
        if not tensors or not self._speaks_nccl(tensors[0]):
            return rop
        dtype, name = tensors[0].dtype, getattr(rop, "name", str(rop))
        if rop in _BITWISE:
            why, kind, fix = f"Cannot use ReduceOp.{name} with NCCL", ValueError, (
                "reduce the integers on a gloo group (new_group(backend='gloo'), or CPU tensors of "
                "'cpu:gloo,cuda:nccl'), or all_gather them and fold with torch.bitwise_and/or/xor")
        elif rop == _AVG and dtype == torch.bool:
            why, kind, fix = "Cannot use ReduceOp.AVG with boolean inputs", TypeError, (
                "reduce with SUM (a logical or on NCCL) or MIN, or cast to a floating dtype first")
        elif rop == _PREMUL and dtype not in _PREMUL_DTYPES:
            why, kind, fix = "PreMulSum Data type must be half, float, bfloat16 or double", TypeError, (
                "cast to a floating dtype first, or reduce with SUM and scale the result")
        elif dtype in _BYTES_FLOAT8:
            why, kind, fix = "Float8 dtypes are not currently supported for NCCL reductions", RuntimeError, (
                "reduce in float8_e4m3fn/float8_e5m2 or a wider dtype, or gather the bytes (all_gather)")
        else:
            return rop
        raise kind(format_message(f"torch.distributed.ProcessGroupNCCL.{call}", why, group=self._g.ranks,
                                  rank=self._g.rank(), values={"op": f"ReduceOp.{name}", "dtype": str(dtype)},
                                  fix=fix))

    def _barrier_device(self, opts: Any) -> Any:
        """The device of a barrier (``device_ids[0]``, else the bound or current one). NCCL's barrier all-reduces one
        element made on it: a device past the node's last, or not the group's bound one, fails as there."""
        device = getattr(opts, "device", None)
        if self._named == "nccl" and getattr(device, "type", None) in ("cuda", "privateuseone"):  # type: ignore
            _nccl_devices(self, "barrier", (torch.zeros(1, device=device),))
        return device

    def _p2p_buffer(self, t: torch.Tensor) -> torch.Tensor:
        """What a point-to-point call moves of ``t``: NCCL moves ``numel`` elements of the storage from the tensor's
        first one, whatever its strides (warning once, as ProcessGroupNCCL does); gloo the tensor's own elements."""
        if not self._speaks_nccl(t) or t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(
                memory_format=torch.channels_last)):
            return t
        if not getattr(_warned, "p2p", False):
            _warned.p2p = True
            warnings.warn("Detected non-contiguous tensor in P2P operations. It is user responsibility to guarantee "
                          "that source and destination tensors have the same contiguity format.", stacklevel=4)
        return t.detach().as_strided((t.numel(),), (1,), t.storage_offset())  # (a view of its storage, no graph)

    def _layout(self, name: str, flat: torch.Tensor, part: torch.Tensor, what: str) -> torch.Tensor:
        """gloo takes only the concatenated layout (``flat`` = ``W`` parts along dim 0).  NCCL sees flat buffers:
        any contiguous ``flat`` of ``W`` times ``part``'s elements (SyncBatchNorm gathers into a ``(1, W * n)``
        tensor), handed on as a view in the concatenated layout."""
        w = self._g.size()
        rows = part.shape[0] if part.dim() else 1
        want = (w * rows, *part.shape[1:])
        if self._speaks_nccl(part):
            if tuple(flat.shape) == want or tuple(flat.shape) == (w, *part.shape) or not flat.is_contiguous():
                return flat
            if flat.numel() != w * part.numel():
                raise DistBackendError(format_message(
                    f"torch.distributed.{name}", f"{what} tensor size must be equal to world_size times "
                    f"{'input' if what == 'output' else 'output'} tensor size (ProcessGroupNCCL)", group=self._g.ranks,
                    rank=self._g.rank(),
                    values={f"{what}.numel()": flat.numel(), "world_size": w, "part.numel()": part.numel()},
                    fix=f"allocate the {what} with {w * part.numel()} elements, e.g. shape {want}"))
            return flat.view(want)
        if tuple(flat.shape) != want:
            raise DistBackendError(format_message(
                f"torch.distributed.{name}", f"invalid tensor size: {self._named} takes the {what} as the "
                f"concatenation of the {w} ranks' parts along dim 0 (ProcessGroupGloo refuses any other layout)",
                group=self._g.ranks, rank=self._g.rank(),
                values={f"{what}.shape": tuple(flat.shape), "expected": want},
                fix=f"allocate the {what} with shape {want} (e.g. torch.cat of the parts), or use the list form"))
        return flat

    def _nccl_shaped(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """A list reduce_scatter's inputs as NCCL reads them: each input's elements, in its output's shape (gloo
        compares the shapes)."""
        if not self._speaks_nccl(outputs[0]):
            return inputs
        return [[t.reshape(o.shape) if t.numel() == o.numel() else t for t in ins] for o, ins in zip(outputs, inputs)]

    # -- NCCL's point-to-point with oneself (torch's isend/irecv allow it; gloo has no pair to itself) ---------------
    def _to_self(self, tensors: list[torch.Tensor]) -> SimWork:
        """A send to this rank: its values as of the call, for the receive that takes them (in posting order)."""
        self.__dict__.setdefault("_tp_to_self", []).extend(t.detach().clone() for t in tensors)
        return SimWork([], tensors)

    def _from_self(self, tensors: list[torch.Tensor]) -> SimWork:
        """A receive from this rank: filled, when waited for, from its sends to itself (a batch posts both first)."""
        me = self._g.rank()

        def take() -> None:
            box = self.__dict__.get("_tp_to_self") or []
            if len(box) < len(tensors):
                raise DistBackendError(format_message(
                    "torch.distributed.irecv", "a receive from this rank has no send to it: NCCL would wait for ever",
                    group=list(self._g.ranks), rank=me, values={"src": me},
                    fix="post the matching isend(tensor, dst=<this rank>) before waiting (batch_isend_irecv posts "
                        "both)"))
            with torch.no_grad():
                for t in tensors:
                    sent = box.pop(0)
                    if sent.numel() != t.numel():
                        raise DistBackendError(format_message(
                            "torch.distributed.irecv", "a receive from this rank is not the size of its send",
                            group=list(self._g.ranks), rank=me, values={"sent": sent.numel(), "received": t.numel()},
                            fix="receive into a tensor of the sent tensor's size"))
                    t.copy_(sent.view(t.shape))

        return SimWork([], tensors, after=take, source=lambda: me)

    def _nccl_for(self, device_type: str) -> bool:
        named: str = self._named  # type: ignore[attr-defined]
        return named == "nccl" or (":" in named and self._by_device.get(device_type) == "nccl")

    # -- NCCL's coalescing (dist._coalescing_manager(device=...)): gloo has none ----------------------------------
    def _start_coalescing(self, device: Any) -> None:
        """Start NCCL's group of operations: those this thread issues until ``_end_coalescing`` are waited for by
        the work that returns (issued at once here; NCCL launches them together at the end, with the same results)."""
        self._coalescing_backend("_start_coalescing", device)
        coalescing.works = []

    def _end_coalescing(self, device: Any) -> SimWork:
        self._coalescing_backend("_end_coalescing", device)
        works = coalescing.__dict__.pop("works", None)
        if works is None:
            raise RuntimeError(self._coalescing_error(
                "_end_coalescing", "no coalescing was started on this thread", device,
                "call _start_coalescing(device) first, or use torch.distributed._coalescing_manager(device=...)"))
        return SimWork(works, [])

    def _coalescing_backend(self, call: str, device: Any) -> None:
        named: str = self._named  # type: ignore[attr-defined]
        if not self._nccl_for(torch.device(device).type):
            raise RuntimeError(self._coalescing_error(
                call, f"backend {named} does not implement startCoalescing", device,
                "use _coalescing_manager() without device= (each op is issued on its own, as on gloo)"))

    def _coalescing_error(self, call: str, problem: str, device: Any, fix: str) -> str:
        named: str = self._named  # type: ignore[attr-defined]
        return format_message(f"ProcessGroup.{call}", problem, rank=self._g.rank(), values={
            "backend": named, "group": list(self._g.ranks), "device": str(device)}, fix=fix)

    def _speaks_gloo(self, t: torch.Tensor) -> bool:
        """Whether calls on ``t`` follow gloo's rules: a "gloo" group, or the CPU side of "cpu:gloo,cuda:nccl"."""
        named: str = self._named  # type: ignore[attr-defined]
        return named == "gloo" or (":" in named and self._by_device.get(t.device.type) == "gloo")

    def _check_tag(self, call: str, tag: Any, t: torch.Tensor) -> None:
        """A point-to-point tag as the backend serving ``t`` checks it (``GlooRules.tag``)."""
        if type(tag) is not int or not 0 <= tag < 2 ** 31:  # (a tag in range costs the send this test only)
            self._rules(call).tag(tag, nccl=self._speaks_nccl(t))  # type: ignore[attr-defined]

    def _lane(self, t: Any) -> Any:
        """The communicator for an operation on ``t`` (a tensor or a device; ``None``: the group's own)."""
        cpu = self._cpu_lane
        if cpu is None or t is None:
            return self._g
        dev = t if isinstance(t, torch.device) else t.device
        return cpu if dev.type == "cpu" else self._g
