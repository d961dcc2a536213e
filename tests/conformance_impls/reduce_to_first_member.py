"""A deliberately broken implementation for the conformance suite's own tests.

Everything is tensorplay's, except reduce: it always reduces to the group's
first member (the lowest global rank), whatever ``dst`` says.
"""
from __future__ import annotations

import tensorplay.distributed as dist
import tensorplay.distributed.nn.functional as ours
from tensorplay.distributed.reduce_op import ReduceOp


def reduce(tensor, dst, op=ReduceOp.SUM, group=None):
    first = min(dist.get_process_group_ranks(group)) if group is not None else 0
    return ours.reduce(tensor, first, op=op, group=group)


def __getattr__(name):
    return getattr(ours, name)
