"""SyncBatchNorm's five CUDA-only operators, computed on the CPU for stand-ins.

``torch.nn.SyncBatchNorm`` (``convert_sync_batchnorm``, common in GPU-written vision programs) normalises over
the batch of every rank of its group: each rank computes its per-channel statistics, the group all-gathers
them, and the backward all-reduces two per-channel sums.  Its local steps are operators that torch implements
for CUDA only; here they are written out (channels on dim 1, statistics in fp32 for half inputs, as CUDA's
accumulate type).  With ``x`` a rank's input, ``n`` its count per channel and ``N`` the group's::

    batch_norm_stats:        mean = E[x],  invstd = 1 / sqrt(Var[x] + eps)            (biased variance)
    ..._gather_stats_with_counts:  mean = sum n_i mean_i / N,
                             var = sum n_i (1/invstd_i^2 - eps + (mean_i - mean)^2) / N;
                             running stats move by momentum (the variance unbiased: var N / (N - 1))
    batch_norm_elemt:        y = (x - mean) invstd weight + bias
    ..._backward_reduce:     sum_dy = sum dy,  sum_dy_xmu = sum dy (x - mean),
                             grad_weight = sum_dy_xmu invstd,  grad_bias = sum_dy
    ..._backward_elemt:      dx = (dy - sum_dy / N - (x - mean) invstd^2 sum_dy_xmu / N) invstd weight
"""
from __future__ import annotations

from typing import Any

import torch

from simulator.standin.tensor import _SPECIAL, StandInTensor, fresh

__all__ = ["OPERATORS"]


def _parts(args: tuple, kwargs: dict) -> tuple[list[Any], int]:
    """The arguments (positional, then keyword, in schema order) with each stand-in replaced by its CPU tensor,
    and the stand-ins' device index."""
    args = (*args, *kwargs.values())
    idx = next((a._idx for a in args if type(a) is StandInTensor), 0)
    return [a._inner if type(a) is StandInTensor else a for a in args], idx


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _channels(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(d for d in range(x.dim()) if d != 1)


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.reshape((1, -1) + (1,) * (x.dim() - 2))


def _stats(func: Any, args: tuple, kwargs: dict) -> Any:
    (x, eps), idx = _parts(args, kwargs)
    xa = _acc(x)
    mean = xa.mean(_channels(x))
    var = xa.var(_channels(x), unbiased=False)
    return fresh(mean, idx), fresh(torch.rsqrt(var + eps), idx)


def _gather(func: Any, args: tuple, kwargs: dict) -> Any:
    (x, means, invstds, running_mean, running_var, momentum, eps, counts), idx = _parts(args, kwargs)
    c = counts.to(means.dtype).reshape(-1, 1)
    total = c.sum()
    mean = (c * means).sum(0) / total
    var = (c * (1.0 / invstds.square() - eps + (means - mean).square())).sum(0) / total
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
        if running_var is not None:
            unbiased = var * total / (total - 1).clamp(min=1)
            running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
    return fresh(mean, idx), fresh(torch.rsqrt(var + eps), idx)


def _elemt(func: Any, args: tuple, kwargs: dict) -> Any:
    (x, weight, bias, mean, invstd, eps), idx = _parts(args, kwargs)
    y = (_acc(x) - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        y = y * _per_channel(_acc(weight), x)
    if bias is not None:
        y = y + _per_channel(_acc(bias), x)
    return fresh(y.to(x.dtype), idx)


def _backward_reduce(func: Any, args: tuple, kwargs: dict) -> Any:
    (dy, x, mean, invstd, weight, input_g, weight_g, bias_g), idx = _parts(args, kwargs)
    dya, dims = _acc(dy), _channels(x)
    sum_dy = dya.sum(dims)
    sum_dy_xmu = (dya * (_acc(x) - _per_channel(mean, x))).sum(dims)
    empty = sum_dy.new_empty(0)
    dtype = weight.dtype if weight is not None else x.dtype
    grad_weight = (sum_dy_xmu * invstd).to(dtype) if weight_g else empty
    grad_bias = sum_dy.to(dtype) if bias_g else empty
    if not input_g:
        sum_dy, sum_dy_xmu = empty, empty
    return tuple(fresh(t, idx) for t in (sum_dy, sum_dy_xmu, grad_weight, grad_bias))


def _backward_elemt(func: Any, args: tuple, kwargs: dict) -> Any:
    (dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count), idx = _parts(args, kwargs)
    total = count.to(sum_dy.dtype).sum()
    k = _per_channel(invstd, x)
    xmu = _acc(x) - _per_channel(mean, x)
    dx = _acc(dy) - _per_channel(sum_dy / total, x) - xmu * k.square() * _per_channel(sum_dy_xmu / total, x)
    dx = dx * k
    if weight is not None:
        dx = dx * _per_channel(_acc(weight), x)
    return fresh(dx.to(x.dtype), idx)


#: the operators, by base name (registered among the stand-in's operators with rules of their own)
OPERATORS = {"batch_norm_stats": _stats, "batch_norm_gather_stats_with_counts": _gather,
             "batch_norm_elemt": _elemt, "batch_norm_backward_reduce": _backward_reduce,
             "batch_norm_backward_elemt": _backward_elemt}
_SPECIAL.update(OPERATORS)
