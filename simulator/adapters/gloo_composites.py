"""gloo's collectives that are several of the simulator's: what torch's ``ProcessGroupGloo`` does for inputs the
one collective of the table does not take (part of :mod:`simulator.adapters.process_group`).

Each is written with tensorplay's own collectives over the group, so its calls are matched, traced and timed as
theirs; each returns the tensors it wrote (the work is complete when it returns).
"""
from __future__ import annotations

from typing import Any

import torch

import tensorplay.distributed as tpd
from tensorplay.distributed.errors import DistBackendError, format_message
from tensorplay.distributed.group import ProcessGroup as TpGroup

from simulator.adapters.gloo_rules import GlooRules

__all__ = ["sparse_allreduce", "reduce_scatter_sized"]


def sparse_allreduce(g: TpGroup, named: str, tensors: list[torch.Tensor], op: Any,
                     rules: GlooRules) -> list[torch.Tensor]:
    """gloo's sparse all_reduce: each rank's (indices, values) gathered, summed, coalesced, written back in place.
    gloo reduces sparse tensors with SUM only; NCCL none."""
    if named == "nccl" or getattr(op, "name", None) != "SUM":
        raise DistBackendError(format_message(
            "torch.distributed.all_reduce", f"unsupported reduction operation: backend {named} does not "
            "reduce sparse tensors with this op", rank=g.rank(),
            values={"op": op, "backend": named, "group": list(g.ranks)},
            fix="use ReduceOp.SUM on a gloo group, or reduce the dense tensor (t.to_dense())"))
    for t in tensors:
        if t.shape != tensors[0].shape:
            raise rules.fail("invalid tensor size", "pass sparse tensors of one shape",
                             shape=tuple(t.shape), expected=tuple(tensors[0].shape))
    w = g.size()
    # several inputs on a rank are summed with the other ranks' as gloo does
    c = tensors[0].coalesce()
    for t in tensors[1:]:
        c = (c + t).coalesce()
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
                                    torch.cat([v[:k] for v, k in zip(all_val, n)]), c.shape).coalesce()
    for t in tensors:
        t.copy_(total)
    return tensors


def reduce_scatter_sized(g: TpGroup, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], op: Any,
                         rules: GlooRules) -> list[torch.Tensor]:
    """gloo's reduce_scatter with a size per rank: rank j's output is ``op`` over every rank's ``input_list[j]``
    (torch's test_c10d_gloo gives rank j ``j`` elements): one reduce into each rank in turn."""
    me = g.rank()
    for o, ins in zip(outputs, inputs):
        if len(ins) != g.size() or ins[me].shape != o.shape:
            raise rules.fail("input_list needs one tensor per rank, and this rank's entry the output's shape",
                             "pass input_list[j] of rank j's output shape, for every rank j",
                             input_list_len=len(ins), output_shape=tuple(o.shape),
                             input_shape=tuple(ins[me].shape) if me < len(ins) else None)
        for j, t in enumerate(ins):
            buf = t.detach().clone()  # (a reduce leaves partial results in the other ranks' tensors)
            tpd.reduce(buf, group_dst=j, op=op, group=g)
            if j == me:
                o.copy_(buf)
    return outputs
