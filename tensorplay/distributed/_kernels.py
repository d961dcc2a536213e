"""Local reduction kernels shared by backends that must emulate an op.

A backend that lacks a native reduction for some (op, dtype) pair gathers the
contributions and reduces them here, always in group-rank order so results
are reproducible bit for bit.
"""
from __future__ import annotations

import torch

from .reduce_op import ReduceOp

__all__ = ["reduce_stacked"]


def reduce_stacked(op: ReduceOp, stacked: torch.Tensor) -> torch.Tensor:
    """Reduce ``stacked`` (one slice per group rank on dim 0) with ``op``, in rank order."""
    if stacked.shape[0] == 0:
        raise ValueError("nothing to reduce")
    if op is ReduceOp.SUM:
        return stacked.sum(0, dtype=stacked.dtype) if stacked.dtype != torch.bool else stacked.any(0)
    if op is ReduceOp.AVG:
        return stacked.sum(0) / stacked.shape[0]
    if op is ReduceOp.PRODUCT:
        if stacked.dtype == torch.bool:
            return stacked.all(0)
        out = stacked[0].clone()
        for k in range(1, stacked.shape[0]):
            out.mul_(stacked[k])
        return out
    if op is ReduceOp.MIN:
        return stacked.amin(0)
    if op is ReduceOp.MAX:
        return stacked.amax(0)
    fn = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}[op]
    out = stacked[0].clone()
    for k in range(1, stacked.shape[0]):
        fn(out, stacked[k], out=out)
    return out
