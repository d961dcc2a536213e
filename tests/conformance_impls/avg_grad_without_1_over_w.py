"""A deliberately broken implementation for the conformance suite's own tests.

Everything is tensorplay's, except all_reduce with AVG: the forward is right,
but the backward forgets the 1/W (it returns SUM's gradient).
"""
from __future__ import annotations

import tensorplay.distributed as dist
import tensorplay.distributed.nn.functional as ours
from tensorplay.distributed.reduce_op import ReduceOp, normalize_op


def all_reduce(tensor, op=ReduceOp.SUM, group=None):
    if normalize_op(op) is not ReduceOp.AVG:
        return ours.all_reduce(tensor, op=op, group=group)
    total = ours.all_reduce(tensor, op=ReduceOp.SUM, group=group)
    w = dist.get_world_size(group)
    # the value of AVG, the gradient of SUM
    return total + (total / w - total).detach()


def __getattr__(name):
    return getattr(ours, name)
