"""torch's ``ProcessGroupWrapper`` checks on a simulated group.

``torch.distributed._create_process_group_wrapper(pg, ...)`` (and every gloo/nccl group made while
``TORCH_DISTRIBUTED_DEBUG=DETAIL``) wraps a group in one that, before each collective, runs a monitored barrier
with every rank on a helper gloo group (its timeout the wrapper's) and then compares the ranks' *fingerprints*
(sequence number, op type, tensors' shapes, dtypes and device types) over that helper group: a rank that does
not come is named by rank 0 (``Ranks 1 failed to pass monitoredBarrier``), the others say ``Please check rank 0
logs for faulty rank``; a disagreement is raised at the call, on every rank, as torch's ``Detected mismatch
between collectives on ranks. ... Collectives differ in the following aspects: ...``.  On a simulated group the
same checks run over a helper communicator of the simulator (:meth:`SimProcessGroup.monitored_barrier`, gloo's
algorithm and messages, and an all-gather).
"""
from __future__ import annotations

import ast
from datetime import timedelta
from typing import Any

import torch

import tensorplay.distributed as tpd
from tensorplay.distributed import state as dist_state

from simulator.adapters.process_group import SimProcessGroup, _member_group
from simulator.core.backend import SimBackend

#: torch's own ``_create_process_group_wrapper``, while the adapter replaces it (adapters.torch_native)
ORIGINAL: dict[str, Any] = {}

#: c10::toString(ScalarType)
_DTYPES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
           torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
           torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _flat(item)]
    return []


#: ProcessGroupWrapper's op type for each group method, and which arguments' tensors it fingerprints (the index of
#: the argument; two for ``_reduce_scatter_base``'s input then output; none where it checks no shapes)
_CHECKED: dict[str, tuple[str, tuple[int, ...]]] = {
    "allreduce": ("ALLREDUCE", (0,)), "broadcast": ("BROADCAST", (0,)), "reduce": ("REDUCE", (0,)),
    "allgather": ("ALLGATHER", (1,)), "all_gather_single": ("_ALLGATHER_BASE", (1,)), "gather": ("GATHER", (1,)),
    "scatter": ("SCATTER", (0,)), "reduce_scatter": ("REDUCE_SCATTER", (0,)),
    "reduce_scatter_single": ("_REDUCE_SCATTER_BASE", (1, 0)), "barrier": ("BARRIER", ()),
    # (uneven splits and coalesced lists: the wrapper checks the op type only)
    "allreduce_coalesced": ("ALLREDUCE_COALESCED", ()), "allgather_coalesced": ("ALLGATHER_COALESCED", ()),
    "all_to_all_single": ("ALLTOALL_BASE", ()), "alltoall": ("ALLTOALL", ()),
}


def _checked(call: str, args: tuple) -> tuple[str, list[torch.Tensor]] | None:
    """ProcessGroupWrapper's op type for a group call and the tensors it fingerprints (None: forwarded unchecked,
    as the wrapper forwards send and recv)."""
    entry = _CHECKED.get(call)
    if entry is None:
        return None
    op, at = entry
    return op, [t for i in at if i < len(args) for t in _flat(args[i])]


def _device_text(device_type: str) -> str:
    # what torch 2.13's wrapper prints for a tensor's device type (observed on gloo: a TensorOptions)
    default = {torch.float32: "float", torch.float64: "double"}.get(torch.get_default_dtype(), "float")
    return (f"TensorOptions(dtype={default} (default), device={device_type}, layout=Strided (default), "
            "requires_grad=false (default), pinned_memory=false (default), memory_format=(nullopt))")


def _text(fp: tuple) -> str:
    seq, op, tensors = fp
    if not tensors:
        return f"CollectiveFingerPrint(SequenceNumber={seq}OpType={op})"
    return (f"CollectiveFingerPrint(SequenceNumber={seq}, OpType={op}, TensorShape=[{_shape(fp)}], "
            f"TensorDtypes={', '.join(t[0] for t in tensors)}, "
            f"TensorDeviceTypes={', '.join(_device_text(t[1]) for t in tensors)})")


