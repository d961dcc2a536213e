"""Autograd-aware collectives with torch.distributed.nn.functional's signatures and exact gradients.

Each function runs one collective forward and returns *new* tensors (inputs
are never written, ``output`` arguments only say which shape, dtype and device
the result has).  Its backward is the exact vector-Jacobian product of the
collective seen as one function of the whole group: every rank feeds its own
upstream gradient, and each input receives the derivative of the *sum over all
ranks* of their losses.  docs/semantics.md states the rule for every
collective and reduce op.

The backward rules live in :mod:`tensorplay.distributed.spec` (one per
collective, next to its reference); they are written with the same
differentiable collectives, so a backward is differentiable again wherever the
collective is linear (SUM, AVG and pure data movement): Hessian-vector products
through a collective just work.  Nothing here looks at the backend's name.

Every rank runs an example's lines, under ``python -m simulator --nproc-per-node 4 ...``,
``simulator.run(fn, 4)`` or torchrun with gloo.

Example (4 ranks)::

    >>> import tensorplay as tp
    >>> import tensorplay.distributed as dist
    >>> import tensorplay.distributed.nn.functional as df
    >>> x = tp.randn(4, 8, requires_grad=True)
    >>> y = df.all_reduce(x)          # the sum of every rank's x
    >>> y.sum().backward()
    >>> x.grad.unique() == dist.get_world_size()   # every rank's loss uses every x
    tensor([True])

Rules every caller should know:

* ``src``/``dst`` are global ranks, also in a subgroup (``group_src``/``group_dst``
  take group ranks instead).
* Every member must run the backward of a collective whose forward it ran (the
  others wait for it).  Rooted collectives return zeros on the other ranks,
  which are still part of the graph, so ``y.sum().backward()`` on every rank is
  always right.
* Whether a result requires grad is decided on each rank from its own inputs,
  as in torch: call the collective with the same ``requires_grad`` on every
  rank.  scatter's non-src ranks follow src automatically.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .. import state
from ..errors import DistError, DistTypeError, DistValueError
from ..group import ProcessGroup
from ..group import group as _groups
from ..reduce_op import ReduceOp
from ..spec import SPECS, Call, gathered_shape
from ..validation import (
    CallContext,
    begin,
    check_gathered_shape,
    check_one_dtype,
    check_receiver_list,
    check_same_dtype,
    check_self_block,
    check_single_splits,
    check_split_list,
    check_tensor,
    check_tensor_list,
    require_root_list,
    resolve_op,
    resolve_root,
)

__all__ = [
    "broadcast",
    "gather",
    "scatter",
    "reduce",
    "reduce_scatter",
    "all_gather",
    "all_gather_single",
    "_all_gather_base",
    "all_to_all",
    "all_to_all_single",
    "all_reduce",
]

WORLD = _groups.WORLD


# ---------------------------------------------------------------------------
# forward kernels: one per collective, on validated arguments in group ranks.
# Each allocates fresh contiguous outputs and runs the backend's blocking call.
# ---------------------------------------------------------------------------
def _empty(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)


def _fresh_copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def _fw_broadcast(c: Call, xs: tuple) -> torch.Tensor:
    (x,) = xs
    out = _fresh_copy(x) if c.me == c.root else _empty(x.shape, x)
    c.group.backend.broadcast(out, c.root, c.group, False)
    return out


def _fw_reduce(c: Call, xs: tuple) -> torch.Tensor:
    (x,) = xs
    out = _fresh_copy(x)  # a backend may leave scratch values in non-root buffers: never hand it x
    c.group.backend.reduce(out, c.root, c.op, c.group, False)
    return out if c.me == c.root else out.zero_()


def _fw_all_reduce(c: Call, xs: tuple) -> torch.Tensor:
    (x,) = xs
    out = _fresh_copy(x)
    c.group.backend.all_reduce(out, c.op, c.group, False)
    return out


def _fw_gather(c: Call, xs: tuple) -> tuple[torch.Tensor, ...]:
    (x,) = xs
    pg = c.group
    if c.me == c.root:
        outs = [_empty(x.shape, x) for _ in range(c.size)]
        pg.backend.gather(x, outs, c.root, pg, False)
        return tuple(outs)
    pg.backend.gather(x, None, c.root, pg, False)
    return tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for _ in range(c.size))


def _fw_scatter(c: Call, xs: tuple) -> torch.Tensor:
    # src passes its W blocks; every other rank passes one tensor shaped like its block (see scatter)
    pg = c.group
    if c.me == c.root:
        out = _empty(xs[c.me].shape, xs[c.me])
        pg.backend.scatter(out, list(xs), c.root, pg, False)
    else:
        out = _empty(xs[0].shape, xs[0])
        pg.backend.scatter(out, None, c.root, pg, False)
    return out


def _fw_all_gather(c: Call, xs: tuple) -> tuple[torch.Tensor, ...]:
    (x,) = xs
    outs = [_empty(x.shape, x) for _ in range(c.size)]
    c.group.backend.all_gather(outs, x, c.group, False)
    return tuple(outs)


def _fw_all_gather_single(c: Call, xs: tuple) -> torch.Tensor:
    (x,) = xs
    out = _empty(c.out_shape, x)
    c.group.backend.all_gather_into_tensor(out, x, c.group, False)
    return out


def _fw_reduce_scatter(c: Call, xs: tuple) -> torch.Tensor:
    (stacked,) = xs  # slot i goes to group rank i
    out = _empty(stacked.shape[1:], stacked)
    c.group.backend.reduce_scatter_tensor(out, stacked, c.op, c.group, False)
    return out


def _fw_all_to_all(c: Call, xs: tuple) -> tuple[torch.Tensor, ...]:
    outs = [_empty(s, xs[0]) for s in c.out_shapes]
    c.group.backend.all_to_all(outs, list(xs), c.group, False)
    return tuple(outs)


def _fw_all_to_all_single(c: Call, xs: tuple) -> torch.Tensor:
    (x,) = xs
    out = _empty((sum(c.out_splits), *x.shape[1:]), x)
    c.group.backend.all_to_all_single(out, x, list(c.out_splits), list(c.in_splits), c.group, False)
    return out


_FORWARD = {
    "broadcast": _fw_broadcast,
    "reduce": _fw_reduce,
    "all_reduce": _fw_all_reduce,
    "gather": _fw_gather,
    "scatter": _fw_scatter,
    "all_gather": _fw_all_gather,
    "all_gather_single": _fw_all_gather_single,
    "reduce_scatter": _fw_reduce_scatter,
    "all_to_all": _fw_all_to_all,
    "all_to_all_single": _fw_all_to_all_single,
}
if set(_FORWARD) != set(SPECS):  # the spec and the kernels must describe the same collectives
    raise ImportError(f"spec and forward kernels disagree: {sorted(set(SPECS) ^ set(_FORWARD))}")


# ---------------------------------------------------------------------------
# the one autograd Function: forward kernel above, backward = the spec's rule
# ---------------------------------------------------------------------------
class _Collective(torch.autograd.Function):
    """``apply(call, *tensors)``: run ``call``'s collective; its backward runs the spec's VJP rule."""

    @staticmethod
    def forward(ctx: Any, call: Call, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        out = _FORWARD[call.name](call, tensors)
        ctx.call = call
        ctx.n_inputs = len(tensors)
        if call.saves_tensors():  # only the non-linear ops (PRODUCT, MIN, MAX) look at values
            ctx.save_for_backward(tensors[0], out)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:  # type: ignore[override]
        call: Call = ctx.call
        with state.backward_of(call.name):
            saved = ctx.saved_tensors if call.saves_tensors() else ()
            got = SPECS[call.name].vjp(_Differentiable(call.group), call, grads, saved)
        # inputs without a gradient (scatter's non-src stand-in) get None, and so does every input
        # autograd did not ask about
        got = [g if need else None for g, need in zip(got, ctx.needs_input_grad[1:])]
        return (None, *got, *([None] * (ctx.n_inputs - len(got))))


def _apply(call: Call, *tensors: torch.Tensor) -> Any:
    return _Collective.apply(call, *tensors)


class _Differentiable:
    """The :class:`~tensorplay.distributed.spec.Collectives` a backward rule uses: the same
    differentiable collectives, on the call's group, in group ranks (arguments come from the
    rules, so they are not validated again)."""

    __slots__ = ("pg", "size", "me")

    def __init__(self, pg: ProcessGroup) -> None:
        self.pg = pg
        self.size = pg.size()
        self.me = pg.rank()

    def _call(self, name: str, **fields: Any) -> Call:
        return Call(name, self.pg, self.size, self.me, **fields)

    def broadcast(self, x: torch.Tensor, root: int) -> torch.Tensor:
        return _apply(self._call("broadcast", root=root), x)

    def reduce(self, x: torch.Tensor, root: int, op: ReduceOp) -> torch.Tensor:
        return _apply(self._call("reduce", root=root, op=op), x)

    def all_reduce(self, x: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        return _apply(self._call("all_reduce", op=op), x)

    def gather(self, x: torch.Tensor, root: int) -> tuple[torch.Tensor, ...]:
        return _apply(self._call("gather", root=root), x)

    def scatter(self, parts: Sequence[torch.Tensor] | None, root: int, like: torch.Tensor) -> torch.Tensor:
        ins = tuple(parts) if self.me == root else (like,)
        return _apply(self._call("scatter", root=root), *ins)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        # stacked layout straight from one all_gather_single: no copy out of a list
        shape = tuple(x.shape)
        return _apply(self._call("all_gather_single", shape=shape, out_shape=(self.size, *shape)), x)

    def reduce_scatter(self, stacked: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        return _apply(self._call("reduce_scatter", op=op), stacked)

    def all_to_all(self, xs: Sequence[torch.Tensor], out_shapes: Sequence[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
        return _apply(self._call("all_to_all", in_shapes=tuple(tuple(t.shape) for t in xs),
                                 out_shapes=tuple(tuple(s) for s in out_shapes)), *xs)

    def all_to_all_single(self, x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int]) -> torch.Tensor:
        return _apply(self._call("all_to_all_single", in_splits=tuple(in_splits), out_splits=tuple(out_splits)), x)


# ---------------------------------------------------------------------------
# every argument is checked on the calling rank before any communication, by the checks the
# torch.distributed-style API uses too (tensorplay.distributed.validation): one mistake, one error class
# ---------------------------------------------------------------------------
def _begin(name: str, group: Any) -> CallContext:
    return begin(f"nn.functional.{name}", group)


def _new_call(c: CallContext, name: str, **fields: Any) -> Call:
    return Call(name, c.pg, c.pg.size(), c.pg.rank(), **fields)


def _wants_grad(tensors: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _reduce_op(c: CallContext, op: Any, tensors: Sequence[torch.Tensor]) -> ReduceOp:
    """``op`` as a ReduceOp the dtype allows and, when a gradient is wanted, one that has a gradient."""
    return resolve_op(c, op, tensors[0].dtype, requires_grad=_wants_grad(tensors))


# ---------------------------------------------------------------------------
# the public collectives
# ---------------------------------------------------------------------------
def broadcast(tensor: torch.Tensor, src: int | None = None, group: Any = WORLD, *,
              group_src: int | None = None) -> torch.Tensor:
    """Every rank gets ``src``'s ``tensor``; the gradient of ``src``'s input is the sum of every rank's.

    Non-src ranks pass a tensor of the same shape and dtype (its values are not
    read); its gradient is exactly zero.

    Example (3 ranks)::

        >>> r = dist.get_rank()
        >>> w = tp.full((2,), float(r), requires_grad=True)
        >>> y = df.broadcast(w, src=2)
        >>> y.tolist()                    # on every rank
        [2.0, 2.0]
        >>> (y * (r + 1)).sum().backward()
        >>> w.grad.tolist() == ([6., 6.] if r == 2 else [0., 0.])   # src: 1 + 2 + 3; the others: zero
        True
    """
    c = _begin("broadcast", group)
    check_tensor(c, tensor, "tensor")
    root = resolve_root(c, "src", src, group_src)
    return _apply(_new_call(c, "broadcast", root=root), tensor)


def reduce(tensor: torch.Tensor, dst: int | None = None, op: Any = ReduceOp.SUM, group: Any = WORLD, *,
           group_dst: int | None = None) -> torch.Tensor:
    """``dst`` gets ``op`` over every rank's ``tensor``; every other rank gets zeros.

    Only ``dst``'s gradient counts (the zeros depend on nothing); it reaches
    every rank's input through the op's derivative.  Run the backward on every
    rank (``y.sum().backward()`` is right everywhere): ``dst`` waits for the others.

    Example (2 ranks)::

        >>> r = dist.get_rank()
        >>> x = tp.tensor([1. + r], requires_grad=True)
        >>> y = df.reduce(x, dst=1, op=dist.ReduceOp.PRODUCT)
        >>> y.tolist() == [[0.], [2.]][r]          # rank 1: 1 * 2; rank 0: zeros
        True
        >>> y.sum().backward()
        >>> x.grad.tolist() == [[2.], [1.]][r]     # each rank's factor is the other rank's input
        True
    """
    c = _begin("reduce", group)
    check_tensor(c, tensor, "tensor")
    rop = _reduce_op(c, op, (tensor,))
    root = resolve_root(c, "dst", dst, group_dst)
    return _apply(_new_call(c, "reduce", root=root, op=rop), tensor)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = WORLD) -> torch.Tensor:
    """Every rank gets ``op`` over every rank's ``tensor``.

    Gradients: SUM passes the sum of every rank's gradient, AVG that sum over
    the group size, PRODUCT multiplies by the product of the *other* ranks'
    inputs (exact with zeros), MIN/MAX give it to the ranks holding the extreme
    value, split evenly on ties.

    Example (4 ranks)::

        >>> x = tp.randn(4, 8, requires_grad=True)
        >>> y = df.all_reduce(x)              # the same on every rank
        >>> y.sum().backward()
        >>> x.grad.unique()                   # every element, on every rank: 4 losses use it
        tensor([4.])
    """
    c = _begin("all_reduce", group)
    check_tensor(c, tensor, "tensor")
    rop = _reduce_op(c, op, (tensor,))
    return _apply(_new_call(c, "all_reduce", op=rop), tensor)


def gather(tensor: torch.Tensor, dst: int | None = None, group: Any = WORLD, *,
           group_dst: int | None = None) -> tuple[torch.Tensor, ...]:
    """``dst`` gets the tuple of every rank's ``tensor`` (in group-rank order); the others get zeros.

    ``dst`` defaults to global rank 0.  Rank ``i``'s gradient is ``dst``'s
    gradient of block ``i``.

    Example (3 ranks)::

        >>> r = dist.get_rank()
        >>> x = tp.tensor([float(r)], requires_grad=True)
        >>> ys = df.gather(x, dst=0)
        >>> [y.item() for y in ys] == ([0., 1., 2.] if r == 0 else [0., 0., 0.])
        True
        >>> sum(y.sum() * (i + 1) for i, y in enumerate(ys)).backward()
        >>> x.grad.tolist() == [r + 1.]       # dst's weight of block r
        True
    """
    c = _begin("gather", group)
    check_tensor(c, tensor, "tensor")
    root = resolve_root(c, "dst", dst, group_dst, default=0)
    return _apply(_new_call(c, "gather", root=root), tensor)


# scatter's non-src ranks learn the block from src in a small header broadcast:
# [status, requires_grad, dtype, device kind, ndim, *shape]
_HEADER_LEN = 40
_MAX_DIMS = _HEADER_LEN - 5
_OK, _REFUSED = 1, 2
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


def _header_device(pg: ProcessGroup) -> torch.device:
    if pg.backend.supports_device(torch.device("cpu")):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def scatter(tensors: Sequence[torch.Tensor] | None, src: int | None = None, group: Any = WORLD, *,
            group_src: int | None = None) -> torch.Tensor:
    """Group rank ``i`` gets ``tensors[i]`` from ``src`` (default: global rank 0).

    ``src`` passes one tensor per group rank.  The other ranks pass ``None``
    or, as torch's module wants, a list of tensors whose values are not read.
    They learn the block's shape, dtype, device kind and whether it requires
    grad from a 40-integer header that ``src`` broadcasts first.

    Gradients: ``src``'s ``tensors[i]`` gets group rank ``i``'s gradient (one
    gather to ``src``); a non-src rank's list gets zeros.  Whether the result
    requires grad is decided by ``src`` alone, for every rank: when ``src``'s
    blocks require grad, every rank's result does (so every rank joins the
    backward gather, whatever its own list), and when they do not, no rank's
    result does (a non-src list that requires grad is then not part of the
    graph), so the backward can never wait for a rank that has no reason to run it.
    ``y.sum().backward()`` on every rank, or ``torch.autograd.grad(y, tensors)``
    with a list on every rank, both work.

    Example (2 ranks)::

        >>> r = dist.get_rank()
        >>> parts = [tp.tensor([10.], requires_grad=True), tp.tensor([11.], requires_grad=True)]
        >>> y = df.scatter(parts if r == 0 else None, src=0)
        >>> y.tolist() == [10. + r]
        True
        >>> (y * (r + 1)).sum().backward()
        >>> r != 0 or [p.grad.tolist() for p in parts] == [[1.], [2.]]   # src's parts[i]: rank i's weight
        True
    """
    c = _begin("scatter", group)
    root = resolve_root(c, "src", src, group_src, default=0)
    pg = c.pg
    me = pg.rank()
    dev = _header_device(pg)
    if me == root:
        refused: DistError | None = None
        try:
            parts = _scatter_parts(c, tensors)
        except DistError as e:
            refused, fields = e, [_REFUSED]  # tell the waiting ranks, then fail here with the reason
        else:
            block = parts[me]
            fields = [_OK, int(_wants_grad(parts)), _DTYPE_CODE[block.dtype], int(block.device.type != "cpu"),
                      block.dim(), *block.shape]
        header = torch.tensor(fields + [0] * (_HEADER_LEN - len(fields)), dtype=torch.int64, device=dev)
        pg.backend.broadcast(header, root, pg, False)
        if refused is not None:
            raise refused
        return _apply(_new_call(c, "scatter", root=root), *parts)
    own = check_receiver_list(c, tensors, "tensors", "src")
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=dev)
    pg.backend.broadcast(header, root, pg, False)
    status, wants_grad, code, on_gpu, ndim = header[:5].tolist()
    if status != _OK:
        raise c.error(DistValueError, "the src rank refused its scatter arguments (its own error says why)",
                      "fix the tensors passed on the src rank", src=pg.ranks[root])
    shape = tuple(header[5:5 + ndim].tolist())
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    # a stand-in with the block's shape and dtype and no storage: it gives the forward the block's layout
    # and, requiring grad exactly when src's blocks do, puts this rank into the backward whatever its list
    like = torch.empty((), dtype=_DTYPES[code], device=dev).expand(shape)
    if wants_grad and torch.is_grad_enabled():
        like = like.detach().requires_grad_()
    else:
        # src decides for everyone: a list that requires grad here must not pull this rank into a
        # backward that src (and every other rank) will never run
        own = [t.detach() for t in own]
    # the list is an input of the graph too, so autograd.grad(y, tensors) reaches the collective here
    call = _new_call(c, "scatter", root=root, in_shapes=tuple(tuple(t.shape) for t in own))
    return _apply(call, like, *own)


def _scatter_parts(c: CallContext, tensors: Any) -> list[torch.Tensor]:
    """src's blocks: one per group rank, of one shape and dtype, that the header can describe."""
    parts = require_root_list(c, tensors, "tensors", "src", None)
    if parts[0].dtype not in _DTYPE_CODE or parts[0].dim() > _MAX_DIMS:
        raise c.error(DistTypeError, "scatter cannot describe this block to the other ranks",
                      f"use one of {[str(d) for d in _DTYPES]} with at most {_MAX_DIMS} dimensions",
                      dtype=parts[0].dtype, ndim=parts[0].dim())
    return parts


