"""The data movement and reductions behind the simulator's collectives.

All functions take every member's tensors in *group-rank order* and write the
outputs in place.  Reductions fold strictly in group-rank order
(``((x0 op x1) op x2) ...``), so results are bitwise independent of the order
in which ranks arrived.  Outputs never alias another rank's input: results are
computed into fresh memory (or read completely before being written).
"""
from __future__ import annotations

from typing import Sequence

import torch

from tensorplay.distributed.reduce_op import ReduceOp

__all__ = ["reduce_tensors", "reduce_into", "copy_rows", "rows_view"]

# Bytes per chunk of the blocked reduction.  Small (cache-sized) chunks would
# save memory traffic, but each torch call made from a non-main thread pays a
# large intra-op-parallel start-up cost (measured: 512 KiB chunks ran 2.5x
# slower in a rank thread than in the main thread), so chunks are big: the
# blocking then only bounds the accumulator's size.
_CHUNK_BYTES = 8 * 1024 * 1024
_CHUNKED_MIN = 1 << 18


_BINARY = {
    ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul, ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum, ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
}
_BINARY_BOOL = {ReduceOp.SUM: torch.logical_or, ReduceOp.AVG: torch.logical_or, ReduceOp.PRODUCT: torch.logical_and}


#: dtypes without CPU arithmetic (NCCL reduces float8): each step is computed in float32 and rounded back
_WIDENED = frozenset(getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz")
                     if hasattr(torch, n))


def _combine(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, op: ReduceOp) -> None:
    """``out = a op b`` in one pass (``out`` may be ``a`` or ``b``)."""
    if a.dtype in _WIDENED:
        out.copy_(_BINARY[op](a.float(), b.float()))
        return
    table = _BINARY_BOOL if a.dtype == torch.bool and op in _BINARY_BOOL else _BINARY
    table[op](a, b, out=out)


def _fold(acc: torch.Tensor, t: torch.Tensor, op: ReduceOp) -> None:
    """``acc = acc op t`` in place."""
    _combine(acc, t, acc, op)


def _finish(acc: torch.Tensor, op: ReduceOp, n: int) -> None:
    if op is ReduceOp.AVG:
        if acc.dtype in _WIDENED:
            acc.copy_(acc.float() / n)
        else:
            acc.div_(n)


def _to(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    return t if t.device == dev else t.to(dev)


def reduce_tensors(ins: Sequence[torch.Tensor], op: ReduceOp, device: torch.device | None = None) -> torch.Tensor:
    """``op`` over ``ins`` folded in order, as a new contiguous tensor."""
    first = ins[0]
    if device is None or device == first.device:
        dev = first.device
        # (empty_like costs a third of empty(shape, dtype=, device=): once per small collective)
        acc = torch.empty_like(first, memory_format=torch.contiguous_format)
    else:
        dev = device
        acc = torch.empty(first.shape, dtype=first.dtype, device=dev)
    if len(ins) == 1:
        acc.copy_(first)
    else:
        _combine(_to(first, dev), _to(ins[1], dev), acc, op)  # the first step writes acc: no copy of input 0
    for t in ins[2:]:
        _fold(acc, _to(t, dev), op)
    _finish(acc, op, len(ins))
    return acc


def reduce_into(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], op: ReduceOp) -> None:
    """Write ``op`` over ``ins`` into every tensor of ``outs`` (which may be some of ``ins``)."""
    first = ins[0]
    n = first.numel()
    if (
        n >= _CHUNKED_MIN
        and first.device.type == "cpu"
        and all(t.is_contiguous() and t.device.type == "cpu" for t in ins)
        and all(t.is_contiguous() and t.device.type == "cpu" for t in outs)
    ):
        _reduce_into_blocked(outs, ins, op, n)
        return
    acc = reduce_tensors(ins, op)
    for o in outs:
        o.copy_(acc)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _reduce_into_blocked(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], op: ReduceOp, n: int) -> None:
    # Each chunk of the result depends only on the same chunk of every input,
    # so chunk c of every input is read before chunk c of any output is
    # written: in-place outputs (out is in) are safe.
    flat_in = [t.view(-1) for t in ins]
    flat_out = [t.view(-1) for t in outs]
    w = len(ins)
    chunk = max(_CHUNK_BYTES // ins[0].element_size(), 1)
    # Fold straight into an output when it is not an input read after the first step (in-place
    # all_reduce: output 0 is input 0); that saves a pass over the data per output.
    target = next((o for o in flat_out if not any(_shares_memory(o, t) for t in flat_in[1:])), None)
    acc_buf = torch.empty(min(chunk, n), dtype=ins[0].dtype) if target is None or w == 1 else None
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        acc = acc_buf[:m] if acc_buf is not None else target[start:start + m]
        if w == 1:
            acc.copy_(flat_in[0][start:start + m])
        else:
            _combine(flat_in[0][start:start + m], flat_in[1][start:start + m], acc, op)
        for t in flat_in[2:]:
            _fold(acc, t[start:start + m], op)
        _finish(acc, op, w)
        for o in flat_out:
            if acc_buf is not None or o is not target:
                o[start:start + m].copy_(acc)


def rows_view(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` seen as ``rows`` equal rows (a view when possible, else a reshaped copy)."""
    if t.dim() == 0:
        return t.reshape(1, 1)
    return t.reshape(rows, -1)


def copy_rows(dst: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Write ``parts`` (each ``dst.numel() / len(parts)`` elements) into ``dst`` row by row."""
    w = len(parts)
    if dst.is_contiguous():
        view = dst.view(w, -1) if dst.numel() else dst.reshape(w, 0)
        for i, p in enumerate(parts):
            view[i].copy_(p.reshape(-1))
    else:
        staging = torch.empty((w, dst.numel() // max(w, 1)), dtype=dst.dtype, device=dst.device)
        for i, p in enumerate(parts):
            staging[i].copy_(p.reshape(-1))
        dst.copy_(staging.view(dst.shape))
