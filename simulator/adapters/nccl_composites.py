"""NCCL's collectives that are several of the simulator's: what torch's ``ProcessGroupNCCL`` does for inputs the one
collective of the table does not take (part of :mod:`simulator.adapters.process_group`; gloo's are in
:mod:`simulator.adapters.gloo_composites`).

Each is written with tensorplay's own collectives over the group, so its calls are matched, traced and timed as
theirs; each returns the tensors it wrote (the work is complete when it returns).
"""
from __future__ import annotations

import torch

import tensorplay.distributed as tpd
from tensorplay.distributed.errors import DistBackendError, format_message
from tensorplay.distributed.group import ProcessGroup as TpGroup

__all__ = ["allgather_reshaped"]

_CALL = "torch.distributed.all_gather (ProcessGroupNCCL::allgather)"


def _fail(g: TpGroup, problem: str, fix: str, **values: object) -> DistBackendError:
    return DistBackendError(format_message(_CALL, problem, group=list(g.ranks), rank=g.rank(), values=values, fix=fix))


def allgather_reshaped(g: TpGroup, outputs: list[torch.Tensor], t: torch.Tensor) -> list[torch.Tensor]:
    """NCCL's list all_gather where the outputs are not all of the input's shape.

    NCCL compares element counts, not shapes.  Outputs of one shape are one flat buffer (``newLikeFlat``) that
    every rank's ``t.numel()`` elements fill in rank order, then copied out: output ``j`` is rank ``j``'s input
    with the output's shape (a 0-dim input into outputs of shape ``(1,)``).  Outputs of several shapes take one
    broadcast per rank, rank ``j``'s input into output ``j`` (torch's "uneven sized tensors are supported")."""
    w, me = g.size(), g.rank()
    for o in outputs:
        if o.dtype != t.dtype:
            raise _fail(g, "output tensors must have the input's dtype (NCCL moves the input's elements as they are)",
                        "allocate the outputs with dtype=input.dtype", output_dtype=str(o.dtype),
                        input_dtype=str(t.dtype))
    flat = t.reshape(-1)
    if len({tuple(o.shape) for o in outputs}) == 1:
        if outputs[0].numel() != t.numel():
            raise _fail(g, "each output tensor must hold as many elements as the input (NCCL gathers input.numel() "
                        "elements from every rank into one flat buffer)", "give every output input.numel() elements",
                        output_numel=outputs[0].numel(), input_numel=t.numel(), output_shape=tuple(outputs[0].shape))
        parts = [torch.empty_like(flat) for _ in range(w)]
        tpd.all_gather(parts, flat, group=g)
        for o, p in zip(outputs, parts):
            o.copy_(p.view(o.shape))
        return outputs
    if outputs[me].numel() != t.numel():
        raise _fail(g, "Tensor input and output of _broadcast_oop must have the same number of elements",
                    "make output_list[rank] hold as many elements as this rank's input",
                    output_numel=outputs[me].numel(), input_numel=t.numel(), rank_in_group=me)
    for j, o in enumerate(outputs):
        buf = flat.clone() if j == me else o.new_empty(o.numel())
        tpd.broadcast(buf, group=g, group_src=j)
        o.copy_(buf.view(o.shape))
    return outputs