def all_gather(tensor: torch.Tensor, group: Any = WORLD) -> tuple[torch.Tensor, ...]:
    """Every rank gets the tuple of every rank's ``tensor``, in group-rank order.

    The backward is one reduce_scatter: rank ``i`` gets the sum over ranks of
    their gradients of block ``i``.

    Example (2 ranks)::

        >>> x = tp.tensor([1. + dist.get_rank()], requires_grad=True)
        >>> a, b = df.all_gather(x)
        >>> a.tolist(), b.tolist()          # on both ranks
        ([1.0], [2.0])
        >>> (a * b).sum().backward()
        >>> x.grad.tolist() == [[4.], [2.]][dist.get_rank()]   # rank 0: 2 + 2; rank 1: 1 + 1
        True
    """
    c = _begin("all_gather", group)
    check_tensor(c, tensor, "tensor")
    return _apply(_new_call(c, "all_gather"), tensor)


def all_gather_single(output: torch.Tensor | None, input: torch.Tensor, group: Any = WORLD) -> torch.Tensor:
    """Every rank gets every rank's ``input`` concatenated on dim 0 (0-d inputs stack to shape ``(W,)``).

    ``output`` (or ``None``) only gives the layout: ``(W * n, ...)``
    concatenated, or ``(W, n, ...)`` stacked.  torch's ``_all_gather_base`` is
    the same function.

    Example (2 ranks)::

        >>> x = tp.full((2,), float(dist.get_rank()), requires_grad=True)
        >>> y = df.all_gather_single(None, x)
        >>> y.tolist()                      # on both ranks
        [0.0, 0.0, 1.0, 1.0]
        >>> (y * tp.arange(4.)).sum().backward()
        >>> x.grad.tolist() == [[0., 2.], [4., 6.]][dist.get_rank()]   # each rank's weights, summed over 2 ranks
        True
    """
    c = _begin("all_gather_single", group)
    if output is not None:  # checked in the order the torch.distributed-style all_gather_into_tensor checks
        check_tensor(c, output, "output")
    check_tensor(c, input, "input")
    if output is None:
        out_shape = gathered_shape(tuple(input.shape), c.pg.size())
    else:
        check_same_dtype(c, output, "output", input, "input")
        check_gathered_shape(c, output.shape, input.shape, "output", "input", may_be_none=True)
        out_shape = tuple(output.shape)
    return _apply(_new_call(c, "all_gather_single", shape=tuple(input.shape), out_shape=out_shape), input)


