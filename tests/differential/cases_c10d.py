"""c10d collectives, every variant: ops, roots, lists and flat tensors, async, subgroups."""
from __future__ import annotations

import torch

from .harness import case


def _x(ctx, n=4, salt=0, dtype=torch.float64):
    """Distinct per rank and position, integer-valued (any summation order is exact)."""
    return (torch.arange(n, dtype=torch.float64) * (ctx.rank + 2) + 10 * ctx.rank + salt).to(dtype).to(ctx.device)


@case()
def all_reduce_sum(ctx):
    x = _x(ctx)
    ctx.dist.all_reduce(x)
    return x