def _shape(fp: tuple) -> str:
    return ", ".join(map(str, fp[2][0][2])) if fp[2] else ""  # (the first tensor's: the wrapper's choice)


def _diff(mine: tuple, theirs: tuple) -> str:
    parts = []
    if mine[0] != theirs[0]:
        parts.append(f"\t Sequence number: {mine[0]}vs {theirs[0]}")
    if mine[1] != theirs[1]:
        parts.append(f"  Op type: {mine[1]}vs {theirs[1]}")
    for what, of in (("shapes", lambda fp: [_shape(fp)] if fp[2] else []),
                     ("dtypes", lambda fp: [t[0] for t in fp[2]]),
                     ("devices", lambda fp: [_device_text(t[1]) for t in fp[2]])):
        a, b = of(mine), of(theirs)
        if a != b:
            parts.append(f"  Tensor Tensor {what}: {', '.join(a)}vs {', '.join(b)}")
    return "Collectives differ in the following aspects: " + "".join(parts) if parts else ""


class WrapperChecks:
    """The checks one wrapped group runs before each collective (``helper``: a gloo group over its ranks)."""

    def __init__(self, helper: Any, timeout: timedelta) -> None:
        self.helper = helper
        self.timeout = timeout

    def __call__(self, call: str, args: tuple, seq: int) -> None:
        what = _checked(call, args)
        if what is None:
            return
        op, tensors = what
        fp = (seq, op, tuple((_DTYPES.get(t.dtype, str(t.dtype)), t.device.type, tuple(t.shape)) for t in tensors))
        try:
            self.helper.monitored_barrier(self.timeout, wait_all_ranks=True)
        except RuntimeError as e:
            raise RuntimeError(f"ProcessGroupWrapper: Monitored Barrier encountered error running collective: "
                               f"{_text(fp)}. Error: \n{e}") from e
        g = self.helper._g
        data = torch.tensor(list(repr(fp).encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(g.size())]
        tpd.all_gather(sizes, torch.tensor([data.numel()]), group=g)
        width = int(max(s.item() for s in sizes))
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[:data.numel()] = data
        outs = [torch.zeros(width, dtype=torch.uint8) for _ in range(g.size())]
        tpd.all_gather(outs, padded, group=g)
        for i, (out, n) in enumerate(zip(outs, sizes)):
            theirs = ast.literal_eval(bytes(out[:int(n.item())].tolist()).decode())
            if theirs != fp:
                raise RuntimeError(  # (torch's TORCH_CHECK: a plain RuntimeError, on every rank)
                    f"Detected mismatch between collectives on ranks. Rank {g.rank()} is running collective: "
                    f"{_text(fp)}, but Rank {i} is running collective: {_text(theirs)}.{_diff(fp, theirs)}")


def wrap(pg: Any, timeout: Any) -> Any:
    """Give the simulated group ``pg`` the wrapper's checks, over a helper gloo communicator of its ranks."""
    td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    helper = SimProcessGroup(_member_group(dist_state.current(), tuple(pg._g.ranks)), "gloo", td)
    pg._tp_wrapper = WrapperChecks(helper, td)
    return pg


def create_process_group_wrapper(wrapped_pg: Any, store_prefix: Any = None, store: Any = None, rank: Any = None,
                                 world_size: Any = None, timeout: Any = timedelta(minutes=30)) -> Any:
    """torch's ``_create_process_group_wrapper`` while a world runs: TORCH_DISTRIBUTED_DEBUG=DETAIL (or a program
    itself) wraps a group in one that checks every collective over a helper gloo group; a simulated group gets
    the same checks over a helper communicator of the simulator (a real gloo helper on a rank thread would wait
    in C++ for ranks the scheduler cannot run).  Anything else is torch's."""
    st = dist_state.current()
    if isinstance(wrapped_pg, SimProcessGroup) and st is not None and isinstance(st.backend, SimBackend):
        return wrap(wrapped_pg, timeout)
    return ORIGINAL["pg_wrapper"](wrapped_pg, store_prefix, store, rank, world_size, timeout=timeout)