def _all_gather_base(output_tensor: torch.Tensor | None, input_tensor: torch.Tensor,
                     group: Any = WORLD) -> torch.Tensor:
    """torch's name for :func:`all_gather_single` (same arguments, same result)."""
    return all_gather_single(output_tensor, input_tensor, group)


def reduce_scatter(output: torch.Tensor | None, input_list: Sequence[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: Any = WORLD) -> torch.Tensor:
    """Group rank ``i`` gets ``op`` over every rank's ``input_list[i]``.

    ``output`` (or ``None``) gives the block's shape and dtype.  The backward
    is one all_gather of the gradients for SUM/AVG; PRODUCT/MIN/MAX add the op's
    derivative (two all_to_all exchanges of the input's size).

    Example (2 ranks)::

        >>> r = dist.get_rank()
        >>> xs = [tp.tensor([1. + r], requires_grad=True), tp.tensor([10. + r], requires_grad=True)]
        >>> y = df.reduce_scatter(None, xs)
        >>> y.tolist() == [[3.], [21.]][r]
        True
        >>> (y * (r + 1)).sum().backward()
        >>> [t.grad.tolist() for t in xs]   # on both ranks: xs[i] gets rank i's weight
        [[1.0], [2.0]]
    """
    c = _begin("reduce_scatter", group)
    like = None if output is None else check_tensor(c, output, "output")
    if like is None:
        like = check_tensor_list(c, input_list, "input_list")[0]
    ins = check_tensor_list(c, input_list, "input_list", like, same_shape=True)
    rop = _reduce_op(c, op, ins)
    return _apply(_new_call(c, "reduce_scatter", op=rop), torch.stack(ins))


def all_to_all(output_tensor_list: Sequence[torch.Tensor] | None, input_tensor_list: Sequence[torch.Tensor],
               group: Any = WORLD) -> tuple[torch.Tensor, ...]:
    """Rank ``i``'s ``j``-th result is rank ``j``'s ``input_tensor_list[i]``; shapes may differ per pair.

    ``output_tensor_list`` gives the shape of each block this rank receives
    (``None``: every block has the shape of the one it sends itself).  The
    backward sends the gradients back along the reversed routes, in one exchange.

    Example (2 ranks, ragged)::

        >>> r = dist.get_rank()
        >>> xs = [tp.full((1 + r,), 10. * r + i, requires_grad=True) for i in range(2)]
        >>> ys = df.all_to_all([tp.empty(1 + j) for j in range(2)], xs)
        >>> [y.tolist() for y in ys] == [[10. * j + r] * (1 + j) for j in range(2)]   # ys[j] came from rank j
        True
        >>> sum(y.sum() for y in ys).backward()
        >>> [t.grad.tolist() for t in xs] == [[1.] * (1 + r)] * 2
        True
    """
    c = _begin("all_to_all", group)
    ins = check_tensor_list(c, input_tensor_list, "input_tensor_list")
    me = c.pg.rank()
    outs = [] if output_tensor_list is None else check_tensor_list(c, output_tensor_list, "output_tensor_list")
    check_one_dtype(c, ins[0], "input_tensor_list[0]", ("input_tensor_list", ins), ("output_tensor_list", outs))
    out_shapes = tuple(tuple(t.shape) for t in outs) if outs else tuple(tuple(ins[me].shape) for _ in ins)
    check_self_block(c, out_shapes[me], ins[me].shape)
    call = _new_call(c, "all_to_all", in_shapes=tuple(tuple(t.shape) for t in ins), out_shapes=out_shapes)
    return _apply(call, *ins)


def all_to_all_single(output: torch.Tensor | None, input: torch.Tensor, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, group: Any = WORLD) -> torch.Tensor:
    """Split ``input`` on dim 0 by ``input_split_sizes``, exchange, concatenate by ``output_split_sizes``.

    ``None`` splits mean equal chunks; uneven and zero splits are allowed.
    ``output`` (or ``None``: ``sum(output_split_sizes)`` rows, or ``input``'s
    rows with equal splits) gives the result's shape.  The backward is the
    same exchange with the two split lists swapped.

    Example (2 ranks; rank r sends r + 1 rows to rank 0 and 1 row to rank 1)::

        >>> r = dist.get_rank()
        >>> x = tp.full((r + 2,), float(r), requires_grad=True)
        >>> y = df.all_to_all_single(None, x, [1, 2] if r == 0 else [1, 1], [r + 1, 1])
        >>> y.tolist() == [[0., 1., 1.], [0., 1.]][r]
        True
        >>> (y * tp.arange(1., len(y) + 1)).sum().backward()
        >>> x.grad.tolist() == [[1., 1.], [2., 3., 2.]][r]   # each row's weight where it landed
        True
    """
    c = _begin("all_to_all_single", group)
    if output is not None:  # checked in the order the torch.distributed-style all_to_all_single checks
        check_tensor(c, output, "output")
    check_tensor(c, input, "input")
    if output is None:
        if output_split_sizes is not None:  # the rows come from the sizes: check them before adding them up
            rows = sum(check_split_list(c, output_split_sizes, "output_split_sizes"))
        else:
            rows = input.shape[0] if input.dim() else 0
        output = torch.empty((rows, *input.shape[1:]), dtype=input.dtype, device="meta")
    else:
        check_same_dtype(c, output, "output", input, "input")
    outs, ins = check_single_splits(c, output, input, output_split_sizes, input_split_sizes)
    return _apply(_new_call(c, "all_to_all_single", in_splits=tuple(ins), out_splits=tuple(outs)), input)
